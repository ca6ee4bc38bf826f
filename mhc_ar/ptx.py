"""PTX primitives the kernels are built from, one instruction (or one fixed sequence) each.

Every floating-point step of the numerics contract (SPEC.md, "The numerics contract") is spelled
here as an explicit PTX instruction, so neither the DSL nor LLVM can contract, reassociate or
flush it: `fma.rn.f32` (no `.ftz`: subnormals are preserved, as the reference assumes),
`mul.rn.f32` and `add.rn.f32` (the `.rn` suffix also forbids contraction into an fma),
`div.rn.f32` and `rsqrt.approx.ftz.f32`. Memory accesses of the Lamport protocol are inline PTX
too, so the PTX shows exactly one 16-byte access per vector: `ld.volatile.global.v4.b32` for the
spin, `st.global.v4.b32` for peer stores and re-arming, `multimem.st` for the multicast
transport only.

Addresses are plain 64-bit integers (`Int64`): the kernels receive raw device addresses, the same
way for a local tensor, a peer's mailbox from symmetric memory or an emulated rank's mailbox.
"""

from __future__ import annotations

from cutlass import Boolean, Float32, Int32, Int64, Uint32, Uint64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .protocol import SENTINEL_HIGH_PTX, SENTINEL_LOW_PTX


def _asm(result_type, operands, ptx, constraints, *, side_effects, loc, ip):
    return llvm.inline_asm(
        result_type,
        operands,
        ptx,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def _ir(values, loc, ip):
    return [v.ir_value(loc=loc, ip=ip) for v in values]


def _unpack(struct, count, dtype, loc, ip):
    element = dtype.mlir_type
    return tuple(dtype(llvm.extractvalue(element, struct, [i], loc=loc, ip=ip)) for i in range(count))


# --------------------------------------------------------------------------------------------
# fp32 arithmetic of the contract
# --------------------------------------------------------------------------------------------


@dsl_user_op
def fma_rn(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """a * b + c with one rounding (contract steps 1, 4, 5, 6)."""
    ops = _ir([Float32(a), Float32(b), Float32(c)], loc, ip)
    return Float32(_asm(T.f32(), ops, "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def mul_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a * b rounded on its own; `.rn` keeps it out of any fma contraction (contract step 4, 6)."""
    ops = _ir([Float32(a), Float32(b)], loc, ip)
    return Float32(_asm(T.f32(), ops, "mul.rn.f32 $0, $1, $2;", "=f,f,f", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def add_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a + b (contract steps 1, 3, 6)."""
    ops = _ir([Float32(a), Float32(b)], loc, ip)
    return Float32(_asm(T.f32(), ops, "add.rn.f32 $0, $1, $2;", "=f,f,f", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def div_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """IEEE division, correctly rounded (contract step 6: ss / H)."""
    ops = _ir([Float32(a), Float32(b)], loc, ip)
    return Float32(_asm(T.f32(), ops, "div.rn.f32 $0, $1, $2;", "=f,f,f", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def rsqrt_approx_ftz(x: Float32, *, loc=None, ip=None) -> Float32:
    """The hardware reciprocal square root (contract step 6); the reference models it by table."""
    ops = _ir([Float32(x)], loc, ip)
    return Float32(_asm(T.f32(), ops, "rsqrt.approx.ftz.f32 $0, $1;", "=f,f", side_effects=False, loc=loc, ip=ip))


# --------------------------------------------------------------------------------------------
# bf16 <-> fp32 on packed words (lane 0 in the low half, as in memory)
# --------------------------------------------------------------------------------------------


@dsl_user_op
def bf16x2_to_f32x2(word: Uint32, *, loc=None, ip=None):
    """Exact widening of the two bf16 lanes of a word: (low lane, high lane)."""
    struct = _asm(
        llvm.StructType.get_literal([T.f32(), T.f32()]),
        _ir([Uint32(word)], loc, ip),
        "{\n\t.reg .b32 lo, hi;\n\tshl.b32 lo, $2, 16;\n\tand.b32 hi, $2, 0xFFFF0000;\n\t"
        "mov.b32 $0, lo;\n\tmov.b32 $1, hi;\n\t}",
        "=f,=f,r",
        side_effects=False,
        loc=loc,
        ip=ip,
    )
    return _unpack(struct, 2, Float32, loc, ip)


@dsl_user_op
def f32x2_to_bf16x2_rn(low: Float32, high: Float32, *, loc=None, ip=None) -> Uint32:
    """Round two fp32 values to bf16 (nearest-even; NaN becomes the canonical 0x7FFF) and pack."""
    # cvt.rn.bf16x2.f32 d, a, b puts a in the upper half and b in the lower half.
    ops = _ir([Float32(high), Float32(low)], loc, ip)
    return Uint32(_asm(T.i32(), ops, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", side_effects=False, loc=loc, ip=ip))


# --------------------------------------------------------------------------------------------
# MXFP8 (contract step 7), per block of 32 bf16 values; 8 per thread
# --------------------------------------------------------------------------------------------


@dsl_user_op
def bf16x2_max_to_f32(word: Uint32, *, loc=None, ip=None) -> Float32:
    """max.f32 of the word's two bf16 lanes, widened exactly (a NaN lane gives the other one)."""
    ptx = "{\n\t.reg .b32 lo, hi;\n\tshl.b32 lo, $1, 16;\n\tand.b32 hi, $1, 0xFFFF0000;\n\tmax.f32 $0, lo, hi;\n\t}"
    return Float32(_asm(T.f32(), _ir([Uint32(word)], loc, ip), ptx, "=f,r", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def ue8m0_scale_and_inverse(nm: Float32, *, loc=None, ip=None):
    """The block's scale byte e and inverse scale from nm = amax * fp32(1/448) >= 0 or NaN, by the
    contract's bit rule: e = min(biased exponent of nm, rounded up when its mantissa is nonzero,
    254), 0 for nm <= 2^-127 (bits <= 0x400000: zero and the subnormals that round down); Inf and
    NaN give 254. inv = 2^(127 - e) as bits (254 - e) << 23, which is 0 at e = 254; 0 at e = 0.
    (bits + 0x7FFFFF) >> 23 is the exponent plus one exactly when the mantissa is nonzero. nm is
    never negative: amax is a maximum of magnitudes, and NaN arithmetic gives the canonical,
    positive NaN 0x7FFFFFFF."""
    ptx = (
        "{\n\t.reg .pred small;\n\t.reg .b32 bits, e, inv;\n\t"
        "mov.b32 bits, $2;\n\t"
        "setp.le.s32 small, bits, 0x400000;\n\t"
        "add.u32 e, bits, 0x7FFFFF;\n\t"
        "shr.u32 e, e, 23;\n\t"
        "min.u32 e, e, 254;\n\t"
        "selp.b32 e, 0, e, small;\n\t"
        "sub.u32 inv, 254, e;\n\t"
        "shl.b32 inv, inv, 23;\n\t"
        "selp.b32 inv, 0, inv, small;\n\t"
        "mov.b32 $0, e;\n\tmov.b32 $1, inv;\n\t}"
    )
    struct = _asm(
        llvm.StructType.get_literal([T.i32(), T.f32()]), _ir([Float32(nm)], loc, ip), ptx, "=r,=f,f",
        side_effects=False, loc=loc, ip=ip,
    )
    scale, inverse = (llvm.extractvalue(t, struct, [i], loc=loc, ip=ip) for i, t in enumerate((T.i32(), T.f32())))
    return Uint32(scale), Float32(inverse)


@dsl_user_op
def bf16x8_to_e4m3x8(w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32, inv: Float32, *, loc=None, ip=None) -> Uint64:
    """Eight bf16 values (four packed words, low lane first) -> eight e4m3 bytes in one 64-bit
    word, byte j = value j: the bytes of e4m3_rn_satfinite(clamp(v * inv, -448, 448)) with NaN
    becoming +448. Only the upper clamp is spelled: min.f32 returns the non-NaN operand, so NaN
    (a NaN v, or Inf * 0 when inv is 0) becomes 448. The lower one cannot act: |v| <= amax and
    amax * inv <= 448 (1 + 2^-22) by the scale rule (nm = amax * fp32(1/448) rounded, inv the
    inverse of a power of two >= nm), and e4m3 rounds everything in [448, 464) to 448; at inv = 0
    the finite products are +-0."""
    lines = ["{", ".reg .b32 v<8>;", ".reg .b16 q<4>;"]
    for w in range(4):
        lines += [f"shl.b32 v{2 * w}, ${w + 1}, 16;", f"and.b32 v{2 * w + 1}, ${w + 1}, 0xFFFF0000;"]
    for j in range(8):
        lines += [f"mul.rn.f32 v{j}, v{j}, $5;", f"min.f32 v{j}, v{j}, 0f43E00000;"]
    for w in range(4):
        # cvt ... d, a, b puts a in the upper byte and b in the lower one.
        lines.append(f"cvt.rn.satfinite.e4m3x2.f32 q{w}, v{2 * w + 1}, v{2 * w};")
    lines += ["mov.b64 $0, {q0, q1, q2, q3};", "}"]
    ptx = "\n\t".join(lines)
    ops = _ir([Uint32(w0), Uint32(w1), Uint32(w2), Uint32(w3), Float32(inv)], loc, ip)
    return Uint64(_asm(T.i64(), ops, ptx, "=l,r,r,r,r,f", side_effects=False, loc=loc, ip=ip))


# --------------------------------------------------------------------------------------------
# Lamport sentinel handling (bitwise, never a float compare)
# --------------------------------------------------------------------------------------------


@dsl_user_op
def scrub_word(word: Uint32, *, loc=None, ip=None) -> Uint32:
    """Contract step 2: a lane with bits 0x8000 (-0.0) is published as 0x0000 (+0.0)."""
    ptx = (
        "{\n\t.reg .pred plo, phi;\n\t.reg .b32 lo, hi;\n\t"
        "and.b32 lo, $1, 0x0000FFFF;\n\tand.b32 hi, $1, 0xFFFF0000;\n\t"
        f"setp.eq.b32 plo, lo, {SENTINEL_LOW_PTX};\n\tsetp.eq.b32 phi, hi, {SENTINEL_HIGH_PTX};\n\t"
        "selp.b32 lo, 0, lo, plo;\n\tselp.b32 hi, 0, hi, phi;\n\tor.b32 $0, lo, hi;\n\t}"
    )
    return Uint32(_asm(T.i32(), _ir([Uint32(word)], loc, ip), ptx, "=r,r", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def words_hold_sentinel(w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32, *, loc=None, ip=None) -> Boolean:
    """True while any of the eight bf16 lanes still equals 0x8000 (an unwritten mailbox lane)."""
    compares = []
    for i in range(1, 5):
        compares.append(f"and.b32 lo, ${i}, 0x0000FFFF;\n\tand.b32 hi, ${i}, 0xFFFF0000;\n\t")
        first = "setp.eq.b32 p, lo, {}" if i == 1 else "setp.eq.or.b32 p, lo, {}, p"
        compares.append(first.format(SENTINEL_LOW_PTX) + f";\n\tsetp.eq.or.b32 p, hi, {SENTINEL_HIGH_PTX}, p;\n\t")
    ptx = "{\n\t.reg .pred p;\n\t.reg .b32 lo, hi;\n\t" + "".join(compares) + "selp.u32 $0, 1, 0, p;\n\t}"
    ops = _ir([Uint32(w0), Uint32(w1), Uint32(w2), Uint32(w3)], loc, ip)
    flag = Uint32(_asm(T.i32(), ops, ptx, "=r,r,r,r,r", side_effects=False, loc=loc, ip=ip))
    return flag != Uint32(0)


@dsl_user_op
def deadline_after(timeout_ns: int, *, loc=None, ip=None) -> Int64:
    """%globaltimer + timeout_ns: the one deadline of a consumer CTA's whole wait (every rank,
    every fragment, the call tags), so a stuck call traps one timeout after the CTA began to
    wait, not tp x fragments timeouts."""
    ptx = f"{{\n\t.reg .u64 now;\n\tmov.u64 now, %globaltimer;\n\tadd.u64 $0, now, {int(timeout_ns)};\n\t}}"
    return Int64(_asm(T.i64(), [], ptx, "=l", side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def trap_after(deadline: Int64, *, loc=None, ip=None) -> None:
    """Called once per spin iteration: past the deadline it executes `trap`, so a peer that never
    publishes fails the launch with a CUDA error instead of hanging the GPU forever."""
    ptx = (
        "{\n\t.reg .u64 now;\n\t.reg .pred late;\n\t"
        "mov.u64 now, %globaltimer;\n\t"
        "setp.gt.u64 late, now, $0;\n\t"
        "@late trap;\n\t}"
    )
    _asm(None, _ir([Int64(deadline)], loc, ip), ptx, "l", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def trap_if(predicate, *, loc=None, ip=None) -> None:
    """`trap` where the predicate holds: a call tag that differs from rank 0's (ranks out of
    step) fails the launch with a CUDA error on this rank."""
    ptx = "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $0, 0;\n\t@p trap;\n\t}"
    _asm(None, [_predicate_operand(predicate, loc, ip)], ptx, "r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def pack_tag_field(value: Uint32, *, loc=None, ip=None) -> Uint32:
    """30 bits of a tag field, 15 per 16-bit lane with the lane's top bit clear (never the
    sentinel); mhc_ar.protocol.pack_tag_field is the same on the host."""
    ptx = (
        "{\n\t.reg .b32 lo, hi;\n\tand.b32 lo, $1, 0x00007FFF;\n\tshl.b32 hi, $1, 1;\n\t"
        "and.b32 hi, hi, 0x7FFF0000;\n\tor.b32 $0, lo, hi;\n\t}"
    )
    return Uint32(_asm(T.i32(), _ir([Uint32(value)], loc, ip), ptx, "=r,r", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def unpack_tag_field(word: Uint32, *, loc=None, ip=None) -> Uint32:
    ptx = (
        "{\n\t.reg .b32 lo, hi;\n\tand.b32 lo, $1, 0x00007FFF;\n\tshr.b32 hi, $1, 1;\n\t"
        "and.b32 hi, hi, 0x3FFF8000;\n\tor.b32 $0, lo, hi;\n\t}"
    )
    return Uint32(_asm(T.i32(), _ir([Uint32(word)], loc, ip), ptx, "=r,r", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def mul_lo_u32(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """a * b mod 2^32 (a term of the call tag's fingerprint)."""
    ops = _ir([Uint32(a), Uint32(b)], loc, ip)
    return Uint32(_asm(T.i32(), ops, "mul.lo.u32 $0, $1, $2;", "=r,r,r", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def add_u32(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """a + b mod 2^32. Inline, so the compiler keeps the fingerprint's sum the balanced tree it is
    written as (not a serial chain of one dependent step per coefficient before the tag store)."""
    ops = _ir([Uint32(a), Uint32(b)], loc, ip)
    return Uint32(_asm(T.i32(), ops, "add.u32 $0, $1, $2;", "=r,r,r", side_effects=False, loc=loc, ip=ip))


# --------------------------------------------------------------------------------------------
# Global memory, 16 bytes at a time. An optional predicate (a DSL Boolean) turns an access off
# for threads that own no vector (a predicated-off load yields zeros, which hold no sentinel).
# --------------------------------------------------------------------------------------------


def _v4_type():
    return llvm.StructType.get_literal([T.i32(), T.i32(), T.i32(), T.i32()])


def _guarded(instruction: str, predicate_operand: int | None, zero_outputs: int = 0) -> str:
    if predicate_operand is None:
        return instruction
    zeros = "".join(f"@!p mov.b32 ${i}, 0;\n\t" for i in range(zero_outputs))
    return (
        f"{{\n\t.reg .pred p;\n\tsetp.ne.b32 p, ${predicate_operand}, 0;\n\t{zeros}@p {instruction}\n\t}}"
    )


def _predicate_operand(predicate, loc, ip):
    return Int32(predicate).ir_value(loc=loc, ip=ip)


def _load_v4(opcode: str, address, predicate, side_effects, loc, ip):
    operands = _ir([Int64(address)], loc, ip)
    constraints = "=r,=r,=r,=r,l"
    pred_index = None
    if predicate is not None:
        operands.append(_predicate_operand(predicate, loc, ip))
        constraints += ",r"
        pred_index = 5
    ptx = _guarded(f"{opcode} {{$0, $1, $2, $3}}, [$4];", pred_index, zero_outputs=4)
    struct = _asm(_v4_type(), operands, ptx, constraints, side_effects=side_effects, loc=loc, ip=ip)
    return _unpack(struct, 4, Uint32, loc, ip)


@dsl_user_op
def ld_global_v4(address: Int64, predicate=None, *, loc=None, ip=None):
    """16-byte load of data written by an earlier kernel (issued after griddepcontrol.wait)."""
    return _load_v4("ld.global.v4.b32", address, predicate, False, loc, ip)


@dsl_user_op
def ld_volatile_v4(address: Int64, predicate=None, *, loc=None, ip=None):
    """16-byte volatile load: the Lamport spin re-reads memory on every iteration."""
    return _load_v4("ld.volatile.global.v4.b32", address, predicate, True, loc, ip)


def _store(instruction: str, constraints: str, values, predicate, loc, ip):
    operands = _ir(values, loc, ip)
    pred_index = None
    if predicate is not None:
        pred_index = len(operands)
        operands.append(_predicate_operand(predicate, loc, ip))
        constraints += ",r"
    _asm(None, operands, _guarded(instruction, pred_index), constraints, side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_global_v4(address: Int64, w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32, predicate=None, *, loc=None, ip=None) -> None:
    """16-byte store: peer mailbox publish, mailbox re-arm, bf16 outputs."""
    values = [Int64(address), Uint32(w0), Uint32(w1), Uint32(w2), Uint32(w3)]
    _store("st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", values, predicate, loc, ip)


@dsl_user_op
def st_global_u64(address: Int64, value: Uint64, predicate=None, *, loc=None, ip=None) -> None:
    """8-byte store: eight MXFP8 values."""
    _store("st.global.b64 [$0], $1;", "l,l", [Int64(address), Uint64(value)], predicate, loc, ip)


@dsl_user_op
def st_global_u8(address: Int64, value: Uint32, predicate=None, *, loc=None, ip=None) -> None:
    """One byte: an MXFP8 scale."""
    values = [Int64(address), Uint32(value)]
    # PTX lets st take a register wider than its type: the low byte is stored.
    _store("st.global.b8 [$0], $1;", "l,r", values, predicate, loc, ip)


@dsl_user_op
def st_global_u32(address: Int64, value: Uint32, predicate=None, *, loc=None, ip=None) -> None:
    """4-byte store: the 4 scales of one MXFP8 padding row in one 16-byte chunk."""
    _store("st.global.b32 [$0], $1;", "l,r", [Int64(address), Uint32(value)], predicate, loc, ip)


@dsl_user_op
def ld_volatile_u32(address: Int64, *, loc=None, ip=None) -> Uint32:
    """A protocol state word (generation), written by the previous kernel."""
    ops = _ir([Int64(address)], loc, ip)
    return Uint32(_asm(T.i32(), ops, "ld.volatile.global.b32 $0, [$1];", "=r,l", side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def ld_global_f32(address: Int64, *, loc=None, ip=None) -> Float32:
    ops = _ir([Int64(address)], loc, ip)
    return Float32(_asm(T.f32(), ops, "ld.global.f32 $0, [$1];", "=f,l", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def ld_global_u32(address: Int64, predicate=None, *, loc=None, ip=None) -> Uint32:
    """A 32-bit word as bits (the fp32 mix coefficients the call tag's fingerprint sums); zero
    where the predicate is off. Issued where it is written (side effects, so the compiler cannot
    sink it to its first use): the fingerprint's loads overlap the thread's data load."""
    operands = _ir([Int64(address)], loc, ip)
    constraints, pred_index = "=r,l", None
    if predicate is not None:
        operands.append(_predicate_operand(predicate, loc, ip))
        constraints, pred_index = "=r,l,r", 2
    ptx = _guarded("ld.global.b32 $0, [$1];", pred_index, zero_outputs=1)
    return Uint32(_asm(T.i32(), operands, ptx, constraints, side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def red_add_u32(address: Int64, value: Uint32, predicate, *, loc=None, ip=None) -> None:
    """Atomic add to a global word, no result (the invalid-route counter)."""
    _store("red.relaxed.gpu.global.add.u32 [$0], $1;", "l,r", [Int64(address), Uint32(value)], predicate, loc, ip)


@dsl_user_op
def ld_global_s32(address: Int64, *, loc=None, ip=None) -> Int32:
    ops = _ir([Int64(address)], loc, ip)
    return Int32(_asm(T.i32(), ops, "ld.global.b32 $0, [$1];", "=r,l", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def fma_rn_if(predicate, a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """fma.rn.f32 where the predicate holds, else c unchanged (a skipped MoE route)."""
    ops = _ir([Float32(a), Float32(b), Float32(c)], loc, ip) + [_predicate_operand(predicate, loc, ip)]
    ptx = (
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $4, 0;\n\tmov.b32 $0, $3;\n\t"
        "@p fma.rn.f32 $0, $1, $2, $3;\n\t}"
    )
    return Float32(_asm(T.f32(), ops, ptx, "=&f,f,f,f,r", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def multimem_st_v4(address: Int64, w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32, *, loc=None, ip=None) -> None:
    """One store to an NVLink multicast address reaches every rank's mailbox (GB200/GB300 only).

    Compiled and PTX-checked on every machine; never executed on the H200 machines this project is
    tested on (a multicast mapping can take shared GPUs out of service there).
    """
    ops = _ir([Int64(address), Uint32(w0), Uint32(w1), Uint32(w2), Uint32(w3)], loc, ip)
    _asm(
        None,
        ops,
        "multimem.st.relaxed.sys.global.v4.bf16x2 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r",
        side_effects=True,
        loc=loc,
        ip=ip,
    )


# --------------------------------------------------------------------------------------------
# Distributed shared memory (the cluster's RMSNorm reduction)
# --------------------------------------------------------------------------------------------


# The cross-CTA sum of squares goes through an mbarrier, not a cluster barrier: a
# `barrier.cluster.arrive` with release semantics compiles to MEMBAR.ALL.GPU, which waits for every
# global store the thread issued before it (the new_residual stores) to complete; in Nsight
# Compute that fence was 27% of the consumer's warp stall samples at H5120 hc4 M1024 (session 16).
# st.async needs no fence: each 4-byte store completes on the receiving CTA's mbarrier.


@dsl_user_op
def mbarrier_init_expect_tx(mbarrier: Uint32, tx_bytes: int, *, loc=None, ip=None) -> None:
    """One thread of the CTA: initialize the mbarrier at `mbarrier` (shared, 8-byte aligned) for
    one arrival, arrive expecting `tx_bytes` of st.async data (its phase 0 completes once they
    have all landed), and fence the initialization for the cluster (the next cluster barrier
    arrive publishes it to the other CTAs)."""
    ptx = (
        "{\n\t.reg .b64 state;\n\t"
        "mbarrier.init.shared::cta.b64 [$0], 1;\n\t"
        f"mbarrier.arrive.expect_tx.shared::cta.b64 state, [$0], {int(tx_bytes)};\n\t"
        "fence.mbarrier_init.release.cluster;\n\t}"
    )
    _asm(None, _ir([Uint32(mbarrier)], loc, ip), ptx, "r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_async_cluster_f32(shared_address: Uint32, mbarrier: Uint32, cta_rank: Int32, value: Float32, *, loc=None, ip=None) -> None:
    """Store `value` at the same shared-memory offset in CTA `cta_rank` of this cluster, completing
    4 bytes of that CTA's mbarrier (at the same offset as `mbarrier` here)."""
    ops = _ir([Uint32(shared_address), Uint32(mbarrier), Int32(cta_rank), Float32(value)], loc, ip)
    ptx = (
        "{\n\t.reg .b32 remote, remote_barrier;\n\t"
        "mapa.shared::cluster.u32 remote, $0, $2;\n\t"
        "mapa.shared::cluster.u32 remote_barrier, $1, $2;\n\t"
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [remote], $3, [remote_barrier];\n\t}"
    )
    _asm(None, ops, ptx, "r,r,r,f", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def mbarrier_phase_pending(mbarrier: Uint32, parity: int, *, loc=None, ip=None) -> Boolean:
    """True while the mbarrier's phase of this parity has not completed (one try_wait; acquire at
    cluster scope, so the other CTAs' st.async data is visible once it returns False)."""
    ptx = (
        "{\n\t.reg .pred done;\n\t"
        f"mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [$1], {int(parity)};\n\t"
        "selp.u32 $0, 0, 1, done;\n\t}"
    )
    flag = Uint32(_asm(T.i32(), _ir([Uint32(mbarrier)], loc, ip), ptx, "=r,r", side_effects=True, loc=loc, ip=ip))
    return flag != Uint32(0)


@dsl_user_op
def ld_shared_f32(shared_address: Uint32, *, loc=None, ip=None) -> Float32:
    ops = _ir([Uint32(shared_address)], loc, ip)
    return Float32(_asm(T.f32(), ops, "ld.shared.f32 $0, [$1];", "=f,r", side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def ld_volatile_shared_v4_f32(shared_address: Uint32, *, loc=None, ip=None):
    """Four fp32 values from 16-byte-aligned shared memory, loaded where this stands (volatile:
    ptxas neither merges nor hoists it, so the values take registers only near their use)."""
    ops = _ir([Uint32(shared_address)], loc, ip)
    struct = _asm(llvm.StructType.get_literal([T.f32()] * 4), ops, "ld.volatile.shared.v4.f32 {$0, $1, $2, $3}, [$4];",
                  "=f,=f,=f,=f,r", side_effects=True, loc=loc, ip=ip)
    return _unpack(struct, 4, Float32, loc, ip)


@dsl_user_op
def st_shared_f32(shared_address: Uint32, value: Float32, *, loc=None, ip=None) -> None:
    ops = _ir([Uint32(shared_address), Float32(value)], loc, ip)
    _asm(None, ops, "st.shared.f32 [$0], $1;", "r,f", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_shared_u32_if(shared_address: Uint32, value: Uint32, predicate, *, loc=None, ip=None) -> None:
    """32-bit shared store where the predicate holds (staging a coefficient's bits)."""
    _store("st.shared.b32 [$0], $1;", "r,r", [Uint32(shared_address), Uint32(value)], predicate, loc, ip)
