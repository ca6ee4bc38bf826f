"""Bit-level views and the one bf16 rounding every stage ends with.

Everything here is integer arithmetic on bit patterns, so the result is the same on every device:
torch's own float32 -> bfloat16 cast is not used, because its NaN handling and rounding are not
specified across platforms. Unsigned bit patterns are carried in int64 (values 0 .. 2^32-1) so
that no shift or add ever overflows a signed type.
"""

from __future__ import annotations

import torch

# What PTX `cvt.rn.bf16.f32` writes for any NaN input: the canonical bf16 NaN. The reference
# canonicalizes every NaN to this value; a GPU test converts NaNs of every payload and sign with
# the kernel's instruction and checks this constant, so it is defined here and nowhere else.
BF16_CANONICAL_NAN = 0x7FFF

# What fp32 arithmetic instructions (and rsqrt.approx) on NVIDIA GPUs return for a NaN result.
F32_CANONICAL_NAN = 0x7FFFFFFF

_F32_EXP_MASK = 0x7F800000
_F32_MANT_MASK = 0x007FFFFF
_F32_ABS_MASK = 0x7FFFFFFF


def f32_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 tensor -> its bit patterns as int32 (a view, same shape)."""
    _expect_dtype(x, torch.float32)
    return x.view(torch.int32)


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 tensor -> its bit patterns as int16 (a view, same shape)."""
    _expect_dtype(x, torch.bfloat16)
    return x.view(torch.int16)


def u32(x: torch.Tensor) -> torch.Tensor:
    """float32 tensor -> its bit patterns as unsigned values in an int64 tensor."""
    return f32_bits(x).to(torch.int64) & 0xFFFFFFFF


def u16(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 tensor -> its bit patterns as unsigned values in an int64 tensor."""
    return bf16_bits(x).to(torch.int64) & 0xFFFF


def f32_from_u32(bits: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit patterns (any integer dtype, values 0 .. 2^32-1) -> float32 tensor."""
    bits = bits.to(torch.int64) & 0xFFFFFFFF
    # Map to the signed int32 range explicitly; never rely on a narrowing cast wrapping.
    signed = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return signed.view(torch.float32)


def bf16_from_u16(bits: torch.Tensor) -> torch.Tensor:
    """Unsigned 16-bit patterns (any integer dtype, values 0 .. 65535) -> bfloat16 tensor."""
    bits = bits.to(torch.int64) & 0xFFFF
    signed = torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16)
    return signed.view(torch.bfloat16)


def bf16_to_f32(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 -> float32, exactly (the bf16 pattern becomes the upper 16 bits)."""
    return f32_from_u32(u16(x) << 16)


def bf16_rn(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16, round to nearest even, as PTX `cvt.rn.bf16.f32`.

    NaN becomes BF16_CANONICAL_NAN; finite values round on the upper 16 bits, which carries into
    the exponent and overflows to +-Inf exactly where IEEE rounding does; subnormals are kept.
    """
    bits = u32(x)
    is_nan = (bits & _F32_ABS_MASK) > _F32_EXP_MASK
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) >> 16
    rounded = torch.where(is_nan, torch.full_like(rounded, BF16_CANONICAL_NAN), rounded)
    return bf16_from_u16(rounded)


def canonicalize_f32_nan(x: torch.Tensor) -> torch.Tensor:
    """Replace every float32 NaN by F32_CANONICAL_NAN (what the GPU's fp32 arithmetic returns)."""
    nan = f32_from_u32(torch.full(x.shape, F32_CANONICAL_NAN, dtype=torch.int64, device=x.device))
    return torch.where(torch.isnan(x), nan, x)


def as_uint8(x: torch.Tensor) -> torch.Tensor:
    """Any contiguous tensor -> its raw bytes as uint8 (flattened)."""
    return x.contiguous().reshape(-1).view(torch.uint8)


def bf16_ordered(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 -> int64 keys ordered like the values, +0 and -0 both 0 (for ulp distances).

    Adjacent finite bf16 values differ by exactly 1 key; NaN keys are meaningless (mask them).
    """
    bits = u16(x)
    magnitude = bits & 0x7FFF
    return torch.where(bits >= 0x8000, -magnitude, magnitude)


def _expect_dtype(x: torch.Tensor, dtype: torch.dtype) -> None:
    if x.dtype != dtype:
        raise ValueError(f"expected a {dtype} tensor, got {x.dtype}")
