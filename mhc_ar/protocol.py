"""The one-shot Lamport push protocol: mailbox layout, sentinel, call tags, generation state.

Each rank owns a mailbox ``[GENERATIONS, tp, capacity, row_elems(H)]`` bf16, filled with the
sentinel 0x8000 (bf16 -0.0). A call publishes rank r's contribution into slot r of generation g
of *every* rank's mailbox; the consumer spins on its own mailbox until no lane equals the
sentinel, reduces, and re-arms exactly the slots it consumed.

A mailbox row is one token: its H values, then ROW_PAD_ELEMS more (one 128-byte line, so rows
stay line-aligned) whose first 16 bytes hold the publisher's **call tag** (below).

Why three generations: a peer can run at most one call ahead of this rank (its consumer for call
n+1 needs this rank's publish n+1, which comes after this rank's consumer n), so while this rank
reads generation g, peers may already write g+1; a slot re-armed in call n is next written in
call n+3. That holds for any skew between ranks, as long as every rank makes the same calls.

Ranks out of step (one rank's call rejected or skipped, or a different M or op on one rank) would
pair call k of one rank with call k+1 of another; since every rank reduces the same slots, all
ranks would still agree with each other. The call tag makes that loud: every publish writes, per
token, a tag of (call sequence, M, a fingerprint of the token's replicated mix coefficients,
op, publisher rank, layout); the consumer compares each rank's tag with rank 0's (the rank field
aside) and with the slot it came from, and traps on any difference. The sequence counts call
*attempts*: a call rejected with ValueError counts (the host passes the number of rejected
attempts since its last launch), so a rank whose call was refused alone is one behind in the
sequence, not only in the data. The fingerprint covers what the sequence cannot see (a rank that
never made a call): post is replicated across TP ranks and differs from layer to layer.

Generation state (int32 words in device memory, advanced by the kernels so CUDA graph replay
works; choosing the generation on the host would freeze it into the graph):

* ``state[PUBLISH_GENERATION]``: generation the next publish writes. Read by every publish CTA;
  written only by the consumer (CTA 0), after which the next publish's griddepcontrol.wait
  orders the read.
* ``state[CONSUME_GENERATION]``: generation the consumer reads. Written by the publish (CTA 0,
  thread 0) with the generation it used; read by every consumer CTA after griddepcontrol.wait.
* ``state[CALL_SEQUENCE]``: sequence number of this rank's next call. Read by every publish CTA
  (plus the rejected attempts the host passes); written only by the consumer (CTA 0), with the
  sequence of the tags it consumed plus one.

* ``state[INVALID_ROUTES]``: how many route entries of this rank's finalize calls so far were
  neither -1 nor a row of gemm2_permuted (each contributes nothing, as -1 does). Only ever
  incremented, atomically, by the finalize publish (the thread of a token's first vector, once
  per bad entry; at tp = 1, where the consumer computes the contribution itself, by the
  consumer's); read by the host (AllReduceMHC.invalid_routes), never by a kernel's logic.

At tp = 1 there is nothing to exchange and none of this runs: the consumer reads the rank's
contribution in place (mhc_ar.config.ConsumerSpec.direct), and the mailbox has no rows.

One writer per word per kernel, so no CTA ever reads a word that another CTA of the same grid
writes (the atomic counter aside: no kernel decides anything on it).
"""

from __future__ import annotations

import zlib

GENERATIONS = 3
SENTINEL_BF16 = 0x8000  # bf16 -0.0: "not yet written"
SENTINEL_WORD = (SENTINEL_BF16 << 16) | SENTINEL_BF16
# The sentinel in the low and in the high 16-bit lane of a 32-bit word, as the PTX immediates of
# the integer compares that test for it (mhc_ar.ptx emits them, conformance.ptx_contract looks
# for them in the compiled kernels).
SENTINEL_LOW_PTX = f"0x{SENTINEL_BF16:08X}"  # "0x00008000"
SENTINEL_HIGH_PTX = f"0x{SENTINEL_BF16 << 16:08X}"  # "0x80000000"

PUBLISH_GENERATION = 0
CONSUME_GENERATION = 1
CALL_SEQUENCE = 2
INVALID_ROUTES = 3
STATE_WORDS = 4  # 16 bytes, one vector load
STATE_WORD_BYTES = 4  # int32 words

MAX_TP = 8

# expanded_idx_to_permuted_idx of a route whose expert lives on another rank: contributes nothing.
# Every other index outside 0 .. rows-1 is invalid: it contributes nothing too, and is counted.
SKIPPED_ROUTE = -1

BF16_BYTES = 2
F32_BYTES = 4  # post, comb, pre, expert_weights
INT32_BYTES = 4  # expanded_idx_to_permuted_idx, the state words
# Per token row: after its H values, one 128-byte line whose first 16 bytes are the call tag.
ROW_PAD_ELEMS = 64
TAG_WORDS = 4  # one 16-byte vector

# A tag word carries 30 bits, 15 per 16-bit lane with the lane's top bit clear, so no lane of a
# tag ever equals the sentinel 0x8000.
TAG_FIELD_BITS = 30
TAG_FIELD_MASK = (1 << TAG_FIELD_BITS) - 1
# Word 3: bit 0 op (1: finalize), bits 1-3 publisher rank, bits 4-29 layout id.
TAG_OP_BITS, TAG_RANK_SHIFT, TAG_RANK_BITS, TAG_LAYOUT_SHIFT = 1, 1, 3, 4
TAG_RANK_MASK = ((1 << TAG_RANK_BITS) - 1) << TAG_RANK_SHIFT
TAG_LAYOUT_BITS = TAG_FIELD_BITS - TAG_LAYOUT_SHIFT
# Fingerprint of a token's post [hc] fp32 words: sum of word_i * multiplier_i
# mod 2^32 (each multiplier odd, so a change of any one word changes the sum), folded to 30 bits.
FINGERPRINT_MULTIPLIER = 0x9E3779B1


def row_elems(hidden_size: int) -> int:
    """bf16 elements per mailbox row: the token's values and the padding line with its tag."""
    return hidden_size + ROW_PAD_ELEMS


def mailbox_shape(tp: int, capacity: int, hidden_size: int) -> tuple[int, int, int, int]:
    return (GENERATIONS, tp, capacity, row_elems(hidden_size))


def row_bytes(hidden_size: int) -> int:
    """Bytes from mailbox[g, r, m] to mailbox[g, r, m + 1]."""
    return row_elems(hidden_size) * BF16_BYTES


def rank_stride_bytes(hidden_size: int, capacity: int) -> int:
    """Bytes from mailbox[g, r] to mailbox[g, r + 1] (and, times tp, from generation g to g + 1)."""
    return capacity * row_bytes(hidden_size)


def slot_byte_offset(generation, rank, token, hidden_size: int, tp: int, capacity: int):
    """Byte offset of mailbox[generation, rank, token, 0] (works on ints and DSL integers)."""
    return ((generation * tp + rank) * capacity + token) * row_elems(hidden_size) * BF16_BYTES


def tag_byte_offset(hidden_size: int) -> int:
    """Byte offset of the call tag within a mailbox row."""
    return hidden_size * BF16_BYTES


def pack_tag_field(value: int) -> int:
    """30 bits of `value` as one tag word: bits 0-14 in the low lane, 15-29 in the high lane."""
    value &= TAG_FIELD_MASK
    return (value & 0x7FFF) | ((value << 1) & 0x7FFF0000)


def unpack_tag_field(word: int) -> int:
    return (word & 0x7FFF) | ((word >> 1) & 0x3FFF8000)


def layout_id(hidden_size: int, tp: int, capacity: int, hc: int) -> int:
    """What every rank's instance must agree on for the mailbox bytes to mean the same thing."""
    key = f"H={hidden_size} tp={tp} capacity={capacity} hc={hc}".encode()
    return zlib.crc32(key) & ((1 << TAG_LAYOUT_BITS) - 1)


def fingerprint_multiplier(index: int) -> int:
    return (FINGERPRINT_MULTIPLIER * (2 * index + 1)) & 0xFFFFFFFF


def fold_fingerprint(total: int) -> int:
    """The 32-bit sum folded to the 30 bits a tag field carries (the top two bits are xor-ed into
    the bottom two, so a sign-bit change of one coefficient still shows)."""
    total &= 0xFFFFFFFF
    return (total ^ (total >> TAG_FIELD_BITS)) & TAG_FIELD_MASK


def fingerprint(words) -> int:
    """Fingerprint of a token's post words (post[0..hc-1]), as ints."""
    total = sum(int(w) * fingerprint_multiplier(i) for i, w in enumerate(words))
    return fold_fingerprint(total)


def call_tag(sequence: int, tokens: int, fingerprint_value: int, finalize: bool, rank: int, layout: int) -> tuple[int, int, int, int]:
    """The four tag words a publish writes (reference for tests; the kernel computes the same)."""
    word3 = int(finalize) | (rank << TAG_RANK_SHIFT) | (layout << TAG_LAYOUT_SHIFT)
    return (pack_tag_field(sequence), pack_tag_field(tokens), pack_tag_field(fingerprint_value), pack_tag_field(word3))


# max_num_tokens must fit a tag field.
MAX_CAPACITY = TAG_FIELD_MASK


# ---- Kernel argument lists, named once -----------------------------------------------------
# The kernels' signatures (mhc_ar.kernels) follow these names in this order (checked by
# tests/test_mhc_compile.py); mhc_ar.compile builds its fake compile arguments from them, and a
# RankEndpoint binds RANK_ARGUMENTS once. Pointers are raw device addresses (0 where unused).
PEER_ARGUMENTS = tuple(f"peer{r}" for r in range(MAX_TP))  # every rank's mailbox base, 0 past tp
# What is fixed per rank (bound once by the host): the state, where the peers' mailboxes are,
# the multicast mailbox, the rank.
RANK_ARGUMENTS = ("state", *PEER_ARGUMENTS, "multicast", "rank")
CONTRIBUTION_ARGUMENTS = ("source", "gemm2", "weights", "routes")  # x, or shared_output and the expert tensors
MIX_ARGUMENTS = ("residual", "post", "comb", "pre", "norm_weight")
OUTPUT_ARGUMENTS = ("new_residual", "layer_input", "mx_values", "mx_scales")
PUBLISH_ARGUMENTS = (*CONTRIBUTION_ARGUMENTS, "post", *RANK_ARGUMENTS, "num_tokens", "rejected", "gemm2_rows")
CONSUMER_ARGUMENTS = ("mailbox", "state", *CONTRIBUTION_ARGUMENTS, *MIX_ARGUMENTS, *OUTPUT_ARGUMENTS, "eps", "num_tokens",
                      "gemm2_rows")
# One host function launching both (mhc_ar.kernels.layer_call): the per-rank part first.
LAYER_CALL_ARGUMENTS = (*RANK_ARGUMENTS, "mailbox", *CONTRIBUTION_ARGUMENTS, *MIX_ARGUMENTS, *OUTPUT_ARGUMENTS, "eps",
                        "num_tokens", "rejected", "gemm2_rows")
TENSOR_LAUNCHER_ARGUMENTS = (*RANK_ARGUMENTS, "mailbox", *CONTRIBUTION_ARGUMENTS, *MIX_ARGUMENTS, "new_residual",
                             "layer_input", "eps", "rejected")
# The device functions (@cute.kernel) take the same arguments with these groups as tuples.
ARGUMENT_GROUPS = {"peers": PEER_ARGUMENTS, "contribution": CONTRIBUTION_ARGUMENTS, "mix": MIX_ARGUMENTS,
                   "outputs": OUTPUT_ARGUMENTS}
PUBLISH_KERNEL_ARGUMENTS = ("contribution", "post", "state", "peers", "multicast", "rank", "num_tokens", "rejected",
                            "gemm2_rows")
CONSUMER_KERNEL_ARGUMENTS = ("mailbox", "state", "contribution", "mix", "outputs", "eps", "num_tokens", "gemm2_rows")
# The 32-bit integer and float arguments; every other is an address (or a tensor).
INT32_ARGUMENTS = frozenset({"rank", "num_tokens", "rejected", "gemm2_rows"})
FLOAT_ARGUMENTS = frozenset({"eps"})


def flat_arguments(names) -> tuple[str, ...]:
    """A grouped argument list (ARGUMENT_GROUPS) spelled out: the host-side list it stands for."""
    return tuple(name for group in names for name in ARGUMENT_GROUPS.get(group, (group,)))


assert flat_arguments(PUBLISH_KERNEL_ARGUMENTS) == PUBLISH_ARGUMENTS
assert flat_arguments(CONSUMER_KERNEL_ARGUMENTS) == CONSUMER_ARGUMENTS
