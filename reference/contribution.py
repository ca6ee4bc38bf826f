"""Stage 1, contribution: what one TP rank publishes, before the sentinel scrub.

Plain call: the rank's sublayer output x itself. Finalize call: the rank's share of an
unfinalized MoE output, the weighted top-k sum of its experts' rows plus its shared-expert
partial, accumulated in fp32 and rounded to bf16 once.
"""

from __future__ import annotations

import torch

from .bits import bf16_rn, bf16_to_f32
from .exact import add_f32, fma_f32

# expanded_idx_to_permuted_idx value of a route whose expert lives on another rank.
SKIPPED_ROUTE = -1


def contribution(x: torch.Tensor) -> torch.Tensor:
    """x [M, H] bf16 -> c [M, H] bf16 (the same tensor: a plain call publishes x as is)."""
    return x


def finalize_contribution(
    gemm2_permuted: torch.Tensor,
    expert_weights: torch.Tensor,
    expanded_idx_to_permuted_idx: torch.Tensor,
    shared_output: torch.Tensor,
    *,
    return_accumulators: bool = False,
):
    """Weighted top-k sum plus shared output -> c [M, H] bf16.

    gemm2_permuted [rows, H] bf16: unweighted expert outputs in permuted order.
    expert_weights [M, top_k] fp32: route weights, already scaled.
    expanded_idx_to_permuted_idx [M, top_k] int32: row of gemm2_permuted per route, -1 = skip.
    shared_output [M, H] bf16: this rank's partial of the shared expert.

    acc = +0.0; for k = 0 .. top_k-1 (in order, skipping -1): acc = fma(w_k, gemm2[idx_k], acc)
    (fma.rn.f32: the kernel's w * g + acc contracts to one); acc = acc + shared (add.rn.f32);
    c = bf16_rn(acc). With return_accumulators, also returns fp32 [top_k + 1, M, H]: acc after
    each route (unchanged by a skipped one) and after the shared add.
    """
    m, top_k = expert_weights.shape
    hidden = shared_output.shape[1]
    acc = torch.zeros(m, hidden, dtype=torch.float32, device=shared_output.device)
    steps = []
    for k in range(top_k):
        idx = expanded_idx_to_permuted_idx[:, k].to(torch.int64)
        routed = idx != SKIPPED_ROUTE
        rows = bf16_to_f32(gemm2_permuted[idx.clamp(min=0)])
        updated = fma_f32(expert_weights[:, k : k + 1], rows, acc)
        acc = torch.where(routed[:, None], updated, acc)
        steps.append(acc)
    acc = add_f32(acc, bf16_to_f32(shared_output))
    steps.append(acc)
    c = bf16_rn(acc)
    if return_accumulators:
        return c, torch.stack(steps)
    return c
