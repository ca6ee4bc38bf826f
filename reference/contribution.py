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


def routed(expanded_idx_to_permuted_idx: torch.Tensor, rows: int) -> torch.Tensor:
    """bool, same shape: the routes that contribute, those whose index is a row of gemm2_permuted
    (0 <= idx < rows). Every other index contributes nothing: -1 by design (the expert lives on
    another rank), anything else (below -1, or rows and beyond) is an *invalid* index, skipped
    the same way and counted (invalid_routes)."""
    idx = expanded_idx_to_permuted_idx.to(torch.int64)
    return (idx >= 0) & (idx < rows)


def invalid_routes(expanded_idx_to_permuted_idx: torch.Tensor, rows: int) -> int:
    """How many route entries are neither -1 nor a row of gemm2_permuted."""
    idx = expanded_idx_to_permuted_idx.to(torch.int64)
    return int(((idx != SKIPPED_ROUTE) & ~routed(idx, rows)).sum())


def gather_rows(gemm2_permuted: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """gemm2_permuted[idx] with every index outside the rows replaced by row 0 (or zeros when
    there is no row): the values of routes that do not contribute, never used."""
    rows = gemm2_permuted.shape[0]
    if rows == 0:
        return gemm2_permuted.new_zeros(*idx.shape, gemm2_permuted.shape[1])
    return gemm2_permuted[torch.where(routed(idx, rows), idx.to(torch.int64), 0)]


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
    expanded_idx_to_permuted_idx [M, top_k] int32: row of gemm2_permuted per route; -1 = skip,
    and any other index outside 0 .. rows-1 is invalid and skipped the same way (routed()).
    shared_output [M, H] bf16: this rank's partial of the shared expert.

    acc = +0.0; for k = 0 .. top_k-1 (in order, skipping routes that are not routed()):
    acc = fma(w_k, gemm2[idx_k], acc)
    (fma.rn.f32: the kernel's w * g + acc contracts to one); acc = acc + shared (add.rn.f32);
    c = bf16_rn(acc). With return_accumulators, also returns fp32 [top_k + 1, M, H]: acc after
    each route (unchanged by a skipped one) and after the shared add.
    """
    m, top_k = expert_weights.shape
    hidden = shared_output.shape[1]
    acc = torch.zeros(m, hidden, dtype=torch.float32, device=shared_output.device)
    steps = []
    for k in range(top_k):
        idx = expanded_idx_to_permuted_idx[:, k]
        taken = routed(idx, gemm2_permuted.shape[0])
        rows = bf16_to_f32(gather_rows(gemm2_permuted, idx))
        updated = fma_f32(expert_weights[:, k : k + 1], rows, acc)
        acc = torch.where(taken[:, None], updated, acc)
        steps.append(acc)
    acc = add_f32(acc, bf16_to_f32(shared_output))
    steps.append(acc)
    c = bf16_rn(acc)
    if return_accumulators:
        return c, torch.stack(steps)
    return c
