"""The gate's verdicts and its command line, as a CI engineer drives them: a run that verified
nothing says NOT VERIFIED (summary line, results.json, JUnit, HTML) and fails under
--require-gpu; a GPU CUDA cannot use is an error; shapes come from the command line; bad usage
is one line on stderr, exit 2, and nothing written. On the CPU (kernel cases cannot run here)."""

from __future__ import annotations

import glob
import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from conformance import cli
from conformance import run as run_module
from conformance.report import EXIT_FAIL, EXIT_NOT_VERIFIED, EXIT_PASS, EXIT_USAGE

# One small selection, fast on the CPU: no compile, no float64 check, no kernel.
FAST = ["run", "--quick", "--tp", "1", "--op", "call", "--variant", "full", "--no-progress",
        "--skip-compile-checks", "--skip-reference-checks"]
ROOT = Path(__file__).resolve().parents[1]


def _run(capsys, *args):
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _summary(out: str) -> str:
    return next(line for line in out.splitlines() if "mhc-ar conformance" in line)


def test_a_run_that_ran_no_kernel_is_not_verified_everywhere(tmp_path, capsys):
    code, out, _ = _run(capsys, *FAST, "--out", str(tmp_path), "--run-id", "r", "--device", "cpu")
    line = _summary(out)
    print(line)
    assert code == EXIT_PASS
    assert line.startswith("NOT VERIFIED mhc-ar conformance r (quick, cpu): ") and "PASS" not in line
    why = "not run: --device cpu" if torch.cuda.is_available() else "not run: no GPU"
    assert f"no kernel case ran ({why})" in line
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    assert results["status"] == "not_verified" and results["exit_code"] == 0
    suites = {s.get("name"): s for s in ET.parse(tmp_path / "r" / "junit.xml").getroot().iter("testsuite")}
    verdict = suites["conformance.verdict"]
    assert verdict.find("testcase/skipped").get("message").startswith("NOT VERIFIED")
    assert {p.get("name"): p.get("value") for p in verdict.iter("property")}["verdict"] == "NOT VERIFIED"
    page = (tmp_path / "r" / "index.html").read_text()
    assert '<span class="badge verdict unverified">NOT VERIFIED</span>' in page
    assert 'class="badge verdict pass"' not in page


def test_require_gpu_makes_nothing_verified_a_failure_of_its_own(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: kernel cases would run")
    code, out, _ = _run(capsys, *FAST, "--out", str(tmp_path), "--run-id", "r", "--require-gpu")
    line = _summary(out)
    print(code, line)
    assert code == EXIT_NOT_VERIFIED == 3
    assert line.startswith("NOT VERIFIED") and "not run: no GPU" in line
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    assert results["status"] == "not_verified" and results["require_gpu"] is True and results["exit_code"] == 3
    verdict = {s.get("name"): s for s in ET.parse(tmp_path / "r" / "junit.xml").getroot().iter("testsuite")}["conformance.verdict"]
    assert verdict.get("failures") == "1" and verdict.find("testcase/failure").get("type") == "not_verified"
    code, _, err = _run(capsys, *FAST, "--out", str(tmp_path), "--require-gpu", "--device", "cpu")
    assert code == EXIT_USAGE and "--require-gpu with --device cpu" in err


def test_a_visible_gpu_that_does_not_initialize_is_an_error(tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA initializes here")
    monkeypatch.setattr(run_module, "visible_gpus", lambda: ["/dev/nvidia0"])
    code, out, _ = _run(capsys, *FAST, "--out", str(tmp_path), "--run-id", "r")
    line = _summary(out)
    print(code, line)
    assert code == EXIT_FAIL and line.startswith("FAIL") and " 0 not run " in line
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    assert {c["status"] for c in results["cases"]} == {"error"}
    assert "a GPU is visible (/dev/nvidia0) but CUDA does not initialize" in results["cases"][0]["error"]


def test_visible_gpus_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert run_module.visible_gpus() == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert run_module.visible_gpus() == sorted(glob.glob("/dev/nvidia[0-9]*"))


def test_shapes_from_the_command_line_are_run_even_off_the_preset(capsys):
    code, out, _ = _run(capsys, "run", "--tp", "3", "--hidden", "1000", "--hc", "3,5", "--m", "1,7", "--list")
    ids = out.splitlines()[:-1]
    print(out.splitlines()[-1])
    assert code == EXIT_PASS and out.splitlines()[-1] == f"{len(ids)} cases (default)"
    # 2 hc x 2 M x 2 ops x 2 variants (mxfp8 needs H % 128 == 0: left out when not asked for)
    assert len(ids) == 16
    assert {i.split("-")[0] for i in ids} == {"tp3"} and {i.split("-")[1] for i in ids} == {"H1000"}
    assert {i.split("-")[2] for i in ids} == {"hc3", "hc5"} and {i.split("-")[3] for i in ids} == {"M1", "M7"}
    assert not [i for i in ids if "-mxfp8-" in i]


def test_the_readme_example_runs_every_m_it_names(capsys):
    code, out, _ = _run(capsys, "run", "--tp", "8", "--hidden", "7168", "--variant", "mxfp8", "--m", "1,129", "--list")
    ids = out.splitlines()[:-1]
    assert code == EXIT_PASS
    assert {i.split("-")[3] for i in ids} == {"M1", "M129"}
    assert all(i.startswith("tp8-H7168-") and "-mxfp8-" in i for i in ids)
    assert "--tp 8 --hidden 7168 --variant mxfp8 --m 1,129" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize(
    "option, value, rule",
    [
        ("--tp", "0", "--tp 0: TP sizes are 1..8"),
        ("--tp", "9", "--tp 9: TP sizes are 1..8"),
        ("--hidden", "7", "--hidden 7: hidden sizes are positive multiples of 8"),
        ("--m", "0", "--m 0: M is 1..256 (the capacity of the run's instances)"),
        ("--m", "-1", "--m -1: M is 1..256 (the capacity of the run's instances)"),
        ("--hc", "9", "--hc 9: hc is 1..8"),
        ("--m", "1,,2", "--m: empty item in '1,,2'"),
    ],
)
def test_out_of_range_values_get_their_rule_in_one_line(tmp_path, capsys, option, value, rule):
    out_dir = tmp_path / "reports"
    code, out, err = _run(capsys, "run", f"{option}={value}", "--out", str(out_dir))
    print(err.strip())
    assert code == EXIT_USAGE and err.strip() == f"mhc-ar-conformance run: {rule}" and not out
    assert not out_dir.exists()


def test_mxfp8_with_a_hidden_size_it_cannot_take_is_refused(tmp_path, capsys):
    code, _, err = _run(capsys, "run", "--variant", "mxfp8", "--hidden", "1000", "--out", str(tmp_path / "x"))
    assert code == EXIT_USAGE
    assert err.strip() == "mhc-ar-conformance run: --hidden 1000 with --variant mxfp8: the mxfp8 variant needs hidden % 128 == 0"
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "device, message",
    [
        ("bogus", "--device bogus: expected cpu, cuda or cuda:N"),
        ("cpu:3", "--device cpu:3: the CPU takes no index (use cpu)"),
        ("cuda", "--device cuda: CUDA is not available here"),
        ("cuda:7", "--device cuda:7: "),
    ],
)
def test_devices_that_are_not_there_are_bad_usage(tmp_path, capsys, device, message):
    if device.startswith("cuda") and torch.cuda.is_available() and (device == "cuda" or torch.cuda.device_count() > 7):
        pytest.skip("that CUDA device exists here")
    out_dir = tmp_path / "reports"
    code, _, err = _run(capsys, *FAST, "--device", device, "--out", str(out_dir))
    print(err.strip())
    assert code == EXIT_USAGE and err.startswith(f"mhc-ar-conformance run: {message}") and len(err.strip().splitlines()) == 1
    assert not out_dir.exists()


def test_an_unwritable_out_is_bad_usage(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for out_dir, message in ((blocker, "exists and is not a directory"), (blocker / "sub", "not writable")):
        code, _, err = _run(capsys, *FAST, "--out", str(out_dir))
        print(err.strip())
        assert code == EXIT_USAGE and message in err and len(err.strip().splitlines()) == 1
    assert blocker.read_text() == "not a folder"


def test_a_reused_run_id_is_refused_unless_overwrite(tmp_path, capsys):
    args = [*FAST, "--device", "cpu", "--out", str(tmp_path), "--run-id", "nightly"]
    assert _run(capsys, *args)[0] == EXIT_PASS
    (tmp_path / "nightly" / "left-from-before").write_text("x")
    code, _, err = _run(capsys, *args)
    print(err.strip())
    assert code == EXIT_USAGE and "--run-id nightly: " in err and "pass --overwrite to replace it" in err
    assert (tmp_path / "nightly" / "left-from-before").exists()
    code, out, _ = _run(capsys, *args, "--overwrite")
    assert code == EXIT_PASS and _summary(out).startswith("NOT VERIFIED mhc-ar conformance nightly")
    assert not (tmp_path / "nightly" / "left-from-before").exists() and (tmp_path / "nightly" / "results.json").exists()


def test_list_into_a_closed_pipe_is_quiet():
    command = f"{sys.executable} -m conformance run --full --list | head -1"
    proc = subprocess.run(["bash", "-c", command + "; echo rc=${PIPESTATUS[0]}"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    print(proc.stdout.strip().splitlines())
    assert proc.stdout.splitlines()[0].startswith("tp1-H4096-")
    assert "BrokenPipeError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "rc=0"


def test_compiling_with_ptx_leaves_nothing_in_the_temp_folder(tmp_path, monkeypatch):
    """The DSL's dump folder (PTX, cubin) lives in a temporary folder removed after each
    compile. This process's temp folder is pointed at an empty one (other xdist workers
    compile at the same time in the real one), and a shape nothing else compiles is used."""
    from mhc_ar.compile import compile_consumer
    from mhc_ar.config import ConsumerSpec, Variant, choose_consumer_tiling

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spec = ConsumerSpec(choose_consumer_tiling(1032), hc=3, tp=3, capacity=7, variant=Variant.RESIDUAL_ONLY)
    misses = compile_consumer.cache_info().misses
    compiled = compile_consumer(spec, "sm_90a", keep_ptx=True)
    assert compile_consumer.cache_info().misses == misses + 1  # it did compile here
    assert compiled.ptx and compiled.function.__cubin__
    assert list(tmp_path.iterdir()) == []


def test_the_ptx_contract_compiles_the_shapes_the_run_selected(tmp_path, capsys):
    args = ["run", "--tp", "3", "--hidden", "1000", "--hc", "3,5", "--m", "1", "--op", "call", "--variant", "full",
            "--skip-reference-checks", "--no-progress", "--device", "cpu", "--out", str(tmp_path), "--run-id", "r"]
    code, out, _ = _run(capsys, *args)
    print(_summary(out))
    assert code == EXIT_PASS
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    kernels = {c["kernel"] for c in results["compile_checks"] if c["status"] == "pass"}
    for hc in (3, 5):
        assert f"consumer-full-H1000-hc{hc}-tp3" in kernels and f"publish-call-unicast-H1000-hc{hc}-tp3-k0" in kernels
    assert "consumer-mxfp8-H5120-hc4-tp8" in kernels  # and the reference shape, every variant
    assert not [k for k in kernels if "mxfp8-H1000" in k]  # H=1000 cannot take MXFP8


def test_a_bundle_without_a_gpu_from_a_planted_flip(tmp_path, capsys):
    """run --plant: the reference plays the kernel with one flipped byte, so the gate's whole
    mismatch path (console line, bundle, report, repro) runs on a CPU; never a PASS."""
    case = "tp2-H4096-hc4-M5-call-mxfp8-normal"
    code, out, _ = _run(capsys, "run", "--case", case, "--plant", "mxfp8_scales@1:3", "--out", str(tmp_path), "--run-id", "p",
                        "--no-progress", "--skip-compile-checks", "--skip-reference-checks")
    print(out)
    assert code == EXIT_FAIL and _summary(out).startswith("FAIL mhc-ar conformance p (cases, cpu): 1 cases: 0 pass, 1 mismatch")
    bundle = tmp_path / "p" / "bundles" / f"{case}.mhcbundle"
    assert f"replay: python -m conformance repro {bundle.resolve()}" in out
    assert f"re-run: python -m conformance run --case {case} --plant mxfp8_scales@1:3" in out
    # The scale byte decoded as 2^(e - 127) on the console line, as in the reproducer.
    assert "mxfp8_scales rank 1 index (3,): expected 0.0078125 = 2^(120 - 127) (0x78), got 0.015625 = 2^(121 - 127) (0x79)" in out
    results = json.loads((tmp_path / "p" / "results.json").read_text())
    assert results["backend"] == "reference" and results["status"] == "fail"
    code, out, _ = _run(capsys, "repro", str(bundle))
    print(out)
    assert code == 1 and "first difference: mxfp8_scales, rank 1, index (3,)" in out
    assert "0.0078125 = 2^(120 - 127)" in out and "bits 0x78" in out
    page = (tmp_path / "p" / "index.html").read_text()
    assert f"replay: <code>python -m conformance repro {bundle.resolve()}</code>" in page


def test_a_planted_flip_that_misses_every_case_is_not_a_pass(tmp_path, capsys):
    code, out, _ = _run(capsys, *FAST, "--plant", "layer_input@5:0", "--out", str(tmp_path), "--run-id", "p")
    print(_summary(out))
    assert code == EXIT_PASS and _summary(out).startswith("NOT VERIFIED")
    assert "the reference backend played the kernel" in _summary(out)
    code, _, err = _run(capsys, *FAST, "--plant", "nothing@0:0", "--out", str(tmp_path))
    assert code == EXIT_USAGE and "--plant 'nothing@0:0': expected OUTPUT@RANK:INDEX" in err


def test_html_matrix_fits_by_hc_and_opens_without_hover(tmp_path, capsys):
    code, _, _ = _run(capsys, "run", "--quick", "--tp", "1,2", "--no-progress", "--skip-compile-checks", "--out", str(tmp_path),
                      "--run-id", "h", "--device", "cpu")
    page = (tmp_path / "h" / "index.html").read_text()
    hcs = {int(line.split("-")[2][2:]) for line in (c["id"] for c in json.loads((tmp_path / "h" / "results.json").read_text())["cases"])}
    assert page.count('<table class="matrix">') == len(hcs) and 'class="scroll"' not in page
    assert "<details><summary>0/1</summary><div>M=" in page and " title=" not in page.split("Coverage matrix")[1].split("By token")[0]
    family_table = page.split("By input family")[1].split("</table>")[0]
    assert "<th>token counts M</th>" in family_table and "<th>families</th>" not in family_table


def test_cells_with_cases_not_judged_are_not_green():
    from conformance.cases import Case
    from conformance.reference_checks import ReferenceCheck, StageResult
    from conformance.report import _reference_section

    def check(case_id, judged):
        stage = StageResult("rms_norm", max_ulps=3, max_unexplained_ulps=0, ill_conditioned=0, nonfinite_mismatches=0,
                            elements=128, judged=judged, passed=True, note=None if judged else "NaN input")
        return ReferenceCheck(Case.from_id(case_id), "pass", [stage], seconds=0.1)

    none_judged = _reference_section([check("tp1-H128-hc1-M1-call-full-normal", False)])
    cell = none_judged.split("<th>normal</th>")[1].split("</tr>")[0].split("</td>", 1)[1]
    assert "(not judged)" in cell and 'class="notrun"' in cell and 'class="pass"' not in cell
    some_judged = _reference_section([check("tp1-H128-hc1-M1-call-full-normal", False), check("tp1-H128-hc1-M2-call-full-normal", True)])
    cell = some_judged.split("<th>normal</th>")[1].split("</tr>")[0].split("</td>", 1)[1]
    assert "(1 of 2 not judged)" in cell and 'class="partial"' in cell
    all_judged = _reference_section([check("tp1-H128-hc1-M2-call-full-normal", True)])
    assert 'class="pass"' in all_judged.split("<th>normal</th>")[1].split("</tr>")[0].split("</td>", 1)[1]


def test_log_axis_ticks_are_readable_in_a_narrow_range():
    import math

    from conformance.plots import _fmt, _ticks

    labels = [_fmt(t) for t in _ticks(math.log10(17.3271), math.log10(21.9), True)]
    assert labels == ["17.3", "20", "21.9"]
    assert [_fmt(t) for t in _ticks(0, 3, True)] == ["1", "10", "100", "1000"]
    assert [_fmt(t) for t in _ticks(math.log10(3), math.log10(40), True)] == ["5", "10", "20"]


def test_linear_axis_ticks_are_few():
    from conformance.plots import _fmt, _ticks

    assert [_fmt(t) for t in _ticks(1, 4, False)] == ["1", "1.5", "2", "2.5", "3", "3.5", "4"]
    assert len(_ticks(0, 17.5, False)) <= 8 and len(_ticks(1, 2, False)) <= 8


def test_under_torchrun_only_rank_0_checks_and_makes_the_run_folder(tmp_path, capsys, monkeypatch):
    """Every rank runs `run`; rank 0 alone writes, so a rank that finds rank 0's folder already
    there must not call it a reused --run-id."""
    (tmp_path / "tp2" / "bundles").mkdir(parents=True)  # as rank 0 would have made it
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert run_module.writes_reports() is False
    code, _, err = _run(capsys, *FAST, "--device", "cpu", "--out", str(tmp_path), "--run-id", "tp2")
    assert code == EXIT_PASS and "already holds a run" not in err
    monkeypatch.setenv("RANK", "0")
    assert run_module.writes_reports() is True
