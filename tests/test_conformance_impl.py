"""Gating another implementation (`run --impl`): the adapter protocol, the built-ins, and three
deliberately wrong implementations (tests/wrong_implementations.py), each caught and attributed to
the stage it got wrong, on the CPU."""

from __future__ import annotations

import json
import os

import pytest

from conformance import cli
from conformance.cases import Case
from conformance.impl import ImplementationBackend, load_factory
from conformance.inputs import make_inputs
from conformance.runner import run_case

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _wrong_implementations_importable(monkeypatch):
    monkeypatch.syspath_prepend(HERE)


def _run(spec: str, case_id: str, inputs=None):
    case = Case.from_id(case_id)
    backend = ImplementationBackend(spec, "cpu")
    if inputs is None:
        return run_case(case, backend).result
    # A case with hand-made inputs: run_case draws its own, so patch them in.
    import conformance.runner as runner

    original = runner.make_inputs
    runner.make_inputs = lambda c, d: inputs
    try:
        return run_case(case, backend).result
    finally:
        runner.make_inputs = original


def test_the_reference_behind_the_adapter_matches_itself():
    result = _run("reference", "tp4-H4096-hc4-M5-finalize-mxfp8-order_sensitive")
    assert result.status.value == "pass", result.summary()


def test_ranks_summed_in_reverse_are_caught_at_the_reduce():
    result = _run("wrong_implementations:reverse_rank_sum", "tp4-H4096-hc4-M5-call-full-order_sensitive")
    print(result.summary(), result.divergence["detail"])
    assert result.status.value == "mismatch"
    assert result.divergence["stage"] == "reduce" and "summed in the order" in result.divergence["detail"]
    assert sum(result.divergence["ulps"]["new_residual"].values()) > 0


def test_a_skipped_scrub_is_caught_at_the_contribution():
    case = Case.from_id("tp2-H128-hc2-M2-call-residual_only-normal")
    inputs = make_inputs(case, "cpu")
    for rank in inputs.ranks:  # every rank -0.0 at (0, 5), and a zero residual there
        rank.x[0, 5] = -0.0
    inputs.mix.residual[0, :, 5] = -0.0
    result = _run("wrong_implementations:no_scrub", case.id, inputs)
    print(result.summary(), result.divergence["detail"])
    assert result.status.value == "mismatch" and result.first_mismatch.index == (0, 0, 5)
    assert result.divergence["stage"] == "contribution" and "without the -0.0 scrub" in result.divergence["detail"]
    assert result.divergence["ulps"]["new_residual"]["sign/NaN/Inf"] >= 1


def test_finalize_routes_in_reverse_are_caught_at_the_contribution():
    result = _run("wrong_implementations:routes_reversed", "tp2-H4096-hc4-M5-finalize-full-order_sensitive")
    print(result.summary(), result.divergence["detail"])
    assert result.status.value == "mismatch"
    assert result.divergence["stage"] == "contribution" and "routes in reverse order" in result.divergence["detail"]


def test_a_collapse_rounded_twice_is_caught_at_the_collapse():
    result = _run("wrong_implementations:collapse_rounded_twice", "tp2-H4096-hc4-M3-call-full-normal")
    print(result.summary(), result.divergence["detail"])
    assert result.status.value == "mismatch" and result.first_mismatch.output == "layer_input"
    assert result.divergence["stage"] == "collapse"


def test_torch_unfused_is_not_bit_exact_and_says_where(tmp_path, capsys):
    code = cli.main(["run", "--impl", "torch-unfused", "--quick", "--tp", "2", "--op", "call", "--out", str(tmp_path),
                     "--run-id", "u", "--no-progress", "--skip-compile-checks", "--skip-reference-checks", "--device", "cpu"])
    out = capsys.readouterr().out
    print(out.splitlines()[-2])
    assert code == 1 and out.splitlines()[-2].startswith("FAIL mhc-ar conformance u")
    results = json.loads((tmp_path / "u" / "results.json").read_text())
    assert results["backend"] == "impl:torch-unfused"
    stages = {c["divergence"]["stage"] for c in results["cases"] if c["status"] == "mismatch"}
    assert stages and stages <= {"reduce", "post_mix", "collapse", "rms_norm", "mxfp8"}
    page = (tmp_path / "u" / "index.html").read_text()
    assert "First divergence" in page


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nowhere_module:factory", "cannot import nowhere_module"),
        ("wrong_implementations:missing", "wrong_implementations has no callable missing"),
        ("just-a-name", "expected one of mhc_ar, reference, torch-unfused or MODULE:FACTORY"),
    ],
)
def test_an_adapter_that_cannot_load_is_bad_usage(spec, message, tmp_path, capsys):
    code = cli.main(["run", "--impl", spec, "--quick", "--tp", "1", "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    print(err.strip())
    assert code == 2 and message in err and not (tmp_path).joinpath("x").exists()


def test_an_incomplete_adapter_is_named():
    with pytest.raises(ValueError, match="has no finalize"):
        _backend = ImplementationBackend("wrong_implementations:no_finalize", "cpu")
        _backend.instance(Case.from_id("tp2-H128-hc2-M2-finalize-full-normal"))
    with pytest.raises(ValueError, match="does not take the adapter arguments"):
        ImplementationBackend("wrong_implementations:wrong_arguments", "cpu").instance(Case.from_id("tp2-H128-hc2-M2-call-full-normal"))


def test_load_factory_knows_the_built_ins():
    assert load_factory("reference").__name__ == "ReferenceImplementation"
    assert callable(load_factory("mhc_ar")) and callable(load_factory("torch-unfused"))
