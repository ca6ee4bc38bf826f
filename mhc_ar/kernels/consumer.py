"""Consumer kernel: Lamport spin, reduce, post-mix, collapse, RMSNorm, MXFP8, re-arm.

One cluster of `cluster_size` CTAs per token (see mhc_ar.config.ConsumerTiling). Each thread owns
`fragments_per_thread` 16-byte vectors of the token's columns and carries them through every
stage in registers; the only cross-thread steps are the RMSNorm sum of squares (warp butterfly,
warps in order through shared memory, CTAs in order through distributed shared memory) and the
MXFP8 block maximum (4 adjacent lanes hold one 32-value block).

Contract steps (SPEC.md) as they appear below: 3 reduce, 4 post_mix, 5 collapse, 6 rms_norm,
7 mxfp8. Steps 1-2 happened in the publish kernel; at tp = 1 (ConsumerSpec.direct) there is no
publish and no mailbox: this kernel loads the contribution itself (step 1; the scrub of step 2
changes no reduce result at tp = 1, since +0.0 + -0.0 = +0.0) and a call is this one kernel.

Protocol checks (mhc_ar.protocol): every wait of a CTA (each rank's 16 bytes of each fragment, and
the call tags) shares one deadline, taken once after griddepcontrol.wait; and CTA 0 of each
token's cluster compares the call tags of all ranks (lane r of its first warp holds rank r's)
right after its first fragment's data has landed, trapping when ranks are out of step.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass.memory import SmemAllocator
from cutlass import Float32, Int32, Int64, Uint32
from flashinfer.quantization.quantization_cute_dsl_utils import INV_FLOAT8_E4M3_MAX, bfloat2_max_abs_4, reduce_max_4threads

from .. import ptx
from ..config import (
    MXFP8_BLOCK,
    Contribution,
    VECTOR_ELEMS,
    VECTORS_PER_MXFP8_BLOCK,
    WARP_SIZE,
    WIDE_FORM_MIN_TOKENS,
    ConsumerSpec,
    Variant,
)
from ..protocol import (
    BF16_BYTES,
    CALL_SEQUENCE,
    CONSUME_GENERATION,
    F32_BYTES,
    GENERATIONS,
    PUBLISH_GENERATION,
    SENTINEL_WORD,
    STATE_WORD_BYTES,
    TAG_FIELD_MASK,
    TAG_RANK_MASK,
    TAG_RANK_SHIFT,
    rank_stride_bytes,
    row_bytes,
    tag_byte_offset,
)
from .contribution import finalize_sum, load_x

_WORDS = 4  # 32-bit words per 16-byte vector
_SCALE_ROW_TILE = 128  # the 128x4 scale layout pads rows to a multiple of 128
_CHUNKS_PER_GROUP = 32  # 16-byte chunks per 512-byte group of the 128x4 layout
_ROWS_PER_CHUNK = 4  # rows i, i+32, i+64, i+96 of a tile share chunk i
_LOG2_VECTORS_PER_BLOCK = VECTORS_PER_MXFP8_BLOCK.bit_length() - 1
_BUTTERFLY_STEPS = WARP_SIZE.bit_length() - 1  # xor offsets 16, 8, 4, 2, 1


def _widen(words):
    """Four packed bf16x2 words -> eight fp32 values (exact)."""
    values = []
    for w in range(_WORDS):
        low, high = ptx.bf16x2_to_f32x2(words[w])
        values += [low, high]
    return values


def _narrow(values):
    """Eight fp32 values -> four packed bf16x2 words (round to nearest even)."""
    return [ptx.f32x2_to_bf16x2_rn(values[2 * w], values[2 * w + 1]) for w in range(_WORDS)]


class _Coefficients:
    """The token's mix coefficients, held in registers: post [hc], comb [hc][hc] (source,
    target), pre [hc] (empty without a norm)."""

    def __init__(self, post, comb, pre):
        self.post, self.comb, self.pre = post, comb, pre


class _SharedCoefficients:
    """hc > REGISTER_BOUND_MAX_HC: the token's coefficients staged in shared memory, rows of
    `stride` words: post [hc], comb [hc][hc] (row s holds comb[s][0..hc-1]), pre [hc], in that
    order. Read where they are used, so they take registers only near their use. The narrow form
    reads `post[t]`, `comb[s][t]`, `pre[t]` as _Coefficients' (one volatile ld.shared each; rows
    of hc words). The wide form (`vectors`; ConsumerSpec.wide) reads a whole row with `row(start)`
    as volatile 16-byte vectors (ptxas neither merges nor hoists them; rows of hc rounded up to 4
    words, so each starts 16-byte aligned)."""

    @staticmethod
    def stride(hc: int, vectors: bool) -> int:
        return -(-hc // _WORDS) * _WORDS if vectors else hc

    @staticmethod
    def count(hc: int, vectors: bool) -> int:
        return _SharedCoefficients.stride(hc, vectors) * (hc + 2)

    def __init__(self, hc, has_norm, tensor, threads, vectors):
        self.hc, self.threads = hc, threads
        stride = self.stride(hc, vectors)
        self.post_start, self.pre_start = 0, stride * (hc + 1)
        self.comb_starts = [stride * (1 + s) for s in range(hc)]
        # (shared start, global element count, global row length) of each section.
        self.sections = [(0, hc, hc), (stride, hc * hc, hc)] + ([(self.pre_start, hc, hc)] if has_norm else [])
        self.stride_words = stride
        self.base = tensor.iterator.toint()
        self.post = _SharedRow(self.base, self.post_start)
        self.comb = [_SharedRow(self.base, start) for start in self.comb_starts]
        self.pre = _SharedRow(self.base, self.pre_start)

    def load(self, post, comb, pre, row, tid):
        """Thread tid's elements (tid, tid + threads, ...) of each section, from global memory
        (predicated loads: zeros past the section's end), with the shared word each goes to."""
        hc = self.hc
        bases = [post + row * hc * F32_BYTES, comb + row * hc * hc * F32_BYTES, pre + row * hc * F32_BYTES]
        slots = []
        for (start, size, length), base in zip(self.sections, bases):
            for first in range(0, size, self.threads):
                index = tid + first
                word = start + index
                if self.stride_words != length:
                    word = start + (index // length) * self.stride_words + index % length
                slots.append((word, index, size, ptx.ld_global_u32(base + Int64(index) * F32_BYTES, index < size)))
        return slots

    def store(self, slots):
        for word, index, size, bits in slots:
            ptx.st_shared_u32_if(self.base + word * F32_BYTES, bits, index < size)

    def row(self, start):
        """The hc coefficients of the row at word `start`, read as 16-byte vectors."""
        values = []
        for q in range(0, self.hc, _WORDS):
            values += list(ptx.ld_volatile_shared_v4_f32(self.base + (start + q) * F32_BYTES))
        return values[: self.hc]


class _SharedRow:
    """Indexing reads one fp32 coefficient from shared memory."""

    def __init__(self, base, start):
        self.base, self.start = base, start

    def __getitem__(self, i):
        return ptx.ld_shared_f32(self.base + (self.start + i) * F32_BYTES)


class _TokenMailbox:
    """Where this thread's token lives in the mailbox of the generation being consumed
    (mhc_ar.protocol), the spin's deadline, and the call tags: lane r of CTA 0's first warp
    holds rank r's (loaded with the first fragment's data, checked as soon as that has landed,
    so its latency hides under the data's)."""

    def __init__(self, spec: ConsumerSpec, mailbox, generation, row, cta, tid, token, state_address):
        self.deadline = ptx.deadline_after(spec.spin_timeout_ns)
        hidden = spec.hidden_size
        self.rank_stride = Int64(rank_stride_bytes(hidden, spec.capacity))
        self.token_base = mailbox + generation * (spec.tp * self.rank_stride) + row * row_bytes(hidden)
        self.tag_checker = (cta == 0) & (tid < spec.tp)
        self.tag_address = self.token_base + tag_byte_offset(hidden) + self.rank_stride * Int64(tid)
        self.cta, self.tid, self.token, self.generation, self.state_address = cta, tid, token, generation, state_address


class ConsumerKernel:
    """Compile-time configuration in `__init__`, launch in `__call__`, device code in `kernel`.

    Pointer arguments are raw device addresses (Int64); those a variant does not use are 0:
    mailbox       this rank's mailbox [3, tp, capacity, H + pad] bf16 (mhc_ar.protocol); unused
                  at tp = 1
    source, gemm2, weights, routes, gemm2_rows
                  the contribution (see PublishKernel), read only at tp = 1 (direct)
    residual      [M, hc, H] bf16          new_residual  [M, hc, H] bf16 (out)
    post          [M, hc] fp32             comb          [M, hc, hc] fp32 [source, target]
    pre           [M, hc] fp32             norm_weight   [H] bf16
    layer_input   [M, H] bf16 (out)        mx_values     [M, H] e4m3 (out, MXFP8 variant)
    mx_scales     [roundup(M,128) * H/32] uint8, 128x4 swizzled (out, MXFP8 variant)
    state         this rank's protocol state tensor (mhc_ar.protocol)
    """

    def __init__(self, spec: ConsumerSpec):
        self.spec = spec
        self.tiling = spec.tiling
        self.has_norm = spec.variant is not Variant.RESIDUAL_ONLY
        self.has_mxfp8 = spec.variant is Variant.MXFP8
        self.direct = spec.direct
        # The cross-CTA sum needs a cluster; residual-only has no cross-CTA step.
        self.cluster = self.tiling.cluster_size if self.has_norm else 1
        # Built beside this one, in the same module; calls of WIDE_FORM_MIN_TOKENS or more launch it.
        self.wide_form = WideFormKernel(dataclasses.replace(spec, wide=True)) if spec.has_wide_form else None

    @cute.jit
    def __call__(
        self,
        mailbox: Int64,
        state: cute.Tensor,
        source: Int64,
        gemm2: Int64,
        weights: Int64,
        routes: Int64,
        residual: Int64,
        post: Int64,
        comb: Int64,
        pre: Int64,
        norm_weight: Int64,
        new_residual: Int64,
        layer_input: Int64,
        mx_values: Int64,
        mx_scales: Int64,
        eps: Float32,
        num_tokens: Int32,
        gemm2_rows: Int32,
        stream,
    ):
        arguments = (mailbox, state, (source, gemm2, weights, routes), (residual, post, comb, pre, norm_weight),
                     (new_residual, layer_input, mx_values, mx_scales), eps, num_tokens, gemm2_rows)
        if cutlass.const_expr(self.wide_form is None):
            self._launch(arguments, num_tokens, stream)
        else:
            # Chosen on the host per call, from M (a graph captures the choice of its M).
            if num_tokens >= WIDE_FORM_MIN_TOKENS:
                self.wide_form._launch(arguments, num_tokens, stream)
            else:
                self._launch(arguments, num_tokens, stream)

    def _launch(self, arguments, num_tokens, stream):
        """This kernel's launch (arguments: those of `kernel`), traced into the caller's host function."""
        tiling, spec = self.tiling, self.spec
        self.kernel(*arguments).launch(
            grid=[num_tokens * tiling.cluster_size, 1, 1],
            block=[tiling.threads_per_cta, 1, 1],
            cluster=[self.cluster, 1, 1],
            stream=stream,
            use_pdl=True,
            # A register bound (launch_bounds' min CTAs per SM), so enough bytes are in flight per
            # SM at large M; preferred_smem_carveout only keeps the DSL from querying a GPU.
            min_blocks_per_mp=spec.min_ctas_per_sm,
            preferred_smem_carveout=0,
        )

    @cute.kernel
    def kernel(
        self,
        mailbox: Int64,
        state: cute.Tensor,
        contribution: tuple,
        mix: tuple,
        outputs: tuple,
        eps: Float32,
        num_tokens: Int32,
        gemm2_rows: Int32,
    ):
        source, gemm2, weights, routes = contribution
        residual, post, comb, pre, norm_weight = mix
        new_residual, layer_input, mx_values, mx_scales = outputs
        spec, tiling = self.spec, self.tiling
        hidden, hc, tp = spec.hidden_size, spec.hc, spec.tp
        threads, per_cta = tiling.threads_per_cta, tiling.vectors_per_cta
        clusters = tiling.cluster_size

        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        token = bid // clusters
        cta = bid - token * clusters
        lane = tid % WARP_SIZE
        warp = tid // WARP_SIZE

        smem = SmemAllocator()
        warp_sums = smem.allocate_tensor(Float32, cute.make_layout((tiling.warps_per_cta,)), byte_alignment=16)
        cluster_sums = smem.allocate_tensor(Float32, cute.make_layout((clusters,)), byte_alignment=16)
        sums_landed = smem.allocate_tensor(Int64, cute.make_layout((1,)), byte_alignment=8)  # an mbarrier
        shared_coefficients = None
        if cutlass.const_expr(spec.coefficients_in_shared):
            shared_coefficients = smem.allocate_tensor(Float32, cute.make_layout((_SharedCoefficients.count(hc, spec.wide),)), byte_alignment=16)
        if cutlass.const_expr(self.has_norm and clusters > 1):
            # The cluster's CTA sums arrive by st.async on this mbarrier (see _inverse_rms): one
            # 4-byte sum from each CTA. Every CTA of the cluster must have started, and initialized
            # its mbarrier, before any store into its shared memory: the matching wait sits right
            # before the first remote store.
            if tid == 0:
                ptx.mbarrier_init_expect_tx(sums_landed.iterator.toint(), clusters * F32_BYTES)
            cute.arch.cluster_arrive_relaxed()

        zero_padding = self.has_mxfp8 and "padding_scales" not in spec.omit
        if cutlass.const_expr(zero_padding and not self.direct):
            # Stores only, of zeros, into scale rows no token of this call owns: issued before the
            # PDL wait so they overlap the publish. Safe: this kernel starts only once the publish
            # has passed its own griddepcontrol.wait (it triggers dependents after it), so every
            # kernel before the publish (e.g. a GEMM still reading last call's scales) has
            # finished; the publish itself never touches the scales. (At tp = 1 there is no
            # publish in between: the kernel before this one may still read them.)
            self._zero_padding_scales(bid, tid, num_tokens, mx_scales)

        # PDL: nothing a preceding kernel wrote (mailbox, generation, inputs) is read before this.
        cute.arch.griddepcontrol_wait()
        state_address = state.iterator.toint()
        generation = Int64(0)
        if cutlass.const_expr(not self.direct):
            # The generation first: every mailbox address depends on it. One load per thread (the
            # publish reads its state words once per CTA, through shared memory). Here one per CTA
            # through shared memory measured no faster (equal within noise in session 12's cost
            # table, slower in session 11's; notes/device-log.md), and it needs a barrier.
            generation = Int64(ptx.ld_volatile_u32(state_address + CONSUME_GENERATION * STATE_WORD_BYTES))
        # What this thread reads that no peer writes (the mix coefficients and, where the
        # registers allow, its fragments' residual streams: ConsumerSpec.prefetch_residual) is
        # loaded now too, so its latency hides under the generation's and the mailbox's instead
        # of following the spin.
        row = Int64(token)
        staged = None
        if cutlass.const_expr(spec.coefficients_in_shared):
            staged = _SharedCoefficients(hc, self.has_norm, shared_coefficients, threads, spec.wide)
            slots = staged.load(post, comb, pre, row, tid)
        else:
            coefficients = self._load_coefficients(post, comb, pre, row)
        fragments = []  # (vector, column, valid) of each fragment this thread owns
        residual_words = []  # per fragment: hc packed vectors, residual[token, s, column]
        contributions = []  # per fragment, at tp = 1: the contribution's packed vector
        for k in cutlass.range_constexpr(tiling.fragments_per_thread):
            local = tid + k * threads
            vector = cta * per_cta + local
            valid = None
            if cutlass.const_expr(tiling.needs_predicate):
                valid = (local < per_cta) & (vector < tiling.num_vectors)
            column = Int64(vector) * VECTOR_ELEMS
            fragments.append((vector, column, valid))
            if cutlass.const_expr(self.direct):
                contributions.append(self._contribution(source, gemm2, weights, routes, gemm2_rows, row, vector, column, valid,
                                                        state_address))
            if cutlass.const_expr(spec.prefetch_residual):
                residual_words.append(self._load_residual(residual, row, column, valid))
        if cutlass.const_expr(spec.coefficients_in_shared):
            # Stored only now: a store waits for its load, and the loads above go out first.
            staged.store(slots)
            coefficients = staged
        if cutlass.const_expr(zero_padding and self.direct):
            self._zero_padding_scales(bid, tid, num_tokens, mx_scales)
        cute.arch.griddepcontrol_launch_dependents()
        box = None
        if cutlass.const_expr(not self.direct):
            box = _TokenMailbox(self.spec, mailbox, generation, row, cta, tid, token, state_address)

        sum_sq = Float32(0.0)
        collapsed = []  # p values per fragment, for the normalization
        for k in cutlass.range_constexpr(tiling.fragments_per_thread):
            vector, column, valid = fragments[k]
            if cutlass.const_expr(self.direct):
                received = [contributions[k]]
            else:
                received = self._receive(box, column, valid, k == 0)
            if cutlass.const_expr(spec.coefficients_in_shared and k == 0):
                cute.arch.sync_threads()  # every staged coefficient is in shared memory
            y = self._reduce(received)
            if cutlass.const_expr(not spec.prefetch_residual):
                residual_words.append(self._load_residual(residual, row, column, valid))
            if cutlass.const_expr(spec.wide):
                p, sum_sq = self._mix_by_word(y, residual_words[k], coefficients, new_residual, row, column, valid, sum_sq)
                collapsed.append(p)
            else:
                targets = self._post_mix(y, residual_words[k], coefficients, new_residual, row, column, valid)
                if cutlass.const_expr(not (spec.coefficients_in_shared and self.has_norm)):
                    # Every target first (at hc <= 4 the registers allow it; residual_only stops here).
                    # With the coefficients in shared memory the collapse takes each target as soon as
                    # it is rounded instead: the same operations in the same order, none stays live.
                    targets = list(targets)
                if cutlass.const_expr(self.has_norm):
                    p = self._collapse(targets, coefficients)
                    sum_sq = self._sum_of_squares(p, sum_sq)
                    collapsed.append(p)

        if cutlass.const_expr(self.has_norm):
            # The norm weight is needed only after the cross-CTA sum: loaded before it, so its
            # latency hides under the cluster barriers (not before the spin: at tp = 8, hc = 4
            # its registers would spill).
            weight_words = [ptx.ld_global_v4(norm_weight + column * BF16_BYTES, valid) for _, column, valid in fragments]
            inv = self._inverse_rms(sum_sq, eps, lane, warp, cta, warp_sums, cluster_sums, sums_landed)
            for f in cutlass.range_constexpr(len(fragments)):
                vector, column, valid = fragments[f]
                out = self._rms_norm(collapsed[f], inv, weight_words[f], layer_input, row, column, valid)
                if cutlass.const_expr(self.has_mxfp8 and "mxfp8_block" not in spec.omit):
                    self._mxfp8_block(out, row, vector, column, lane, valid, mx_values, mx_scales)

    # ---- the stages, in contract order (reference/compose.py) -----------------------------------

    def _load_coefficients(self, post, comb, pre, row):
        """The token's post [hc], comb [hc][hc] and (with a norm) pre [hc], fp32."""
        hc = self.spec.hc
        post_t = [ptx.ld_global_f32(post + (row * hc + t) * F32_BYTES) for t in range(hc)]
        comb_st = [[ptx.ld_global_f32(comb + ((row * hc + s) * hc + t) * F32_BYTES) for t in range(hc)] for s in range(hc)]
        pre_t = []
        if self.has_norm:
            pre_t = [ptx.ld_global_f32(pre + (row * hc + t) * F32_BYTES) for t in range(hc)]
        return _Coefficients(post_t, comb_st, pre_t)

    @cute.jit
    def _receive(self, box, column, valid, first):
        """Every rank's 16 bytes of this fragment from the mailbox: spin until they have landed
        (bitwise sentinel test), re-arm exactly the slots consumed (peers write this generation
        again 3 calls later); with the `first` fragment, CTA 0 also checks the call tags."""
        tp = self.spec.tp
        slot = box.token_base + column * BF16_BYTES
        received = []
        for r in cutlass.range_constexpr(tp):
            received.append(ptx.ld_volatile_v4(slot + box.rank_stride * r, valid))
        tag = None
        if cutlass.const_expr(first):
            tag = ptx.ld_volatile_v4(box.tag_address, box.tag_checker)
        for r in cutlass.range_constexpr(tp):
            w0, w1, w2, w3 = received[r]
            while ptx.words_hold_sentinel(w0, w1, w2, w3):
                ptx.trap_after(box.deadline)
                w0, w1, w2, w3 = ptx.ld_volatile_v4(slot + box.rank_stride * r, valid)
            received[r] = (w0, w1, w2, w3)
        for r in cutlass.range_constexpr(tp):
            ptx.st_global_v4(slot + box.rank_stride * r, *([Uint32(SENTINEL_WORD)] * _WORDS), valid)
        if cutlass.const_expr(first):
            if box.cta == 0:
                self._check_call_tags(tag, box.tag_address, box.tag_checker, box.deadline, box.tid, box.token, box.generation,
                                      box.state_address)
        return received

    def _reduce(self, received):
        """Contract step 3: fp32 sum in rank order from +0.0, one rounding to bf16; y as fp32."""
        total = [Float32(0.0)] * VECTOR_ELEMS
        for words in received:
            lanes = _widen(words)
            total = [ptx.add_rn(total[j], lanes[j]) for j in range(VECTOR_ELEMS)]
        return _widen(_narrow(total))

    def _post_mix(self, y, residual_words, coefficients, new_residual, row, column, valid):
        """Contract step 4, per target t: a = y * post[t]; a = fma(residual[s], comb[s, t], a)
        over s in order; new_residual[t] = bf16(a), stored. Yields each target as fp32 (traced
        when the caller takes it)."""
        hc, hidden = self.spec.hc, self.spec.hidden_size
        streams = [_widen(words) for words in residual_words]
        for t in range(hc):
            a = [ptx.mul_rn(y[j], coefficients.post[t]) for j in range(VECTOR_ELEMS)]
            for s in range(hc):
                a = [ptx.fma_rn(streams[s][j], coefficients.comb[s][t], a[j]) for j in range(VECTOR_ELEMS)]
            words = _narrow(a)
            ptx.st_global_v4(new_residual + ((row * hc + t) * hidden + column) * BF16_BYTES, *words, valid)
            yield _widen(words)

    def _mix_by_word(self, y, residual_words, coefficients, new_residual, row, column, valid, sum_sq):
        """Contract steps 4-6 with the coefficients in shared memory, one word (two elements) of
        the fragment at a time: each element's chains are _post_mix's, _collapse's and
        _sum_of_squares' (the same operations in the same order; elements stay in order), but
        only one word of each residual stream is widened at a time and the coefficients are read
        again for each word, so few values are live at once (ptxas -v: see
        WIDE_FORM_THREADS_PER_SM). new_residual is stored once all its words are rounded.
        Returns (p, sum_sq); without a norm (residual_only) p is empty and sum_sq unchanged."""
        hc, hidden = self.spec.hc, self.spec.hidden_size
        target_words = [[None] * _WORDS for _ in range(hc)]
        p = []
        for w in range(_WORDS):
            post = coefficients.row(coefficients.post_start)
            a = [[ptx.mul_rn(y[2 * w + h], post[t]) for h in range(2)] for t in range(hc)]
            for s in range(hc):  # each target's chain takes s in order
                pair = ptx.bf16x2_to_f32x2(residual_words[s][w])
                comb = coefficients.row(coefficients.comb_starts[s])
                a = [[ptx.fma_rn(pair[h], comb[t], a[t][h]) for h in range(2)] for t in range(hc)]
            for t in range(hc):
                target_words[t][w] = ptx.f32x2_to_bf16x2_rn(a[t][0], a[t][1])
            if cutlass.const_expr(self.has_norm):
                pre = coefficients.row(coefficients.pre_start)
                c = [Float32(0.0)] * 2
                for t in range(hc):
                    mixed = ptx.bf16x2_to_f32x2(target_words[t][w])
                    c = [ptx.fma_rn(mixed[h], pre[t], c[h]) for h in range(2)]
                rounded = ptx.bf16x2_to_f32x2(ptx.f32x2_to_bf16x2_rn(c[0], c[1]))
                for h in range(2):
                    sum_sq = ptx.fma_rn(rounded[h], rounded[h], sum_sq)
                p += list(rounded)
        for t in range(hc):
            ptx.st_global_v4(new_residual + ((row * hc + t) * hidden + column) * BF16_BYTES, *target_words[t], valid)
        return p, sum_sq

    def _collapse(self, targets, coefficients):
        """Contract step 5: c = +0; c = fma(new_residual[t], pre[t], c) over t in order; p = bf16(c)."""
        c = [Float32(0.0)] * VECTOR_ELEMS
        for t, mixed in enumerate(targets):
            c = [ptx.fma_rn(mixed[j], coefficients.pre[t], c[j]) for j in range(VECTOR_ELEMS)]
        return _widen(_narrow(c))

    def _sum_of_squares(self, p, sum_sq):
        """Contract step 6, the thread's partial: fragments in order, elements in order."""
        for j in range(VECTOR_ELEMS):
            sum_sq = ptx.fma_rn(p[j], p[j], sum_sq)
        return sum_sq

    def _rms_norm(self, p, inv, weight_words, layer_input, row, column, valid):
        """Contract step 6's output: bf16((p * inv) * w), stored; returned as packed words."""
        w = _widen(weight_words)
        out = _narrow([ptx.mul_rn(ptx.mul_rn(p[j], inv), w[j]) for j in range(VECTOR_ELEMS)])
        ptx.st_global_v4(layer_input + (row * self.spec.hidden_size + column) * BF16_BYTES, *out, valid)
        return out

    # ------------------------------------------------------------------------------------------

    def _contribution(self, source, gemm2, weights, routes, gemm2_rows, row, vector, column, valid, state_address):
        """tp = 1: the rank's contribution to this fragment (contract step 1), as the publish
        computes it at tp > 1; the thread of the token's first vector counts invalid routes."""
        element_offset = row * self.spec.hidden_size + column
        if self.spec.contribution is Contribution.FINALIZE:
            return finalize_sum(self.spec.hidden_size, self.spec.top_k, source, gemm2, weights, routes, gemm2_rows, row, vector,
                                element_offset, vector == 0, state_address, valid)
        return load_x(source, element_offset, valid)

    def _load_residual(self, residual, row, column, valid):
        """The hc packed vectors residual[token, s, column .. column + 7], s in order."""
        hc, hidden = self.spec.hc, self.spec.hidden_size
        return [ptx.ld_global_v4(residual + ((row * hc + s) * hidden + column) * BF16_BYTES, valid) for s in range(hc)]

    @cute.jit
    def _check_call_tags(self, tag, tag_address, checker, deadline, tid, token, generation, state_address):
        """CTA 0 of a token: wait for every rank's call tag, trap unless each equals rank 0's
        with its own rank in the rank field (mhc_ar.protocol), re-arm the tags; CTA 0 of token 0
        then advances this rank's generation and call sequence for the next publish (which reads
        them only after its griddepcontrol.wait, i.e. once this whole grid has finished, so they
        can be written this early)."""
        if tid < WARP_SIZE:
            t0, t1, t2, t3 = tag
            while ptx.words_hold_sentinel(t0, t1, t2, t3):  # lanes >= tp loaded zeros
                ptx.trap_after(deadline)
                t0, t1, t2, t3 = ptx.ld_volatile_v4(tag_address, checker)
            if cutlass.const_expr("step_check" not in self.spec.omit):
                first = [cute.arch.shuffle_sync(t, offset=0) for t in (t0, t1, t2, t3)]
                own_rank = (first[3] & Uint32(~TAG_RANK_MASK & 0xFFFFFFFF)) | (Uint32(tid) << TAG_RANK_SHIFT)
                differs = (t0 != first[0]) | (t1 != first[1]) | (t2 != first[2]) | (t3 != own_rank)
                ptx.trap_if(checker & differs)
            ptx.st_global_v4(tag_address, *([Uint32(SENTINEL_WORD)] * _WORDS), checker)
            if token == 0 and tid == 0:
                # For the next publish (see mhc_ar.protocol): the generation after this one, and
                # the sequence after the one every rank's tag carried.
                next_generation = (generation + 1) % GENERATIONS
                ptx.st_global_u32(state_address + PUBLISH_GENERATION * STATE_WORD_BYTES, Uint32(next_generation))
                next_sequence = (ptx.unpack_tag_field(t0) + Uint32(1)) & Uint32(TAG_FIELD_MASK)
                ptx.st_global_u32(state_address + CALL_SEQUENCE * STATE_WORD_BYTES, next_sequence)

    # ------------------------------------------------------------------------------------------

    @cute.jit
    def _inverse_rms(self, sum_sq, eps, lane, warp, cta, warp_sums, cluster_sums, sums_landed):
        """Contract step 6's tree: warp butterfly, warps in order, CTAs in order; then
        rsqrt.approx(ss / H + eps). Across the cluster each CTA's sum goes by st.async into slot
        [cta] of every CTA, completing on that CTA's `sums_landed` mbarrier: no release fence, so
        no wait here for this thread's earlier global stores (mhc_ar.ptx, the st.async helpers)."""
        tiling = self.tiling
        for step in cutlass.range_constexpr(_BUTTERFLY_STEPS):
            offset = (WARP_SIZE // 2) >> step  # 16, 8, 4, 2, 1
            sum_sq = ptx.add_rn(sum_sq, cute.arch.shuffle_sync_bfly(sum_sq, offset=offset))
        if lane == 0:
            ptx.st_shared_f32((warp_sums.iterator + warp).toint(), sum_sq)
        cute.arch.sync_threads()
        cta_sum = Float32(0.0)
        for w in cutlass.range_constexpr(tiling.warps_per_cta):
            cta_sum = ptx.add_rn(cta_sum, ptx.ld_shared_f32((warp_sums.iterator + w).toint()))

        total = Float32(0.0)
        if cutlass.const_expr(tiling.cluster_size > 1):
            cute.arch.cluster_wait()  # pairs with the arrive at kernel start: all CTAs running
            tid, _, _ = cute.arch.thread_idx()
            barrier = sums_landed.iterator.toint()
            if tid < tiling.cluster_size:
                # Thread d writes this CTA's sum into slot [cta] of CTA d.
                ptx.st_async_cluster_f32((cluster_sums.iterator + cta).toint(), barrier, tid, cta_sum)
            while ptx.mbarrier_phase_pending(barrier, 0):  # every CTA's sum has landed here
                pass
            for c in cutlass.range_constexpr(tiling.cluster_size):
                total = ptx.add_rn(total, ptx.ld_shared_f32((cluster_sums.iterator + c).toint()))
        else:
            total = ptx.add_rn(total, cta_sum)
        mean = ptx.div_rn(total, Float32(float(self.spec.hidden_size)))
        return ptx.rsqrt_approx_ftz(ptx.add_rn(mean, eps))

    @cute.jit
    def _mxfp8_block(self, out, row, vector, column, lane, valid, mx_values, mx_scales):
        """Contract step 7, the bytes of mxfp8_quantize(layer_input): 4 adjacent lanes hold one
        block of 32. The magnitudes' maximum by FlashInfer's CuTe helpers; the scale byte, its
        inverse and the e4m3 bytes in one PTX sequence each (mhc_ar.ptx), fewer instructions
        than FlashInfer's per-pair helpers for the same bits."""
        amax = ptx.bf16x2_max_to_f32(bfloat2_max_abs_4(out[0], out[1], out[2], out[3]))
        amax = reduce_max_4threads(amax)
        scale, inverse = ptx.ue8m0_scale_and_inverse(ptx.mul_rn(amax, Float32(INV_FLOAT8_E4M3_MAX)))
        packed = ptx.bf16x8_to_e4m3x8(out[0], out[1], out[2], out[3], inverse)
        ptx.st_global_u64(mx_values + row * self.spec.hidden_size + column, packed, valid)
        # vector and lane are never negative: shifts and masks, not the signed // and % (whose
        # rounding fix-ups ptxas cannot drop).
        block = vector >> _LOG2_VECTORS_PER_BLOCK
        ptx.st_global_u8(mx_scales + Int64(self._scale_offset(row, block)), scale, self._scale_leader(lane, valid))

    def _scale_offset(self, row, block):
        """Byte offset of scale (row, block) in the 128x4 swizzled layout (the formula of
        _zero_padding_scales' docstring): block % 4 + (block // 4) * 512 + (row % 32) * 16
        + ((row % 128) // 32) * 4 + (row // 128) * 128 * (H/32), for row, block >= 0."""
        row = Int32(row)
        within = (block & 3) + ((block >> 2) << 9)
        return within + ((row & 31) << 4) + (((row >> 5) & 3) << 2) + (row >> 7) * (_SCALE_ROW_TILE * self._scale_columns())

    def _scale_leader(self, lane, valid):
        leader = (lane & (VECTORS_PER_MXFP8_BLOCK - 1)) == 0
        if cutlass.const_expr(valid is not None):
            leader = leader & valid
        return leader

    @cute.jit
    def _zero_padding_scales(self, bid, tid, num_tokens, mx_scales):
        """Scale rows M .. roundup(M,128)-1 are zero. In the 128x4 layout the scales of columns
        4g..4g+3 of row r are the 4 bytes at g*512 + (r%32)*16 + ((r%128)//32)*4
        + (r//128)*128*(H/32): the 16-byte chunk i of group g holds rows i, i+32, i+64, i+96 of
        a 128-row tile. Only the last tile has padding rows (local rows m0 = M%128 .. 127).
        A chunk with i >= m0 is all padding: one 16-byte store, and consecutive threads take
        consecutive chunks, so a warp writes 512 contiguous bytes. A chunk with i < m0 holds
        token rows (written by their clusters) and up to 3 padding rows: 4-byte stores."""
        groups = self.spec.hidden_size // (4 * MXFP8_BLOCK)
        m0 = num_tokens % _SCALE_ROW_TILE
        tile = Int64(num_tokens // _SCALE_ROW_TILE) * (_SCALE_ROW_TILE * self._scale_columns())
        stride = num_tokens * self.tiling.cluster_size * self.tiling.threads_per_cta
        unit = bid * self.tiling.threads_per_cta + tid
        if m0 == 0:
            unit = Int32(_CHUNKS_PER_GROUP * groups)  # M is a multiple of 128: no padding rows
        zero = Uint32(0)
        while unit < _CHUNKS_PER_GROUP * groups:
            group = unit // _CHUNKS_PER_GROUP
            i = unit - group * _CHUNKS_PER_GROUP
            chunk = mx_scales + tile + Int64(group * 512 + i * 16)
            ptx.st_global_v4(chunk, zero, zero, zero, zero, i >= m0)
            for k in cutlass.range_constexpr(1, _ROWS_PER_CHUNK):
                ptx.st_global_u32(chunk + 4 * k, zero, (i < m0) & (i + 32 * k >= m0))
            unit = unit + stride

    def _scale_columns(self) -> int:
        # The MXFP8 variant requires H % 128 == 0, so H/32 is already a multiple of 4.
        return self.spec.hidden_size // MXFP8_BLOCK


class WideFormKernel(ConsumerKernel):
    """A consumer's wide form (ConsumerSpec.wide), launched by the narrow form's host function
    for calls of WIDE_FORM_MIN_TOKENS tokens or more. Its own class only so that its kernel's
    name says which form ran (the DSL names a kernel after its object's class: a profiler trace
    shows "WideFormKernel")."""
