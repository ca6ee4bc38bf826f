"""junit.xml for CI dashboards: one testcase per case, per compiled kernel and per reference check.

A mismatch is a <failure> (first difference and repro command), an exception an <error>, a
case that was not run (no GPU) a <skipped>. The suite conformance.verdict holds one testcase, the
run's verdict: it passes on PASS, fails on FAIL, and on NOT VERIFIED (no kernel case ran) is
skipped, or fails under --require-gpu; its properties carry the verdict and the exit status.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from .report import RunReport, Verdict
from .runner import Status


_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _text(value) -> str:
    """Text XML 1.0 can hold (tracebacks may carry control characters)."""
    return _NOT_XML.sub("?", str(value))


def _testcase(suite: ET.Element, classname: str, name: str, seconds: float) -> ET.Element:
    return ET.SubElement(suite, "testcase", classname=classname, name=name, time=f"{seconds:.4f}")


def build_junit(report: RunReport) -> ET.ElementTree:
    root = ET.Element("testsuites", name="mhc-ar-conformance")
    _verdict_suite(root, report)
    cases = ET.SubElement(root, "testsuite", name=f"conformance.cases.{report.preset}")
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for result in report.cases:
        c = result.case
        element = _testcase(cases, f"conformance.tp{c.tp}.H{c.hidden}", c.id, sum(result.timings.values()))
        counts["tests"] += 1
        if result.status is Status.MISMATCH:
            first = result.first_mismatch
            text = "\n".join([m.describe() + f" [vs {m.oracle}]" for m in result.mismatches] + [f"repro: {c.repro_command}"])
            if result.bundle:
                text += f"\nbundle: {result.bundle} (python -m conformance repro {result.bundle})"
            message = first.describe()
            if result.divergence and result.divergence.get("stage"):
                message += f" | first divergence: {result.divergence['stage']}: {result.divergence['detail']}"
                text = f"first divergence: {result.divergence['stage']}: {result.divergence['detail']}\n" + text
            ET.SubElement(element, "failure", message=_text(message), type="mismatch").text = _text(text)
            counts["failures"] += 1
        elif result.status is Status.ERROR:
            last = (result.error or "error").strip().splitlines()[-1]
            ET.SubElement(element, "error", message=_text(last), type="error").text = _text(f"{result.error}\nrepro: {c.repro_command}")
            counts["errors"] += 1
        elif result.status is Status.NOT_RUN:
            ET.SubElement(element, "skipped", message=result.reason or "not run")
            counts["skipped"] += 1
    cases.attrib.update({k: str(v) for k, v in counts.items()})

    ptx = ET.SubElement(root, "testsuite", name="conformance.ptx_contract")
    counts = {"tests": 0, "failures": 0, "errors": 0}
    for contract in report.compile_checks:
        element = _testcase(ptx, f"conformance.ptx.{contract.arch}", contract.kernel, contract.compile_s)
        counts["tests"] += 1
        if contract.status == "error":
            ET.SubElement(element, "error", message="compile error", type="compile").text = _text(contract.error)
            counts["errors"] += 1
        elif contract.status == "fail":
            failed = [c for c in contract.checks if not c.passed]
            ET.SubElement(element, "failure", message=_text(f"{failed[0].name}: {failed[0].message}"), type="ptx").text = _text(
                "\n".join(f"{c.name}: {c.message}" for c in failed)
            )
            counts["failures"] += 1
    ptx.attrib.update({k: str(v) for k, v in counts.items()})

    reference = ET.SubElement(root, "testsuite", name="conformance.reference_vs_float64")
    counts = {"tests": 0, "failures": 0, "errors": 0}
    for check in report.reference_checks:
        element = _testcase(reference, "conformance.reference_vs_float64", check.case.id, check.seconds)
        counts["tests"] += 1
        if check.status == "error":
            ET.SubElement(element, "error", message="error", type="error").text = _text(check.error)
            counts["errors"] += 1
        elif check.status == "fail":
            ET.SubElement(element, "failure", message=_text(check.summary()), type="float64")
            counts["failures"] += 1
    reference.attrib.update({k: str(v) for k, v in counts.items()})
    return ET.ElementTree(root)


def _verdict_suite(root: ET.Element, report: RunReport) -> None:
    suite = ET.SubElement(root, "testsuite", name="conformance.verdict")
    properties = ET.SubElement(suite, "properties")
    for name, value in (("verdict", report.verdict.label), ("exit_code", report.exit_code), ("require_gpu", report.require_gpu)):
        ET.SubElement(properties, "property", name=name, value=str(value))
    element = _testcase(suite, "conformance.verdict", "verdict", report.timings.get("total_s", 0.0))
    counts = {"tests": 1, "failures": 0, "errors": 0, "skipped": 0}
    summary = _text(report.summary_line())
    if report.verdict is Verdict.FAIL:
        ET.SubElement(element, "failure", message=summary, type="fail")
        counts["failures"] = 1
    elif report.verdict is Verdict.NOT_VERIFIED:
        if report.require_gpu:
            ET.SubElement(element, "failure", message=summary, type="not_verified")
            counts["failures"] = 1
        else:
            ET.SubElement(element, "skipped", message=summary)
            counts["skipped"] = 1
    suite.attrib.update({k: str(v) for k, v in counts.items()})


def write_junit(report: RunReport, path) -> Path:
    path = Path(path)
    tree = build_junit(report)
    ET.indent(tree)
    tree.write(path, encoding="utf-8", xml_declaration=True)
    return path


__all__ = ["build_junit", "write_junit"]
