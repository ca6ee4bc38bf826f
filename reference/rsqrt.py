"""PTX `rsqrt.approx.ftz.f32`, reproduced bit for bit on any device.

The hardware reciprocal square root is an approximation: on the H200 it differs from the
correctly rounded 1/sqrt(x) in about a fifth of the normal inputs, by at most 2 ulp. Facts the
emulation rests on (measured on sm_90, see tests/data and the GPU tests):
- for every normal input it equals `torch.rsqrt` of a CUDA float32 tensor, so on CUDA we call that;
- rsqrt(x * 4^k) == rsqrt(x) / 2^k exactly, so the hardware's behaviour over [0.5, 2) (2^24
  floats) determines it everywhere; a table of its deviation there (int8 per float) is shipped.

Table format (`*.i8.zlib`): zlib-compressed int8 array of 2^24 entries; entry i belongs to the
float32 whose bits are (126 << 23) + i, and holds
    bits(hardware rsqrt(x)) - bits(float32(1.0 / sqrt(float64(x)))).
"""

from __future__ import annotations

import functools
import zlib
from pathlib import Path

import torch

from .bits import F32_CANONICAL_NAN, f32_from_u32, u32

TABLE_SIZE = 1 << 24
# Bits of 0.5, the first float the table covers; [0.5, 2) spans biased exponents 126 and 127.
TABLE_BASE_BITS = 126 << 23
DATA_DIR = Path(__file__).resolve().parent / "data"
# One measured table per GPU architecture whose rsqrt.approx the reference can reproduce.
TABLE_FILES = {"sm_90": "rsqrt_delta_sm90.i8.zlib"}

_POS_INF_BITS = 0x7F800000


def load_table(path: str | Path) -> torch.Tensor:
    """Read a `*.i8.zlib` table -> int8 tensor [2^24] (CPU)."""
    raw = zlib.decompress(Path(path).read_bytes())
    if len(raw) != TABLE_SIZE:
        raise ValueError(f"{path}: expected {TABLE_SIZE} int8 entries, found {len(raw)}")
    return torch.frombuffer(bytearray(raw), dtype=torch.int8)


def write_table(path: str | Path, table: torch.Tensor) -> None:
    """Write an int8 tensor [2^24] as a `*.i8.zlib` table."""
    if table.dtype != torch.int8 or table.shape != (TABLE_SIZE,):
        raise ValueError(f"table must be int8 [{TABLE_SIZE}], got {table.dtype} {tuple(table.shape)}")
    Path(path).write_bytes(zlib.compress(table.cpu().numpy().tobytes(), 9))


@functools.cache
def reference_rsqrt_table(arch: str = "sm_90") -> torch.Tensor:
    """The shipped deviation table of `arch` -> int8 tensor [2^24] (CPU), loaded once."""
    if arch not in TABLE_FILES:
        raise ValueError(f"arch: no rsqrt table for {arch!r}; known: {sorted(TABLE_FILES)}")
    return load_table(DATA_DIR / TABLE_FILES[arch])


def unit_interval_floats(start: int = 0, stop: int = TABLE_SIZE, device=None) -> torch.Tensor:
    """The float32 values of table entries start .. stop-1 (floats in [0.5, 2), ascending)."""
    index = torch.arange(start, stop, dtype=torch.int64, device=device)
    return f32_from_u32(TABLE_BASE_BITS + index)


def correctly_rounded_rsqrt_bits(m: torch.Tensor) -> torch.Tensor:
    """bits(float32(1.0 / sqrt(float64(m)))) as int64, the table's baseline (m > 0 finite)."""
    m64 = m.double()
    # sqrt and division are each correctly rounded in fp64 on every device; this is the exact
    # expression the table is defined with, not a correctly rounded rsqrt (which does not matter:
    # the table stores the difference to this baseline).
    return u32((torch.ones_like(m64) / torch.sqrt(m64)).float())


def rsqrt_delta_from_measurement(hw_bits: torch.Tensor, *, chunk: int = 1 << 22) -> torch.Tensor:
    """Measured hardware results over [0.5, 2) -> deviation table int8 [2^24] (CPU).

    hw_bits: int32 [2^24], hw_bits[i] = bits of the hardware rsqrt of the float with bits
    (126 << 23) + i. Raises ValueError if a deviation does not fit in int8.
    """
    if hw_bits.dtype != torch.int32 or hw_bits.shape != (TABLE_SIZE,):
        raise ValueError(f"hw_bits must be int32 [{TABLE_SIZE}], got {hw_bits.dtype} {tuple(hw_bits.shape)}")
    hw_bits = hw_bits.cpu()
    table = torch.empty(TABLE_SIZE, dtype=torch.int8)
    for start in range(0, TABLE_SIZE, chunk):
        stop = min(start + chunk, TABLE_SIZE)
        base = correctly_rounded_rsqrt_bits(unit_interval_floats(start, stop))
        delta = (hw_bits[start:stop].to(torch.int64) & 0xFFFFFFFF) - base
        bad = delta.abs() > 127
        if bool(bad.any()):
            first = start + int(bad.nonzero()[0, 0])
            raise ValueError(
                f"hw_bits: deviation {int(delta[first - start])} ulp at entry {first} does not fit int8"
            )
        table[start:stop] = delta.to(torch.int8)
    return table


def rsqrt_approx_ftz(x: torch.Tensor, *, arch: str = "sm_90", use_table: bool | None = None) -> torch.Tensor:
    """rsqrt.approx.ftz.f32 of a float32 tensor, elementwise.

    Subnormal inputs are flushed to a zero of the same sign first (.ftz): +-0 -> +-Inf, negative
    -> NaN, +Inf -> +0, NaN -> NaN (every NaN is F32_CANONICAL_NAN). use_table=None uses
    torch.rsqrt on CUDA tensors and the shipped table of `arch` elsewhere; True/False force one.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"x: expected float32, got {x.dtype}")
    if use_table is None:
        use_table = x.device.type != "cuda"
    bits = u32(x)
    exponent = (bits >> 23) & 0xFF
    flushed = torch.where(exponent == 0, bits & 0x80000000, bits)
    if not use_table:
        result = torch.rsqrt(f32_from_u32(flushed))
    else:
        result = _rsqrt_from_table(flushed, reference_rsqrt_table(arch).to(x.device))
    nan = f32_from_u32(torch.full_like(bits, F32_CANONICAL_NAN))
    return torch.where(torch.isnan(result), nan, result)


def _rsqrt_from_table(flushed: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Table path on unsigned bit patterns (int64) with subnormals already flushed."""
    sign = flushed >> 31
    magnitude = flushed & 0x7FFFFFFF
    exponent = magnitude >> 23
    normal_positive = (sign == 0) & (exponent >= 1) & (exponent <= 254)
    # x = m * 4^k with m in [0.5, 2): m keeps x's mantissa and gets biased exponent 126 + parity.
    k = torch.div(exponent - 126, 2, rounding_mode="floor")
    m_bits = magnitude - k * (1 << 24)  # multiply: k may be negative
    index = torch.where(normal_positive, m_bits - TABLE_BASE_BITS, 0)
    m = f32_from_u32(torch.where(normal_positive, m_bits, TABLE_BASE_BITS))
    value_bits = correctly_rounded_rsqrt_bits(m) + table[index].to(torch.int64)
    # rsqrt(m) is in (0.7, 1.5] and -63 <= k <= 64, so dividing by 2^k only moves the exponent
    # (it stays within 62 .. 190): the result is normal and exact, no rounding happens.
    scaled_bits = value_bits - k * (1 << 23)
    special = torch.where(
        magnitude == 0,
        (sign << 31) | _POS_INF_BITS,  # +-0 -> +-Inf
        torch.where((sign == 0) & (magnitude == _POS_INF_BITS), 0, F32_CANONICAL_NAN),
    )
    return f32_from_u32(torch.where(normal_positive, scaled_bits, special))
