"""Reports of a run: results.json (machine-readable, see conformance.schema) and index.html.

index.html is one self-contained file (inline CSS and inline SVG, no script, no network) that
reads well opened from disk: counts, environment, the coverage matrix (TP x H rows, hc x
variant x op columns, each cell passed/total over its M values and families), per-M and
per-family tables, the PTX contract per arch and kernel, the reference-vs-float64 checks, the
failures with links to their bundles and repro commands, and a time-per-case plot (drawn by
conformance.plots, which the bench report uses too).
"""

from __future__ import annotations

import enum
import html
import json
import shlex
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from .cases import FAMILIES, OPS, VARIANTS
from .plots import line_plot_svg
from .ptx_contract import KernelContract
from .reference_checks import ULP_BOUND, ReferenceCheck
from .runner import CaseResult, Status
from .schema import RESULTS_SCHEMA_VERSION


# Exit status of `mhc-ar-conformance run` (documented in its --help and in README).
EXIT_PASS = 0  # no mismatch, error or failed check (the verdict says PASS, or NOT VERIFIED without --require-gpu)
EXIT_FAIL = 1  # a mismatch, an error or a failed check
EXIT_USAGE = 2  # bad usage: nothing ran
EXIT_NOT_VERIFIED = 3  # --require-gpu, and no kernel case ran


class Verdict(str, enum.Enum):
    """What a run verified: PASS needs at least one kernel case run and equal to the reference."""

    PASS = "pass"
    FAIL = "fail"
    NOT_VERIFIED = "not_verified"

    @property
    def label(self) -> str:
        return self.value.replace("_", " ").upper()


@dataclass
class RunReport:
    run_id: str
    preset: str
    filters: dict
    seed_offset: int
    mode: str  # gpu | cpu
    started_at: str
    finished_at: str
    environment: dict
    timings: dict
    cases: list[CaseResult] = field(default_factory=list)
    compile_checks: list[KernelContract] = field(default_factory=list)
    reference_checks: list[ReferenceCheck] = field(default_factory=list)
    # Filled by `mhc-ar-conformance bench`: {"latency_us": {series label: [[M, microseconds], ...]}}
    # is drawn as a latency-vs-M plot; the rest is kept in results.json as it is.
    bench: dict | None = None
    # --require-gpu: a run in which no kernel case ran exits EXIT_NOT_VERIFIED.
    require_gpu: bool = False
    # What played the kernel: "kernels" (the GPU kernels, or nothing without a GPU), or
    # "reference" (the reference with planted flips, run --plant): then nothing is PASS.
    backend: str = "kernels"
    plants: list[str] = field(default_factory=list)  # the run's --plant values

    def case_counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in Status}
        for result in self.cases:
            counts[result.status.value] += 1
        return {"total": len(self.cases), **counts}

    def compile_counts(self) -> dict[str, int]:
        return _tally((c.status for c in self.compile_checks), ("pass", "fail", "error"))

    def reference_counts(self) -> dict[str, int]:
        return _tally((c.status for c in self.reference_checks), ("pass", "fail", "error"))

    @property
    def verdict(self) -> Verdict:
        """FAIL on any mismatch, error or failed check; otherwise NOT VERIFIED unless at least one
        kernel case ran (and, as everything that ran, matched); otherwise PASS."""
        cases = self.case_counts()
        bad = cases["mismatch"] + cases["error"]
        bad += sum(v for k, v in self.compile_counts().items() if k in ("fail", "error"))
        bad += sum(v for k, v in self.reference_counts().items() if k in ("fail", "error"))
        if bad:
            return Verdict.FAIL
        judged = self.backend == "kernels" or self.backend.startswith("impl:")
        return Verdict.PASS if cases["pass"] and judged else Verdict.NOT_VERIFIED

    @property
    def exit_code(self) -> int:
        verdict = self.verdict
        if verdict is Verdict.FAIL:
            return EXIT_FAIL
        if verdict is Verdict.NOT_VERIFIED and self.require_gpu:
            return EXIT_NOT_VERIFIED
        return EXIT_PASS

    def not_verified_reason(self) -> str:
        """Why no kernel case ran (the reasons of the cases not run), for the summary line."""
        if self.backend == "reference":
            return "the reference backend played the kernel"
        reasons = sorted({r.reason or "not run" for r in self.cases if r.status is Status.NOT_RUN})
        if not self.cases:
            return "no case selected"
        return "; ".join(reasons) if reasons else "no kernel case ran"

    def to_dict(self) -> dict:
        return _json_safe(
            {
                "schema_version": RESULTS_SCHEMA_VERSION,
                "run_id": self.run_id,
                "preset": self.preset,
                "filters": self.filters,
                "seed_offset": self.seed_offset,
                "mode": self.mode,
                "started_at": self.started_at,
                "finished_at": self.finished_at,
                "environment": self.environment,
                "timings": {k: round(v, 4) for k, v in self.timings.items()},
                "counts": {
                    "cases": self.case_counts(),
                    "compile_checks": self.compile_counts(),
                    "reference_checks": self.reference_counts(),
                },
                "status": self.verdict.value,
                "require_gpu": self.require_gpu,
                "backend": self.backend,
                "exit_code": self.exit_code,
                "cases": [r.to_dict() for r in self.cases],
                "compile_checks": [c.to_dict() for c in self.compile_checks],
                "reference_checks": [c.to_dict() for c in self.reference_checks],
                "bench": self.bench,
            }
        )

    def summary_line(self) -> str:
        c = self.case_counts()
        k = self.compile_counts()
        r = self.reference_counts()
        line = (
            f"{self.verdict.label} mhc-ar conformance {self.run_id} ({self.preset}, {self.mode}): {c['total']} cases: "
            f"{c['pass']} pass, {c['mismatch']} mismatch, {c['error']} error, {c['not_run']} not run | "
            f"PTX contract {k['pass']}/{k['total']} kernels | reference vs float64 {r['pass']}/{r['total']} | "
            f"{self.timings.get('total_s', 0.0):.1f} s"
        )
        if self.verdict is Verdict.NOT_VERIFIED:
            line += f" | no kernel case ran ({self.not_verified_reason()})"
        return line


def _tally(statuses: Iterable[str], keys: Sequence[str]) -> dict[str, int]:
    counts = {k: 0 for k in keys}
    total = 0
    for status in statuses:
        counts[status] = counts.get(status, 0) + 1
        total += 1
    return {"total": total, **counts}


def _json_safe(value):
    """JSON has no NaN/Inf: non-finite floats become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_results_json(report: RunReport, path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(report.to_dict(), indent=1, allow_nan=False))
    return path


# ----- HTML ---------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,sans-serif;margin:1.5em;color:#222;max-width:1500px}
h1{font-size:1.5em;margin:0 0 .3em} h2{font-size:1.2em;margin:1.6em 0 .5em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:.4em 0} th,td{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}
th{background:#f3f3f3;font-weight:600} td.num{text-align:right}
.matrix td{text-align:center;min-width:3.2em;font-variant-numeric:tabular-nums;vertical-align:top}
.matrices{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start} .matrices table{margin:0}
.matrix details div{font-size:11px;white-space:nowrap;text-align:left} .matrix summary{cursor:pointer}
.pass{background:#c8ecc8} .fail{background:#f4b6b6;font-weight:600} .notrun{background:#e2e2e2;color:#555}
.partial{background:#f6e7b0} .empty{background:#fff}
.badge{display:inline-block;padding:3px 10px;border-radius:10px;margin-right:6px;font-weight:600}
.verdict{font-size:1.1em;padding:4px 14px}
.unverified{background:#f6c26b;color:#4a2c00} .unverified-note{background:#fff4de;border-left:4px solid #f6a623;padding:6px 10px}
code,pre{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
pre{background:#f7f7f7;padding:6px;overflow-x:auto;max-height:20em}
details{margin:.3em 0} summary{cursor:pointer}
.legend span{display:inline-block;padding:0 8px;margin-right:6px;border:1px solid #ccc}
.small{color:#666;font-size:12px} .scroll{overflow-x:auto}
"""


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _status_class(statuses: Sequence[str]) -> str:
    if not statuses:
        return "empty"
    if any(s in ("mismatch", "error", "fail") for s in statuses):
        return "fail"
    if all(s == "not_run" for s in statuses):
        return "notrun"
    if all(s == "pass" for s in statuses):
        return "pass"
    return "partial"


def _badge(label: str, count: int, css: str) -> str:
    return f'<span class="badge {css}">{_e(label)}: {count}</span>'


def _header(report: RunReport) -> str:
    c = report.case_counts()
    k = report.compile_counts()
    r = report.reference_counts()
    verdict = report.verdict
    css = {Verdict.PASS: "pass", Verdict.FAIL: "fail", Verdict.NOT_VERIFIED: "unverified"}[verdict]
    gpu = report.environment.get("gpu")
    where = f"GPU: {gpu['name']} (sm {gpu['capability']})" if gpu else "no GPU: kernels compiled and PTX-checked, not run"
    if report.backend == "reference":
        where = f"no kernel ran: the reference played it, with planted flips {', '.join(report.plants) or 'none'}"
    elif report.backend.startswith("impl:"):
        where = f"implementation judged: {report.backend.removeprefix('impl:')} (on {report.mode})"
    parts = [
        f"<h1>mhc-ar conformance: run {_e(report.run_id)}</h1>",
        f'<p><span class="badge verdict {css}">{verdict.label}</span>'
        f" preset <b>{_e(report.preset)}</b>, {_e(where)}, total {report.timings.get('total_s', 0.0):.1f} s,"
        f" started {_e(report.started_at)}</p>",
        *([f'<p class="unverified-note">NOT VERIFIED: no kernel case ran ({_e(report.not_verified_reason())}). '
           "Nothing here says the kernels are right; run on a GPU (with --require-gpu in CI).</p>"]
          if verdict is Verdict.NOT_VERIFIED else []),
        "<p>",
        _badge("pass", c["pass"], "pass"),
        _badge("mismatch", c["mismatch"], "fail" if c["mismatch"] else "empty"),
        _badge("error", c["error"], "fail" if c["error"] else "empty"),
        _badge("not run", c["not_run"], "notrun"),
        f" of {c['total']} cases &nbsp;|&nbsp; PTX contract: {k['pass']}/{k['total']} kernels pass"
        f" &nbsp;|&nbsp; reference vs float64: {r['pass']}/{r['total']} pass</p>",
    ]
    if report.filters:
        filters = ", ".join(f"{k}={','.join(map(str, v))}" for k, v in report.filters.items())
        parts.append(f'<p class="small">filters: {_e(filters)}; seed offset {report.seed_offset}</p>')
    timings = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in report.timings.items())
    parts.append(f'<p class="small">time: {_e(timings)}</p>')
    return "\n".join(parts)


def _environment(report: RunReport) -> str:
    env = report.environment
    rows = []
    gpu = env.get("gpu")
    if gpu:
        rows += [("GPU", gpu.get("name")), ("compute capability", gpu.get("capability")), ("driver", gpu.get("driver")),
                 ("CUDA runtime", gpu.get("cuda_runtime"))]
    else:
        rows.append(("GPU", "none"))
    for name, version in env.get("versions", {}).items():
        rows.append((name, version))
    rows += [("host", env.get("hostname")), ("platform", env.get("platform")), ("git commit", env.get("git_commit"))]
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    return f"<h2>Environment</h2><table>{body}</table>"


def _coverage_matrix(results: Sequence[CaseResult]) -> str:
    """One table per hc value (side by side where the window is wide enough): TP x H rows,
    variant x op columns; each cell passed / cases, opening (a click, no hover) to its cases."""
    cells = defaultdict(list)
    rows, hcs = set(), set()
    for r in results:
        c = r.case
        rows.add((c.tp, c.hidden))
        hcs.add(c.hc)
        cells[(c.tp, c.hidden, c.hc, c.variant, c.op)].append(r)
    rows, hcs = sorted(rows), sorted(hcs)
    variants = [v for v in VARIANTS if any(r.case.variant is v for r in results)]
    ops = [o for o in OPS if any(r.case.op is o for r in results)]
    tables = []
    for hc in hcs:
        head = [f'<tr><th colspan="2">hc = {hc}</th>']
        head += [f'<th colspan="{len(ops)}">{_e(v.value)}</th>' for v in variants]
        head.append("</tr><tr><th>TP</th><th>H</th>")
        head += [f"<th>{_e(o.value)}</th>" for _ in variants for o in ops]
        head.append("</tr>")
        body = []
        for tp, hidden in rows:
            if not any(cells.get((tp, hidden, hc, v, o)) for v in variants for o in ops):
                continue
            body.append(f"<tr><th>{tp}</th><th>{hidden}</th>")
            body += [_matrix_cell(cells.get((tp, hidden, hc, v, o), [])) for v in variants for o in ops]
            body.append("</tr>")
        tables.append(f'<table class="matrix">{"".join(head)}{"".join(body)}</table>')
    legend = (
        '<p class="legend small"><span class="pass">all pass</span><span class="fail">any mismatch or error</span>'
        '<span class="notrun">not run</span><span class="partial">partly run</span>'
        " each cell: passed / cases over its M values and input families; click a cell for its cases</p>"
    )
    return f'<h2>Coverage matrix</h2>{legend}<div class="matrices">{"".join(tables)}</div>'


def _matrix_cell(group: Sequence[CaseResult]) -> str:
    if not group:
        return '<td class="empty"></td>'
    statuses = [r.status.value for r in group]
    passed = statuses.count("pass")
    lines = "".join(
        f"<div>M={r.case.m} {_e(r.case.family.value)}: {_e(r.status.value)}</div>" for r in sorted(group, key=lambda r: r.case.m)
    )
    return f'<td class="{_status_class(statuses)}"><details><summary>{passed}/{len(group)}</summary>{lines}</details></td>'


def _breakdown(results: Sequence[CaseResult], key, label: str, order: Sequence, other: tuple[str, object]) -> str:
    """Counts by one axis; `other` (column title, case -> value) lists what else each row covers."""
    other_title, other_value = other
    groups = defaultdict(list)
    for r in results:
        groups[key(r.case)].append(r)
    rows = []
    for value in [v for v in order if v in groups]:
        group = groups[value]
        counts = {s.value: sum(1 for r in group if r.status is s) for s in Status}
        covered = sorted({other_value(r.case) for r in group})
        css = _status_class([r.status.value for r in group])
        rows.append(
            f'<tr><th>{_e(getattr(value, "value", value))}</th><td class="num {css}">{len(group)}</td>'
            + "".join(f'<td class="num">{counts[s.value]}</td>' for s in Status)
            + f'<td class="small">{_e(", ".join(map(str, covered)))}</td></tr>'
        )
    head = f"<tr><th>{_e(label)}</th><th>cases</th>" + "".join(f"<th>{_e(s.value)}</th>" for s in Status)
    head += f"<th>{_e(other_title)}</th></tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def _ptx_section(contracts: Sequence[KernelContract]) -> str:
    if not contracts:
        return "<h2>PTX contract</h2><p>not checked in this run</p>"
    archs = list(dict.fromkeys(c.arch for c in contracts))
    kernels = list(dict.fromkeys(c.kernel for c in contracts))
    by = {(c.arch, c.kernel): c for c in contracts}
    head = "<tr><th>kernel (variant, shape)</th>" + "".join(f"<th>{_e(a)}</th>" for a in archs) + "</tr>"
    rows = []
    for kernel in kernels:
        row = f"<tr><th>{_e(kernel)}</th>"
        for arch in archs:
            c = by.get((arch, kernel))
            if c is None:
                row += '<td class="empty"></td>'
                continue
            passed = sum(ch.passed for ch in c.checks)
            failed = [ch.name for ch in c.checks if not ch.passed]
            text = "compile error" if c.status == "error" else f"{passed}/{len(c.checks)}"
            link = f' <a href="{_e(c.ptx_file)}">ptx</a>' if c.ptx_file else ""
            why = f'<div class="small">{_e("; ".join(failed))}</div>' if failed else ""
            row += f'<td class="{_status_class([c.status])}">{_e(text)}{link}{why}</td>'
        rows.append(row + "</tr>")
    details = []
    for c in contracts:
        items = "".join(
            f'<tr><td class="{"pass" if ch.passed else "fail"}">{"pass" if ch.passed else "FAIL"}</td>'
            f"<td>{_e(ch.name)}</td><td><code>{_e(ch.message)}</code></td></tr>"
            for ch in c.checks
        )
        error = f"<pre>{_e(c.error)}</pre>" if c.error else ""
        open_attr = " open" if c.status != "pass" else ""
        details.append(
            f"<details{open_attr}><summary>{_e(c.arch)} {_e(c.kernel)}: {_e(c.status)} "
            f"({c.compile_s:.2f} s)</summary>{error}<table>{items}</table></details>"
        )
    failing = sum(c.status != "pass" for c in contracts)
    return (
        "<h2>PTX contract</h2><p class=\"small\">every kernel variant of the reference shape and of the run's own"
        " shapes, compiled for every target arch; each cell: checks passed / checks, the failed ones named</p>"
        f"<table>{head}{''.join(rows)}</table>"
        f"<details{' open' if failing else ''}><summary>every check of every kernel ({len(contracts)} compiles,"
        f" {failing} not passing)</summary>{''.join(details)}</details>"
    )


def _reference_section(checks: Sequence[ReferenceCheck]) -> str:
    if not checks:
        return "<h2>Reference vs float64 model</h2><p>not checked in this run</p>"
    stages = list(dict.fromkeys(s.stage for c in checks for s in c.stages))
    families = [f for f in FAMILIES if any(c.case.family is f for c in checks)]
    head = "<tr><th>family</th><th>cases</th>" + "".join(f"<th>{_e(s)}</th>" for s in stages) + "</tr>"
    rows = []
    for family in families:
        group = [c for c in checks if c.case.family is family]
        row = f'<tr><th>{_e(family.value)}</th><td class="num {_status_class([c.status for c in group])}">{len(group)}</td>'
        for stage in stages:
            results = [s for c in group for s in c.stages if s.stage == stage]
            if not results:
                row += '<td class="empty"></td>'
                continue
            judged = [s for s in results if s.judged]
            if judged and not all(s.passed for s in judged):
                css = "fail"
            else:  # green only if every case of the cell was judged (and passed)
                css = "notrun" if not judged else ("pass" if len(judged) == len(results) else "partial")
            text = f"{max(s.max_unexplained_ulps for s in results)} / {max(s.max_ulps for s in results)} ulp"
            if len(judged) < len(results):
                text += " (not judged)" if not judged else f" ({len(results) - len(judged)} of {len(results)} not judged)"
            notes = sorted({s.note for s in results if s.note})
            row += f'<td class="{css}" title="{_e(chr(10).join(notes))}">{_e(text)}</td>'
        rows.append(row + "</tr>")
    per_case = "".join(
        f'<tr><td class="{_status_class([c.status])}">{_e(c.status)}</td><td><code>{_e(c.case.id)}</code></td>'
        f'<td class="num">{c.seconds:.2f}</td><td class="small">{_e(c.summary() if c.status != "pass" else "")}</td></tr>'
        for c in checks
    )
    explanation = (
        '<p class="small">each cell: largest distance from the float64 model beyond the fp32 chain\'s own error'
        " bound / largest raw distance, in bf16 ulps (e4m3 codes, scale steps), over the family's cases; a stage"
        f" passes within {ULP_BOUND} unexplained ulp and with NaN/Inf at the same places. Hover for notes.</p>"
    )
    return (
        f"<h2>Reference vs float64 model</h2>{explanation}<table>{head}{''.join(rows)}</table>"
        f"<details><summary>every checked case ({len(checks)})</summary><table><tr><th>status</th><th>case</th>"
        f"<th>s</th><th>detail</th></tr>{per_case}</table></details>"
    )


def _divergence_section(results: Sequence[CaseResult]) -> str:
    """Mismatching cases by the first stage that differs (conformance.divergence), with what
    they cover, and the distances of their differing elements per output."""
    found = [r for r in results if r.divergence]
    if not found:
        return ""
    from .divergence import STAGES, ULP_BINS

    rows = []
    for stage in [*STAGES, None]:
        group = [r for r in found if r.divergence["stage"] == stage]
        if not group:
            continue
        covered = "; ".join(
            f"{label} {', '.join(map(str, sorted({key(r.case) for r in group})))}"
            for label, key in (("M", lambda c: c.m), ("hc", lambda c: c.hc), ("TP", lambda c: c.tp), ("op", lambda c: c.op.value))
        )
        example = group[0].divergence["detail"]
        rows.append(f'<tr><th>{_e(stage or "none")}</th><td class="num fail">{len(group)}</td><td class="small">{_e(covered)}</td>'
                    f'<td class="small">{_e(group[0].case.id)}: {_e(example)}</td></tr>')
    totals = defaultdict(lambda: dict.fromkeys(ULP_BINS, 0))
    for r in found:
        for output, bins in r.divergence["ulps"].items():
            for name, count in bins.items():
                totals[output][name] += count
    ulp_rows = "".join(
        f"<tr><th>{_e(output)}</th>" + "".join(f'<td class="num">{bins[name]}</td>' for name in ULP_BINS) + "</tr>"
        for output, bins in totals.items()
    )
    plots = []
    for label, key in (("M", lambda c: c.m), ("hc", lambda c: c.hc), ("TP", lambda c: c.tp)):
        series = {}
        for stage in STAGES:
            counts = defaultdict(int)
            for r in found:
                if r.divergence["stage"] == stage:
                    counts[key(r.case)] += 1
            if counts:
                series[stage] = sorted(counts.items())
        plots.append(line_plot_svg(series, x_label=label, y_label="mismatching cases", log_x=label == "M", width=460, height=260))
    return (
        "<h2>First divergence</h2><p class=\"small\">each mismatching case by the first stage whose value differs,"
        " found from its outputs and the reference's intermediates (conformance.divergence)</p>"
        f"<table><tr><th>stage</th><th>cases</th><th>covering</th><th>first case</th></tr>{''.join(rows)}</table>"
        "<p class=\"small\">differing elements by distance, in units in the last place of each output's format</p>"
        f"<table><tr><th>output</th>{''.join(f'<th>{_e(b)} ulp</th>' for b in ULP_BINS)}</tr>{ulp_rows}</table>"
        "<p class=\"small\">mismatching cases by first divergent stage, against M, hc and TP</p>"
        f'<div class="matrices">{"".join(plots)}</div>'
    )


def replay_command(bundle: str, run_dir: Path | None = None) -> str:
    """The shell line that replays a bundle (a path relative to the run folder)."""
    path = str(run_dir / bundle) if run_dir is not None else bundle
    return f"python -m conformance repro {shlex.quote(path)}"


def rerun_command(report: RunReport, case) -> str:
    """The shell line that runs one case again (with the run's planted flips, if any)."""
    return case.repro_command + "".join(f" --plant {shlex.quote(p)}" for p in report.plants)


def _failures(report: RunReport, run_dir: Path | None = None) -> str:
    items = []
    for r in report.cases:
        if r.status not in (Status.MISMATCH, Status.ERROR):
            continue
        detail = ""
        if r.mismatches:
            detail = "<ul>" + "".join(f"<li><code>{_e(m.describe())}</code> [vs {_e(m.oracle)}]</li>" for m in r.mismatches[:8]) + "</ul>"
        if r.error:
            detail += f"<pre>{_e(r.error[-3000:])}</pre>"
        bundle = f' <a href="{_e(r.bundle)}">bundle</a>' if r.bundle else ""
        repro = replay_command(r.bundle, run_dir) if r.bundle else ""
        items.append(
            f'<li><span class="badge fail">{_e(r.status.value)}</span><code>{_e(r.case.id)}</code>{bundle}'
            f"{detail}<div>re-run: <code>{_e(rerun_command(report, r.case))}</code></div>"
            + (f"<div>replay: <code>{_e(repro)}</code></div>" if repro else "")
            + "</li>"
        )
    for c in report.compile_checks:
        if c.status != "pass":
            failed = "; ".join(f"{ch.name}: {ch.message}" for ch in c.checks if not ch.passed) or (c.error or "")[-500:]
            items.append(f'<li><span class="badge fail">PTX {_e(c.status)}</span><code>{_e(c.arch)} {_e(c.kernel)}</code>: {_e(failed)}</li>')
    for c in report.reference_checks:
        if c.status != "pass":
            items.append(f'<li><span class="badge fail">reference {_e(c.status)}</span><code>{_e(c.summary())}</code></li>')
    if not items:
        return "<h2>Failures</h2><p>none</p>"
    return f"<h2>Failures ({len(items)})</h2><ul>{''.join(items)}</ul>"


def _median_by_m(points: Iterable[tuple[int, float]]) -> list[tuple[int, float]]:
    by_m = defaultdict(list)
    for m, value in points:
        by_m[m].append(value)
    return [(m, statistics.median(values)) for m, values in sorted(by_m.items())]


def _timing_plot(report: RunReport) -> str:
    """Median time per case by M, one line per kind of work (log-log)."""
    series = {}
    for label, points in (
        ("kernels on the GPU (CUDA events)", [(r.case.m, 1e3 * r.timings["kernel_gpu_s"]) for r in report.cases if "kernel_gpu_s" in r.timings]),
        ("kernel call on the host, incl. sync", [(r.case.m, 1e3 * r.timings["kernel_s"]) for r in report.cases if "kernel_s" in r.timings]),
        ("reference, same device", [(r.case.m, 1e3 * r.timings["reference_s"]) for r in report.cases if "reference_s" in r.timings]),
        ("reference + float64 check", [(c.case.m, 1e3 * c.seconds) for c in report.reference_checks if c.seconds > 0]),
    ):
        if points:
            series[label] = _median_by_m(points)
    if not series:
        return ""
    plot = line_plot_svg(series, x_label="M (tokens)", y_label="median ms per case", log_x=True, log_y=True)
    what = (
        '<p class="small">median over the cases of each M, in milliseconds, log-log. "kernels on the GPU": CUDA'
        " events around one emulated call (every rank's publish and consumer, one stream; the first call of an"
        ' instance includes its compile); "on the host": the same call timed on the host until synchronized;'
        " the reference lines: the PyTorch reference on the run's device, and with its float64 check. Not a"
        " benchmark (see mhc-ar-conformance bench).</p>"
    )
    return f"<h2>Time per case by M</h2>{what}{plot}"


def _bench_plot(report: RunReport) -> str:
    latency = (report.bench or {}).get("latency_us")
    if not isinstance(latency, dict) or not latency:
        return ""
    series = {str(label): [(float(m), float(us)) for m, us in points] for label, points in latency.items()}
    plot = line_plot_svg(series, x_label="M (tokens)", y_label="latency (us)", log_x=True, log_y=True)
    return f"<h2>Latency by M</h2>{plot}"


def render_html(report: RunReport, run_dir: Path | None = None) -> str:
    """The page; with run_dir (where it is written) the replay hints carry absolute bundle paths,
    so they paste into any shell."""
    results = report.cases
    body = [
        _header(report),
        _environment(report),
        _coverage_matrix(results) if results else "<h2>Coverage matrix</h2><p>no cases</p>",
        "<h2>By token count M</h2>",
        _breakdown(results, lambda c: c.m, "M", sorted({r.case.m for r in results}), ("input families", lambda c: c.family.value)),
        "<h2>By input family</h2>",
        _breakdown(results, lambda c: c.family, "family", FAMILIES, ("token counts M", lambda c: c.m)),
        _ptx_section(report.compile_checks),
        _reference_section(report.reference_checks),
        _divergence_section(results),
        _failures(report, run_dir),
        _timing_plot(report),
        _bench_plot(report),
        '<p class="small">results.json holds everything on this page; junit.xml one test case per case and check.</p>',
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>mhc-ar conformance {_e(report.run_id)}</title><style>{_CSS}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )


def write_html(report: RunReport, path) -> Path:
    path = Path(path)
    path.write_text(render_html(report, path.parent.resolve()), encoding="utf-8")
    return path


__all__ = ["RunReport", "render_html", "write_html", "write_results_json"]
