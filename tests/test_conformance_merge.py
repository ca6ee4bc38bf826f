"""`mhc-ar-conformance merge`: one coverage report over three runs' results.json (a CPU run that
verified nothing, a passing run, a run with mismatches), on the CPU."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from conformance import cli

FAST = ["--no-progress", "--skip-compile-checks", "--skip-reference-checks"]


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    assert cli.main(["run", "--quick", "--tp", "1,2", "--device", "cpu", "--out", str(out), "--run-id", "cpu", *FAST]) == 0
    assert cli.main(["run", "--quick", "--tp", "2,4", "--impl", "reference", "--device", "cpu", "--out", str(out), "--run-id", "ref", *FAST]) == 0
    assert cli.main(["run", "--quick", "--tp", "2", "--plant", "layer_input@1:9", "--out", str(out), "--run-id", "planted", *FAST]) == 1
    return out


def test_merge_shows_every_run_per_cell(three_runs, tmp_path, capsys):
    files = [str(three_runs / name / "results.json") for name in ("cpu", "ref", "planted")]
    capsys.readouterr()
    code = cli.main(["merge", *files, "--out", str(tmp_path / "m")])
    out = capsys.readouterr().out
    print(out.splitlines()[0])
    assert code == 1 and out.startswith("FAIL mhc-ar conformance merge: 3 runs, ")
    merged = json.loads((tmp_path / "m" / "results.json").read_text())
    assert [r["status"] for r in merged["runs"]] == ["not_verified", "pass", "fail"]
    tp2 = {i: e for i, e in merged["cases"].items() if i.startswith("tp2-")}
    assert tp2 and all(len(e["runs"]) == 3 for e in tp2.values())  # tp 2 is in every run's selection
    assert all(len(e["runs"]) == 1 for i, e in merged["cases"].items() if i.startswith(("tp1-", "tp4-")))
    statuses = {s for e in tp2.values() for s in e["runs"].values()}
    assert statuses == {"not_run", "pass", "mismatch"}
    page = (tmp_path / "m" / "index.html").read_text()
    assert "3 runs merged" in page and "NOT VERIFIED" in page and "impl:reference" in page
    assert '<div class="notrun">R1 0/1</div><div class="pass">R2 1/1</div>' in page and '<div class="fail">R3 0/1</div>' in page
    suites = ET.parse(tmp_path / "m" / "junit.xml").getroot().findall("testsuite")
    assert len(suites) == 3 and int(suites[2].get("failures")) > 0 and int(suites[0].get("skipped")) == int(suites[0].get("tests"))


def test_merge_refuses_another_schema_version(three_runs, tmp_path, capsys):
    data = json.loads((three_runs / "cpu" / "results.json").read_text())
    data["schema_version"] = 1
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    code = cli.main(["merge", str(old), str(three_runs / "ref" / "results.json"), "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    print(err.strip())
    assert code == 2 and "results schema version 1; this merge reads version 2" in err
    assert not (tmp_path / "m").exists()
