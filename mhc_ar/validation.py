"""Input checks at the API boundary: ValueError naming the argument and the rule, before any launch."""

from __future__ import annotations

import math
from typing import Sequence

import torch

ALIGNMENT = 16  # every tensor is accessed with 16-byte vectors or from 16-byte aligned rows


def check_tensor(
    tensor,
    name: str,
    *,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    alignment: int = ALIGNMENT,
) -> int:
    """Return the tensor's address if it has this dtype, shape and device, is contiguous and
    `alignment`-byte aligned; else raise ValueError naming `name` and the rule it breaks.

    The accepted case is a handful of attribute reads (it runs on every eager call)."""
    try:
        if (
            tensor.dtype is dtype
            and tensor.shape == shape
            and tensor.device == device
            and tensor.is_contiguous()
        ):
            address = tensor.data_ptr()
            if address % alignment == 0:
                return address
    except AttributeError:
        pass
    _raise_for(tensor, name, shape, dtype, device, alignment)


def _raise_for(tensor, name, shape, dtype, device, alignment):
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {tensor.dtype}")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} must be on {device}, got {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {tensor.stride()})")
    raise ValueError(f"{name} must be {alignment}-byte aligned (address {tensor.data_ptr():#x})")


def check_tokens(tensor, name: str, capacity: int) -> int:
    """The token count M of a [M, ...] input: 1 <= M <= capacity."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() < 1:
        raise ValueError(f"{name} must have a leading token dimension, got shape {list(tensor.shape)}")
    tokens = tensor.shape[0]
    if not 1 <= tokens <= capacity:
        raise ValueError(f"{name} has {tokens} tokens; expected 1 <= M <= max_num_tokens={capacity}")
    return tokens


def check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise ValueError(f"eps must be a float, got {type(eps).__name__}")
    eps = float(eps)
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return eps


def check_no_overlap(outputs, inputs) -> None:
    """Outputs must not share memory with the consumer's inputs (other threads of the kernel still
    read an input row while one thread writes its output). Both are (name, address, nbytes)."""
    for out_name, o_start, o_size in outputs:
        for in_name, i_start, i_size in inputs:
            if o_start < i_start + i_size and i_start < o_start + o_size:
                raise ValueError(f"{out_name} overlaps {in_name}: outputs must not alias inputs")


def check_disjoint(outputs) -> None:
    """No two outputs share memory (each is written by the kernel). (name, address, nbytes)."""
    for i, (a_name, a_start, a_size) in enumerate(outputs):
        for b_name, b_start, b_size in outputs[i + 1 :]:
            if a_start < b_start + b_size and b_start < a_start + a_size:
                raise ValueError(f"{a_name} overlaps {b_name}: outputs must not share memory")
