"""The PTX contract: every check passes on the real sm_90a PTX of every kernel variant and fails
on PTX doctored to lack (or add) the instruction it is about."""

from __future__ import annotations

import dataclasses
import re

import pytest

from conformance import ptx_contract
from conformance.ptx_contract import (
    KernelContract,
    check_compiled_variants,
    check_consumer_ptx,
    check_ptx,
    check_publish_ptx,
    describe_spec,
    parse_instructions,
)
from mhc_ar.compile import compile_spec, kernel_variants
from mhc_ar.config import ConsumerSpec, Contribution, PublishSpec, Variant, choose_consumer_tiling
from mhc_ar.protocol import SENTINEL_HIGH_PTX, SENTINEL_LOW_PTX

SPECS = kernel_variants()


def _label(spec) -> str:
    return "-".join(describe_spec(spec))


@pytest.fixture(scope="module")
def sm90_ptx() -> dict:
    return {_label(spec): (spec, compile_spec(spec, "sm_90a", keep_ptx=True).ptx) for spec in SPECS}


def _failed(spec, ptx) -> set[str]:
    return {c.name for c in check_ptx(spec, ptx) if not c.passed}


def test_the_contract_looks_for_the_sentinel_the_kernels_emit():
    assert (ptx_contract.SENTINEL_LOW, ptx_contract.SENTINEL_HIGH) == (SENTINEL_LOW_PTX, SENTINEL_HIGH_PTX)


def test_every_variant_is_compiled(sm90_ptx):
    assert set(sm90_ptx) == {
        "publish-call-unicast", "publish-call-multicast", "publish-finalize-unicast", "publish-finalize-multicast",
        "consumer-full", "consumer-mxfp8", "consumer-residual_only",
    }


@pytest.mark.parametrize("label", [_label(s) for s in SPECS])
def test_real_ptx_meets_the_contract(sm90_ptx, label):
    spec, ptx = sm90_ptx[label]
    checks = check_ptx(spec, ptx)
    assert checks and all(c.passed for c in checks), [f"{c.name}: {c.message}" for c in checks if not c.passed]


CONSUMER_DOCTORINGS = [
    # (what, variant, old, new, check that must fail)
    ("fma flushes subnormals", "full", "fma.rn.f32", "fma.rn.ftz.f32", "no .ftz on float arithmetic"),
    ("no fma at all", "full", "fma.rn.f32", "mad.lo.s32", "has fma.rn.f32"),
    ("mul contracted away", "mxfp8", "mul.rn.f32", "mul.f32", "has mul.rn.f32"),
    ("approximate division", "full", "div.rn.f32", "div.approx.f32", "f32 division is IEEE (div.rn)"),
    ("no rsqrt", "mxfp8", "rsqrt.approx.ftz.f32", "sqrt.rn.f32", "1 x rsqrt.approx.ftz.f32"),
    ("spin load not volatile", "full", "ld.volatile.global.v4.b32", "ld.global.v4.b32", "has ld.volatile.global.v4.b32"),
    ("sentinel compared as float", "full", "setp.eq.or.b32 p, hi, 0x80000000, p", "setp.eq.or.f32 p, hi, 0x80000000, p",
     "spin loops compare integer lanes only"),
    ("no re-arm / stores", "residual_only", "st.global.v4.b32", "st.global.v2.b32", "has st.global.v4.b32"),
    ("no PDL wait", "full", "griddepcontrol.wait;", "membar.gl;", "griddepcontrol.wait before global loads"),
    ("load before the wait", "mxfp8", "griddepcontrol.wait;", "ld.global.f32 %r1, [%rd1];\n\tgriddepcontrol.wait;",
     "griddepcontrol.wait before global loads"),
    ("no bf16 rounding", "full", "cvt.rn.bf16x2.f32", "cvt.rz.bf16x2.f32", "has cvt.rn.bf16x2.f32"),
    ("no e4m3 conversion", "mxfp8", "cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.e4m3x2.f32", "has cvt.rn.satfinite.e4m3x2.f32"),
    ("no scale byte store", "mxfp8", "st.global.b8", "st.global.b16", "has st.global.b8"),
    ("output store before the wait", "full", "griddepcontrol.wait;", "st.global.v4.b32 [%rd1], {%r1, %r1, %r1, %r1};\n\tgriddepcontrol.wait;",
     "stores before griddepcontrol.wait: only MXFP8 padding zeros"),
    ("non-zero store before the wait", "mxfp8", "griddepcontrol.wait;", "st.global.b32 [%rd1], %r1;\n\tgriddepcontrol.wait;",
     "stores before griddepcontrol.wait: only MXFP8 padding zeros"),
    # The deadline taken inside the spin loops only (as before this check: restarted per rank and
    # fragment), or a second time outside them.
    ("deadline only inside the spin loops", "full", "mov.u64 now, %globaltimer;\n\tadd.u64", "mov.u64 now, 0;\n\tadd.u64",
     "one spin deadline, every spin loop can trap"),
    ("a second deadline", "mxfp8", "griddepcontrol.launch_dependents;", "griddepcontrol.launch_dependents;\n\tmov.u64 %rd9, %globaltimer;",
     "one spin deadline, every spin loop can trap"),
    ("spin loops never trap", "residual_only", "@late trap;", "@late exit;", "one spin deadline, every spin loop can trap"),
    ("tag mismatch does not trap", "full", "@p trap;", "@p exit;", "call tags compared, mismatch traps"),
    ("rank 0's tag not broadcast", "mxfp8", "shfl.sync.idx", "shfl.sync.bfly", "call tags compared, mismatch traps"),
    # The cross-CTA sums through a release cluster barrier (MEMBAR.ALL.GPU: it waits for the
    # output stores) instead of st.async on an mbarrier, or a fence of its own.
    ("release cluster barrier", "full", "barrier.cluster.wait;", "barrier.cluster.arrive;\n\tbarrier.cluster.wait;", "no release fence"),
    ("a gpu fence", "mxfp8", "griddepcontrol.launch_dependents;", "griddepcontrol.launch_dependents;\n\tfence.acq_rel.gpu;",
     "no release fence"),
]


@pytest.mark.parametrize("what, variant, old, new, check", CONSUMER_DOCTORINGS, ids=[d[0] for d in CONSUMER_DOCTORINGS])
def test_doctored_consumer_ptx_fails(sm90_ptx, what, variant, old, new, check):
    spec, ptx = sm90_ptx[f"consumer-{variant}"]
    assert old in ptx
    assert check in _failed(spec, ptx.replace(old, new)), what


def test_consumer_without_the_tag_comparison_fails_the_contract():
    """The diagnostic build that leaves the call-tag comparison out (what out-of-step ranks do
    without it) is not a contract kernel."""
    spec = next(s for s in SPECS if isinstance(s, ConsumerSpec) and s.variant is Variant.FULL)
    diagnostic = dataclasses.replace(spec, omit=frozenset({"step_check"}))
    ptx = compile_spec(diagnostic, "sm_90a", keep_ptx=True).ptx
    assert _failed(diagnostic, ptx) == {"call tags compared, mismatch traps"}


def test_residual_only_must_not_normalize(sm90_ptx):
    spec, ptx = sm90_ptx["consumer-residual_only"]
    doctored = ptx.replace("ret;", "div.rn.f32 %r1, %r2, %r3;\n\trsqrt.approx.ftz.f32 %r1, %r1;\n\tret;", 1)
    assert {"no div.rn.f32", "no rsqrt.approx.ftz.f32"} <= _failed(spec, doctored)


def test_a_second_division_fails(sm90_ptx):
    spec, ptx = sm90_ptx["consumer-full"]
    doctored = ptx.replace("div.rn.f32", "div.rn.f32 %r9, %r9, %r9;\n\tdiv.rn.f32", 1)
    assert "1 x div.rn.f32" in _failed(spec, doctored)


def test_load_reachable_before_the_wait_through_a_branch_fails():
    # Text order alone looks fine here, but a branch reaches the load before the wait.
    ptx = """
    .entry k() {
        bra.uni $L__early;
    $L__late:
        griddepcontrol.wait;
        ld.global.f32 %r1, [%rd1];
        ret;
    $L__early:
        ld.global.f32 %r2, [%rd2];
        bra.uni $L__late;
    }
    """
    failed = {c.name for c in check_consumer_ptx(ptx, Variant.FULL) if not c.passed}
    assert "griddepcontrol.wait before global loads" in failed
    assert [i.opcode for i in parse_instructions(ptx)][:3] == ["bra.uni", "griddepcontrol.wait", "ld.global.f32"]


PUBLISH_DOCTORINGS = [
    ("unicast stores to one peer too few", "call-unicast", "st.global.v4.b32", "st.global.v2.b32", "8 peer stores of data and 8 of the call tag", 1),
    ("unicast uses multimem", "call-unicast", "ret;", "multimem.st.relaxed.sys.global.v4.bf16x2 [%rd1], {%r1, %r1, %r1, %r1};\n\tret;", "no multimem", 1),
    ("multicast loops over peers", "call-multicast", "ret;", "st.global.v4.b32 [%rd1], {%r1, %r1, %r1, %r1};\n\tret;", "no peer st.global.v4 loop", 1),
    ("multicast without multimem", "finalize-multicast", "multimem.st", "st.global", "one multimem.st per vector and per call tag", 1),
    ("finalize without fma", "finalize-unicast", "fma.rn.f32", "mul.rn.f32", "has fma.rn.f32", None),
    ("finalize without add", "finalize-unicast", "add.rn.f32", "sub.rn.f32", "has add.rn.f32", None),
    ("dependents launched before the wait", "call-unicast", "griddepcontrol.wait;",
     "griddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;", "griddepcontrol.launch_dependents after griddepcontrol.wait", 1),
    ("dependents never launched", "finalize-unicast", "griddepcontrol.launch_dependents;", "membar.gl;",
     "griddepcontrol.launch_dependents after griddepcontrol.wait", None),
    ("scrub compares floats", "call-unicast", "setp.eq.b32 plo, lo, 0x00008000", "setp.eq.f32 plo, lo, 0x00008000",
     "sentinel compared as integer lanes", None),
]


@pytest.mark.parametrize("what, variant, old, new, check, count", PUBLISH_DOCTORINGS, ids=[d[0] for d in PUBLISH_DOCTORINGS])
def test_doctored_publish_ptx_fails(sm90_ptx, what, variant, old, new, check, count):
    spec, ptx = sm90_ptx[f"publish-{variant}"]
    assert old in ptx
    doctored = ptx.replace(old, new) if count is None else ptx.replace(old, new, count)
    assert check in _failed(spec, doctored), what


def test_padding_zeros_moved_after_the_wait_fail(sm90_ptx):
    """The MXFP8 consumer's padding stores are meant to overlap the publish: if a rebuild put
    them after the wait, the check says so (it expects zero stores before the wait)."""
    spec, ptx = sm90_ptx["consumer-mxfp8"]
    lines = ptx.splitlines()
    wait = next(n for n, line in enumerate(lines) if "griddepcontrol.wait;" in line)
    doctored = "\n".join(
        line.replace("st.global", "st.shared") if n < wait and "st.global" in line else line for n, line in enumerate(lines)
    )
    assert "stores before griddepcontrol.wait: only MXFP8 padding zeros" in _failed(spec, doctored)


def test_publish_store_count_follows_tp(sm90_ptx):
    _, ptx = sm90_ptx["publish-call-unicast"]
    assert all(c.passed for c in check_publish_ptx(ptx, Contribution.CALL, multicast=False, tp=8))
    failed = {c.name for c in check_publish_ptx(ptx, Contribution.CALL, multicast=False, tp=4) if not c.passed}
    assert failed == {"4 peer stores of data and 4 of the call tag"}


def test_empty_ptx_fails_every_presence_check():
    for spec in SPECS:
        checks = {c.name: c.passed for c in check_ptx(spec, "")}
        required = [n for n in checks if n.startswith("has ") or n.startswith("1 x")]
        required += ["griddepcontrol.wait before global loads", "sentinel compared as integer lanes"]
        assert not any(checks[n] for n in required), (spec, {n: checks[n] for n in required})


def test_check_ptx_rejects_other_objects():
    with pytest.raises(ValueError, match="PublishSpec or ConsumerSpec"):
        check_ptx(object(), "")


def test_compile_coverage_records_results(tmp_path):
    specs = [s for s in SPECS if isinstance(s, ConsumerSpec) and s.variant is Variant.RESIDUAL_ONLY]
    seen = []
    results = check_compiled_variants(["sm_90a"], specs, ptx_dir=tmp_path / "ptx", on_result=seen.append)
    assert len(results) == 1 and seen == results
    result: KernelContract = results[0]
    assert result.status == "pass" and result.kind == "consumer" and result.variant == "residual_only"
    assert (tmp_path / result.ptx_file).read_text().count("ld.volatile.global.v4.b32") > 0
    assert result.to_dict()["checks"][0].keys() == {"name", "passed", "message"}
    assert isinstance(SPECS[0], PublishSpec)


def test_ptx_snapshot_compares_all_but_symbol_names():
    """scripts/ptx_snapshot.py (issue 16's guard): the same kernel under another module path
    compares equal; one changed instruction does not."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "ptx_snapshot.py"
    spec = importlib.util.spec_from_file_location("ptx_snapshot", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ptx = "// generated\n.entry kernel_cutlass_kernel_mhc_arkernelsA_0(\n.param .u64 kernel_cutlass_kernel_mhc_arkernelsA_0_param_0)\n{ fma.rn.f32 %f1, %f2, %f3, %f4; }"
    renamed = ptx.replace("mhc_arkernelsA", "mhc_arkernelsstagesB").replace("// generated", "// other compiler")
    assert module.normalized(ptx) == module.normalized(renamed)
    assert module.normalized(ptx) != module.normalized(renamed.replace("fma.rn.f32", "fma.rz.f32"))


def test_route_bounds_doctored_away_fail(sm90_ptx):
    """The finalize publish's route checks (mhc_ar.routes): each fails on PTX that reads a gemm2
    row unpredicated, compares the index with a constant only, or drops the counter."""
    spec, ptx = sm90_ptx["publish-finalize-unicast"]
    top_k = spec.top_k
    assert not _failed(spec, ptx)
    unguarded = re.sub(r"@p (ld\.global\.v4\.b32)", r"\1", ptx)
    assert f"{top_k} predicated gemm2 row loads" in _failed(spec, unguarded)
    constant_bound = re.sub(r"(setp\.(?:lt|ge)\.s32\s+%p\d+, %r\d+), %r\d+;", r"\1, 0;", ptx)
    assert "route index compared with the row count" in _failed(spec, constant_bound)
    no_counter = ptx.replace("red.relaxed.gpu.global.add.u32", "st.global.u32")
    assert f"{top_k} x red.relaxed.gpu.global.add.u32" in _failed(spec, no_counter)


def test_residual_prefetch_rule():
    """ConsumerSpec.prefetch_residual: the residual is loaded before the spin unless the words
    live across it would exceed the 64-register bound (ptxas -v: tp 8 with hc 4 spills)."""
    tiling = choose_consumer_tiling(5120)

    def spec(tp, hc):
        return ConsumerSpec(tiling, hc=hc, tp=tp, capacity=128, variant=Variant.FULL)

    assert spec(1, 4).prefetch_residual and spec(7, 4).prefetch_residual and spec(8, 2).prefetch_residual
    assert not spec(8, 4).prefetch_residual
    assert spec(8, 8).prefetch_residual  # hc > 4 has no register bound


def test_residual_loads_placed_as_the_spec_says():
    """Each side of the prefetch rule is checked against the other's PTX: a consumer that loads
    its residual before the spin fails the check expecting none there, and the other way round."""
    tiling = choose_consumer_tiling(5120)
    early = ConsumerSpec(tiling, hc=4, tp=2, capacity=128, variant=Variant.FULL)
    late = ConsumerSpec(tiling, hc=4, tp=8, capacity=128, variant=Variant.FULL)
    early_ptx = compile_spec(early, "sm_90a", keep_ptx=True).ptx
    late_ptx = compile_spec(late, "sm_90a", keep_ptx=True).ptx
    name = "4 residual loads before the spin"
    assert name not in _failed(early, early_ptx) and "0 residual loads before the spin" not in _failed(late, late_ptx)
    assert name in {c.name for c in check_consumer_ptx(late_ptx, Variant.FULL, 4) if not c.passed}
    assert "0 residual loads before the spin" in {
        c.name for c in check_consumer_ptx(early_ptx, Variant.FULL, 0) if not c.passed
    }
