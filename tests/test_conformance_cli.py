"""The command line: `run --quick` without a GPU (compile + PTX for every arch, reference vs
float64, kernel cells not run), the reports it writes, usage errors, extension subcommands."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance import cli
from conformance.cases import Preset, preset_cases
from conformance.run import contract_specs
from conformance.schema import RESULTS_SCHEMA, SchemaError, validate
from mhc_ar.compile import TARGET_ARCHS, kernel_variants

QUICK = preset_cases(Preset.QUICK)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, worker_id):
    """One `run --quick` per test session, shared by the xdist workers (the xdist recipe: the
    first worker runs it under a file lock, the others read its exit code and files)."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    out = shared / "conformance_quick_reports"
    with FileLock(str(shared / "conformance_quick_reports.lock")):
        code_file = out / "exit_code"
        if not code_file.exists():
            # --device cpu: on a GPU machine too, this is the no-GPU path.
            code = cli.main(["run", "--quick", "--out", str(out), "--run-id", "quick", "--device", "cpu", "--no-progress"])
            code_file.write_text(str(code))
    return int(code_file.read_text()), out / "quick"


def test_quick_run_without_gpu_is_not_verified_and_writes_the_reports(quick_run, capsys):
    code, run_dir = quick_run
    assert code == 0  # NOT VERIFIED, and --require-gpu was not given
    assert {p.name for p in run_dir.iterdir()} >= {"index.html", "results.json", "junit.xml", "bundles", "ptx"}


def test_results_json_validates_and_holds_every_part(quick_run):
    _, run_dir = quick_run
    results = json.loads(run_dir / "results.json" and (run_dir / "results.json").read_text())
    validate(results, RESULTS_SCHEMA)
    assert results["preset"] == "quick" and results["mode"] == "cpu" and results["exit_code"] == 0
    assert results["status"] == "not_verified" and results["require_gpu"] is False
    assert results["counts"]["cases"] == {"total": len(QUICK), "pass": 0, "mismatch": 0, "error": 0, "not_run": len(QUICK)}
    assert all(case["status"] == "not_run" and case["reason"].startswith("not run") for case in results["cases"])
    assert [case["id"] for case in results["cases"]] == [c.id for c in QUICK]
    compiled = {(c["arch"], c["kernel"]) for c in results["compile_checks"]}
    assert len(compiled) == len(TARGET_ARCHS) * len(contract_specs(QUICK)) > len(TARGET_ARCHS) * len(kernel_variants())
    assert {c["arch"] for c in results["compile_checks"]} == set(TARGET_ARCHS)
    assert all(c["status"] == "pass" and c["checks"] for c in results["compile_checks"])
    checked = results["reference_checks"]
    assert len(checked) == sum(1 for c in QUICK if c.m <= 16)
    assert all(c["status"] == "pass" for c in checked)
    assert {s["stage"] for c in checked for s in c["stages"]} >= {"reduce", "post_mix", "collapse", "rms_norm", "mxfp8_values"}
    assert results["environment"]["versions"]["torch"]
    for key in ("total_s", "compile_s", "reference_checks_s", "cases_s"):
        assert results["timings"][key] >= 0


def test_schema_rejects_a_broken_results_file(quick_run):
    _, run_dir = quick_run
    results = json.loads((run_dir / "results.json").read_text())
    results["cases"][0]["status"] = "maybe"
    with pytest.raises(SchemaError, match=r"\$\.cases\[0\]\.status"):
        validate(results, RESULTS_SCHEMA)
    del results["counts"]
    with pytest.raises(SchemaError, match="counts"):
        validate(results, RESULTS_SCHEMA)


def test_junit_parses_with_skipped_cases_and_passing_checks(quick_run):
    _, run_dir = quick_run
    root = ET.parse(run_dir / "junit.xml").getroot()
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    cases = suites["conformance.cases.quick"]
    assert int(cases.get("tests")) == len(QUICK) and int(cases.get("skipped")) == len(QUICK)
    assert len(cases.findall("testcase/skipped")) == len(QUICK)
    ptx = suites["conformance.ptx_contract"]
    assert int(ptx.get("tests")) == len(TARGET_ARCHS) * len(contract_specs(QUICK)) and ptx.get("failures") == "0"
    assert int(suites["conformance.reference_vs_float64"].get("tests")) > 0


def test_index_html_is_self_contained(quick_run):
    _, run_dir = quick_run
    page = (run_dir / "index.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in page
    for heading in ("Coverage matrix", "By token count M", "PTX contract", "Reference vs float64 model", "Failures", "<svg"):
        assert heading in page
    assert 'class="notrun"' in page and "sm_103a" in page
    assert page.count("<table") >= 6


def test_index_html_renders_in_headless_chromium(quick_run, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium or chromium-browser on PATH")
    _, run_dir = quick_run
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
         "--dump-dom", (run_dir / "index.html").as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Coverage matrix" in proc.stdout and "<svg" in proc.stdout


def test_list_and_usage_errors(capsys):
    assert cli.main(["run", "--quick", "--tp", "8", "--op", "finalize", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"{len(out) - 1} cases (quick)"
    assert all(line.startswith("tp8-") and "-finalize-" in line for line in out[:-1])
    assert cli.main(["run", "--tp", "two"]) == 2
    assert "--tp: invalid value 'two'" in capsys.readouterr().err
    assert cli.main(["run", "--quick", "--hidden", "7168", "--list"]) == 0  # an axis given is crossed, not filtered
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"{len(QUICK) // 2} cases (quick)" and all("-H7168-" in line for line in out[:-1])
    assert cli.main(["run", "--case", "tp3-nonsense", "--list"]) == 2
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--quick", "--full"])
    assert exit_info.value.code == 2


def test_case_option_runs_exactly_the_named_case(capsys):
    case = preset_cases(Preset.DEFAULT)[7]
    assert cli.main(["run", "--case", case.id, "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == [case.id, "1 cases (cases)"]


def test_repro_refuses_a_broken_bundle(tmp_path, capsys):
    bad = tmp_path / "bad.mhcbundle"
    bad.write_bytes(b"PK\x03\x04 not really")
    assert cli.main(["repro", str(bad)]) == 2
    assert "not a readable bundle" in capsys.readouterr().err


def test_extension_subcommands_hand_their_arguments_to_the_module(monkeypatch):
    calls = []
    fake = types.SimpleNamespace(main=lambda argv: calls.append(argv) or 7)
    monkeypatch.setattr(cli, "_extension", lambda name: (fake, None))
    assert cli.main(["measure-rsqrt", "--out", "table.i8.zlib"]) == 7
    assert cli.main(["bench", "--m", "1,2", "--help"]) == 7
    assert calls == [["--out", "table.i8.zlib"], ["--m", "1,2", "--help"]]
    with pytest.raises(SystemExit):
        cli.main(["run", "--quick", "--anything"])


def test_missing_extension_module_is_reported(monkeypatch, capsys):
    monkeypatch.setitem(cli.EXTENSIONS, "bench", ("conformance._not_written_yet", "later"))
    assert cli.main(["bench"]) == 2
    assert "conformance._not_written_yet is not part of this installation yet" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", "run", "--quick", "--variant", "residual_only", "--tp", "1", "--list"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("cases (quick)")


def test_bench_results_become_a_latency_plot():
    from conformance.report import RunReport, render_html

    report = RunReport("r", "quick", {}, 0, "gpu", "t0", "t1", {"gpu": None, "versions": {}, "hostname": "h"}, {"total_s": 1.0})
    assert "Latency" not in render_html(report)
    report.bench = {"latency_us": {"tp8 H7168 <script>": [[1, 9.5], [128, 14.0]]}}
    page = render_html(report)
    assert "Latency by M" in page and page.count("<circle") >= 2 and "&lt;script&gt;" in page and "<script>" not in page


def test_contract_compiles_the_shared_coefficient_consumer_where_the_cases_have_it():
    """TP = 1 with hc > 4 has a consumer of its own (ConsumerSpec.coefficients_in_shared): the
    contract compiles it when the cases include such a shape, and only then."""
    from conformance.cases import Filters

    def shared(cases):
        return sorted({(s.hidden_size, s.hc, s.variant.value, s.contribution.value) for s in contract_specs(cases)
                       if getattr(s, "coefficients_in_shared", False)})

    default = preset_cases(Preset.DEFAULT)
    assert shared(default) == [(7168, 8, v, op) for v in ("full", "mxfp8", "residual_only") for op in ("call", "finalize")]
    assert shared(preset_cases(Preset.DEFAULT, Filters(tp=(1,), hc=(4,)))) == []
    assert shared(preset_cases(Preset.DEFAULT, Filters(tp=(2,), hc=(8,)))) == []
    assert shared(preset_cases(Preset.DEFAULT, Filters(tp=(1,), hidden=(5120,), hc=(8,))))[0][:2] == (5120, 8)
