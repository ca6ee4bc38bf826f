"""Stage 7, MXFP8: the bf16 layer input as float8_e4m3fn values with UE8M0 block scales.

One scale byte per block of 32 consecutive columns of a row, stored in the 128x4 swizzled layout
FlashInfer's MXFP8 GEMMs read. The rules follow flashinfer.mxfp8_quantize (cute-dsl backend)
bit for bit; every rounding is integer arithmetic on bit patterns, never torch's float8 cast.
"""

from __future__ import annotations

import torch

from .bits import f32_from_u32, u32, bf16_to_f32
from .exact import mul_f32

BLOCK_SIZE = 32  # values per UE8M0 scale
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E4M3_MAX_CODE = 0x7E  # its code; 0x7F is NaN, which satfinite never produces
# fp32 nearest to 1/448 (0.002232143), the multiplier FlashInfer uses instead of dividing by 448;
# its rounding is checked against exact rational arithmetic in the tests.
RCP_E4M3_MAX_BITS = 0x3B124925
UE8M0_MAX = 254  # largest scale byte produced (255 would be the UE8M0 NaN)
SCALE_TILE_ROWS = 128  # rows of one swizzled scale tile
SCALE_TILE_COLS = 4  # scale columns of one swizzled scale tile


def padded_scale_cols(hidden: int) -> int:
    """Scale columns per row in the layout: H/32 rounded up to a multiple of 4."""
    cols = hidden // BLOCK_SIZE
    return -(-cols // SCALE_TILE_COLS) * SCALE_TILE_COLS


def scale_layout_size(m: int, hidden: int) -> int:
    """Bytes of the swizzled scale buffer: roundup(M, 128) * roundup(H/32, 4)."""
    padded_rows = -(-m // SCALE_TILE_ROWS) * SCALE_TILE_ROWS
    return padded_rows * padded_scale_cols(hidden)


def swizzle_offset(r, c, padded_cols: int):
    """Byte offset of the scale of row r, block column c (ints or integer tensors).

    Tiles of 128 rows x 4 columns, 512 bytes each, tile columns contiguous within a row band:
    inside a tile, row r sits at (r % 32) * 16 + ((r % 128) // 32) * 4 and column c at c % 4.
    """
    return (
        (c % 4)
        + (c // 4) * 512
        + (r % 32) * 16
        + ((r % 128) // 32) * 4
        + (r // 128) * (128 * padded_cols)
    )


def block_scales(amax: torch.Tensor):
    """amax fp32 [...] -> (nm fp32, scale byte int64 e, inverse scale fp32), per block.

    nm = amax * fp32(1/448) (mul.rn.f32); e = ceil(log2(nm)) + 127 clamped to 0 .. 254, by the
    bit rule on nm: nm <= 0 -> 0; else exponent + (mantissa != 0), except that a subnormal nm
    with mantissa <= 0x400000 (nm <= 2^-127) gives 0; Inf and NaN give 254.
    inverse scale = 2^(127 - e), built from bits, but 0.0 when e is 0 or 254.
    """
    rcp = f32_from_u32(torch.full_like(u32(amax), RCP_E4M3_MAX_BITS))
    nm = mul_f32(amax, rcp)
    bits = u32(nm)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    bump = ((mantissa != 0) & ~((exponent == 0) & (mantissa <= 0x400000))).to(torch.int64)
    e = torch.clamp(exponent + bump, max=UE8M0_MAX)
    e = torch.where(nm <= 0, 0, e)  # NaN compares false and keeps its 254
    inv_bits = torch.where((e == 0) | (e == UE8M0_MAX), 0, (UE8M0_MAX - e) << 23)
    return nm, e, f32_from_u32(inv_bits)


def e4m3_rn_satfinite(q: torch.Tensor) -> torch.Tensor:
    """fp32 values (not NaN) -> float8_e4m3fn codes (int64 0 .. 255), RNE, saturating at 448.

    Signed zero is kept (-0.0 -> 0x80). Normal e4m3 (|q| >= 2^-6): keep 3 mantissa bits of the
    fp32 and round on the 20 dropped ones; a carry moves into the exponent by itself.
    Subnormal e4m3: round |q| / 2^-9 to an integer 0 .. 8 (8 is the smallest normal, 2^-6).
    """
    bits = u32(q)
    sign = bits >> 31
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF

    # (Arithmetic, not shifts: lanes below the normal range compute garbage here, never UB.)
    normal_code = (exponent - 120) * 8 + (mantissa >> 20)
    normal_code = normal_code + _round_up(mantissa & 0xFFFFF, 1 << 19, normal_code)

    # Units of 2^-9: an fp32 with biased exponent E (>= 1) is full * 2^(E - 150), full < 2^24;
    # fp32 subnormals use E = 1 without the implicit bit. Shifts >= 25 leave 0 with a
    # remainder below half, so clamping the shift to 25 changes nothing and avoids huge shifts.
    full = torch.where(exponent == 0, mantissa, mantissa | 0x800000)
    shift = torch.clamp(141 - torch.clamp(exponent, min=1), min=21, max=25)  # 21: E = 120
    units = full >> shift
    remainder = full & ((torch.ones_like(shift) << shift) - 1)
    subnormal_code = units + _round_up(remainder, torch.ones_like(shift) << (shift - 1), units)

    code = torch.where(exponent >= 121, normal_code, subnormal_code)
    code = torch.clamp(code, max=E4M3_MAX_CODE)  # satfinite
    return (sign << 7) | code


def _round_up(remainder, half, kept):
    """1 where round-to-nearest-even rounds the kept integer up, else 0."""
    return ((remainder > half) | ((remainder == half) & ((kept & 1) == 1))).to(torch.int64)


def mxfp8_quantize(out: torch.Tensor, *, return_blocks: bool = False):
    """out [M, H] bf16, H a multiple of 32 -> (values uint8 [M, H], scales uint8 [layout size]).

    values are float8_e4m3fn bit patterns; scales are UE8M0 bytes in the 128x4 swizzled layout,
    padding rows (r >= M) and padding columns zero. Per block of 32: amax = max |v| ignoring NaN
    (all-NaN -> NaN); scale by `block_scales`; q = v * inverse scale (mul.rn.f32);
    q = max(min(q, 448), -448) as min.f32/max.f32 (a NaN q becomes 448); value = e4m3 RNE of q.
    With return_blocks, also returns {"amax", "nm", "scale", "inv_scale"} ([M, H/32]; fp32, fp32,
    uint8, fp32) and "q" (fp32 [M, H], after the clamp).
    """
    m, hidden = out.shape
    if hidden % BLOCK_SIZE:
        raise ValueError(f"out: hidden size {hidden} is not a multiple of {BLOCK_SIZE}")
    v = bf16_to_f32(out).reshape(m, hidden // BLOCK_SIZE, BLOCK_SIZE)
    magnitude = torch.where(torch.isnan(v), -1.0, v.abs())  # NaN never wins the max
    amax = magnitude.amax(dim=-1)
    amax = torch.where(amax < 0, torch.nan, amax)  # every lane was NaN
    nm, e, inv_scale = block_scales(amax)

    q = mul_f32(v, inv_scale[..., None])
    # min.f32 returns the non-NaN operand, so NaN (v = NaN, or Inf * 0) saturates to +448.
    q = torch.where(torch.isnan(q) | (q > E4M3_MAX), E4M3_MAX, q)
    q = torch.where(q < -E4M3_MAX, -E4M3_MAX, q)
    values = e4m3_rn_satfinite(q).to(torch.uint8).reshape(m, hidden)

    cols = padded_scale_cols(hidden)
    scales = torch.zeros(scale_layout_size(m, hidden), dtype=torch.uint8, device=out.device)
    rows = torch.arange(m, device=out.device)[:, None]
    blocks = torch.arange(hidden // BLOCK_SIZE, device=out.device)[None, :]
    scales[swizzle_offset(rows, blocks, cols).reshape(-1)] = e.to(torch.uint8).reshape(-1)
    if return_blocks:
        extra = {"amax": amax, "nm": nm, "scale": e.to(torch.uint8), "inv_scale": inv_scale, "q": q.reshape(m, hidden)}
        return values, scales, extra
    return values, scales


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes (any integer dtype, 0 .. 255) -> their values as fp32 (exact)."""
    codes = codes.to(torch.int64) & 0xFF
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    significand = torch.where(exponent == 0, mantissa, mantissa + 8).double()
    magnitude = torch.ldexp(significand, torch.clamp(exponent, min=1) - 10)  # 1.mmm * 2^(E-7)
    magnitude = torch.where((exponent == 0xF) & (mantissa == 0x7), torch.nan, magnitude)
    return torch.where(codes >= 0x80, -magnitude, magnitude).float()
