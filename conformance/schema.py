"""JSON schemas of results.json and of a bundle's manifest.json, and a small validator.

The schemas are plain JSON Schema (draft 2020-12 keywords: type, properties, required,
additionalProperties, items, enum, minimum) so any JSON Schema tool can check a report; the
validator below implements exactly those keywords, so the package needs no extra dependency.
"""

from __future__ import annotations

from typing import Any

RESULTS_SCHEMA_VERSION = 2  # 2: the run's status (pass, fail, not_verified), require_gpu, backend

_STR = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_STR_OR_NULL = {"type": ["string", "null"]}
_NUM_OR_STR = {"type": ["number", "string"]}  # non-finite floats are written as strings

MISMATCH_SCHEMA = {
    "type": "object",
    "required": ["count", "total", "index", "expected_value", "actual_value", "expected_bits", "actual_bits",
                 "expected_hex", "actual_hex", "dtype", "output", "rank", "oracle"],
    "properties": {
        "count": {"type": "integer", "minimum": 1},
        "total": _INT,
        "index": {"type": "array", "items": _INT},
        "expected_value": _NUM_OR_STR,
        "actual_value": _NUM_OR_STR,
        "expected_bits": _INT,
        "actual_bits": _INT,
        "expected_hex": _STR,
        "actual_hex": _STR,
        "dtype": _STR,
        "output": {"enum": ["new_residual", "layer_input", "mxfp8_values", "mxfp8_scales"]},
        "rank": {"type": ["integer", "null"]},
        "oracle": {"enum": ["reference", "flashinfer", "rank0"]},
    },
}

CASE_PROPERTIES = {
    "id": _STR,
    "tp": {"type": "integer", "minimum": 1},
    "hidden": {"type": "integer", "minimum": 8},
    "hc": {"type": "integer", "minimum": 1},
    "m": {"type": "integer", "minimum": 1},
    "op": {"enum": ["call", "finalize"]},
    "variant": {"enum": ["full", "mxfp8", "residual_only"]},
    "family": {"enum": ["normal", "wide_range", "signed_zeros", "nan_inf", "order_sensitive", "tiny", "captured"]},
    "top_k": {"type": "integer", "minimum": 0},
    "capacity": {"type": "integer", "minimum": 1},
    "seed_offset": _INT,
    "seed": {"type": "integer", "minimum": 0},
}
CASE_SCHEMA = {"type": "object", "required": list(CASE_PROPERTIES), "properties": CASE_PROPERTIES}

ENVIRONMENT_SCHEMA = {
    "type": "object",
    "required": ["gpu", "versions", "hostname"],
    "properties": {
        "gpu": {
            "type": ["object", "null"],
            "required": ["name", "capability", "driver"],
            "properties": {"name": _STR, "capability": _STR, "driver": _STR_OR_NULL},
        },
        "versions": {
            "type": "object",
            "required": ["torch", "cutlass_dsl", "flashinfer", "python"],
            "properties": {k: _STR_OR_NULL for k in ("torch", "cutlass_dsl", "flashinfer", "python")},
        },
        "hostname": _STR,
    },
}

CASE_RESULT_SCHEMA = {
    "type": "object",
    "required": list(CASE_PROPERTIES) + ["status", "timings", "mismatch_counts", "first_mismatch", "mismatches",
                                          "error", "reason", "bundle", "repro"],
    "properties": {
        **CASE_PROPERTIES,
        "status": {"enum": ["pass", "mismatch", "error", "not_run"]},
        "timings": {"type": "object"},
        "mismatch_counts": {"type": "object"},
        "first_mismatch": {"anyOf": [{"type": "null"}, MISMATCH_SCHEMA]},
        "mismatches": {"type": "array", "items": MISMATCH_SCHEMA},
        "error": _STR_OR_NULL,
        "reason": _STR_OR_NULL,
        "bundle": _STR_OR_NULL,
        "repro": _STR,
        # A mismatching case: the first stage that differs (conformance.divergence), and the
        # distance of the differing elements per output, binned in ulps of their format.
        "divergence": {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "required": ["stage", "detail", "ulps"],
                    "properties": {
                        "stage": {"enum": [None, "contribution", "reduce", "post_mix", "collapse", "rms_norm", "mxfp8"]},
                        "detail": _STR,
                        "ulps": {"type": "object"},
                    },
                },
            ]
        },
    },
}

KERNEL_CONTRACT_SCHEMA = {
    "type": "object",
    "required": ["arch", "kernel", "kind", "variant", "status", "compile_s", "checks", "error"],
    "properties": {
        "arch": _STR,
        "kernel": _STR,
        "kind": {"enum": ["publish", "consumer"]},
        "variant": _STR,
        "status": {"enum": ["pass", "fail", "error"]},
        "compile_s": _NUM,
        "checks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "passed", "message"],
                "properties": {"name": _STR, "passed": _BOOL, "message": _STR},
            },
        },
        "error": _STR_OR_NULL,
    },
}

REFERENCE_CHECK_SCHEMA = {
    "type": "object",
    "required": ["case", "family", "m", "status", "stages", "error"],
    "properties": {
        "case": _STR,
        "family": CASE_PROPERTIES["family"],
        "m": _INT,
        "status": {"enum": ["pass", "fail", "error"]},
        "stages": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["stage", "max_ulps", "max_unexplained_ulps", "ill_conditioned", "nonfinite_mismatches",
                             "elements", "judged", "passed"],
                "properties": {
                    "stage": _STR,
                    "max_ulps": _INT,
                    "max_unexplained_ulps": _INT,
                    "ill_conditioned": _INT,
                    "nonfinite_mismatches": _INT,
                    "elements": _INT,
                    "judged": _BOOL,
                    "passed": _BOOL,
                    "note": _STR_OR_NULL,
                },
            },
        },
        "error": _STR_OR_NULL,
    },
}

_COUNTS = {"type": "object", "required": ["total", "pass", "mismatch", "error", "not_run"],
           "properties": {k: {"type": "integer", "minimum": 0} for k in ("total", "pass", "mismatch", "error", "not_run")}}

RESULTS_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "mhc-ar conformance results",
    "type": "object",
    "required": ["schema_version", "run_id", "preset", "filters", "mode", "started_at", "finished_at",
                 "environment", "timings", "counts", "status", "require_gpu", "backend", "exit_code", "cases", "compile_checks",
                 "reference_checks"],
    "properties": {
        "schema_version": {"enum": [RESULTS_SCHEMA_VERSION]},
        "run_id": _STR,
        "preset": {"enum": ["quick", "default", "full", "cases"]},
        "filters": {"type": "object"},
        "seed_offset": _INT,
        "mode": {"enum": ["gpu", "cpu"]},
        "started_at": _STR,
        "finished_at": _STR,
        "environment": ENVIRONMENT_SCHEMA,
        "timings": {
            "type": "object",
            "required": ["total_s", "compile_s", "reference_checks_s", "cases_s"],
            "properties": {k: _NUM for k in ("total_s", "compile_s", "reference_checks_s", "cases_s")},
        },
        "counts": {
            "type": "object",
            "required": ["cases", "compile_checks", "reference_checks"],
            "properties": {
                "cases": _COUNTS,
                "compile_checks": {"type": "object", "required": ["total", "pass", "fail", "error"]},
                "reference_checks": {"type": "object", "required": ["total", "pass", "fail", "error"]},
            },
        },
        # pass: kernel cases ran and everything matched; not_verified: no kernel case ran (and
        # nothing failed); fail: a mismatch, an error or a failed check.
        "status": {"enum": ["pass", "fail", "not_verified"]},
        "require_gpu": {"type": "boolean"},
        "backend": _STR,  # kernels, reference (planted flips), or impl:NAME (run --impl)
        "exit_code": {"enum": [0, 1, 3]},
        "cases": {"type": "array", "items": CASE_RESULT_SCHEMA},
        "compile_checks": {"type": "array", "items": KERNEL_CONTRACT_SCHEMA},
        "reference_checks": {"type": "array", "items": REFERENCE_CHECK_SCHEMA},
        "bench": {"type": ["object", "null"]},
    },
}

ARRAY_ENTRY_SCHEMA = {
    "type": "object",
    "required": ["file", "torch_dtype", "numpy_dtype", "shape", "sha256"],
    "additionalProperties": False,
    "properties": {
        "file": _STR,
        "torch_dtype": {"enum": ["bfloat16", "float8_e4m3fn", "float32", "int32", "uint8"]},
        "numpy_dtype": {"enum": ["<u2", "|u1", "<f4", "<i4"]},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "sha256": _STR,
    },
}

MANIFEST_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "mhc-ar conformance bundle manifest",
    "type": "object",
    "required": ["format", "format_version", "case", "seed", "eps", "reduction_tree", "environment",
                 "mismatched_outputs", "first_mismatch", "mismatches", "arrays"],
    "properties": {
        "format": _STR,
        "format_version": _INT,
        "created": _STR,
        "case": CASE_SCHEMA,
        "seed": _INT,
        "eps": _NUM,
        "reduction_tree": {
            "type": ["object", "null"],
            "required": ["cluster_size", "threads_per_cta", "vectors_per_cta", "elems_per_vector", "warp_size"],
            "additionalProperties": False,
            "properties": {k: {"type": "integer", "minimum": 1}
                           for k in ("cluster_size", "threads_per_cta", "vectors_per_cta", "elems_per_vector", "warp_size")},
        },
        "environment": {"type": "object"},
        "mismatched_outputs": {"type": "array", "items": _STR},
        "first_mismatch": {"anyOf": [{"type": "null"}, MISMATCH_SCHEMA]},
        "mismatches": {"type": "array", "items": MISMATCH_SCHEMA},
        "arrays": {"type": "object", "additionalProperties": ARRAY_ENTRY_SCHEMA},
        # Only in bundles recorded by mhc_ar.capture (conformance.capture): one rank's view of one
        # call; its peers' views are the sibling files of the same call.
        "capture": {
            "type": "object",
            "required": ["call", "rank", "tp", "source"],
            "properties": {
                "call": {"type": "integer", "minimum": 0},
                "rank": {"type": "integer", "minimum": 0},
                "tp": {"type": "integer", "minimum": 1},
                "source": {"enum": ["AllReduceMHC", "EmulatedAllReduceMHC"]},
            },
        },
    },
}


class SchemaError(ValueError):
    """An instance does not match its schema; the message names the JSON path."""


_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "null": type(None),
}


def _is_type(value: Any, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES[name])


def validate(instance: Any, schema: dict, path: str = "$") -> None:
    """Raise SchemaError at the first place `instance` breaks `schema`."""
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            try:
                validate(instance, option, path)
                break
            except SchemaError as error:
                errors.append(str(error))
        else:
            raise SchemaError(f"{path}: matches none of the allowed forms ({'; '.join(errors)})")
    if "enum" in schema and instance not in schema["enum"]:
        raise SchemaError(f"{path}: {instance!r} is not one of {schema['enum']}")
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(instance, n) for n in names):
            raise SchemaError(f"{path}: expected {' or '.join(names)}, got {type(instance).__name__}")
    if "minimum" in schema and _is_type(instance, "number") and instance < schema["minimum"]:
        raise SchemaError(f"{path}: {instance} is below the minimum {schema['minimum']}")
    if isinstance(instance, dict):
        for key in schema.get("required", ()):
            if key not in instance:
                raise SchemaError(f"{path}: missing required key {key!r}")
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, value in instance.items():
            if key in properties:
                validate(value, properties[key], f"{path}.{key}")
            elif extra is False:
                raise SchemaError(f"{path}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                validate(value, extra, f"{path}.{key}")
    if isinstance(instance, list) and "items" in schema:
        for i, item in enumerate(instance):
            validate(item, schema["items"], f"{path}[{i}]")


__all__ = ["MANIFEST_SCHEMA", "RESULTS_SCHEMA", "RESULTS_SCHEMA_VERSION", "SchemaError", "validate"]
