"""reference.rsqrt: the CPU emulation of rsqrt.approx.ftz.f32 against its definition.

Definition (SPEC.md, measured facts): for x = m * 4^k with m in [0.5, 2),
    rsqrt(x) = bits(float32(1 / sqrt(float64(m)))) + delta[m] as fp32, divided by 2^k,
subnormals flushed first. The expected values here are computed with numpy, independently of the
reference's own index and scaling arithmetic.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from reference.rsqrt import (
    TABLE_BASE_BITS,
    TABLE_SIZE,
    load_table,
    reference_rsqrt_table,
    rsqrt_approx_ftz,
    rsqrt_delta_from_measurement,
    write_table,
)

INDEPENDENT_TABLE = Path(__file__).parent / "data" / "rsqrt_delta_h200_independent.i8.zlib"
CHUNK = 1 << 22


def _table_np() -> np.ndarray:
    return reference_rsqrt_table("sm_90").numpy()


def _unit_floats(start: int, stop: int) -> np.ndarray:
    return (np.arange(start, stop, dtype=np.uint32) + np.uint32(TABLE_BASE_BITS)).view(np.float32)


def _definition_bits(m: np.ndarray) -> np.ndarray:
    """The table definition for m in [0.5, 2): baseline bits + delta, as uint32."""
    base = (1.0 / np.sqrt(m.astype(np.float64))).astype(np.float32).view(np.int32).astype(np.int64)
    index = m.view(np.uint32).astype(np.int64) - TABLE_BASE_BITS
    return (base + _table_np()[index]).astype(np.uint32)


def _assert_equal_bits(got: torch.Tensor, want_bits: np.ndarray, inputs: np.ndarray, what: str) -> None:
    got_bits = got.view(torch.int32).numpy().view(np.uint32)
    differ = np.nonzero(got_bits != want_bits)[0]
    if differ.size:
        i = differ[0]
        pytest.fail(
            f"{what}: {differ.size} differ; first x={float(inputs[i])!r} (0x{inputs[i:i + 1].view(np.uint32)[0]:08x}):"
            f" got 0x{got_bits[i]:08x}, want 0x{want_bits[i]:08x}"
        )


def test_every_input_in_unit_interval_matches_definition():
    for start in range(0, TABLE_SIZE, CHUNK):
        m = _unit_floats(start, start + CHUNK)
        got = rsqrt_approx_ftz(torch.from_numpy(m))
        _assert_equal_bits(got, _definition_bits(m), m, f"entries {start}..{start + CHUNK - 1}")


def test_power_of_four_scaling():
    m = _unit_floats(0, TABLE_SIZE)[::997]  # strided over both binades
    expected_m = _definition_bits(m).view(np.float32).astype(np.float64)
    for k in range(-30, 31):
        x = np.ldexp(m.astype(np.float64), 2 * k).astype(np.float32)  # exact: stays normal
        want = np.ldexp(expected_m, -k).astype(np.float32).view(np.uint32)  # exact: power of 2
        _assert_equal_bits(rsqrt_approx_ftz(torch.from_numpy(x)), want, x, f"k={k}")


def test_extreme_exponents():
    """k = -63 .. 64 reaches every normal binade, FLT_MIN and FLT_MAX included."""
    m = _unit_floats(0, TABLE_SIZE)[::65_537]
    expected_m = _definition_bits(m).view(np.float32).astype(np.float64)
    for k in list(range(-63, -55)) + list(range(56, 65)):
        x64 = np.ldexp(m.astype(np.float64), 2 * k)
        normal = (x64 >= np.finfo(np.float32).tiny) & (x64 <= np.finfo(np.float32).max)
        x = x64[normal].astype(np.float32)
        want = np.ldexp(expected_m[normal], -k).astype(np.float32).view(np.uint32)
        _assert_equal_bits(rsqrt_approx_ftz(torch.from_numpy(x)), want, x, f"k={k}")
    flt_max = np.array([np.finfo(np.float32).max], dtype=np.float32)
    got = rsqrt_approx_ftz(torch.from_numpy(flt_max))
    m_max = np.ldexp(flt_max.astype(np.float64), -128).astype(np.float32)  # FLT_MAX = m * 4^64
    want = np.ldexp(_definition_bits(m_max).view(np.float32).astype(np.float64), -64).astype(np.float32)
    assert got.view(torch.int32).item() == int(want.view(np.int32)[0])


def test_special_values():
    tiny = np.finfo(np.float32).tiny
    cases = [  # (input, expected bits); every NaN result is the canonical 0x7FFFFFFF
        (0.0, 0x7F800000),
        (-0.0, 0xFF800000),
        (1e-45, 0x7F800000),  # subnormal: flushed to +0
        (-1e-45, 0xFF800000),  # flushed to -0
        (float(np.float32(tiny) * np.float32(0.5)), 0x7F800000),
        (float(np.inf), 0x00000000),
        (float(-np.inf), 0x7FFFFFFF),
        (float(np.nan), 0x7FFFFFFF),
        (-1.0, 0x7FFFFFFF),
        (-float(tiny), 0x7FFFFFFF),
        (float(tiny), 0x5F000000),  # 1/sqrt(2^-126) = 2^63 (delta at m = 1.0 is 0)
        (1.0, 0x3F800000),
        (4.0, 0x3F000000),
    ]
    x = np.array([value for value, _ in cases], dtype=np.float32)
    x_bits = x.view(np.uint32).copy()
    x_bits[7] = 0xFFC01234  # the NaN input: make it a negative NaN with a payload
    x = x_bits.view(np.float32)
    want = np.array([bits for _, bits in cases], dtype=np.uint32)
    assert _table_np()[(1 << 23)] == 0, "delta at m = 1.0 (used by the FLT_MIN case) is not 0"
    _assert_equal_bits(rsqrt_approx_ftz(torch.from_numpy(x)), want, x, "special values")


def test_emulation_within_two_ulp_of_true_rsqrt():
    """SPEC fact: the hardware is at most 2 ulp from the fp64-rounded 1/sqrt; so is the table."""
    table = _table_np()
    assert np.abs(table.astype(np.int64)).max() <= 2
    counts = np.bincount(table.astype(np.int64) + 2, minlength=5)
    assert counts[2] < TABLE_SIZE, "table is all zeros: it cannot be a hardware measurement"


def test_shipped_table_equals_independent_measurement():
    shipped = _table_np()
    independent = np.frombuffer(zlib.decompress(INDEPENDENT_TABLE.read_bytes()), dtype=np.int8)
    assert independent.size == TABLE_SIZE
    differ = np.nonzero(shipped != independent)[0]
    if differ.size:
        first = ", ".join(
            f"entry {i} (x=0x{TABLE_BASE_BITS + i:08x}): shipped {shipped[i]}, independent {independent[i]}"
            for i in differ[:5]
        )
        pytest.fail(f"{differ.size} of {TABLE_SIZE} entries differ; first: {first}")


def test_delta_from_measurement_round_trips(tmp_path):
    table = reference_rsqrt_table("sm_90")
    m = _unit_floats(0, TABLE_SIZE)
    base = (1.0 / np.sqrt(m.astype(np.float64))).astype(np.float32).view(np.int32)
    hw_bits = torch.from_numpy(base.astype(np.int64) + table.numpy()).to(torch.int32)
    rebuilt = rsqrt_delta_from_measurement(hw_bits)
    assert torch.equal(rebuilt, table)

    hw_bits[12345] += 200
    with pytest.raises(ValueError, match="12345"):
        rsqrt_delta_from_measurement(hw_bits)
    with pytest.raises(ValueError, match="hw_bits"):
        rsqrt_delta_from_measurement(hw_bits[:10])

    path = tmp_path / "table.i8.zlib"
    write_table(path, rebuilt)
    assert torch.equal(load_table(path), table)


def test_unknown_arch_is_rejected():
    with pytest.raises(ValueError, match="arch"):
        reference_rsqrt_table("sm_75")


@pytest.mark.gpu
def test_cuda_torch_rsqrt_equals_table_path():
    """On a GPU: the CUDA path (torch.rsqrt) and the table path agree on every input of [0.5, 2)
    and under 4^k scaling; this checks the shipped table against the GPU running the test."""
    for start in range(0, TABLE_SIZE, CHUNK):
        m = torch.from_numpy(_unit_floats(start, start + CHUNK)).cuda()
        for k in (0, -20, 17):
            x = torch.ldexp(m, torch.tensor(2 * k, device="cuda")).float()
            hw = rsqrt_approx_ftz(x)
            table = rsqrt_approx_ftz(x, use_table=True)
            differ = (hw.view(torch.int32) != table.view(torch.int32)).nonzero()
            assert differ.numel() == 0, f"k={k}: {differ.numel()} differ, first x={x[differ[0, 0]].item()!r}"
