"""Exactness primitives: the fp32 operations of the numerics contract, each named for its PTX.

All are IEEE-754 binary32, round-to-nearest-even, subnormals preserved (no .ftz). Inputs are
float32 tensors that broadcast against each other; results are float32.

- `add_f32`  = add.rn.f32 and `mul_f32` = mul.rn.f32: torch's fp32 add and multiply of two
  tensors are already the IEEE operations on CPU and CUDA. They are wrapped only so every stage
  names the instruction it models (and so none of them can be contracted into an fma).
- `fma_f32`  = fma.rn.f32: PyTorch has no fp32 fma, so it is emulated exactly (see below).
- `div_f32`  = div.rn.f32: computed in fp64 and rounded once more; never torch's fp32 division,
  which on CUDA may multiply by a reciprocal when the divisor is a scalar.
"""

from __future__ import annotations

import torch


def add_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b, add.rn.f32."""
    _check_f32(a, b)
    return torch.add(a, b)


def mul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a * b, mul.rn.f32."""
    _check_f32(a, b)
    return torch.mul(a, b)


def div_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b, div.rn.f32.

    The fp64 quotient is correctly rounded to 53 bits and then rounded to 24 bits. This double
    rounding is innocuous for division because 53 >= 2 * 24 + 2: a quotient of two 24-bit numbers
    that is not exactly an fp32 midpoint is never close enough to one for the first rounding to
    land on it (and an exact midpoint is represented exactly in fp64).
    """
    _check_f32(a, b)
    # Keep the divisor a tensor on the dividend's device: with a CPU scalar divisor, CUDA torch
    # multiplies by the reciprocal instead of dividing.
    return torch.div(a.double(), b.double().to(a.device)).float()


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c with a single rounding, fma.rn.f32.

    Method: the product of two fp32 values is exact in fp64 (48 significant bits, exponent far
    inside fp64's range, so even products of subnormals are exact). The sum p + c is computed in
    fp64 with Knuth's TwoSum, which yields the rounded sum s and its exact error e. Replacing s by
    its round-to-odd neighbour (move one fp64 ulp towards the exact value when e != 0 and s is
    even) gives p + c rounded to odd at 53 bits; rounding that to fp32 (24 bits, RNE) is then the
    correctly rounded fma, since 53 >= 24 + 2 (Boldo and Melquiond, "Emulation of FMA and
    correctly rounded sums: proved algorithms using rounding to odd", IEEE TC 2008). The same
    holds for fp32 subnormal and overflowing results, whose rounding points are still >= 2 bits
    coarser than the fp64 one.

    Signed zeros: an exactly zero p + c comes out of the fp64 add with the IEEE sign (e is 0, no
    adjustment), and a nonzero sum that rounds to zero keeps the sign of s, as IEEE fma does.
    Infinities and NaNs: finite operands cannot overflow fp64, so a non-finite s only comes from
    non-finite operands, and fp64 gives the IEEE answer (NaN for Inf * 0 and Inf - Inf).
    """
    _check_f32(a, b, c)
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    bb = s - p
    e = (p - (s - bb)) + (c64 - bb)
    s_bits = s.view(torch.int64)
    inexact = torch.isfinite(s) & (e != 0)
    even = (s_bits & 1) == 0
    # Raw fp64 patterns order magnitudes: +1 moves away from zero, -1 towards it, for either sign.
    towards_exact = torch.where((e > 0) == (s > 0), 1, -1)
    odd_bits = torch.where(inexact & even, s_bits + towards_exact, s_bits)
    return odd_bits.view(torch.float64).float()


def _check_f32(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32:
            raise ValueError(f"fp32 primitive got a {t.dtype} operand; convert explicitly first")
