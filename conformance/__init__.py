"""conformance: judges the mhc_ar kernels against the reference, byte for byte.

Three uses (SPEC.md): a CI bit-exactness gate (`mhc-ar-conformance run`, non-zero exit on any
differing byte, results.json + junit.xml), a reproducer (`mhc-ar-conformance repro BUNDLE`
names the first differing element and every intermediate behind it) and a coverage report
(index.html).

Modules, one job each:
  cases             the case matrix as data: Case (readable id, id-derived seed), presets, filters
  inputs            input families drawn from the seed on the target device
  compare           the one bitwise comparison (first_mismatch, assert_bitwise_equal)
  runner            KernelBackend protocol, the GPU backend, the CPU stand-in, one case / many
  ptx_contract      compile every kernel variant for every arch and check its PTX
  reference_checks  the reference against the float64 model
  bundle            reproducer bundles (safe to load: no pickle, schema, sha256)
  repro             replay a bundle, explain the first difference
  report, junit     results.json, index.html, junit.xml;  schema: their JSON schemas
  run, cli          one whole run; the command line

Imports are lazy so that `import conformance` stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Case": "cases",
    "Family": "cases",
    "Filters": "cases",
    "Preset": "cases",
    "preset_cases": "cases",
    "CaseInputs": "inputs",
    "make_inputs": "inputs",
    "Mismatch": "compare",
    "assert_bitwise_equal": "compare",
    "first_mismatch": "compare",
    "CaseResult": "runner",
    "EmulatedKernelBackend": "runner",
    "KernelBackend": "runner",
    "KernelOutputs": "runner",
    "PlantedFlip": "runner",
    "ReferenceKernelBackend": "runner",
    "Status": "runner",
    "run_case": "runner",
    "run_cases": "runner",
    "check_compiled_variants": "ptx_contract",
    "check_ptx": "ptx_contract",
    "check_reference": "reference_checks",
    "Bundle": "bundle",
    "BundleError": "bundle",
    "load_bundle": "bundle",
    "write_bundle": "bundle",
    "replay": "repro",
    "RunReport": "report",
    "RunOptions": "run",
    "execute": "run",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'conformance' has no attribute {name!r}")
