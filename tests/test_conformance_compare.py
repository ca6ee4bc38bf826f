"""The bitwise comparison helper: a single flipped bit anywhere is found and reported exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.compare import Mismatch, assert_bitwise_equal, first_mismatch

DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.uint8, torch.int32]
_UINT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _tensor(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.uint8, torch.int32):
        return torch.randint(0, 100, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    data=st.data(),
)
def test_one_flipped_bit_is_found_with_its_index_and_values(dtype, shape, data):
    expected = _tensor(dtype, shape)
    actual = expected.clone()
    flat = data.draw(st.integers(0, expected.numel() - 1))
    bit = data.draw(st.integers(0, 8 * expected.element_size() - 1))
    view = actual.view(_UINT[expected.element_size()]).view(-1)
    view[flat] = view[flat] ^ (1 << bit) if bit < 8 * expected.element_size() - 1 else view[flat] ^ (-(1 << bit))
    mismatch = first_mismatch(expected, actual, output="layer_input", rank=3)
    assert mismatch is not None
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape))
    assert mismatch.index == index and mismatch.count == 1 and mismatch.total == expected.numel()
    assert mismatch.expected_bits ^ mismatch.actual_bits == 1 << bit
    assert mismatch.rank == 3 and mismatch.output == "layer_input"
    assert str(index) in mismatch.describe() and mismatch.hex(mismatch.actual_bits) in mismatch.describe()


def test_bf16_report_names_values_and_bits():
    expected = torch.tensor([[1.0, 2.0], [3.0, -0.0]], dtype=torch.bfloat16)
    actual = expected.clone()
    actual[1, 1] = 0.0  # -0.0 -> +0.0: equal as floats, different bits
    mismatch = first_mismatch(expected, actual)
    assert mismatch == Mismatch(
        count=1, total=4, index=(1, 1), expected_value=-0.0, actual_value=0.0, expected_bits=0x8000,
        actual_bits=0x0000, dtype="bfloat16", output="", rank=None, oracle="reference",
    )
    assert "expected -0.0 (0x8000), got 0.0 (0x0000)" in mismatch.describe()


def test_identical_nans_are_equal_and_different_payloads_are_not():
    a = torch.tensor([float("nan"), 1.0])
    assert first_mismatch(a, a.clone()) is None
    b = a.clone()
    b.view(torch.int32)[0] = 0x7FC00001
    mismatch = first_mismatch(a, b)
    assert mismatch is not None and mismatch.actual_bits == 0x7FC00001
    assert mismatch.to_dict()["actual_value"] == "nan"  # JSON-safe


def test_counts_every_differing_element_and_reports_the_first():
    expected = torch.zeros(4, 5, dtype=torch.bfloat16)
    actual = expected.clone()
    actual[2, 1] = 1.0
    actual[3, 4] = 2.0
    actual[0, 3] = -1.0
    mismatch = first_mismatch(expected, actual)
    assert mismatch.count == 3 and mismatch.index == (0, 3)


def test_fp8_uses_byte_compare():
    expected = torch.tensor([0.5, -448.0], dtype=torch.float8_e4m3fn)
    actual = expected.clone()
    actual.view(torch.uint8)[1] = 0xFE  # -448 is 0xFE already: no change
    assert first_mismatch(expected, actual) is None
    actual.view(torch.uint8)[0] ^= 0x80
    assert first_mismatch(expected, actual).describe().startswith("tensor index (0,): expected 0.5 (0x30), got -0.5 (0xb0)")


@pytest.mark.parametrize(
    "expected, actual, message",
    [
        (torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.float32), "dtype differs"),
        (torch.zeros(3), torch.zeros(4), "shape differs"),
        (torch.zeros(3), torch.zeros(1, 3), "shape differs"),
        (torch.zeros(3), torch.zeros(3, device="meta"), "device differs"),
        (torch.zeros(3), [0.0, 0.0, 0.0], "not a tensor"),
    ],
)
def test_incomparable_tensors_raise(expected, actual, message):
    with pytest.raises(ValueError, match=message):
        first_mismatch(expected, actual)
    with pytest.raises(AssertionError, match=message):
        assert_bitwise_equal(actual, expected, "out")


def test_assert_bitwise_equal_message():
    expected = torch.ones(2, 3, dtype=torch.bfloat16)
    assert_bitwise_equal(expected.clone(), expected, "new_residual")
    actual = expected.clone()
    actual.view(torch.int16)[1, 2] ^= 1
    with pytest.raises(AssertionError, match=r"new_residual index \(1, 2\): expected 1.0 \(0x3f80\), got 1.0078125 \(0x3f81\)"):
        assert_bitwise_equal(actual, expected, "new_residual")
