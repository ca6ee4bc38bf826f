"""Reproducer bundles: one mismatching case in one zip file that anyone can replay.

``<case-id>.mhcbundle`` holds ``manifest.json`` (format and version, the case, its seed, the
reduction tree of the consumer that ran it, versions and GPU, which outputs differed and where,
and the sha256, dtype and shape of every array) and one ``.npy`` per tensor: every rank's
inputs (``inputs/...``) and every rank's kernel outputs (``kernel/...``). bf16 is stored as
uint16 and float8_e4m3fn as uint8 (numpy has neither); the manifest records the torch dtype.

Loading trusts nothing: numpy.load(allow_pickle=False) only, the manifest is validated against
its schema, every array must exist with the recorded dtype, shape and sha256, members that the
manifest does not list are refused, and any problem raises `BundleError` (a ValueError) with a
message saying what is wrong, never a raw zipfile/KeyError traceback.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from reference import ReductionTree, validate_inputs

from .cases import Case
from .compare import Mismatch
from .inputs import CaseInputs
from .runner import KernelOutputs
from .schema import MANIFEST_SCHEMA, SchemaError, validate

FORMAT = "mhc-ar-conformance-bundle"
FORMAT_VERSION = 1
SUFFIX = ".mhcbundle"
MANIFEST = "manifest.json"
_MAX_MANIFEST_BYTES = 4 << 20
_NPY_HEADER_SLACK = 4096  # an .npy header is at most a few hundred bytes

# torch dtype -> (numpy dtype of the stored array, same-width integer view used to store it)
_STORAGE = {
    torch.bfloat16: ("<u2", torch.int16),
    torch.float8_e4m3fn: ("|u1", torch.uint8),
    torch.float32: ("<f4", None),
    torch.int32: ("<i4", None),
    torch.uint8: ("|u1", None),
}
_TORCH_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in _STORAGE}


class BundleError(ValueError):
    """A bundle that is malformed, truncated, tampered with or of another format version."""


@dataclass
class Bundle:
    path: Path
    manifest: dict
    case: Case
    inputs: CaseInputs
    kernel: KernelOutputs
    tree: ReductionTree | None

    @property
    def mismatches(self) -> list[Mismatch]:
        return [Mismatch.from_dict(m) for m in self.manifest["mismatches"]]


# ----- writing ------------------------------------------------------------------------------------


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    numpy_dtype, integer_view = _STORAGE[t.dtype]
    t = t.detach().cpu().contiguous()
    if integer_view is not None:
        t = t.view(integer_view)
    return t.numpy().view(np.dtype(numpy_dtype))


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def write_bundle(
    path,
    *,
    case: Case,
    inputs: CaseInputs,
    kernel: KernelOutputs,
    tree: ReductionTree | None,
    mismatches: list[Mismatch],
    environment: dict | None = None,
) -> Path:
    """Write the bundle atomically (temp file, then rename) and return its path."""
    arrays = {f"inputs/{name}": t for name, t in inputs.tensors().items()}
    arrays |= {f"kernel/{name}": t for name, t in kernel.tensors().items()}
    manifest = manifest_fields(case, float(inputs.mix.eps), tree, environment)
    manifest |= {
        "mismatched_outputs": sorted({m.output for m in mismatches}),
        "first_mismatch": mismatches[0].to_dict() if mismatches else None,
        "mismatches": [m.to_dict() for m in mismatches],
    }
    return write_archive(path, manifest, arrays)


def manifest_fields(case: Case, eps: float, tree: ReductionTree | None, environment: dict | None) -> dict:
    """The manifest fields every bundle has, mismatches none (write_archive adds the arrays)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "case": case.to_dict(),
        "seed": case.seed,
        "eps": eps,
        "reduction_tree": None if tree is None else dict(tree.__dict__),
        "environment": environment or {},
        "mismatched_outputs": [],
        "first_mismatch": None,
        "mismatches": [],
    }


def write_archive(path, manifest: dict, arrays: dict[str, torch.Tensor]) -> Path:
    """`manifest` plus one .npy per tensor of `arrays` (name -> tensor, listed in the manifest
    with dtype, shape and sha256), written atomically (temp file, then rename)."""
    path = Path(path)
    entries, payloads = {}, {}
    for name, tensor in arrays.items():
        if tensor.dtype not in _STORAGE:
            raise ValueError(f"{name}: cannot store dtype {tensor.dtype}")
        data = _npy_bytes(_to_numpy(tensor))
        file = f"{name}.npy"
        entries[name] = {
            "file": file,
            "torch_dtype": str(tensor.dtype).removeprefix("torch."),
            "numpy_dtype": _STORAGE[tensor.dtype][0],
            "shape": list(tensor.shape),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        payloads[file] = data
    manifest = manifest | {"arrays": entries}
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".partial")
    os.close(handle)
    try:
        # Level 1: bf16 activations barely compress; a fast level keeps bundling cheap.
        with zipfile.ZipFile(temporary, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
            archive.writestr(MANIFEST, json.dumps(manifest, indent=1, allow_nan=False))
            for file, data in payloads.items():
                archive.writestr(file, data)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return path


# ----- loading ------------------------------------------------------------------------------------


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int, what: str) -> bytes:
    if info.file_size > limit:
        raise BundleError(f"{what}: {info.file_size} bytes, more than the {limit} expected")
    try:
        with archive.open(info) as member:
            data = member.read(limit + 1)
    except (zipfile.BadZipFile, OSError, EOFError, RuntimeError, ValueError) as error:
        raise BundleError(f"{what}: cannot be read ({error})") from None
    if len(data) > limit:
        raise BundleError(f"{what}: larger than the {limit} bytes expected")
    return data


def _load_array(archive, members, name: str, entry: dict) -> torch.Tensor:
    file = entry["file"]
    if file not in members:
        raise BundleError(f"array {name}: file {file} is missing from the bundle")
    numpy_dtype = np.dtype(entry["numpy_dtype"])
    torch_dtype = _TORCH_DTYPES[entry["torch_dtype"]]
    if _STORAGE[torch_dtype][0] != entry["numpy_dtype"]:
        raise BundleError(f"array {name}: torch dtype {entry['torch_dtype']} is not stored as {entry['numpy_dtype']}")
    shape = tuple(entry["shape"])
    expected_bytes = int(np.prod(shape, dtype=np.int64)) * numpy_dtype.itemsize
    data = _read_member(archive, members[file], expected_bytes + _NPY_HEADER_SLACK, f"array {name}")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise BundleError(f"array {name}: sha256 differs from the manifest (file {file} changed or corrupt)")
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise BundleError(f"array {name}: not a plain .npy array ({error})") from None
    if not isinstance(array, np.ndarray):
        raise BundleError(f"array {name}: not a single .npy array")
    if array.dtype != numpy_dtype:
        raise BundleError(f"array {name}: stored as {array.dtype.str}, manifest says {numpy_dtype.str}")
    if array.shape != shape:
        raise BundleError(f"array {name}: shape {array.shape}, manifest says {shape}")
    tensor = torch.from_numpy(np.ascontiguousarray(array).copy())
    return tensor.view(torch_dtype) if tensor.dtype != torch_dtype else tensor


def read_archive(path, *, arrays: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """The verified manifest and every array of a bundle file (name -> tensor; none read with
    arrays=False); raises BundleError for anything that is not a valid bundle of this format
    version."""
    path = Path(path)
    if not path.is_file():
        raise BundleError(f"{path}: no such bundle file")
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise BundleError(f"{path}: not a readable bundle (zip) file: {error}") from None
    with archive:
        members = {info.filename: info for info in archive.infolist()}
        if MANIFEST not in members:
            raise BundleError(f"{path}: no {MANIFEST} in the bundle")
        raw = _read_member(archive, members[MANIFEST], _MAX_MANIFEST_BYTES, MANIFEST)
        try:
            manifest = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise BundleError(f"{path}: {MANIFEST} is not valid JSON ({error})") from None
        if not isinstance(manifest, dict):
            raise BundleError(f"{path}: {MANIFEST} is not a JSON object")
        if manifest.get("format") != FORMAT:
            raise BundleError(f"{path}: not an {FORMAT} (format {manifest.get('format')!r})")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise BundleError(
                f"{path}: format version {manifest.get('format_version')!r}; this reader understands {FORMAT_VERSION}"
            )
        try:
            validate(manifest, MANIFEST_SCHEMA)
        except SchemaError as error:
            raise BundleError(f"{path}: invalid manifest: {error}") from None
        entries = manifest["arrays"]
        listed = {entry["file"] for entry in entries.values()}
        unexpected = sorted(set(members) - listed - {MANIFEST})
        if unexpected:
            raise BundleError(f"{path}: members not listed in the manifest: {', '.join(unexpected[:5])}")
        tensors = {name: _load_array(archive, members, name, entry) for name, entry in entries.items()} if arrays else {}
    return manifest, tensors


def is_captured(manifest: dict) -> bool:
    """Whether a bundle was recorded from a real call (conformance.capture) rather than a case."""
    return "capture" in manifest


def load_bundle(path) -> Bundle:
    """Read and verify a bundle; raises BundleError for anything that is not a valid bundle of
    this format version. A captured call's bundle is read with conformance.capture.load_call."""
    path = Path(path)
    manifest, tensors = read_archive(path)
    if is_captured(manifest):
        raise BundleError(f"{path}: a captured call (one rank's view); read it with conformance.capture.load_call")
    try:
        case = Case.from_dict(manifest["case"])
    except ValueError as error:
        raise BundleError(f"{path}: {error}") from None
    if manifest["seed"] != case.seed:
        raise BundleError(f"{path}: seed {manifest['seed']} does not belong to case {case.id}")
    try:
        tree = None if manifest["reduction_tree"] is None else ReductionTree(**manifest["reduction_tree"])
        inputs = CaseInputs.from_tensors(
            {k.removeprefix("inputs/"): t for k, t in tensors.items() if k.startswith("inputs/")},
            tp=case.tp,
            eps=manifest["eps"],
        )
        validate_inputs(inputs.ranks, inputs.mix, tree=tree, mxfp8=case.variant.value == "mxfp8")
        kernel = KernelOutputs.from_tensors(
            {k.removeprefix("kernel/"): t for k, t in tensors.items() if k.startswith("kernel/")}, case.tp
        )
        _check_kernel_shapes(case, kernel)
    except ValueError as error:
        raise BundleError(f"{path}: arrays do not fit case {case.id}: {error}") from None
    if inputs.mix.residual.shape != (case.m, case.hc, case.hidden):
        raise BundleError(f"{path}: residual shape {tuple(inputs.mix.residual.shape)} does not fit case {case.id}")
    return Bundle(path, manifest, case, inputs, kernel, tree)


def _check_kernel_shapes(case: Case, kernel: KernelOutputs) -> None:
    from mhc_ar.config import mxfp8_scale_bytes

    shapes = {
        "new_residual": ((case.m, case.hc, case.hidden), torch.bfloat16),
        "layer_input": ((case.m, case.hidden), torch.bfloat16),
        "mxfp8_values": ((case.m, case.hidden), torch.float8_e4m3fn),
        "mxfp8_scales": ((mxfp8_scale_bytes(case.m, case.hidden),), torch.uint8),
    }
    for output, (shape, dtype) in shapes.items():
        for rank in range(case.tp):
            t = kernel.get(output, rank)
            if t is not None and (tuple(t.shape) != shape or t.dtype != dtype):
                raise ValueError(f"kernel {output} rank {rank}: {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")


def bundle_name(case: Case) -> str:
    return f"{case.id}{SUFFIX}"


__all__ = [
    "Bundle", "BundleError", "FORMAT", "FORMAT_VERSION", "SUFFIX", "bundle_name", "is_captured", "load_bundle", "manifest_fields",
    "read_archive", "write_archive", "write_bundle",
]
