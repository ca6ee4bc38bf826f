"""Publish kernel: this rank's contribution into slot `rank` of every rank's mailbox.

One thread per 16-byte vector of the [M, H] contribution. Contract steps 1 (contribution: x, or
the MoE finalize sum with one rounding) and 2 (sentinel scrub) happen here; the 16 bytes are then
stored to each of the tp mailboxes (unicast/emulated: `st.global.v4.b32` per peer) or once to the
multicast address (`multimem.st`, GB200/GB300 only). The thread of each token's first vector also
stores the token's call tag (mhc_ar.protocol) the same way.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.memory import SmemAllocator
from cutlass import Int32, Int64, Uint32

from .. import ptx
from ..config import VECTOR_ELEMS, Contribution, PublishSpec
from ..protocol import (
    BF16_BYTES,
    CALL_SEQUENCE,
    CONSUME_GENERATION,
    F32_BYTES,
    MAX_TP,
    PUBLISH_GENERATION,
    STATE_WORD_BYTES,
    STATE_WORDS,
    TAG_FIELD_BITS,
    TAG_FIELD_MASK,
    TAG_LAYOUT_SHIFT,
    TAG_RANK_SHIFT,
    fingerprint_multiplier,
    layout_id,
    slot_byte_offset,
    tag_byte_offset,
)
from .contribution import finalize_sum, load_x


class PublishKernel:
    """Compile-time configuration in `__init__`, launch in `__call__`, device code in `kernel`.

    Every pointer argument is a raw device address (Int64); unused ones are 0:
    source      x [M, H] bf16 (call) or shared_output [M, H] bf16 (finalize)
    gemm2       gemm2_permuted [rows, H] bf16 (finalize)
    weights     expert_weights [M, top_k] fp32 (finalize)
    routes      expanded_idx_to_permuted_idx [M, top_k] int32, -1 = no such expert here; any
                other index outside 0 .. gemm2_rows-1 is skipped too and counted in
                state[INVALID_ROUTES]: gemm2 is never read outside its rows
    post        [M, hc] fp32: only its bits, for the call tag's fingerprint
    state       this rank's protocol state, int32 [STATE_WORDS] tensor (mhc_ar.protocol); also
                tells TVM-FFI which device and stream to launch on
    peer0..7    mailbox base of ranks 0..tp-1 (unicast/emulated)
    multicast   multicast mailbox base (multicast transport)
    rejected    this rank's calls rejected (ValueError) since its last launch: they count in the
                call sequence, so a call refused on one rank only leaves it visibly out of step
    gemm2_rows  gemm2_permuted's row count (finalize; 0 for a call)
    """

    def __init__(self, spec: PublishSpec):
        self.spec = spec
        self.finalize = spec.contribution is Contribution.FINALIZE

    @cute.jit
    def __call__(
        self,
        source: Int64,
        gemm2: Int64,
        weights: Int64,
        routes: Int64,
        post: Int64,
        state: cute.Tensor,
        peer0: Int64,
        peer1: Int64,
        peer2: Int64,
        peer3: Int64,
        peer4: Int64,
        peer5: Int64,
        peer6: Int64,
        peer7: Int64,
        multicast: Int64,
        rank: Int32,
        num_tokens: Int32,
        rejected: Int32,
        gemm2_rows: Int32,
        stream,
    ):
        threads = self.spec.threads_per_cta
        blocks = (num_tokens * self.spec.num_vectors + (threads - 1)) // threads
        peers = (peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7)
        contribution = (source, gemm2, weights, routes)
        self.kernel(contribution, post, state, peers, multicast, rank, num_tokens, rejected, gemm2_rows).launch(
            grid=[blocks, 1, 1], block=[threads, 1, 1], stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(
        self,
        contribution: tuple,
        post: Int64,
        state: cute.Tensor,
        peers: tuple,
        multicast: Int64,
        rank: Int32,
        num_tokens: Int32,
        rejected: Int32,
        gemm2_rows: Int32,
    ):
        spec = self.spec
        hidden = spec.hidden_size
        source, gemm2, weights, routes = contribution
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        shared_state = SmemAllocator().allocate_tensor(Uint32, cute.make_layout((STATE_WORDS,)), byte_alignment=16)
        # PDL: nothing the preceding kernel wrote (x, expert outputs, the generation) is read
        # before this wait.
        cute.arch.griddepcontrol_wait()
        # The state words are read by one thread per CTA and shared (every thread of the grid
        # needs them, and one load per warp would queue tens of thousands of requests for one
        # line of one L2 slice at large M). The data loads do not depend on them, so they go out
        # before the barrier that shares the state: the two latencies overlap instead of adding.
        state_address = state.iterator.toint()
        words = ptx.ld_volatile_v4(state_address, tid == 0)  # the STATE_WORDS words, 16 bytes
        index = bid * spec.threads_per_cta + tid
        active = index < num_tokens * spec.num_vectors
        # Threads past the last vector load the last vector again (in bounds; never stored).
        index = cutlass.min(index, num_tokens * spec.num_vectors - 1)
        token = index // spec.num_vectors
        vector = index - token * spec.num_vectors
        element_offset = Int64(token) * hidden + Int64(vector) * VECTOR_ELEMS
        # The thread of the token's first vector also publishes its call tag; the fingerprint's
        # loads go out with the data loads.
        tag_thread = vector == 0
        coefficients = self._tag_coefficients(post, token, tag_thread)
        if cutlass.const_expr(self.finalize):
            # The invalid-route count: once per entry, by the token's tag thread (an inactive
            # thread reloads the last vector and counts nothing).
            data = finalize_sum(hidden, spec.top_k, source, gemm2, weights, routes, gemm2_rows, token, vector, element_offset,
                                tag_thread & active, state_address)
        else:
            data = load_x(source, element_offset)
        if tid == 0:
            for w in cutlass.range_constexpr(STATE_WORDS):
                shared_state[w] = words[w]
            if bid == 0:
                # Tell this call's consumer which generation to read (see mhc_ar.protocol).
                ptx.st_global_u32(state_address + CONSUME_GENERATION * STATE_WORD_BYTES, words[PUBLISH_GENERATION])
        cute.arch.sync_threads()
        generation = Int32(shared_state[PUBLISH_GENERATION])
        sequence = (shared_state[CALL_SEQUENCE] + Uint32(rejected)) & Uint32(TAG_FIELD_MASK)
        cute.arch.griddepcontrol_launch_dependents()

        if active:
            w0 = ptx.scrub_word(data[0])
            w1 = ptx.scrub_word(data[1])
            w2 = ptx.scrub_word(data[2])
            w3 = ptx.scrub_word(data[3])
            row = slot_byte_offset(Int64(generation), Int64(rank), Int64(token), hidden, spec.tp, spec.capacity)
            self._store_everywhere(peers, multicast, row + Int64(vector) * (VECTOR_ELEMS * BF16_BYTES), (w0, w1, w2, w3))
            if tag_thread:
                tag = self._call_tag(coefficients, sequence, num_tokens, rank)
                self._store_everywhere(peers, multicast, row + tag_byte_offset(hidden), tag)

    def _store_everywhere(self, peers, multicast, offset, words):
        """16 bytes at `offset` of every rank's mailbox: one store per peer, or one multicast
        (plain Python, traced inline: the branch and the loop are compile-time)."""
        if self.spec.multicast:
            ptx.multimem_st_v4(multicast + offset, *words)
        else:
            for peer in range(self.spec.tp):
                ptx.st_global_v4(peers[peer] + offset, *words)

    def _tag_coefficients(self, post, token, tag_thread):
        """The bits of the token's post [hc] (zeros off the tag thread). Only post: it differs
        from layer to layer as comb does, and hc registers held through the data load (not
        hc + hc^2) keep the publish at full occupancy."""
        hc = self.spec.hc
        row = Int64(token)
        return [ptx.ld_global_u32(post + (row * hc + t) * F32_BYTES, tag_thread) for t in range(hc)]

    def _call_tag(self, coefficients, sequence, num_tokens, rank):
        """The token's call tag (mhc_ar.protocol.call_tag): sequence, M, fingerprint of the
        token's post bits, and op | rank | layout."""
        spec = self.spec
        # The sum of word_i * multiplier_i mod 2^32 (any order gives the same sum), as a
        # balanced tree: a few dependent steps after the loads, not one per coefficient.
        terms = [ptx.mul_lo_u32(bits, Uint32(fingerprint_multiplier(i))) for i, bits in enumerate(coefficients)]
        while len(terms) > 1:
            pairs = [ptx.add_u32(terms[j], terms[j + 1]) for j in range(0, len(terms) - 1, 2)]
            terms = pairs + terms[len(terms) - len(terms) % 2 :]
        total = terms[0]
        folded = (total ^ (total >> TAG_FIELD_BITS)) & Uint32(TAG_FIELD_MASK)
        layout = layout_id(spec.hidden_size, spec.tp, spec.capacity, spec.hc)
        fixed = int(self.finalize) | (layout << TAG_LAYOUT_SHIFT)
        op_rank_layout = Uint32(fixed) | (Uint32(rank) << TAG_RANK_SHIFT)
        return tuple(ptx.pack_tag_field(Uint32(v)) for v in (sequence, num_tokens, folded, op_rank_layout))


assert MAX_TP == 8, "PublishKernel takes exactly eight peer mailbox addresses"
