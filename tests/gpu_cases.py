"""Input builders and kernel/reference runners shared by the GPU tests (no test functions here)."""

from __future__ import annotations

import torch

from mhc_ar import EmulatedAllReduceMHC, mxfp8_scale_bytes
from conformance.runner import POISON_BF16, POISON_FP8, POISON_SCALE
from reference import MixInputs, RankInputs, ReductionTree, all_reduce_mhc


def random_inputs(tp, m, hidden, hc, *, finalize=False, top_k=8, seed=0, residual_only=False, device="cuda"):
    """Per-rank contributions and replicated mix inputs, deterministic in `seed`."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    def uniform(*shape, low=0.0, high=1.0):
        return (low + (high - low) * torch.rand(*shape, generator=g)).to(device)

    ranks = []
    for _ in range(tp):
        if finalize:
            rows = m * top_k
            routes = torch.randperm(rows, generator=g).reshape(m, top_k).to(torch.int32)
            routes[torch.rand(m, top_k, generator=g) < 0.25] = -1
            ranks.append(
                RankInputs(
                    gemm2_permuted=normal(rows, hidden),
                    expert_weights=uniform(m, top_k) / top_k,
                    expanded_idx_to_permuted_idx=routes.to(device),
                    shared_output=normal(m, hidden),
                )
            )
        else:
            ranks.append(RankInputs(x=normal(m, hidden)))
    mix = MixInputs(
        residual=normal(m, hc, hidden),
        post=uniform(m, hc, low=0.5, high=1.5),
        comb=uniform(m, hc, hc, low=-0.5, high=1.0) / hc,
        pre=None if residual_only else uniform(m, hc, low=0.5, high=1.5) / hc,
        norm_weight=None if residual_only else (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16).to(device),
        eps=1e-6,
    )
    return ranks, mix


def poisoned_outputs(op: EmulatedAllReduceMHC, m: int, hidden: int, hc: int, *, mxfp8: bool, residual_only: bool):
    """Per-rank output buffers filled with poison, so an unwritten element cannot pass."""
    device = op.endpoints[0].mailbox.device
    outs, mx = [], []
    for _ in range(op.tp_size):
        new_residual = torch.full((m, hc, hidden), POISON_BF16, dtype=torch.int16, device=device).view(torch.bfloat16)
        layer_input = None
        if not residual_only:
            layer_input = torch.full((m, hidden), POISON_BF16, dtype=torch.int16, device=device).view(torch.bfloat16)
        outs.append((new_residual, layer_input))
        if mxfp8:
            values = torch.full((m, hidden), POISON_FP8, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
            scales = torch.full((mxfp8_scale_bytes(m, hidden),), POISON_SCALE, dtype=torch.uint8, device=device)
            mx.append((values, scales))
    return outs, (mx if mxfp8 else None)


def run_kernel(op: EmulatedAllReduceMHC, ranks, mix, *, mxfp8: bool, out=None, mxfp8_out=None):
    m, hc, hidden = mix.residual.shape
    residual_only = mix.residual_only
    if out is None:
        out, mxfp8_out = poisoned_outputs(op, m, hidden, hc, mxfp8=mxfp8, residual_only=residual_only)
    if ranks[0].is_finalize:
        op.finalize(
            [r.gemm2_permuted for r in ranks],
            [r.expert_weights for r in ranks],
            [r.expanded_idx_to_permuted_idx for r in ranks],
            [r.shared_output for r in ranks],
            mix.residual,
            mix.post,
            mix.comb,
            mix.pre,
            mix.norm_weight,
            mix.eps,
            out=out,
            mxfp8_out=mxfp8_out,
        )
    else:
        op([r.x for r in ranks], mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight, mix.eps, out=out, mxfp8_out=mxfp8_out)
    return out, mxfp8_out


def reference_for(op: EmulatedAllReduceMHC, ranks, mix, *, mxfp8: bool):
    tree = ReductionTree(**op.consumer_tiling.reduction_tree_args())
    return all_reduce_mhc(ranks, mix, tree=tree, mxfp8=mxfp8)


def check_outputs(out, mxfp8_out, ref, assert_equal):
    """Every rank's every output against the reference, with the project's bitwise helper."""
    for rank, (new_residual, layer_input) in enumerate(out):
        assert_equal(new_residual, ref.new_residual, f"rank {rank} new_residual")
        if ref.layer_input is not None:
            assert_equal(layer_input, ref.layer_input, f"rank {rank} layer_input")
        if mxfp8_out is not None:
            values, scales = mxfp8_out[rank]
            assert_equal(values.view(torch.uint8), ref.mxfp8_values, f"rank {rank} mxfp8 values")
            assert_equal(scales, ref.mxfp8_scales, f"rank {rank} mxfp8 scales")
