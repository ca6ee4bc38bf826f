"""reference.compose: the whole TP group, its stage order, and the tools built on it.

Checks: each stage within 1 bf16 ulp of a float64 model fed the same stage inputs; identical
bytes on a re-run; the sentinel scrub; the rank order of the reduce; the RMSNorm reduction tree
against a hand-written sequential model; input validation; explain_element.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

import pytest
import torch

from reference import (
    MixInputs,
    RankInputs,
    ReductionTree,
    all_reduce_mhc,
    check_against_float64,
    explain_element,
    format_steps,
    invalid_routes,
    routed,
    scrub,
)
from reference.exact import add_f32, fma_f32
from reference.rms_norm import sum_of_squares


@dataclass(frozen=True)
class Case:
    tp: int
    hc: int
    hidden: int
    m: int
    finalize: bool = False
    residual_only: bool = False
    mxfp8: bool = False
    top_k: int = 4

    @property
    def id(self) -> str:
        kind = "finalize" if self.finalize else "call"
        mode = "residual_only" if self.residual_only else ("mxfp8" if self.mxfp8 else "bf16")
        return f"tp{self.tp}-hc{self.hc}-H{self.hidden}-M{self.m}-{kind}-{mode}"


CASES = [
    Case(1, 1, 8, 1),
    Case(2, 2, 64, 3),
    Case(3, 4, 64, 17, mxfp8=True),
    Case(8, 8, 64, 17),
    Case(2, 4, 4096, 1, mxfp8=True),
    Case(8, 4, 4096, 3),
    Case(3, 8, 4096, 1, finalize=True, mxfp8=True),
    Case(1, 2, 64, 17, finalize=True),
    Case(8, 1, 8, 3, finalize=True, top_k=8),
    Case(2, 4, 64, 3, residual_only=True),
    Case(3, 8, 4096, 3, residual_only=True, finalize=True),
    Case(8, 2, 64, 1, mxfp8=True, finalize=True, top_k=2),
]


def make_inputs(case: Case, seed: int | None = None):
    """Realistic random inputs: mHC weights positive (post = 2 sigmoid, comb row-softmax,
    pre = sigmoid), residual and outputs N(0, 1), some finalize routes skipped (-1)."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()) if seed is None else seed)
    m, hc, hidden = case.m, case.hc, case.hidden

    def normal(*shape):
        return torch.randn(*shape, generator=gen)

    ranks = []
    for _ in range(case.tp):
        if not case.finalize:
            ranks.append(RankInputs(x=normal(m, hidden).bfloat16()))
            continue
        rows = m * case.top_k + 2
        idx = torch.randperm(rows, generator=gen)[: m * case.top_k].reshape(m, case.top_k).to(torch.int32)
        idx[torch.rand(m, case.top_k, generator=gen) < 0.3] = -1
        ranks.append(RankInputs(
            gemm2_permuted=normal(rows, hidden).bfloat16(),
            expert_weights=torch.softmax(normal(m, case.top_k), dim=1) * 2.5,
            expanded_idx_to_permuted_idx=idx,
            shared_output=normal(m, hidden).bfloat16(),
        ))
    mix = MixInputs(
        residual=normal(m, hc, hidden).bfloat16(),
        post=2 * torch.sigmoid(normal(m, hc)),
        comb=torch.softmax(normal(m, hc, hc), dim=2),
        pre=None if case.residual_only else torch.sigmoid(normal(m, hc)),
        norm_weight=None if case.residual_only else (1 + 0.1 * normal(hidden)).bfloat16(),
        eps=1e-6,
    )
    tree = None if case.residual_only else ReductionTree.for_hidden(hidden, cluster_size=2, threads_per_cta=64)
    return ranks, mix, tree


def _all_outputs(outputs) -> dict[str, torch.Tensor]:
    named = {"new_residual": outputs.new_residual, "layer_input": outputs.layer_input,
             "mxfp8_values": outputs.mxfp8_values, "mxfp8_scales": outputs.mxfp8_scales}
    return {name: t for name, t in named.items() if t is not None}


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    x, y = a.contiguous().view(torch.uint8).reshape(-1), b.contiguous().view(torch.uint8).reshape(-1)
    differ = (x != y).nonzero()
    if differ.numel():
        i = int(differ[0, 0])
        pytest.fail(f"{what}: {differ.numel()} bytes differ; first byte {i}: 0x{int(x[i]):02x} vs 0x{int(y[i]):02x}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_stages_within_one_ulp_of_float64_model(case):
    ranks, mix, tree = make_inputs(case)
    outputs = all_reduce_mhc(ranks, mix, tree=tree, mxfp8=case.mxfp8, intermediates=True)
    report = check_against_float64(ranks, mix, tree, outputs)
    assert report.within(1), f"{case.id}:\n{report}"
    expected_stages = {"reduce", "post_mix"} | ({"contribution"} if case.finalize else set())
    expected_stages |= set() if case.residual_only else {"collapse", "rms_norm"}
    expected_stages |= {"mxfp8_scale", "mxfp8_values"} if case.mxfp8 else set()
    assert set(report.stages) == expected_stages
    assert (outputs.layer_input is None) == case.residual_only
    assert (outputs.mxfp8_scales is None) == (not case.mxfp8)

    again = all_reduce_mhc(ranks, mix, tree=tree, mxfp8=case.mxfp8)
    for name, tensor in _all_outputs(outputs).items():
        assert_same_bytes(tensor, _all_outputs(again)[name], f"{case.id} re-run {name}")


def test_post_accepts_trailing_unit_dimension():
    ranks, mix, tree = make_inputs(Case(2, 4, 64, 3))
    flat = all_reduce_mhc(ranks, mix, tree=tree, mxfp8=False)
    mix.post = mix.post[..., None]
    assert_same_bytes(flat.layer_input, all_reduce_mhc(ranks, mix, tree=tree, mxfp8=False).layer_input, "post [M,hc,1]")


def test_scrub_changes_only_the_sentinel_pattern():
    every = torch.arange(-(2**15), 2**15, dtype=torch.int16)
    scrubbed = scrub(every.view(torch.bfloat16)).view(torch.int16)
    changed = (scrubbed != every).nonzero().reshape(-1)
    assert changed.tolist() == [0] and every[0].item() == -(2**15) and scrubbed[0].item() == 0


def test_negative_zero_contributions_are_published_as_positive_zero():
    case = Case(3, 2, 64, 3, finalize=True, top_k=2)
    ranks, mix, tree = make_inputs(case)
    for rank in ranks:
        rank.gemm2_permuted.zero_()
        rank.shared_output.fill_(-0.0)
    # Rank 1: a tiny negative sum (fp32 subnormal) that rounds to bf16 -0.0, the sentinel.
    ranks[1].gemm2_permuted.fill_(-1e-39)
    ranks[1].expert_weights.fill_(1e-3)
    ranks[1].expanded_idx_to_permuted_idx[:, 0] = 0
    rec = all_reduce_mhc(ranks, mix, tree=tree, mxfp8=False, intermediates=True).intermediates
    assert bool((rec["finalize_acc"][1, -1] < 0).all()), "rank 1's fp32 sum must be negative"
    assert bool((rec["contribution"].view(torch.int16) == 0).all()), "every contribution lane must be +0.0"
    assert bool((rec["y"].view(torch.int16) == 0).all())

    plain = [RankInputs(x=torch.full((3, 64), -0.0, dtype=torch.bfloat16)) for _ in range(2)]
    rec = all_reduce_mhc(plain, mix, tree=tree, mxfp8=False, intermediates=True).intermediates
    assert bool((rec["contribution"].view(torch.int16) == 0).all())
    assert bool((rec["y"].view(torch.int16) == 0).all()), "y of all -0.0 ranks must be +0.0"


def test_reduce_follows_rank_order():
    """Per rank 2^24, 1, -2^24 in chosen columns: rank order gives (2^24 + 1) - 2^24 = 0 in fp32,
    any order that adds the 1 last gives 1."""
    case = Case(3, 2, 64, 2)
    _, mix, tree = make_inputs(case)
    values = [2.0**24, 1.0, -(2.0**24)]
    columns = [3, 17, 40]

    def ranks_in(order):
        ranks = []
        for r in order:
            x = torch.zeros(2, 64)
            x[:, columns] = values[r]
            ranks.append(RankInputs(x=x.bfloat16()))
        return ranks

    y = all_reduce_mhc(ranks_in([0, 1, 2]), mix, tree=tree, mxfp8=False, intermediates=True).intermediates["y"]
    assert y[:, columns].float().eq(0.0).all()
    reordered = all_reduce_mhc(ranks_in([0, 2, 1]), mix, tree=tree, mxfp8=False, intermediates=True).intermediates["y"]
    assert reordered[:, columns].float().eq(1.0).all()


# ----- the RMSNorm reduction tree --------------------------------------------------------------


def sequential_sum_of_squares(row: torch.Tensor, tree: ReductionTree) -> torch.Tensor:
    """The tree written out loop by loop for one row (fp32 [H]); unowned slots are skipped."""
    zero = torch.zeros((), dtype=torch.float32)
    vectors = row.numel() // tree.elems_per_vector
    fragments = -(-tree.vectors_per_cta // tree.threads_per_cta)
    cta_sums = []
    for c in range(tree.cluster_size):
        thread_sums = []
        for t in range(tree.threads_per_cta):
            ss = zero
            for k in range(fragments):
                local = k * tree.threads_per_cta + t
                v = c * tree.vectors_per_cta + local
                if local >= tree.vectors_per_cta or v >= vectors:
                    continue
                for j in range(tree.elems_per_vector):
                    x = row[v * tree.elems_per_vector + j]
                    ss = fma_f32(x, x, ss)
            thread_sums.append(ss)
        warp_sums = []
        for w in range(tree.threads_per_cta // tree.warp_size):
            lanes = thread_sums[w * tree.warp_size : (w + 1) * tree.warp_size]
            offset = tree.warp_size // 2
            while offset:
                lanes = [add_f32(lanes[i], lanes[i ^ offset]) for i in range(tree.warp_size)]
                offset //= 2
            assert all(bool(lane == lanes[0]) for lane in lanes)
            warp_sums.append(lanes[0])
        total = zero
        for s in warp_sums:
            total = add_f32(total, s)
        cta_sums.append(total)
    total = zero
    for s in cta_sums:
        total = add_f32(total, s)
    return total


TINY_TREES = [
    ReductionTree(cluster_size=2, threads_per_cta=4, vectors_per_cta=4, warp_size=2),
    ReductionTree(cluster_size=1, threads_per_cta=4, vectors_per_cta=8, warp_size=2),
    ReductionTree(cluster_size=2, threads_per_cta=8, vectors_per_cta=5, warp_size=4),  # unowned slots
    ReductionTree(cluster_size=3, threads_per_cta=2, vectors_per_cta=3, warp_size=1),
    ReductionTree.for_hidden(64, cluster_size=1, threads_per_cta=32),
]


def test_reduction_tree_order_matters_and_matches_sequential_model():
    gen = torch.Generator().manual_seed(64)
    # Squares spanning 2^-16 .. 2^24: the fp32 sum of 64 of them depends on the order.
    p = (torch.randn(6, 64, generator=gen) * 2.0 ** torch.randint(-8, 13, (6, 64), generator=gen)).bfloat16()
    results = []
    for tree in TINY_TREES:
        ss = sum_of_squares(p, tree)
        for r in range(p.shape[0]):
            want = sequential_sum_of_squares(p[r].float(), tree)
            assert ss[r].view(torch.int32).item() == want.view(torch.int32).item(), f"{tree}, row {r}"
        results.append(ss)
    distinct = {tuple(ss.view(torch.int32).tolist()) for ss in results}
    assert len(distinct) >= 3, "inputs too easy: the trees should disagree"


def test_reduction_tree_config_validation():
    with pytest.raises(ValueError, match="threads_per_cta"):
        ReductionTree(cluster_size=1, threads_per_cta=48, vectors_per_cta=4)
    with pytest.raises(ValueError, match="cluster_size"):
        ReductionTree(cluster_size=0, threads_per_cta=32, vectors_per_cta=4)
    with pytest.raises(ValueError, match="warp_size"):
        ReductionTree(cluster_size=1, threads_per_cta=24, vectors_per_cta=4, warp_size=12)
    tree = ReductionTree.for_hidden(7168, cluster_size=4, threads_per_cta=128)
    assert tree.vectors_per_cta == 224 and tree.fragments_per_thread == 2
    assert ReductionTree.for_hidden(8 * 13, cluster_size=2, threads_per_cta=32).vectors_per_cta == 8
    with pytest.raises(ValueError, match="tree"):
        ReductionTree(cluster_size=1, threads_per_cta=32, vectors_per_cta=4).check_hidden(64)


# ----- validation ----------------------------------------------------------------------------


def _call(mutate):
    ranks, mix, tree = make_inputs(Case(2, 2, 64, 3))
    kwargs = {"tree": tree, "mxfp8": True}
    mutate(ranks, mix, kwargs)
    return ranks, mix, kwargs


def _finalize(mutate):
    ranks, mix, tree = make_inputs(Case(2, 2, 64, 3, finalize=True, top_k=2))
    kwargs = {"tree": tree, "mxfp8": False}
    mutate(ranks, mix, kwargs)
    return ranks, mix, kwargs


def _set(obj, name, value):
    setattr(obj, name, value)


# (test id, the argument the error must name, a valid setup with one thing broken)
BAD_INPUTS = [
    ("x-dtype", "ranks[0].x", lambda: _call(lambda r, m, k: _set(r[0], "x", r[0].x.float()))),
    ("x-shape", "ranks[1].x", lambda: _call(lambda r, m, k: _set(r[1], "x", r[1].x[:, :32]))),
    ("residual-2d", "mix.residual", lambda: _call(lambda r, m, k: _set(m, "residual", m.residual[:, 0]))),
    ("post-shape", "mix.post", lambda: _call(lambda r, m, k: _set(m, "post", m.post[:, :1]))),
    ("comb-dtype", "mix.comb", lambda: _call(lambda r, m, k: _set(m, "comb", m.comb.double()))),
    ("pre-without-weight", "mix.pre", lambda: _call(lambda r, m, k: _set(m, "norm_weight", None))),
    ("weight-shape", "mix.norm_weight", lambda: _call(lambda r, m, k: _set(m, "norm_weight", m.norm_weight[:8]))),
    ("eps-nan", "mix.eps", lambda: _call(lambda r, m, k: _set(m, "eps", float("nan")))),
    ("tree-missing", "tree", lambda: _call(lambda r, m, k: k.update(tree=None))),
    ("tree-too-small", "tree", lambda: _call(lambda r, m, k: k.update(tree=ReductionTree(1, 32, 4)))),
    ("mxfp8-residual-only", "mxfp8", lambda: _call(lambda r, m, k: (_set(m, "pre", None), _set(m, "norm_weight", None)))),
    ("no-ranks", "ranks", lambda: _call(lambda r, m, k: r.clear())),
    ("mixed-kinds", "ranks[1]", lambda: _call(lambda r, m, k: _set(r[1], "x", None))),
    ("weights-dtype", "ranks[0].expert_weights",
     lambda: _finalize(lambda r, m, k: _set(r[0], "expert_weights", r[0].expert_weights.bfloat16()))),
    ("gemm2-width", "ranks[0].gemm2_permuted",
     lambda: _finalize(lambda r, m, k: _set(r[0], "gemm2_permuted", r[0].gemm2_permuted[:, :8]))),
    ("shared-device", "ranks[1].shared_output",
     lambda: _finalize(lambda r, m, k: _set(r[1], "shared_output", r[1].shared_output.to("meta")))),
]


@pytest.mark.parametrize("argument, setup", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_validation_names_the_argument(argument, setup):
    ranks, mix, kwargs = setup()
    with pytest.raises(ValueError, match=re.escape(argument)):
        all_reduce_mhc(ranks, mix, **kwargs)


INVALID_INDICES = (0, 10**9, -2, -5)  # added to rows for the first two: rows, rows + 10^9


def test_an_invalid_route_index_contributes_nothing_as_minus_one_does():
    """SPEC of an index outside 0 .. rows-1: skipped like -1, and counted. The same call with
    those entries set to -1 gives the same bytes; every other entry still contributes."""
    ranks, mix, tree = make_inputs(Case(2, 2, 64, 3, finalize=True, top_k=4))
    rows = ranks[1].gemm2_permuted.shape[0]
    bad = [(0, 0), (1, 1), (2, 2), (2, 3)]
    for m, k in bad:
        ranks[1].expanded_idx_to_permuted_idx[m, k] = m  # a real row, so each entry matters
    before = all_reduce_mhc(ranks, mix, tree=tree, mxfp8=False)
    skipped = [RankInputs(**vars(r)) for r in ranks]
    skipped[1].expanded_idx_to_permuted_idx = ranks[1].expanded_idx_to_permuted_idx.clone()
    invalid = ranks[1].expanded_idx_to_permuted_idx.clone()
    for (m, k), value in zip(bad, INVALID_INDICES):
        invalid[m, k] = rows + value if value >= 0 else value
        skipped[1].expanded_idx_to_permuted_idx[m, k] = -1
    ranks[1].expanded_idx_to_permuted_idx = invalid
    assert invalid_routes(invalid, rows) == len(bad)
    assert invalid_routes(skipped[1].expanded_idx_to_permuted_idx, rows) == 0
    got = all_reduce_mhc(ranks, mix, tree=tree, mxfp8=False)
    want = all_reduce_mhc(skipped, mix, tree=tree, mxfp8=False)
    for name in ("new_residual", "layer_input"):
        a, b = getattr(got, name).view(torch.int16), getattr(want, name).view(torch.int16)
        assert torch.equal(a, b), f"{name} differs at {(a != b).nonzero()[0].tolist()}"
    # The entries changed were routes that contributed: without them the bytes differ.
    assert not torch.equal(before.new_residual.view(torch.int16), want.new_residual.view(torch.int16))


def test_routed_is_the_row_range():
    idx = torch.tensor([[-5, -2, -1, 0], [3, 4, 10**9, 2**31 - 1]], dtype=torch.int32)
    assert routed(idx, 4).tolist() == [[False, False, False, True], [True, False, False, False]]
    assert invalid_routes(idx, 4) == 5
    assert invalid_routes(idx, 0) == 7  # no rows: every index but -1 is invalid


# ----- explain -------------------------------------------------------------------------------


def test_explain_element_agrees_with_full_intermediates():
    case = Case(3, 4, 64, 5, finalize=True, mxfp8=True, top_k=3)
    ranks, mix, tree = make_inputs(case)
    rec = all_reduce_mhc(ranks, mix, tree=tree, mxfp8=True, intermediates=True).intermediates

    def f32_hex(t):
        return f"0x{t.view(torch.int32).item() & 0xFFFFFFFF:08x}"

    def bf16_hex(t):
        return f"0x{t.view(torch.int16).item() & 0xFFFF:04x}"

    for row, col, target in [(0, 0, None), (2, 37, 1), (4, 63, 3)]:
        steps = explain_element(ranks, mix, tree, row=row, col=col, target=target, mxfp8=True)
        by_name = {step.name.split(" ")[0]: step for step in steps}
        expected = {f"rank{r}.contribution": bf16_hex(rec["contribution"][r, row, col]) for r in range(case.tp)}
        for r in range(case.tp):
            for k in range(case.top_k):
                expected[f"rank{r}.finalize.route{k}"] = f32_hex(rec["finalize_acc"][r, k, row, col])
            expected[f"reduce.sum_after_rank{r}"] = f32_hex(rec["reduce_partial_sum"][r, row, col])
        expected["y"] = bf16_hex(rec["y"][row, col])
        for t in range(case.hc) if target is None else [target]:
            expected[f"post_mix[t={t}].y_times_post"] = f32_hex(rec["post_mix_acc"][row, t, 0, col])
            for s in range(case.hc):
                expected[f"post_mix[t={t}].fma_source{s}"] = f32_hex(rec["post_mix_acc"][row, t, s + 1, col])
            expected[f"new_residual[t={t}]"] = bf16_hex(rec["new_residual"][row, t, col])
        for t in range(case.hc):
            expected[f"collapse.fma_stream{t}"] = f32_hex(rec["collapse_acc"][row, t, col])
        expected.update({
            "p": bf16_hex(rec["p"][row, col]),
            "rms_norm.ss": f32_hex(rec["ss"][row]),
            "rms_norm.inv": f32_hex(rec["inv"][row]),
            "layer_input": bf16_hex(rec["layer_input"][row, col]),
            "mxfp8.amax": f32_hex(rec["mxfp8_amax"][row, col // 32]),
            "mxfp8.scale": f"0x{rec['mxfp8_scale'][row, col // 32].item():02x}",
            "mxfp8.value": f"0x{rec['mxfp8_values'][row, col].item():02x}",
        })
        for name, bits in expected.items():
            assert name in by_name, f"explain_element lacks {name}; has {list(by_name)}"
            assert by_name[name].bits == bits, f"({row}, {col}) {name}: {by_name[name].bits} vs {bits}"
        text = format_steps(steps)
        assert expected["layer_input"] in text and "mxfp8.scale" in text


def test_explain_element_rejects_out_of_range():
    ranks, mix, tree = make_inputs(Case(2, 2, 64, 3))
    with pytest.raises(ValueError, match="row"):
        explain_element(ranks, mix, tree, row=3, col=0)
    with pytest.raises(ValueError, match="target"):
        explain_element(ranks, mix, tree, row=0, col=0, target=2)


# ----- devices -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[2], CASES[6]], ids=lambda c: c.id)
def test_cuda_and_cpu_give_identical_bytes(case):
    ranks, mix, tree = make_inputs(case)
    cpu = all_reduce_mhc(ranks, mix, tree=tree, mxfp8=case.mxfp8, intermediates=True)

    def to_cuda(obj):
        fields = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in vars(obj).items()}
        return type(obj)(**fields)

    gpu = all_reduce_mhc([to_cuda(r) for r in ranks], to_cuda(mix), tree=tree, mxfp8=case.mxfp8, intermediates=True)
    for name, tensor in cpu.intermediates.items():
        assert_same_bytes(tensor, gpu.intermediates[name].cpu(), f"{case.id} {name}")
