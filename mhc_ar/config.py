"""Launch configuration: every knob of the kernels lives here, chosen by named functions.

The consumer runs one cluster of CTAs per token. The token's H columns are cut into 16-byte
vectors of 8 bf16; CTA c of the cluster owns vectors [c * vectors_per_cta, (c+1) *
vectors_per_cta); its thread t owns local vectors t, t + threads_per_cta, ... (its fragments).
The RMSNorm sum of squares follows exactly that tiling (per-thread partial over its fragments,
warp butterfly, warps in order, CTAs in order), and the reference models it from
:meth:`ConsumerTiling.reduction_tree_args`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .protocol import MAX_CAPACITY, MAX_TP

VECTOR_ELEMS = 8  # bf16 per 16-byte vector
WARP_SIZE = 32
MAX_HC = 8
# Hopper's portable cluster size limit (larger needs a non-portable opt-in per kernel).
MAX_CLUSTER_SIZE = 8
MAX_THREADS_PER_CTA = 1024
# MXFP8: one UE8M0 scale per 32 values = 4 vectors held by 4 adjacent lanes.
MXFP8_BLOCK = 32
VECTORS_PER_MXFP8_BLOCK = MXFP8_BLOCK // VECTOR_ELEMS
# The consumer aims at this many vectors per CTA (one per thread): 4096 -> 4 CTAs,
# 5120 -> 5, 7168 -> 7, each CTA 128 threads with one vector each.
TARGET_VECTORS_PER_CTA = 128
CONSUMER_MAX_THREADS = 256
# Up to hc = 4 the consumer fits in 64 registers without spilling (ptxas -v on sm_90a), which
# lets 1024 threads per SM be resident; hc = 8 needs about 128 and is left to the compiler.
RESIDENT_THREADS_PER_SM = 1024
REGISTER_BOUND_MAX_HC = 4
# Above it, at tp = 1, the hc * (hc + 2) mix coefficients (80 at hc = 8) go through shared
# memory, read where used, instead of living in registers, and each post-mix target is folded into
# the collapse as soon as it is rounded: then this many CTAs per SM fit the register bound (ptxas
# -v, sm_90a, H 7168, hc 8: 128 registers, 4-12 bytes of spills). Measured on the H200 (session
# 15): TP=1 H7168 hc8 -10.5% at M=1, -9.1% at M=16, -22% at M=1024 and M=8192; at emulated TP=8
# (behind the spin) -0.5% at M=16 but +2.3% at M=1024, so the mailbox consumer keeps them in registers.
SHARED_COEFFICIENT_CTAS_PER_SM = 4
# From this many tokens a call of such a consumer launches its wide form instead
# (ConsumerSpec.wide): the mix taken a word at a time, each row of coefficients re-read per word
# as volatile vectors (ConsumerKernel._mix_by_word), so a CTA needs fewer registers and more CTAs
# fit an SM: ptxas -v (CUDA 13, sm_90a, H7168 hc8, 128-thread CTAs) gives 96 registers and no
# spills at 5 CTAs per SM (4 CTAs: 118/125 full/MXFP8; 6 CTAs: 80 with 16/20 bytes of spills).
# The bound is in threads: at H > 8192 a CTA has 256 threads with two fragments each, and 640
# threads (2 CTAs) give them 128 registers and no spills. Measured on an H100 (session 32, same
# run, against the narrow form): -0.2 to -0.7% at M = 1024 and 8192 (H 5120 and 7168, hc 8, full
# and MXFP8; one row +0.1%), but +4.7 to +17% at M <= 16 and -4.9 to +3.4% at M = 128: below
# this count the narrow form runs.
WIDE_FORM_THREADS_PER_SM = 640
WIDE_FORM_MIN_TOKENS = 1024
# The consumer loads its fragments' residual streams before the Lamport spin, so their latency
# hides under the wait, when the 32-bit words then live across the spin fit: tp received vectors
# (4 words each), the residual (4 * hc per fragment) and the mix coefficients (hc * (hc + 2)).
# At the 64-register bound (hc <= 4), ptxas -v (CUDA 13.5, sm_90a, H 5120 and 7168) spills 24-32
# bytes from 72 such words (tp 8, hc 4) and none up to 68 (tp 7, hc 4; every tp <= 7 with hc <= 4).
PREFETCH_MAX_LIVE_WORDS = 68
PUBLISH_THREADS = 128
# A consumer that has waited this long for a peer's data traps (a CUDA launch error on that
# rank) instead of spinning forever; healthy calls wait microseconds.
DEFAULT_SPIN_TIMEOUT_NS = 10_000_000_000


class Variant(str, enum.Enum):
    """What the consumer writes."""

    FULL = "full"  # new_residual + layer_input (bf16)
    MXFP8 = "mxfp8"  # new_residual + layer_input (bf16) + layer_input as MXFP8
    RESIDUAL_ONLY = "residual_only"  # new_residual only


class Contribution(str, enum.Enum):
    """What a rank publishes."""

    CALL = "call"  # x
    FINALIZE = "finalize"  # weighted top-k sum of permuted expert rows + shared expert


class Transport(str, enum.Enum):
    EMULATED = "emulated"  # tp virtual ranks in one GPU's memory
    UNICAST = "unicast"  # torch symmetric memory peer addresses (H100/H200)
    MULTICAST = "multicast"  # NVLink multicast (GB200/GB300); compile-tested only here


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class ConsumerTiling:
    hidden_size: int
    cluster_size: int
    threads_per_cta: int
    vectors_per_cta: int

    def __post_init__(self):
        h = self.hidden_size
        if h <= 0 or h % VECTOR_ELEMS:
            raise ValueError(f"hidden_size must be a positive multiple of {VECTOR_ELEMS}, got {h}")
        if not 1 <= self.cluster_size <= MAX_CLUSTER_SIZE:
            raise ValueError(f"cluster_size must be in [1, {MAX_CLUSTER_SIZE}], got {self.cluster_size}")
        t = self.threads_per_cta
        if t <= 0 or t % WARP_SIZE or t > MAX_THREADS_PER_CTA:
            raise ValueError(f"threads_per_cta must be a multiple of {WARP_SIZE} in (0, {MAX_THREADS_PER_CTA}], got {t}")
        if self.vectors_per_cta <= 0 or self.vectors_per_cta % VECTORS_PER_MXFP8_BLOCK:
            raise ValueError(
                f"vectors_per_cta must be a positive multiple of {VECTORS_PER_MXFP8_BLOCK} "
                f"(an MXFP8 block must not straddle CTAs), got {self.vectors_per_cta}"
            )
        n = self.num_vectors
        if self.cluster_size * self.vectors_per_cta < n:
            raise ValueError(f"tiling covers {self.cluster_size * self.vectors_per_cta} of {n} vectors")
        if (self.cluster_size - 1) * self.vectors_per_cta >= n:
            raise ValueError("tiling leaves the last CTA of the cluster without columns")

    @property
    def num_vectors(self) -> int:
        return self.hidden_size // VECTOR_ELEMS

    @property
    def fragments_per_thread(self) -> int:
        return -(-self.vectors_per_cta // self.threads_per_cta)

    @property
    def warps_per_cta(self) -> int:
        return self.threads_per_cta // WARP_SIZE

    @property
    def needs_predicate(self) -> bool:
        """Whether some thread owns fewer fragments than others (then loads/stores are predicated)."""
        return (
            self.fragments_per_thread * self.threads_per_cta != self.vectors_per_cta
            or self.cluster_size * self.vectors_per_cta != self.num_vectors
        )

    def reduction_tree_args(self) -> dict:
        """Keyword arguments of reference.ReductionTree describing this tiling's sum order."""
        return dict(
            cluster_size=self.cluster_size,
            threads_per_cta=self.threads_per_cta,
            vectors_per_cta=self.vectors_per_cta,
            elems_per_vector=VECTOR_ELEMS,
            warp_size=WARP_SIZE,
        )


def choose_consumer_tiling(hidden_size: int) -> ConsumerTiling:
    """The consumer tiling for a hidden size: about TARGET_VECTORS_PER_CTA vectors per CTA."""
    if hidden_size <= 0 or hidden_size % VECTOR_ELEMS:
        raise ValueError(f"hidden_size must be a positive multiple of {VECTOR_ELEMS}, got {hidden_size}")
    vectors = hidden_size // VECTOR_ELEMS
    cluster = min(MAX_CLUSTER_SIZE, -(-vectors // TARGET_VECTORS_PER_CTA))
    while True:
        per_cta = _round_up(-(-vectors // cluster), VECTORS_PER_MXFP8_BLOCK)
        if cluster == 1 or (cluster - 1) * per_cta < vectors:
            break
        cluster -= 1  # rounding per_cta up emptied the last CTA: use fewer CTAs
    threads = min(_round_up(per_cta, WARP_SIZE), CONSUMER_MAX_THREADS)
    return ConsumerTiling(hidden_size, cluster, threads, per_cta)


# Consumer stages a diagnostic build may leave out: the zeroing of the padding scale rows and the
# per-block quantization (amax, scale, e4m3 values and scale stores) of the MXFP8 variant; and
# the comparison of the ranks' call tags (the tags are still awaited and re-armed), which shows
# what out-of-step ranks do without it and what the comparison costs.
DIAGNOSTIC_STAGES = frozenset({"padding_scales", "mxfp8_block", "step_check"})


@dataclass(frozen=True)
class ConsumerSpec:
    """Everything one consumer compile depends on."""

    tiling: ConsumerTiling
    hc: int
    tp: int
    capacity: int
    variant: Variant
    spin_timeout_ns: int = DEFAULT_SPIN_TIMEOUT_NS
    # At tp = 1 there is nothing to exchange: the consumer computes the rank's contribution
    # itself (x, or the MoE finalize sum; contract steps 1-2) and a call is this one kernel, with
    # no mailbox, publish, spin or call tag (`direct`). These two say which contribution; at
    # tp > 1 the publish computes it, and one consumer serves both (CALL, 0).
    contribution: Contribution = Contribution.CALL
    top_k: int = 0
    # Diagnosis only (the bench times a variant with a stage left out; outputs then break the
    # contract): a subset of DIAGNOSTIC_STAGES. Never set by AllReduceMHC.
    omit: frozenset = frozenset()
    # The kernel a call of WIDE_FORM_MIN_TOKENS or more tokens launches where `has_wide_form`
    # (never set by a caller: ConsumerKernel builds it beside the narrow one). The same operations
    # in the same order, so the same bytes; it trades latency per token for CTAs per SM.
    wide: bool = False

    def __post_init__(self):
        _check_sizes(self.tiling.hidden_size, self.tp, self.capacity)
        if not self.omit <= DIAGNOSTIC_STAGES:
            raise ValueError(f"omit must be a subset of {sorted(DIAGNOSTIC_STAGES)}, got {sorted(self.omit)}")
        if not 0 < self.spin_timeout_ns < 2**62:
            raise ValueError(f"spin timeout must be positive, got {self.spin_timeout_ns} ns")
        _check_hc(self.hc)
        if self.variant is Variant.MXFP8 and self.tiling.hidden_size % (4 * MXFP8_BLOCK):
            raise ValueError("the MXFP8 variant needs hidden_size to be a multiple of 128")
        if self.tp > 1 and (self.contribution, self.top_k) != (Contribution.CALL, 0):
            raise ValueError("at tp > 1 the publish computes the contribution: the consumer takes (CALL, top_k=0)")
        _check_contribution(self.contribution, self.top_k)
        if self.wide and not self.coefficients_in_shared:
            raise ValueError("only a tp = 1 consumer with hc > 4 (coefficients in shared memory) has a wide form")

    @property
    def hidden_size(self) -> int:
        return self.tiling.hidden_size

    @property
    def direct(self) -> bool:
        """tp = 1: the consumer reads its contribution itself (see `contribution`)."""
        return self.tp == 1

    @property
    def prefetch_residual(self) -> bool:
        """Whether the residual is loaded before the spin (see PREFETCH_MAX_LIVE_WORDS)."""
        if self.hc > REGISTER_BOUND_MAX_HC:
            return True  # no register bound: the compiler makes room
        live = 4 * self.tp + 4 * self.hc * self.tiling.fragments_per_thread + self.hc * (self.hc + 2)
        return live <= PREFETCH_MAX_LIVE_WORDS

    @property
    def coefficients_in_shared(self) -> bool:
        """Whether the mix coefficients are staged in shared memory (see SHARED_COEFFICIENT_CTAS_PER_SM)."""
        return self.hc > REGISTER_BOUND_MAX_HC and self.direct

    @property
    def has_wide_form(self) -> bool:
        """Whether calls of WIDE_FORM_MIN_TOKENS tokens or more launch this consumer's wide form
        (the same module holds both kernels; see `wide`)."""
        return self.coefficients_in_shared and not self.wide

    @property
    def min_ctas_per_sm(self) -> int:
        """Launch-bounds minimum of resident CTAs per SM (0: no register bound)."""
        if self.wide:
            return max(1, WIDE_FORM_THREADS_PER_SM // self.tiling.threads_per_cta)
        if self.coefficients_in_shared:
            return SHARED_COEFFICIENT_CTAS_PER_SM
        if self.hc > REGISTER_BOUND_MAX_HC:
            return 0  # no register bound: the compiler makes room
        return max(1, RESIDENT_THREADS_PER_SM // self.tiling.threads_per_cta)


@dataclass(frozen=True)
class PublishSpec:
    """Everything one publish compile depends on."""

    hidden_size: int
    tp: int
    capacity: int
    contribution: Contribution
    top_k: int
    multicast: bool
    hc: int  # the call tag's fingerprint reads each token's post [hc]
    threads_per_cta: int = PUBLISH_THREADS

    def __post_init__(self):
        _check_sizes(self.hidden_size, self.tp, self.capacity)
        _check_hc(self.hc)
        _check_contribution(self.contribution, self.top_k)
        if self.threads_per_cta % WARP_SIZE or not 0 < self.threads_per_cta <= MAX_THREADS_PER_CTA:
            raise ValueError(f"threads_per_cta must be a multiple of {WARP_SIZE}, got {self.threads_per_cta}")

    @property
    def num_vectors(self) -> int:
        return self.hidden_size // VECTOR_ELEMS


def _check_sizes(hidden_size: int, tp: int, capacity: int) -> None:
    if hidden_size <= 0 or hidden_size % VECTOR_ELEMS:
        raise ValueError(f"hidden_size must be a positive multiple of {VECTOR_ELEMS}, got {hidden_size}")
    if not 1 <= tp <= MAX_TP:
        raise ValueError(f"tp size must be in [1, {MAX_TP}], got {tp}")
    if not 1 <= capacity <= MAX_CAPACITY:
        # M travels in a 30-bit call-tag field (mhc_ar.protocol).
        raise ValueError(f"max_num_tokens must be in [1, {MAX_CAPACITY}], got {capacity}")
    # Byte offsets are 64-bit; token and vector indices are 32-bit.
    if capacity * (hidden_size // VECTOR_ELEMS) >= 2**31:
        raise ValueError("max_num_tokens * hidden_size / 8 must stay below 2**31")


def _check_contribution(contribution: Contribution, top_k: int) -> None:
    if contribution is Contribution.FINALIZE and top_k < 1:
        raise ValueError(f"top_k must be >= 1 for finalize, got {top_k}")
    if contribution is Contribution.CALL and top_k != 0:
        raise ValueError("top_k is a finalize parameter; the call takes top_k=0")


def _check_hc(hc: int) -> None:
    if not 1 <= hc <= MAX_HC:
        raise ValueError(f"hc_mult must be in [1, {MAX_HC}], got {hc}")


def padded_scale_rows(num_tokens: int) -> int:
    return _round_up(num_tokens, 128)


def mxfp8_scale_bytes(num_tokens: int, hidden_size: int) -> int:
    """Bytes of the 128x4-swizzled UE8M0 scale tensor FlashInfer's MXFP8 GEMMs read."""
    return padded_scale_rows(num_tokens) * _round_up(hidden_size // MXFP8_BLOCK, 4)


__all__ = [
    "ConsumerSpec",
    "ConsumerTiling",
    "Contribution",
    "PublishSpec",
    "Transport",
    "Variant",
    "choose_consumer_tiling",
    "mxfp8_scale_bytes",
    "padded_scale_rows",
]
