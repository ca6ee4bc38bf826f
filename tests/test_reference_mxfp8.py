"""reference.mxfp8 against a deliberately naive second implementation written here.

The naive version works per block and per element in plain Python: the scale byte from the fp32
bits of nm with Python ints, and each e4m3 code by searching all 256 codes for the nearest value
(exact integer distances, ties to the even code, the sign of zero kept).
"""

from __future__ import annotations

import functools
import math
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch

from reference.mxfp8 import RCP_E4M3_MAX_BITS, e4m3_decode, mxfp8_quantize, scale_layout_size, swizzle_offset

# ----- the naive implementation --------------------------------------------------------------


def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _f32(x: float) -> float:
    return float(np.float32(x))


def _e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa * 2.0**-9
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def _as_int_2_149(x: float) -> int:
    """x * 2^149 as an exact integer (x is a float32 value, so this is exact)."""
    numerator, denominator = x.as_integer_ratio()
    return numerator * ((1 << 149) // denominator)


_CODES = [(code, _e4m3_value(code)) for code in range(256)]
_CODE_INTS = [(code, _as_int_2_149(value), code >> 7) for code, value in _CODES if not math.isnan(value)]


def naive_e4m3(q: float) -> int:
    """Nearest e4m3 code to q (|q| <= 448, not NaN) with the sign of q; ties to the even code."""
    return _naive_e4m3_of_bits(_f32_bits(q))  # cached by bit pattern: -0.0 == 0.0 as a dict key


@functools.lru_cache(maxsize=None)
def _naive_e4m3_of_bits(q_bits: int) -> int:
    q = struct.unpack("<f", struct.pack("<I", q_bits))[0]
    sign = 1 if math.copysign(1.0, q) < 0 else 0
    target = _as_int_2_149(q)
    best = None
    for code, value, code_sign in _CODE_INTS:
        if code_sign != sign:
            continue
        key = (abs(value - target), code & 1)
        if best is None or key < best[0]:
            best = (key, code)
    return best[1]


def naive_scale(block: list[float]) -> int:
    finite = [abs(v) for v in block if not math.isnan(v)]
    amax = max(finite) if finite else math.nan
    rcp = struct.unpack("<f", struct.pack("<I", RCP_E4M3_MAX_BITS))[0]
    nm = float(np.float32(amax) * np.float32(rcp))
    if not math.isnan(nm) and nm <= 0:
        return 0
    bits = _f32_bits(nm)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    bump = 1 if mantissa != 0 else 0
    if exponent == 0 and mantissa <= 0x400000:
        bump = 0
    return min(exponent + bump, 254)


def naive_quantize_block(block: list[float]) -> tuple[int, list[int]]:
    e = naive_scale(block)
    inverse = 0.0 if e in (0, 254) else 2.0 ** (127 - e)
    codes = []
    for v in block:
        with np.errstate(invalid="ignore", over="ignore"):
            q = _f32(v * inverse)  # exact in Python's double, then one fp32 rounding (Inf * 0 = NaN)
        q = 448.0 if math.isnan(q) else min(q, 448.0)
        q = max(q, -448.0)
        codes.append(naive_e4m3(q))
    return e, codes


# ----- helpers -------------------------------------------------------------------------------


def _bf16_from_bits(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(bits, dtype=np.uint16).view(np.int16).copy()).view(torch.bfloat16)


def _bf16(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)  # exact for bf16 values


def assert_matches_naive(blocks: torch.Tensor, what: str) -> None:
    """blocks: bf16 [rows, 32 * k]; compares values and scale bytes block by block."""
    values, _, extra = mxfp8_quantize(blocks, return_blocks=True)
    scales = extra["scale"].numpy()
    values = values.numpy()
    as_float = blocks.float().numpy()
    for r in range(blocks.shape[0]):
        for b in range(blocks.shape[1] // 32):
            block = [float(v) for v in as_float[r, 32 * b : 32 * b + 32]]
            e, codes = naive_quantize_block(block)
            got_codes = values[r, 32 * b : 32 * b + 32].tolist()
            if scales[r, b] != e or got_codes != codes:
                j = next((j for j in range(32) if got_codes[j] != codes[j]), None)
                detail = "" if j is None else f"; first value {block[j]!r}: got 0x{got_codes[j]:02x}, want 0x{codes[j]:02x}"
                pytest.fail(f"{what}: row {r} block {b}: scale got {scales[r, b]}, want {e}{detail}")


# ----- tests ---------------------------------------------------------------------------------


def test_reciprocal_constant_is_nearest_fp32_to_one_over_448():
    value = Fraction(struct.unpack("<f", struct.pack("<I", RCP_E4M3_MAX_BITS))[0])
    neighbours = [Fraction(struct.unpack("<f", struct.pack("<I", RCP_E4M3_MAX_BITS + d))[0]) for d in (-1, 1)]
    target = Fraction(1, 448)
    assert all(abs(value - target) < abs(n - target) for n in neighbours)


def test_every_bf16_pattern_in_several_block_contexts():
    patterns = np.arange(1 << 16, dtype=np.uint32)
    rng = np.random.default_rng(448)
    contexts = {
        "consecutive": patterns,
        "shuffled": rng.permutation(patterns),
    }
    # Each pattern again beside an anchor that sets (or not) the block's scale.
    for anchor in (1.0, 448.0 * 2.0**8, 2.0**-120, 2.0**120):
        anchor_bits = np.uint32(_f32_bits(anchor) >> 16)
        filler = np.concatenate([patterns, patterns[: (-len(patterns)) % 31]])
        grid = filler.reshape(-1, 31)
        positions = rng.integers(0, 32, grid.shape[0])
        blocks = np.empty((grid.shape[0], 32), dtype=np.uint32)
        for i, p in enumerate(positions):
            blocks[i] = np.insert(grid[i], p, anchor_bits)
        contexts[f"anchor {anchor!r}"] = blocks.reshape(-1)
    for name, bits in contexts.items():
        assert_matches_naive(_bf16_from_bits(bits.reshape(-1, 32)), name)


def test_special_blocks():
    nan, inf = math.nan, math.inf
    rows = [
        [nan] * 32,
        [0.0] * 32,
        [-0.0] * 32,
        [nan] + [1.0] * 31,
        [inf] + [1.0] * 31,
        [-inf] + [-2.0] * 31,
        [inf, -inf, nan] + [0.0] * 29,
        [-0.0, 0.0] * 16,
        [nan] * 31 + [-0.0],
        [3.0e38] + [1e-38] * 31,
    ]
    assert_matches_naive(_bf16(rows), "special blocks")
    values, _, extra = mxfp8_quantize(_bf16(rows), return_blocks=True)
    assert extra["scale"][:4, 0].tolist() == [254, 0, 0, 119]  # all-NaN, +0, -0, NaN ignored (1/448 -> 2^-8)
    assert values[2].tolist() == [0x80] * 32  # -0 keeps its sign
    assert values[0].tolist() == [0x7E] * 32  # NaN -> +448


def test_tiny_amax_around_the_subnormal_rule():
    """amax from 2.0e-36 to 6.0e-36: nm = amax / 448 crosses 2^-127 (mantissa 0x400000)."""
    lo, hi = _f32_bits(2.0e-36) >> 16, _f32_bits(6.0e-36) >> 16
    amax_bits = np.arange(lo, hi + 1, dtype=np.uint32)
    rng = np.random.default_rng(5)
    blocks = []
    for a in amax_bits:
        rest = (rng.integers(0, int(a) + 1, 31, dtype=np.uint32)) | (rng.integers(0, 2, 31, dtype=np.uint32) << 15)
        blocks.append(np.concatenate([[a], rest]))
    tensor = _bf16_from_bits(np.stack(blocks))
    assert_matches_naive(tensor, "tiny amax")
    scales = mxfp8_quantize(tensor, return_blocks=True)[2]["scale"][:, 0]
    assert set(scales.tolist()) >= {0, 1}, "the range must cross the e = 0 / e = 1 boundary"


def test_amax_at_powers_of_two_and_448_boundaries():
    amaxes = []
    for k in range(-133, 128):
        for base in (1.0, 448.0, 1.5, 1.75):
            v = base * 2.0**k
            if 9.2e-41 <= v <= 3.38e38:
                bits = _f32_bits(v) >> 16
                amaxes += [bits - 1, bits, bits + 1]
    rng = np.random.default_rng(9)
    amax = np.array(amaxes, dtype=np.uint32)
    blocks = np.zeros((amax.size, 32), dtype=np.uint32)
    blocks[:, 0] = amax | (rng.integers(0, 2, amax.size, dtype=np.uint32) << 15)
    smaller = (rng.random((amax.size, 31)) * amax[:, None]).astype(np.uint32)  # |v| <= amax
    blocks[:, 1:] = smaller | (rng.integers(0, 2, (amax.size, 31), dtype=np.uint32) << 15)
    assert_matches_naive(_bf16_from_bits(blocks), "power-of-two and 448*2^k amax")


def test_values_agree_with_torch_float8_cast():
    """Extra check: torch's own fp32 -> float8_e4m3fn cast of the clamped q (not NaN there)."""
    rng = np.random.default_rng(17)
    bits = rng.integers(0, 1 << 16, (64, 1024), dtype=np.uint32)
    values, _, extra = mxfp8_quantize(_bf16_from_bits(bits), return_blocks=True)
    cast = extra["q"].to(torch.float8_e4m3fn).view(torch.uint8)
    differ = (cast != values).nonzero()
    assert differ.numel() == 0, f"{differ.shape[0]} differ; first q={extra['q'][tuple(differ[0])].item()!r}"
    assert torch.equal(e4m3_decode(values.to(torch.int64)), extra["q"].to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("m", [1, 127, 128, 129, 300])
@pytest.mark.parametrize("hidden", [128, 160, 7168])
def test_scale_layout(m, hidden):
    cols = hidden // 32
    padded_rows, padded_cols = -(-m // 128) * 128, -(-cols // 4) * 4
    assert scale_layout_size(m, hidden) == padded_rows * padded_cols
    # The formula, written out again: a bijection of the padded grid onto the buffer.
    r, c = np.meshgrid(np.arange(padded_rows), np.arange(padded_cols), indexing="ij")
    offsets = (r // 128) * 128 * padded_cols + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    assert np.array_equal(np.sort(offsets.reshape(-1)), np.arange(padded_rows * padded_cols))
    assert np.array_equal(swizzle_offset(r, c, padded_cols), offsets)

    rng = np.random.default_rng(m * 10_000 + hidden)
    data = torch.from_numpy(rng.standard_normal((m, hidden)).astype(np.float32) * 2.0 ** rng.integers(-20, 20, (m, 1)))
    _, scales, extra = mxfp8_quantize(data.to(torch.bfloat16), return_blocks=True)
    assert scales.dtype == torch.uint8 and scales.shape == (padded_rows * padded_cols,)
    layout = scales.numpy()[offsets]
    assert np.array_equal(layout[:m, :cols], extra["scale"].numpy())
    assert (extra["scale"].numpy() > 0).all()  # so a misplaced byte cannot hide as a zero
    assert not layout[m:].any() and not layout[:, cols:].any(), "padding rows/columns must be zero"


def test_rejects_hidden_not_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8_quantize(torch.zeros(2, 48, dtype=torch.bfloat16))
