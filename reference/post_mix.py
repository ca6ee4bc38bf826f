"""Stage 4, post-mix: the reduced output y mixed into the hc residual streams."""

from __future__ import annotations

import torch

from .bits import bf16_rn, bf16_to_f32
from .exact import fma_f32, mul_f32


def post_mix(
    y: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    return_accumulators: bool = False,
):
    """y [M, H] bf16, residual [M, hc, H] bf16, post [M, hc] or [M, hc, 1] fp32,
    comb [M, hc, hc] fp32 indexed [source, target] -> new_residual [M, hc, H] bf16.

    For each target t: a = y * post[t] (mul.rn.f32); for s = 0 .. hc-1:
    a = fma(residual[s], comb[s, t], a) (fma.rn.f32); new_residual[t] = bf16_rn(a).
    With return_accumulators, also returns fp32 [M, hc, hc + 1, H]: for each target, a after
    the mul and after every fma.
    """
    hc = residual.shape[1]
    post = post.reshape(post.shape[0], hc)
    y32 = bf16_to_f32(y)
    residual32 = bf16_to_f32(residual)
    targets = []
    accumulators = []
    for t in range(hc):
        a = mul_f32(y32, post[:, t : t + 1])
        steps = [a]
        for s in range(hc):
            a = fma_f32(residual32[:, s], comb[:, s, t : t + 1], a)
            steps.append(a)
        targets.append(bf16_rn(a))
        accumulators.append(torch.stack(steps, dim=1))
    new_residual = torch.stack(targets, dim=1)
    if return_accumulators:
        return new_residual, torch.stack(accumulators, dim=1)
    return new_residual
