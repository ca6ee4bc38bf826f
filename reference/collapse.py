"""Stage 5, collapse: the new residual streams folded into the next layer's input by `pre`."""

from __future__ import annotations

import torch

from .bits import bf16_rn, bf16_to_f32
from .exact import fma_f32


def collapse(new_residual: torch.Tensor, pre: torch.Tensor, *, return_accumulators: bool = False):
    """new_residual [M, hc, H] bf16, pre [M, hc] fp32 -> p [M, H] bf16.

    c = +0.0; for t = 0 .. hc-1: c = fma(float(new_residual[t]), pre[t], c) (fma.rn.f32);
    p = bf16_rn(c). It reads the bf16-rounded streams, exactly what the kernel just stored.
    With return_accumulators, also returns fp32 [M, hc, H]: c after every fma.
    """
    m, hc, hidden = new_residual.shape
    streams = bf16_to_f32(new_residual)
    c = torch.zeros(m, hidden, dtype=torch.float32, device=new_residual.device)
    steps = []
    for t in range(hc):
        c = fma_f32(streams[:, t], pre[:, t : t + 1], c)
        steps.append(c)
    p = bf16_rn(c)
    if return_accumulators:
        return p, torch.stack(steps, dim=1)
    return p
