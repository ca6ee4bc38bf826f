"""The reference on a GPU: the shipped rsqrt table against the hardware, exhaustively, and the
CUDA reference equal to the CPU reference on whole-op cases."""

from __future__ import annotations

import pytest
import torch

from conformance.compare import assert_bitwise_equal
from conformance.rsqrt_measure import measure
from mhc_ar import choose_consumer_tiling
from reference import MixInputs, RankInputs, ReductionTree, all_reduce_mhc, reference_rsqrt_table

from gpu_cases import random_inputs

pytestmark = pytest.mark.gpu


def test_shipped_rsqrt_table_matches_this_gpu_exhaustively():
    """rsqrt.approx.ftz of every float in [0.5, 2), and of each scaled by 4^k for |k| <= 30,
    equals the shipped table's prediction; torch.rsqrt equals the instruction on every normal."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the shipped table is the sm_90 one")
    result = measure(max_power=30, check_torch=True)
    differ = (result.table != reference_rsqrt_table("sm_90")).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} table entries differ, first at {differ[:5].tolist()}"
    assert result.scaling_mismatches == 0, result.first_problems[:5]
    assert result.torch_mismatches == 0, result.first_problems[:5]


def _to(ranks, mix, device):
    def move(t):
        return None if t is None else t.to(device)

    moved = [RankInputs(**{k: move(getattr(r, k)) for k in ("x", "gemm2_permuted", "expert_weights", "expanded_idx_to_permuted_idx", "shared_output")}) for r in ranks]
    return moved, MixInputs(move(mix.residual), move(mix.post), move(mix.comb), move(mix.pre), move(mix.norm_weight), mix.eps)


@pytest.mark.parametrize(
    "tp,hidden,hc,m,finalize,mxfp8,residual_only",
    [(1, 4096, 4, 3, False, False, False), (4, 5120, 8, 17, True, True, False), (8, 7168, 2, 9, False, False, True), (3, 128, 1, 130, True, True, False)],
)
def test_reference_cuda_equals_cpu(tp, hidden, hc, m, finalize, mxfp8, residual_only):
    ranks, mix = random_inputs(tp, m, hidden, hc, finalize=finalize, seed=tp * 1000 + m, residual_only=residual_only, device="cpu")
    # Widen the dynamic range so rsqrt, subnormals and rounding ties are exercised too.
    mix.residual.mul_(2.0**-100) if hidden == 128 else None
    tree = ReductionTree(**choose_consumer_tiling(hidden).reduction_tree_args())
    cpu = all_reduce_mhc(ranks, mix, tree=tree, mxfp8=mxfp8, intermediates=True)
    g_ranks, g_mix = _to(ranks, mix, "cuda")
    gpu = all_reduce_mhc(g_ranks, g_mix, tree=tree, mxfp8=mxfp8, intermediates=True)
    for name, value in cpu.intermediates.items():
        assert_bitwise_equal(gpu.intermediates[name].cpu(), value, f"intermediate {name}")
