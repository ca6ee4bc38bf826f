"""`mhc-ar-conformance merge RESULTS.json... --out DIR`: one coverage report over several runs.

A CI fleet runs the gate on several machine kinds (an H200, a GB300, a CPU-only runner); the
merge shows, case by case, what each run verified. Each run is a column group, labelled by its
GPU (or "CPU"), host, commit and run id; each matrix cell lists per run its passed / cases, in
that run's colour. Written: DIR/index.html, DIR/results.json (the merge: the runs, each case's
status per run, counts), DIR/junit.xml (one suite per run). Results of another schema version
are refused with the version each side has. Exit status: 1 if any run has a mismatch or error,
else 0; 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Sequence
import xml.etree.ElementTree as ET

from .cases import OPS, VARIANTS
from .report import _CSS, _e, _status_class
from .schema import RESULTS_SCHEMA, RESULTS_SCHEMA_VERSION, SchemaError, validate

MERGE_SCHEMA_VERSION = 1
_STATUSES = ("pass", "mismatch", "error", "not_run")


def load_results(path: Path) -> dict:
    """A results.json, checked: readable, this schema version, valid; ValueError otherwise."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable results.json ({error})") from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != RESULTS_SCHEMA_VERSION:
        raise ValueError(f"{path}: results schema version {version!r}; this merge reads version {RESULTS_SCHEMA_VERSION} "
                         "(merge it with the mhc-ar that wrote it, or run that gate again)")
    try:
        validate(data, RESULTS_SCHEMA)
    except SchemaError as error:
        raise ValueError(f"{path}: {error}") from None
    return data


def run_label(data: dict) -> str:
    env = data["environment"]
    gpu = env.get("gpu")
    machine = gpu["name"] if gpu else "CPU"
    commit = (env.get("git_commit") or "?")[:10]
    return f"{machine} @ {env.get('hostname', '?')} {commit} ({data['run_id']})"


def merge(results: Sequence[dict]) -> dict:
    """The merged results: runs (label, verdict, environment, counts), and per case id its
    fields and status in each run (absent: not in that run's selection)."""
    runs, cases = [], {}
    for data in results:
        label = run_label(data)
        while label in {r["label"] for r in runs}:
            label += "'"
        runs.append({"label": label, "run_id": data["run_id"], "status": data["status"], "mode": data["mode"],
                     "backend": data["backend"], "environment": data["environment"], "counts": data["counts"]["cases"],
                     "started_at": data["started_at"]})
        for case in data["cases"]:
            entry = cases.setdefault(case["id"], {"case": {k: case[k] for k in ("tp", "hidden", "hc", "m", "op", "variant", "family")},
                                                  "runs": {}})
            entry["runs"][label] = case["status"]
    return {"schema_version": MERGE_SCHEMA_VERSION, "results_schema_version": RESULTS_SCHEMA_VERSION, "runs": runs,
            "cases": cases, "failed": any(r["counts"]["mismatch"] or r["counts"]["error"] for r in runs)}


def render_merged_html(merged: dict) -> str:
    runs = merged["runs"]
    head = "<tr><th>run</th><th>verdict</th><th>judged</th><th>GPU</th><th>torch</th><th>cutlass-dsl</th><th>commit</th><th>started</th>" + \
        "".join(f"<th>{s}</th>" for s in _STATUSES) + "</tr>"
    rows = []
    for i, run in enumerate(runs):
        env = run["environment"]
        gpu = env.get("gpu")
        verdict = run["status"].replace("_", " ").upper()
        css = {"pass": "pass", "fail": "fail"}.get(run["status"], "unverified")
        rows.append(
            f"<tr><th>R{i + 1}: {_e(run['label'])}</th><td class=\"{css}\">{_e(verdict)}</td><td>{_e(run['backend'])}</td>"
            f"<td>{_e(gpu['name'] + ' (sm ' + gpu['capability'] + ')' if gpu else 'none')}</td>"
            f"<td>{_e(env['versions'].get('torch'))}</td><td>{_e(env['versions'].get('cutlass_dsl'))}</td>"
            f"<td>{_e(env.get('git_commit'))}</td><td>{_e(run['started_at'])}</td>"
            + "".join(f'<td class="num">{run["counts"][s]}</td>' for s in _STATUSES) + "</tr>"
        )
    cells = defaultdict(lambda: defaultdict(list))  # (tp, H, hc, variant, op) -> run label -> statuses
    shapes, hcs = set(), set()
    for entry in merged["cases"].values():
        c = entry["case"]
        shapes.add((c["tp"], c["hidden"]))
        hcs.add(c["hc"])
        for label, status in entry["runs"].items():
            cells[(c["tp"], c["hidden"], c["hc"], c["variant"], c["op"])][label].append(status)
    variants = [v.value for v in VARIANTS if any(k[3] == v.value for k in cells)]
    ops = [o.value for o in OPS if any(k[4] == o.value for k in cells)]
    tables = []
    for hc in sorted(hcs):
        t = [f'<table class="matrix"><tr><th colspan="2">hc = {hc}</th>']
        t += [f'<th colspan="{len(ops)}">{_e(v)}</th>' for v in variants]
        t.append("</tr><tr><th>TP</th><th>H</th>" + "".join(f"<th>{_e(o)}</th>" for _ in variants for o in ops) + "</tr>")
        for tp, hidden in sorted(shapes):
            if not any(cells.get((tp, hidden, hc, v, o)) for v in variants for o in ops):
                continue
            t.append(f"<tr><th>{tp}</th><th>{hidden}</th>")
            for v in variants:
                for o in ops:
                    per_run = cells.get((tp, hidden, hc, v, o), {})
                    parts = []
                    for i, run in enumerate(runs):
                        statuses = per_run.get(run["label"])
                        if statuses:
                            passed = statuses.count("pass")
                            parts.append(f'<div class="{_status_class(statuses)}">R{i + 1} {passed}/{len(statuses)}</div>')
                    t.append(f'<td>{"".join(parts)}</td>' if parts else '<td class="empty"></td>')
            t.append("</tr>")
        t.append("</table>")
        tables.append("".join(t))
    failures = []
    for case_id, entry in merged["cases"].items():
        bad = [(label, s) for label, s in entry["runs"].items() if s in ("mismatch", "error")]
        if bad:
            failures.append(f"<li><code>{_e(case_id)}</code>: " + "; ".join(f"{_e(s)} on {_e(label)}" for label, s in bad) + "</li>")
    failed = f"<h2>Failures ({len(failures)})</h2><ul>{''.join(failures)}</ul>" if failures else "<h2>Failures</h2><p>none</p>"
    verdict = "FAIL" if merged["failed"] else "merged"
    return (
        f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>mhc-ar conformance: {len(runs)} runs merged</title>"
        f"<style>{_CSS}</style></head><body>"
        f"<h1>mhc-ar conformance: {len(runs)} runs merged</h1>"
        f'<p><span class="badge verdict {"fail" if merged["failed"] else "pass"}">{verdict}</span> {len(merged["cases"])} distinct cases;'
        " each run's own verdict below (NOT VERIFIED: that run ran no kernel case)</p>"
        f"<h2>Runs</h2><table>{head}{''.join(rows)}</table>"
        '<h2>Coverage matrix</h2><p class="legend small"><span class="pass">all pass</span><span class="fail">any mismatch or '
        'error</span><span class="notrun">not run</span><span class="partial">partly run</span> each cell: per run (R1, R2, ...)'
        " passed / cases over its M values and input families; a run that did not select the shape is left out</p>"
        f'<div class="matrices">{"".join(tables)}</div>{failed}'
        "</body></html>"
    )


def write_merged_junit(merged: dict, path: Path) -> None:
    root = ET.Element("testsuites", name="mhc-ar-conformance-merge")
    for run in merged["runs"]:
        suite = ET.SubElement(root, "testsuite", name=f"conformance.merge.{run['label']}")
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        for case_id, entry in merged["cases"].items():
            status = entry["runs"].get(run["label"])
            if status is None:
                continue
            element = ET.SubElement(suite, "testcase", classname=f"conformance.tp{entry['case']['tp']}.H{entry['case']['hidden']}", name=case_id)
            counts["tests"] += 1
            if status == "mismatch":
                ET.SubElement(element, "failure", message=f"mismatch on {run['label']}", type="mismatch")
                counts["failures"] += 1
            elif status == "error":
                ET.SubElement(element, "error", message=f"error on {run['label']}", type="error")
                counts["errors"] += 1
            elif status == "not_run":
                ET.SubElement(element, "skipped", message=f"not run on {run['label']}")
                counts["skipped"] += 1
        suite.attrib.update({k: str(v) for k, v in counts.items()})
    tree = ET.ElementTree(root)
    ET.indent(tree)
    tree.write(path, encoding="utf-8", xml_declaration=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mhc-ar-conformance merge", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json files of earlier runs")
    parser.add_argument("--out", type=Path, required=True, help="folder for index.html, results.json, junit.xml")
    args = parser.parse_args(argv)
    try:
        loaded = [load_results(path) for path in args.results]
        if args.out.exists() and not args.out.is_dir():
            raise ValueError(f"--out {args.out}: exists and is not a directory")
    except ValueError as error:
        print(f"mhc-ar-conformance merge: {error}", file=sys.stderr)
        return 2
    merged = merge(loaded)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(merged, indent=1))
    (args.out / "index.html").write_text(render_merged_html(merged), encoding="utf-8")
    write_merged_junit(merged, args.out / "junit.xml")
    counts = {s: sum(r["counts"][s] for r in merged["runs"]) for s in _STATUSES}
    print(f"{'FAIL' if merged['failed'] else 'MERGED'} mhc-ar conformance merge: {len(merged['runs'])} runs, "
          f"{len(merged['cases'])} distinct cases | " + ", ".join(f"{counts[s]} {s.replace('_', ' ')}" for s in _STATUSES)
          + " (over all runs)")
    print(f"report: {args.out / 'index.html'}  results: {args.out / 'results.json'}  junit: {args.out / 'junit.xml'}")
    return 1 if merged["failed"] else 0


__all__ = ["load_results", "main", "merge", "render_merged_html", "run_label"]
