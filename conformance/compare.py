"""The project's one bitwise comparison: integer views, never allclose.

`first_mismatch(expected, actual)` returns None when every byte agrees, else a `Mismatch`
naming how many elements differ, the first differing index and both values (as float and as
hex bits). `assert_bitwise_equal(actual, expected, name)` is the same as a test assertion.
Both refuse tensors that cannot be compared (dtype, shape or device differ): that is a bug of
the caller, not a numerical difference.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

# Same-width integer dtype per element size: bf16 -> int16, fp8 -> uint8, fp32 -> int32, ...
_INTEGER_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


UE8M0_NAN = 0xFF


def ue8m0_value(byte: int) -> float:
    """The scale a UE8M0 byte stands for: 2^(byte - 127); 0xFF is NaN (OCP MX). The one decoding
    every report, console line and reproducer uses (reference.explain prints the same)."""
    return float("nan") if byte == UE8M0_NAN else 2.0 ** (byte - 127)


@dataclass(frozen=True)
class Mismatch:
    """Where two tensors first differ. `index` is the first differing element in row-major
    order; bits are the unsigned bit patterns; values are the elements as Python floats (for
    integer dtypes, the integer). `output`, `rank` and `oracle` say what was compared."""

    count: int  # differing elements
    total: int  # elements compared
    index: tuple[int, ...]
    expected_value: float
    actual_value: float
    expected_bits: int
    actual_bits: int
    dtype: str
    output: str = ""
    rank: int | None = None
    oracle: str = "reference"  # what `expected` came from: reference | flashinfer | rank0

    @property
    def width(self) -> int:
        """Hex digits of one element."""
        return 2 * _element_size(self.dtype)

    def hex(self, bits: int) -> str:
        return f"0x{bits:0{self.width}x}"

    def shown(self, value: float, bits: int) -> str:
        """An element's value as printed: a UE8M0 scale byte decoded (see ue8m0_value)."""
        if self.output == "mxfp8_scales":
            return f"{ue8m0_value(bits)!r} = 2^({bits} - 127)" if bits != UE8M0_NAN else "NaN (0xff)"
        return repr(value)

    def describe(self) -> str:
        """One line: what, where, both values."""
        where = self.output or "tensor"
        if self.rank is not None:
            where += f" rank {self.rank}"
        expected_from = {"reference": "expected", "flashinfer": "flashinfer", "rank0": "rank 0"}.get(self.oracle, self.oracle)
        return (
            f"{where} index {self.index}: {expected_from} {self.shown(self.expected_value, self.expected_bits)} "
            f"({self.hex(self.expected_bits)}), got {self.shown(self.actual_value, self.actual_bits)} "
            f"({self.hex(self.actual_bits)}); {self.count} of {self.total} elements differ"
        )

    def to_dict(self) -> dict:
        data = asdict(self)
        data["index"] = list(self.index)
        data["expected_hex"] = self.hex(self.expected_bits)
        data["actual_hex"] = self.hex(self.actual_bits)
        # JSON has no NaN/Inf: floats that are not finite are written as strings.
        for key in ("expected_value", "actual_value"):
            data[key] = _json_float(data[key])
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Mismatch":
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        fields["index"] = tuple(fields["index"])
        for key in ("expected_value", "actual_value"):
            fields[key] = float(fields[key])
        return cls(**fields)


def _json_float(value: float):
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    return value


def _element_size(dtype_name: str) -> int:
    return getattr(torch, dtype_name.removeprefix("torch.")).itemsize


def integer_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a same-width integer tensor (a view: no conversion, NaNs intact)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if not t.dtype.is_floating_point and not t.dtype.is_complex:
        return t
    return t.view(_INTEGER_VIEW[t.element_size()])


def check_comparable(expected: torch.Tensor, actual: torch.Tensor, name: str = "tensor") -> None:
    """Raise ValueError unless both are tensors of the same dtype, shape and device."""
    for label, t in (("expected", expected), ("actual", actual)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {label} is not a tensor ({type(t).__name__})")
    if expected.dtype != actual.dtype:
        raise ValueError(f"{name}: dtype differs: expected {expected.dtype}, got {actual.dtype}")
    if tuple(expected.shape) != tuple(actual.shape):
        raise ValueError(f"{name}: shape differs: expected {tuple(expected.shape)}, got {tuple(actual.shape)}")
    if expected.device != actual.device:
        raise ValueError(f"{name}: device differs: expected {expected.device}, got {actual.device}")


def first_mismatch(
    expected: torch.Tensor,
    actual: torch.Tensor,
    *,
    output: str = "",
    rank: int | None = None,
    oracle: str = "reference",
) -> Mismatch | None:
    """None if `actual` has exactly the bits of `expected`, else where they first differ.

    Raises ValueError if dtype, shape or device differ.
    """
    check_comparable(expected, actual, output or "tensor")
    differs = integer_view(expected.contiguous()) != integer_view(actual.contiguous())
    count = int(differs.sum())
    if count == 0:
        return None
    flat = int(differs.reshape(-1).nonzero()[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(expected.shape)))
    e, a = expected[index].reshape(1).cpu(), actual[index].reshape(1).cpu()
    mask = (1 << (8 * expected.element_size())) - 1
    return Mismatch(
        count=count,
        total=expected.numel(),
        index=index,
        expected_value=_as_number(e),
        actual_value=_as_number(a),
        expected_bits=int(integer_view(e).to(torch.int64)[0]) & mask,
        actual_bits=int(integer_view(a).to(torch.int64)[0]) & mask,
        dtype=str(expected.dtype).removeprefix("torch."),
        output=output,
        rank=rank,
        oracle=oracle,
    )


def _as_number(element: torch.Tensor) -> float:
    if element.dtype.is_floating_point:
        return float(element.float()[0])
    return float(int(element.to(torch.int64)[0]))


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "tensor") -> None:
    """Assert identical dtype, shape, device and bits; the message names the first difference."""
    try:
        mismatch = first_mismatch(expected, actual, output=name)
    except ValueError as error:
        raise AssertionError(str(error)) from None
    if mismatch is not None:
        raise AssertionError(mismatch.describe())


__all__ = ["Mismatch", "assert_bitwise_equal", "check_comparable", "first_mismatch", "integer_view", "ue8m0_value"]
