"""Stage 3, reduce: the fp32 sum of every rank's scrubbed contribution, in rank order."""

from __future__ import annotations

from typing import Sequence

import torch

from .bits import bf16_rn, bf16_to_f32
from .exact import add_f32


def reduce(contributions: Sequence[torch.Tensor], *, return_partial_sums: bool = False):
    """Scrubbed contributions of ranks 0 .. tp-1, each [M, H] bf16 -> y [M, H] bf16.

    s = +0.0; for r = 0 .. tp-1: s = s + float(c_r) (add.rn.f32); y = bf16_rn(s). The order is
    the rank order on every rank, which is what makes all ranks' bytes identical. With
    return_partial_sums, also returns fp32 [tp, M, H]: s after each rank's add.
    """
    if len(contributions) == 0:
        raise ValueError("contributions: need at least one rank")
    s = torch.zeros(contributions[0].shape, dtype=torch.float32, device=contributions[0].device)
    partial_sums = []
    for c in contributions:
        s = add_f32(s, bf16_to_f32(c))
        partial_sums.append(s)
    y = bf16_rn(s)
    if return_partial_sums:
        return y, torch.stack(partial_sums)
    return y
