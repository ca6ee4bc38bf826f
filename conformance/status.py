"""The status of a check: a kernel's PTX contract, or a reference-vs-float64 check.

A str enum, so a status compares equal to its string and serializes as it: results.json, JUnit
and the HTML report read the same whether a check holds the enum or the bare string. (A case's
status, which also has mismatch and not_run, is conformance.runner.Status.)
"""

from __future__ import annotations

import enum


class CheckStatus(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"  # compiled, or computed, and a named check did not hold
    ERROR = "error"  # the check itself raised: compile error, reference crash


__all__ = ["CheckStatus"]
