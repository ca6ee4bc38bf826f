"""The runner end to end on the CPU: a planted byte flip is caught, bundled and replayed to
exactly that element; poisoning, rank identity, the second oracle and error isolation."""

from __future__ import annotations

import io
import json

import pytest
import torch

from conformance import cli
from conformance.bundle import load_bundle
from conformance.cases import Case
from conformance.repro import locate, replay
from conformance.run import RunOptions, execute
from conformance.runner import (
    POISON_BF16,
    POISON_FP8,
    POISON_SCALE,
    EmulatedKernelBackend,
    PlantedFlip,
    ReferenceKernelBackend,
    Status,
    Watchdog,
    compare_outputs,
    poisoned_outputs,
    run_case,
    run_cases,
    tiling_tree,
)
from reference import all_reduce_mhc, swizzle_offset
from reference.mxfp8 import padded_scale_cols

CASE = Case.from_id("tp4-H256-hc2-M5-call-mxfp8-normal")
ROW, COL, RANK = 3, 17, 2


def _options(tmp_path, case=CASE, **kwargs) -> RunOptions:
    return RunOptions(case_ids=[case.id], out=tmp_path, run_id="planted", compile_checks=False,
                      reference_checks=False, progress=False, **kwargs)


def test_reference_backend_passes_and_times_every_step():
    run = run_case(CASE, ReferenceKernelBackend())
    assert run.result.status is Status.PASS and run.result.mismatches == []
    assert set(run.result.timings) == {"inputs_s", "kernel_s", "reference_s", "compare_s"}


@pytest.fixture(scope="module")
def planted_layer_input(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("planted")
    byte = 2 * (ROW * CASE.hidden + COL) + 1  # high byte of bf16 element (ROW, COL)
    backend = ReferenceKernelBackend(plants=[PlantedFlip("layer_input", RANK, byte, 0x01)])
    report = execute(_options(tmp_path), backend=backend)
    return tmp_path / "planted", report


def test_planted_flip_is_a_mismatch_with_a_bundle(planted_layer_input):
    run_dir, report = planted_layer_input
    assert report.exit_code == 1
    (result,) = report.cases
    assert result.status is Status.MISMATCH
    first = result.first_mismatch
    assert (first.output, first.rank, first.index, first.count, first.oracle) == ("layer_input", RANK, (ROW, COL), 1, "reference")
    assert first.expected_bits ^ first.actual_bits == 0x0100
    # The same element also breaks rank identity; no other output or rank differs.
    assert {(m.output, m.rank, m.oracle) for m in result.mismatches} == {("layer_input", RANK, "reference"), ("layer_input", RANK, "rank0")}
    assert result.bundle == f"bundles/{CASE.id}.mhcbundle" and (run_dir / result.bundle).is_file()
    saved = json.loads((run_dir / "results.json").read_text())
    assert saved["cases"][0]["first_mismatch"]["index"] == [ROW, COL]
    assert saved["cases"][0]["repro"] == f"python -m conformance run --case {CASE.id}"
    assert load_bundle(run_dir / result.bundle).manifest["first_mismatch"]["rank"] == RANK


def test_repro_on_the_cpu_names_exactly_the_planted_element(planted_layer_input, capsys):
    run_dir, report = planted_layer_input
    code = cli.main(["repro", str(run_dir / report.cases[0].bundle), "--reference-only"])
    out = capsys.readouterr().out
    assert code == 1
    assert f"first difference: layer_input, rank {RANK}, index ({ROW}, {COL})" in out
    assert f"intermediates of row {ROW}, column {COL} (reference):" in out
    lines = out[out.index("intermediates of"):].splitlines()
    names = [line.split()[0] for line in lines[2:] if line.strip()]
    for step in ("rank0.contribution", "reduce.sum_after_rank3", "y", "post_mix[t=1].y_times_post",
                 "post_mix[t=1].fma_source1", "new_residual[t=0]", "collapse.fma_stream1", "p", "rms_norm.ss",
                 "rms_norm.inv", "layer_input", "mxfp8.scale", "mxfp8.value"):
        assert step in names, step
    expected = all_reduce_mhc(*_reference_inputs(), tree=tiling_tree(CASE.hidden), mxfp8=True).layer_input[ROW, COL]
    bits = int(expected.view(torch.int16)) & 0xFFFF
    assert f"reference:  {float(expected)!r}" in out and f"bits 0x{bits:04x}" in out
    assert f"bits 0x{bits ^ 0x0100:04x}" in out  # the kernel's (planted) value


def _reference_inputs():
    from conformance.inputs import make_inputs

    inputs = make_inputs(CASE)
    return inputs.ranks, inputs.mix


def test_planted_scale_byte_is_located_and_explained(tmp_path):
    row, block = 2, 5
    offset = swizzle_offset(row, block, padded_scale_cols(CASE.hidden))
    backend = ReferenceKernelBackend(plants=[PlantedFlip("mxfp8_scales", 1, offset, 0x04)])
    report = execute(_options(tmp_path), backend=backend)
    (result,) = report.cases
    assert result.status is Status.MISMATCH
    first = result.first_mismatch
    assert (first.output, first.rank, first.index) == ("mxfp8_scales", 1, (offset,))
    out = io.StringIO()
    assert replay(load_bundle(tmp_path / "planted" / result.bundle), out=out, reference_only=True) == 1
    text = out.getvalue()
    assert f"first difference: mxfp8_scales, rank 1, index ({offset},)" in text
    assert f"intermediates of row {row}, column {block * 32} (reference):" in text
    assert "mxfp8.scale" in text and "mxfp8.amax (block 5)" in text


def test_a_padding_scale_byte_is_named_as_padding():
    from conformance.compare import Mismatch

    cols = padded_scale_cols(CASE.hidden)
    offset = swizzle_offset(CASE.m + 1, 0, cols)
    mismatch = Mismatch(1, 1, (offset,), 0.0, 1.0, 0, 1, "uint8", "mxfp8_scales", 0)
    element = locate(mismatch, CASE.m, CASE.hidden)
    assert element.padding and element.row == CASE.m + 1


def test_repro_of_matching_outputs_exits_zero(tmp_path, planted_layer_input):
    run_dir, report = planted_layer_input
    bundle = load_bundle(run_dir / report.cases[0].bundle)
    expected = all_reduce_mhc(bundle.inputs.ranks, bundle.inputs.mix, tree=bundle.tree, mxfp8=True)
    for rank in range(CASE.tp):
        bundle.kernel.layer_input[rank] = expected.layer_input.clone()
    out = io.StringIO()
    assert replay(bundle, out=out, reference_only=True) == 0
    assert "no difference" in out.getvalue()


def test_outputs_are_poisoned_before_the_call():
    outputs = poisoned_outputs(CASE, "cpu")
    assert bool((outputs.new_residual[0].view(torch.int16) == POISON_BF16).all())
    assert bool((outputs.layer_input[3].view(torch.int16) == POISON_BF16).all())
    assert bool((outputs.mxfp8_values[1].view(torch.uint8) == POISON_FP8).all())
    assert bool((outputs.mxfp8_scales[2] == POISON_SCALE).all())
    residual_only = poisoned_outputs(Case.from_id("tp2-H128-hc1-M1-call-residual_only-normal"), "cpu")
    assert residual_only.layer_input == [None, None] and residual_only.mxfp8_scales == [None, None]


def test_an_unwritten_output_is_a_mismatch():
    # A "kernel" that forgets layer_input of rank 1 leaves the poison there.
    class Forgetful(ReferenceKernelBackend):
        def run(self, case, inputs):
            outputs = super().run(case, inputs)
            outputs.layer_input[1] = poisoned_outputs(case, "cpu").layer_input[1]
            return outputs

    result = run_case(CASE, Forgetful()).result
    assert result.status is Status.MISMATCH
    assert result.first_mismatch.output == "layer_input" and result.first_mismatch.rank == 1
    assert result.first_mismatch.count == CASE.m * CASE.hidden
    assert result.first_mismatch.actual_bits == POISON_BF16


def test_second_oracle_disagreement_is_reported():
    def flipped_oracle(layer_input):
        expected = all_reduce_mhc(*_reference_inputs(), tree=tiling_tree(CASE.hidden), mxfp8=True)
        scales = expected.mxfp8_scales.clone()
        scales[0] ^= 1
        return expected.mxfp8_values.view(torch.float8_e4m3fn), scales

    run = run_case(CASE, ReferenceKernelBackend(), second_oracle=flipped_oracle)
    assert run.result.status is Status.MISMATCH
    assert [(m.output, m.oracle) for m in run.result.mismatches] == [("mxfp8_scales", "flashinfer")]


def test_an_exception_is_an_error_and_the_run_goes_on():
    class Broken(ReferenceKernelBackend):
        def run(self, case, inputs):
            if case.tp == 2:
                raise RuntimeError("launch failed")
            return super().run(case, inputs)

    cases = [Case.from_id("tp2-H128-hc1-M1-call-full-normal"), Case.from_id("tp1-H128-hc1-M2-call-full-normal")]
    seen = []
    results = run_cases(cases, Broken(), on_run=seen.append)
    assert [r.status for r in results] == [Status.ERROR, Status.PASS]
    assert "RuntimeError: launch failed" in results[0].error and len(seen) == 2
    assert results[0].to_dict()["status"] == "error"


def test_bundle_limit(tmp_path):
    byte = 0
    backend = ReferenceKernelBackend(plants=[PlantedFlip("new_residual", 0, byte)])
    options = _options(tmp_path, max_bundles=0)
    (result,) = execute(options, backend=backend).cases
    assert result.status is Status.MISMATCH and result.bundle is None and "limit" in result.note


def test_watchdog_fires_and_can_be_cancelled():
    import threading

    fired = threading.Event()
    dog = Watchdog(0.05, lambda case: fired.set())
    dog.start(CASE)
    assert fired.wait(2.0)
    fired.clear()
    dog = Watchdog(0.2, lambda case: fired.set())
    dog.start(CASE)
    dog.stop()
    assert not fired.wait(0.4)


def test_rank_outputs_must_agree_with_rank_zero():
    inputs_ranks, mix = _reference_inputs()
    expected = all_reduce_mhc(inputs_ranks, mix, tree=tiling_tree(CASE.hidden), mxfp8=True)
    kernel = ReferenceKernelBackend().run(CASE, _inputs())
    kernel.new_residual[0].view(torch.int16)[0, 0, 0] ^= 1  # rank 0 itself is wrong
    mismatches = compare_outputs(CASE, kernel, expected)
    assert [(m.oracle, m.rank) for m in mismatches] == [("reference", 0)] + [("rank0", r) for r in range(1, CASE.tp)]


def _inputs():
    from conformance.inputs import make_inputs

    return make_inputs(CASE)


def test_emulated_backend_needs_cuda():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        EmulatedKernelBackend("cpu")


@pytest.mark.gpu
def test_gpu_kernels_match_on_a_few_cases(tmp_path):
    ids = [
        "tp2-H128-hc2-M3-call-full-signed_zeros",
        "tp4-H4096-hc4-M129-finalize-mxfp8-order_sensitive",
        "tp8-H5120-hc1-M1-call-residual_only-nan_inf",
    ]
    options = RunOptions(case_ids=ids, out=tmp_path, run_id="gpu", compile_checks=False, progress=False)
    report = execute(options)
    assert report.mode == "gpu"
    assert [r.status for r in report.cases] == [Status.PASS] * len(ids), [r.summary() for r in report.cases]
    assert report.exit_code == 0


_HUNG_RUN = """
import sys, time
from conformance.run import RunOptions, execute
from conformance.runner import ReferenceKernelBackend

class Hangs(ReferenceKernelBackend):
    def run(self, case, inputs):
        if case.tp == 2:
            time.sleep(120)  # a consumer spinning forever, as far as the run can tell
        return super().run(case, inputs)

options = RunOptions(case_ids=sys.argv[2].split(","), out=sys.argv[1], run_id="hung", compile_checks=False,
                     reference_checks=False, progress=False, case_timeout_s=float(sys.argv[3]))
execute(options, backend=Hangs())
print("execute returned")
"""


def test_a_hung_case_writes_the_report_and_exits_1(tmp_path):
    """The watchdog's way out: the process cannot return from a hung CUDA call, so it writes the
    report (the hung case an error, the rest not run) and leaves with os._exit(1)."""
    import subprocess
    import sys
    from pathlib import Path

    ids = ["tp1-H128-hc1-M1-call-full-normal", "tp2-H128-hc1-M1-call-full-normal", "tp4-H128-hc1-M1-call-full-normal"]
    timeout_s = 5.0
    proc = subprocess.run([sys.executable, "-c", _HUNG_RUN, str(tmp_path), ",".join(ids), str(timeout_s)],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"ERROR    {ids[1]}: timed out after {timeout_s} s; writing the report and exiting"
    assert lines[1].startswith("FAIL mhc-ar conformance hung (cases, cpu): 3 cases: 1 pass, 0 mismatch, 1 error, 1 not run")
    assert "execute returned" not in proc.stdout
    saved = json.loads((tmp_path / "hung" / "results.json").read_text())
    assert [(c["id"], c["status"]) for c in saved["cases"]] == list(zip(ids, ["pass", "error", "not_run"]))
    assert saved["cases"][1]["error"] == f"timeout: no result after {timeout_s} s (kernel hang?); run aborted"
    assert saved["cases"][2]["reason"] == f"not run: run aborted after {ids[1]} timed out"
    assert (tmp_path / "hung" / "junit.xml").is_file() and (tmp_path / "hung" / "index.html").is_file()
