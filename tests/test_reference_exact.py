"""reference.exact and reference.bits against exact rational arithmetic.

The oracle here is `fractions.Fraction` (a*b + c and a/b computed exactly) followed by this
file's own correct rounding to binary32, written from the IEEE-754 rules: subnormals, overflow
to Inf, ties to even, and the signed-zero rules. Nothing in it comes from the reference.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.bits import BF16_CANONICAL_NAN, bf16_rn, bf16_to_f32
from reference.exact import add_f32, div_f32, fma_f32, mul_f32

F32_INF_BITS = 0x7F800000
SIGN_BIT = 0x80000000


# ----- the rational oracle -------------------------------------------------------------------


def fraction_to_f32_bits(q: Fraction, negative_zero: bool = False) -> int:
    """Correctly rounded (RNE) binary32 bit pattern of the rational q.

    A q that rounds to zero keeps its own sign; q == 0 gives -0 only if negative_zero.
    """
    if q == 0:
        return SIGN_BIT if negative_zero else 0
    sign = SIGN_BIT if q < 0 else 0
    q = abs(q)
    n, d = q.numerator, q.denominator
    e = n.bit_length() - d.bit_length()  # floor(log2 q) is e or e - 1
    if (n << max(0, -e)) < (d << max(0, e)):
        e -= 1
    quantum = max(e, -126) - 23  # exponent of the last significand bit kept (subnormals: -149)
    num, den = (n, d << quantum) if quantum >= 0 else (n << -quantum, d)
    k, rem = divmod(num, den)
    if 2 * rem > den or (2 * rem == den and k & 1):
        k += 1
    if k == 0:
        return sign
    if k == 1 << 24:  # rounding carried into the next binade
        k, quantum = 1 << 23, quantum + 1
    if k < 1 << 23:  # subnormal (quantum is -149)
        return sign | k
    biased = quantum + 23 + 127
    if biased >= 255:
        return sign | F32_INF_BITS
    return sign | (biased << 23) | (k - (1 << 23))


def _neg(x: float) -> bool:
    return math.copysign(1.0, x) < 0


def fma_oracle(a: float, b: float, c: float) -> int | None:
    """IEEE fma(a, b, c) in binary32 as bits; None means NaN."""
    if math.isnan(a) or math.isnan(b) or math.isnan(c):
        return None
    if (math.isinf(a) and b == 0) or (math.isinf(b) and a == 0):
        return None
    product_negative = _neg(a) != _neg(b)
    if math.isinf(a) or math.isinf(b):
        if math.isinf(c) and _neg(c) != product_negative:
            return None
        return (SIGN_BIT if product_negative else 0) | F32_INF_BITS
    if math.isinf(c):
        return (SIGN_BIT if _neg(c) else 0) | F32_INF_BITS
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    # An exact zero: -0 only when both addends are zeros of negative sign (a*b is then a zero).
    negative_zero = (a == 0 or b == 0) and c == 0 and product_negative and _neg(c)
    return fraction_to_f32_bits(exact, negative_zero)


def div_oracle(a: float, b: float) -> int | None:
    """IEEE a / b in binary32 as bits; None means NaN."""
    if math.isnan(a) or math.isnan(b) or (a == 0 and b == 0) or (math.isinf(a) and math.isinf(b)):
        return None
    sign = SIGN_BIT if _neg(a) != _neg(b) else 0
    if math.isinf(a) or b == 0:
        return sign | F32_INF_BITS
    if math.isinf(b) or a == 0:
        return sign
    return fraction_to_f32_bits(Fraction(a) / Fraction(b))


# ----- inputs --------------------------------------------------------------------------------


def _f32(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _random_f32(rng, n, exp_lo, exp_hi) -> np.ndarray:
    """Random sign and mantissa, biased exponent uniform in [exp_lo, exp_hi]."""
    sign = rng.integers(0, 2, n, dtype=np.uint32) << 31
    exponent = rng.integers(exp_lo, exp_hi + 1, n, dtype=np.uint32) << 23
    return _f32(sign | exponent | rng.integers(0, 1 << 23, n, dtype=np.uint32))


def _pick(rng, n, choices) -> np.ndarray:
    return np.asarray(choices, dtype=np.float32)[rng.integers(0, len(choices), n)]


def fma_cases(rng, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n triples of each of twelve kinds (a, b, c float32 arrays)."""
    kinds = []
    # 1. uniformly random bit patterns (mostly huge/tiny, some NaN/Inf)
    kinds.append(tuple(_f32(rng.integers(0, 1 << 32, n, dtype=np.uint64)) for _ in range(3)))
    # 2. ordinary magnitudes
    kinds.append(tuple(_random_f32(rng, n, 107, 147) for _ in range(3)))
    # 3. subnormals in any position, products landing near the subnormal range
    sub = lambda: _f32(rng.integers(0, 1 << 23, n, dtype=np.uint32) | (rng.integers(0, 2, n, dtype=np.uint32) << 31))
    kinds.append((_random_f32(rng, n, 40, 90), _random_f32(rng, n, 40, 90), sub()))
    kinds.append((sub(), _random_f32(rng, n, 120, 200), sub()))
    # 4. signed zeros everywhere
    zeros = [0.0, -0.0, 0.0, -0.0, 1.5, -3.0, 1e-40, -1e-40]
    kinds.append((_pick(rng, n, zeros), _pick(rng, n, zeros), _pick(rng, n, zeros)))
    # 5. products that overflow fp32 (or underflow it) but whose sum with c does not
    big_a, big_b = _random_f32(rng, n, 190, 191), _random_f32(rng, n, 190, 191)
    product_sign = np.sign(big_a.astype(np.float64) * big_b)
    big_c = (-product_sign * np.abs(_random_f32(rng, n, 253, 254))).astype(np.float32)
    kinds.append((big_a, big_b, big_c))
    kinds.append((_random_f32(rng, n, 50, 52), _random_f32(rng, n, 50, 52), sub()))
    # 6. cancellation: c = -round(a*b) moved by a few ulps
    a, b = _random_f32(rng, n, 100, 154), _random_f32(rng, n, 100, 154)
    rounded = (a.astype(np.float64) * b).astype(np.float32)
    moved = rounded.view(np.int32) + rng.integers(-3, 4, n).astype(np.int32)
    kinds.append((a, b, -moved.view(np.float32)))
    # 7. exact ties: A * 1.5 with A odd has 25 significant bits (a normal-range midpoint);
    #    A * 2^-149 * 0.5 is a midpoint in the subnormal range; c keeps it on the midpoint grid
    #    (c = j * 2^k is a multiple of the product's fp32 quantum 2^k, |j| small)
    odd = rng.integers(1 << 22, (1 << 25) // 6, n, dtype=np.uint32) * 2 + 1
    k = rng.integers(-140, 80, n)
    tie_a = np.ldexp(odd.astype(np.float64), k).astype(np.float32)
    tie_b = np.where(rng.integers(0, 2, n) == 1, 1.5, -1.5).astype(np.float32)
    tie_c = np.ldexp(rng.integers(-8, 9, n).astype(np.float64), k).astype(np.float32)
    kinds.append((tie_a, tie_b, tie_c))
    #    ... and a c far below the product's fp64 ulp: the exact sum is just off the midpoint,
    #    but a plain fp64 sum rounds back onto it (the double rounding that round-to-odd avoids)
    k = rng.integers(-50, 80, n)
    near_a = np.ldexp(odd.astype(np.float64), k).astype(np.float32)
    near_c = np.ldexp(rng.uniform(-2, 2, n), k - 30 - rng.integers(0, 40, n)).astype(np.float32)
    kinds.append((near_a, tie_b, near_c))
    sub_odd = rng.integers(0, 1 << 23, n, dtype=np.uint32) * 2 + 1
    sub_c = np.ldexp(rng.integers(-8, 9, n).astype(np.float64), -149).astype(np.float32)
    kinds.append((np.ldexp(sub_odd.astype(np.float64), -149).astype(np.float32), _pick(rng, n, [0.5, -0.5]), sub_c))
    # 8. Inf and NaN among ordinary values
    special = [np.inf, -np.inf, np.nan, 0.0, -0.0, 1.0, -2.0, 3.4e38]
    kinds.append((_pick(rng, n, special), _pick(rng, n, special), _pick(rng, n, special)))
    return tuple(np.concatenate([kind[i] for kind in kinds]).astype(np.float32) for i in range(3))


# ----- comparison ----------------------------------------------------------------------------


def assert_bits_match(got: torch.Tensor, expected: list, inputs: tuple[np.ndarray, ...]) -> None:
    """got fp32 tensor vs oracle bits (None = any NaN); report the first difference."""
    got_bits = got.view(torch.int32).numpy().view(np.uint32)
    got_nan = np.isnan(got.numpy())
    for i, want in enumerate(expected):
        ok = got_nan[i] if want is None else (not got_nan[i] and int(got_bits[i]) == want)
        if not ok:
            operands = ", ".join(f"{float(x[i])!r} (0x{x[i:i + 1].view(np.uint32)[0]:08x})" for x in inputs)
            want_text = "NaN" if want is None else f"0x{want:08x}"
            pytest.fail(f"first difference at index {i}: operands {operands}: got 0x{got_bits[i]:08x}, want {want_text}")


# ----- tests ---------------------------------------------------------------------------------


def test_oracle_rounding_sanity():
    """The oracle itself, on values whose rounding is known by hand."""
    assert fraction_to_f32_bits(Fraction(1)) == 0x3F800000
    assert fraction_to_f32_bits(Fraction(1) + Fraction(1, 2**24)) == 0x3F800000  # tie -> even
    assert fraction_to_f32_bits(Fraction(1) + Fraction(3, 2**24)) == 0x3F800002  # tie -> even (up)
    assert fraction_to_f32_bits(Fraction(1, 2**150)) == 0  # tie between 0 and 2^-149 -> 0
    assert fraction_to_f32_bits(Fraction(3, 2**151)) == 1  # above the tie
    assert fraction_to_f32_bits(-Fraction(1, 2**151)) == SIGN_BIT  # underflow keeps the sign
    assert fraction_to_f32_bits(Fraction(2**128 - 2**103)) == F32_INF_BITS  # tie above FLT_MAX
    assert fraction_to_f32_bits(Fraction(2**128 - 2**103 - 1)) == 0x7F7FFFFF


def test_fma_matches_rational_arithmetic():
    rng = np.random.default_rng(20261202)
    a, b, c = fma_cases(rng, 10_000)
    assert a.size >= 100_000
    got = fma_f32(torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c))
    expected = [fma_oracle(float(x), float(y), float(z)) for x, y, z in zip(a, b, c)]
    assert_bits_match(got, expected, (a, b, c))


@settings(max_examples=400, deadline=None)
@given(st.floats(width=32), st.floats(width=32), st.floats(width=32))
def test_fma_property(a, b, c):
    arrays = tuple(np.array([v], dtype=np.float32) for v in (a, b, c))
    got = fma_f32(*(torch.from_numpy(x) for x in arrays))
    assert_bits_match(got, [fma_oracle(a, b, c)], arrays)


def test_fma_signed_zeros():
    cases = [  # (a, b, c, expected sign of the zero result)
        (2.0, -0.0, 0.0, "+"), (2.0, -0.0, -0.0, "-"), (-0.0, -0.0, -0.0, "+"),
        (0.0, 5.0, -0.0, "+"), (3.0, 2.0, -6.0, "+"), (-3.0, 2.0, 6.0, "+"),
        (1e-30, -1e-30, -0.0, "-"), (1e-30, 1e-30, 0.0, "+"),
    ]
    for a, b, c, sign in cases:
        got = fma_f32(torch.tensor([a]), torch.tensor([b]), torch.tensor([c]))
        assert float(got) == 0.0 and (math.copysign(1, float(got)) < 0) == (sign == "-"), (a, b, c, float(got))


def test_fma_broadcasts():
    a = torch.tensor([[1.5], [2.0]])
    got = fma_f32(a, torch.tensor([1.0, 2.0, 3.0]), torch.zeros(()))
    assert got.shape == (2, 3) and got.tolist() == [[1.5, 3.0, 4.5], [2.0, 4.0, 6.0]]


def test_div_matches_rational_arithmetic():
    rng = np.random.default_rng(7)
    n = 6_000
    numerators = np.concatenate([
        _f32(rng.integers(0, 1 << 32, n, dtype=np.uint64)),
        _random_f32(rng, n, 100, 154),
        _random_f32(rng, n, 1, 30),  # quotients deep in the subnormal range
        np.ldexp((rng.integers(0, 1 << 22, n) * 2 + 1).astype(np.float64), -149).astype(np.float32),  # ties
        _pick(rng, n, [np.inf, -np.inf, np.nan, 0.0, -0.0, 1.0, 3e38, 1e-45]),
    ]).astype(np.float32)
    denominators = np.concatenate([
        _f32(rng.integers(0, 1 << 32, n, dtype=np.uint64)),
        _random_f32(rng, n, 100, 154),
        _random_f32(rng, n, 140, 180),
        _pick(rng, n, [2.0, -2.0, 4.0, 0.5]),
        _pick(rng, n, [np.inf, -np.inf, np.nan, 0.0, -0.0, 3.0, 1e-45, 7168.0]),
    ]).astype(np.float32)
    got = div_f32(torch.from_numpy(numerators), torch.from_numpy(denominators))
    expected = [div_oracle(float(x), float(y)) for x, y in zip(numerators, denominators)]
    assert_bits_match(got, expected, (numerators, denominators))


def test_add_mul_are_ieee():
    rng = np.random.default_rng(3)
    a, b = _random_f32(rng, 20_000, 1, 254), _random_f32(rng, 20_000, 1, 254)
    a[:5000] = _f32(rng.integers(0, 1 << 23, 5000, dtype=np.uint32))  # subnormals must survive
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    assert_bits_match(add_f32(ta, tb), [fma_oracle(float(x), 1.0, float(y)) for x, y in zip(a, b)], (a, b))
    assert_bits_match(mul_f32(ta, tb), [fma_oracle(float(x), float(y), -0.0) for x, y in zip(a, b)], (a, b))


def test_primitives_reject_other_dtypes():
    with pytest.raises(ValueError, match="bfloat16"):
        fma_f32(torch.ones(2), torch.ones(2, dtype=torch.bfloat16), torch.ones(2))


def test_bf16_rn_is_nearest_even_with_canonical_nan():
    rng = np.random.default_rng(11)
    bits = np.concatenate([
        rng.integers(0, 1 << 32, 200_000, dtype=np.uint64),
        (rng.integers(0, 1 << 16, 20_000, dtype=np.uint64) << 16) | 0x8000,  # exact ties
        np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F800000, 0x00000001, 0x80008000], np.uint64),
    ]).astype(np.uint32)
    x = bits.view(np.float32)
    got = bf16_rn(torch.from_numpy(x.copy())).view(torch.int16).numpy().view(np.uint16).astype(np.int64)
    nan = np.isnan(x)
    assert (got[nan] == BF16_CANONICAL_NAN).all()
    # Independent oracle: the two bf16 candidates around x (truncation and the next pattern),
    # distances exact in fp64; the nearer wins, ties go to the even pattern.
    lower = (bits[~nan] >> 16).astype(np.int64)
    upper = lower + 1
    xs = x[~nan].astype(np.float64)
    value = lambda p: (p.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        upper_value = np.where((lower & 0x7FFF) == 0x7F7F, np.copysign(2.0**128, xs), value(upper))
        d_lower, d_upper = np.abs(xs - value(lower)), np.abs(upper_value - xs)
    want = np.where((d_upper < d_lower) | ((d_upper == d_lower) & (lower % 2 == 1)), upper, lower)
    want = np.where(np.isinf(xs), lower, want)
    mismatch = np.nonzero(got[~nan] != want)[0]
    assert mismatch.size == 0, f"first: x bits 0x{bits[~nan][mismatch[0]]:08x} got 0x{got[~nan][mismatch[0]]:04x} want 0x{want[mismatch[0]]:04x}"
    # Round trip: every bf16 pattern converts to fp32 exactly and back to itself (NaNs canonical).
    every = torch.arange(-(2**15), 2**15, dtype=torch.int16).view(torch.bfloat16)
    back = bf16_rn(bf16_to_f32(every)).view(torch.int16)
    is_nan = torch.isnan(every)
    assert torch.equal(back[~is_nan], every.view(torch.int16)[~is_nan])
    assert bool((back[is_nan] == BF16_CANONICAL_NAN).all())
