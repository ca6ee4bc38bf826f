"""Input families: deterministic from the seed, the documented shapes, and what each claims."""

from __future__ import annotations

import pytest
import torch

from conformance.cases import FAMILIES, Case, Family
from conformance.compare import first_mismatch
from conformance.inputs import (
    ORDER_COLLAPSE_COLUMN,
    ORDER_PERIOD,
    ORDER_POST_MIX_COLUMN,
    ORDER_REDUCE_COLUMN,
    TWO_24,
    make_inputs,
)
from conformance.runner import tiling_tree
from reference import all_reduce_mhc


def _case(family, op="call", variant="mxfp8", tp=4, hidden=256, hc=4, m=6):
    return Case(tp=tp, hidden=hidden, hc=hc, m=m, op=op, variant=variant, family=Family(family))


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16).to(torch.int64) & 0xFFFF


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("op", ["call", "finalize"])
def test_same_seed_same_bits_and_documented_shapes(family, op):
    case = _case(family, op)
    first, second = make_inputs(case), make_inputs(case)
    for name, tensor in first.tensors().items():
        assert first_mismatch(tensor, second.tensors()[name]) is None, name
    m, h, hc, k = case.m, case.hidden, case.hc, case.top_k
    mix = first.mix
    assert mix.residual.shape == (m, hc, h) and mix.residual.dtype == torch.bfloat16
    assert mix.post.shape == (m, hc) and mix.comb.shape == (m, hc, hc) and mix.pre.shape == (m, hc)
    assert mix.norm_weight.shape == (h,) and mix.norm_weight.dtype == torch.bfloat16
    assert mix.eps == 1e-6 and len(first.ranks) == case.tp
    for rank in first.ranks:
        if op == "call":
            assert rank.x.shape == (m, h) and rank.x.dtype == torch.bfloat16
        else:
            assert rank.gemm2_permuted.shape == (m * k, h)
            assert rank.expert_weights.shape == (m, k) and rank.expert_weights.dtype == torch.float32
            assert rank.expanded_idx_to_permuted_idx.dtype == torch.int32
            assert rank.shared_output.shape == (m, h)
    other = make_inputs(Case.from_id(case.id, seed_offset=1))
    assert first_mismatch(first.mix.residual, other.mix.residual) is not None, "seed offset changes the inputs"


def test_finalize_routes_are_a_permutation_with_about_a_quarter_skipped():
    case = _case("normal", "finalize", m=64)
    routes = torch.stack([r.expanded_idx_to_permuted_idx for r in make_inputs(case).ranks])
    for rank_routes in routes:
        taken = rank_routes[rank_routes >= 0]
        assert len(set(taken.tolist())) == taken.numel(), "no expert row is routed twice"
        assert int(taken.max()) < case.m * case.top_k
    skipped = float((routes == -1).float().mean())
    assert 0.15 < skipped < 0.35
    weights = torch.stack([r.expert_weights for r in make_inputs(case).ranks])
    assert float(weights.min()) >= 0 and float(weights.max()) <= 1 / case.top_k


def test_residual_only_has_no_pre_or_weight():
    inputs = make_inputs(_case("normal", variant="residual_only"))
    assert inputs.mix.pre is None and inputs.mix.norm_weight is None and inputs.mix.residual_only


def test_normal_family_ranges():
    inputs = make_inputs(_case("normal", m=32))
    post, comb, pre = inputs.mix.post, inputs.mix.comb, inputs.mix.pre
    assert 0.5 <= float(post.min()) and float(post.max()) <= 1.5
    assert float(comb.min()) > 0 and torch.allclose(comb.sum(dim=1), torch.ones(32, 4), atol=0.05)
    assert 0.5 / 4 <= float(pre.min()) and float(pre.max()) <= 1.5 / 4


def test_signed_zeros_holds_negative_zero_bits_and_a_whole_rank_of_them():
    inputs = make_inputs(_case("signed_zeros"))
    xs = [_bits16(rank.x) for rank in inputs.ranks]
    assert bool((xs[-1] == 0x8000).all()), "the last rank is entirely -0.0 (the mailbox sentinel)"
    assert any(bool((x == 0x0000).any()) for x in xs) and bool((xs[0] == 0x8000).any())
    residual = _bits16(inputs.mix.residual)
    assert bool((residual == 0x8000).any()) and bool((residual == 0x0000).any())
    for name in ("post", "comb", "pre"):
        values = getattr(inputs.mix, name)
        assert bool(((values == 0) & torch.signbit(values)).any()), f"{name} has -0.0"
    assert bool((_bits16(inputs.mix.norm_weight) == 0x8000).any())


def test_signed_zeros_single_rank_has_negative_zero_rows():
    inputs = make_inputs(_case("signed_zeros", tp=1))
    assert bool((_bits16(inputs.ranks[0].x[0]) == 0x8000).all())


@pytest.mark.parametrize("op", ["call", "finalize"])
def test_nan_inf_holds_nan_payloads_and_infinities_on_even_rows_only(op):
    inputs = make_inputs(_case("nan_inf", op, m=8, hidden=1024))
    activations = torch.stack([r.x if op == "call" else r.shared_output for r in inputs.ranks]).float()
    for name, values in (("activations", activations.transpose(0, 1)), ("residual", inputs.mix.residual.float()),
                         ("comb", inputs.mix.comb), ("post", inputs.mix.post)):
        special = ~torch.isfinite(values)
        assert bool(special.any()), f"{name} has NaN/Inf"
        assert not bool(special[1::2].any()), f"{name}: odd rows stay finite"
    bits = _bits16(inputs.mix.residual)
    nans = bits[torch.isnan(inputs.mix.residual.float())]
    assert len(set(nans.tolist())) > 2, "several NaN payloads and signs"
    assert bool(torch.isinf(inputs.mix.residual.float()).any())


def test_order_sensitive_places_two_to_the_24_one_and_minus_two_to_the_24():
    case = _case("order_sensitive", tp=4, hc=4, m=4, hidden=256)
    inputs = make_inputs(case)
    x = torch.stack([r.x.float() for r in inputs.ranks])  # [tp, M, H]
    reduce_cols = torch.arange(ORDER_REDUCE_COLUMN, case.hidden, ORDER_PERIOD)
    column = x[:, 0, reduce_cols[0]]
    assert sorted(column.tolist()) == [-TWO_24, 0.0, 1.0, TWO_24]
    residual = inputs.mix.residual.float()
    post_cols = torch.arange(ORDER_POST_MIX_COLUMN, case.hidden, ORDER_PERIOD)
    assert residual[0, 0, post_cols].eq(1.0).all() and residual[0, 1, post_cols].eq(-TWO_24).all()
    collapse_cols = torch.arange(ORDER_COLLAPSE_COLUMN, case.hidden, ORDER_PERIOD)
    assert residual[1, :3, collapse_cols[0]].tolist() == [TWO_24, 1.0, -TWO_24]
    # The contract's order makes all of it cancel to exactly 0 where another order gives 1.
    out = all_reduce_mhc(inputs.ranks, inputs.mix, tree=tiling_tree(case.hidden), mxfp8=False, intermediates=True)
    assert bool((out.intermediates["y"].float()[:, reduce_cols] == 0).all())
    assert bool((out.intermediates["new_residual"].float()[0::2][:, :, post_cols] == 0).all())
    assert bool((out.intermediates["p"].float()[1::2][:, collapse_cols] == 0).all())


def test_order_sensitive_finalize_routes_carry_the_pattern():
    case = _case("order_sensitive", "finalize", tp=2, m=3)
    for rank in make_inputs(case).ranks:
        assert bool((rank.expanded_idx_to_permuted_idx[:, :3] >= 0).all())
        assert bool((rank.expert_weights[:, :3] == 1.0).all())
        rows = rank.expanded_idx_to_permuted_idx[:, 0].long()
        assert bool((rank.gemm2_permuted.float()[rows, 13] == TWO_24).all())


def test_wide_range_spans_two_to_the_plus_minus_sixty():
    inputs = make_inputs(_case("wide_range", m=16, hidden=1024))
    magnitudes = torch.stack([r.x.float() for r in inputs.ranks]).abs()
    exponents = torch.log2(magnitudes[magnitudes > 0])
    assert float(exponents.min()) < -55 and float(exponents.max()) > 55


def test_tiny_gives_subnormal_activations_and_mxfp8_block_maxima_near_2_pow_minus_118():
    case = _case("tiny", m=16, hidden=1024, hc=2)
    inputs = make_inputs(case)
    x = torch.stack([r.x.float() for r in inputs.ranks])
    assert bool(((x != 0) & (x.abs() < 2.0**-126)).any()), "subnormal activations"
    out = all_reduce_mhc(inputs.ranks, inputs.mix, tree=tiling_tree(case.hidden), mxfp8=True, intermediates=True)
    amax = out.intermediates["mxfp8_amax"]
    in_window = ((amax >= 2.6e-36) & (amax <= 5.3e-36)).float().mean()
    assert float(in_window) > 0.4, f"only {float(in_window):.2f} of the blocks have amax in 2.6e-36 .. 5.3e-36"
    # nm = amax / 448 sits at the fp32 normal/subnormal boundary: scale bytes near 0..2.
    assert int(out.intermediates["mxfp8_scale"].max()) <= 4


def test_replicated_inputs_are_shared_and_contributions_differ():
    inputs = make_inputs(_case("normal", tp=3))
    xs = [r.x for r in inputs.ranks]
    assert first_mismatch(xs[0], xs[1]) is not None and first_mismatch(xs[1], xs[2]) is not None
    assert list(inputs.tensors()) == [
        "rank0.x", "rank1.x", "rank2.x", "mix.residual", "mix.post", "mix.comb", "mix.pre", "mix.norm_weight"
    ]
