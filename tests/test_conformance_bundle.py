"""Reproducer bundles: exact round trip, and every kind of broken bundle is a BundleError."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile

import numpy as np
import pytest

from conformance.bundle import FORMAT_VERSION, MANIFEST, BundleError, load_bundle, write_bundle
from conformance.cases import Case
from conformance.compare import first_mismatch
from conformance.runner import PlantedFlip, ReferenceKernelBackend, run_case

CASE = Case.from_id("tp2-H128-hc2-M3-finalize-mxfp8-signed_zeros")


@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory):
    backend = ReferenceKernelBackend(plants=[PlantedFlip("new_residual", 1, 100)])
    run = run_case(CASE, backend)
    assert run.result.status.value == "mismatch"
    path = tmp_path_factory.mktemp("bundles") / "case.mhcbundle"
    write_bundle(path, case=CASE, inputs=run.inputs, kernel=run.kernel, tree=run.tree,
                 mismatches=run.result.mismatches, environment={"hostname": "test"})
    return path, run


def test_round_trip_is_bit_exact(bundle_path):
    path, run = bundle_path
    bundle = load_bundle(path)
    assert bundle.case == CASE and bundle.tree == run.tree
    assert bundle.inputs.mix.eps == run.inputs.mix.eps
    for name, tensor in run.inputs.tensors().items():
        assert first_mismatch(tensor, bundle.inputs.tensors()[name]) is None, name
    for name, tensor in run.kernel.tensors().items():
        assert first_mismatch(tensor, bundle.kernel.tensors()[name]) is None, name
    assert bundle.mismatches == run.result.mismatches
    manifest = bundle.manifest
    assert manifest["format_version"] == FORMAT_VERSION and manifest["seed"] == CASE.seed
    assert manifest["mismatched_outputs"] == ["new_residual"]
    assert manifest["arrays"]["inputs/rank0.gemm2_permuted"]["numpy_dtype"] == "<u2"
    assert manifest["arrays"]["kernel/rank1.mxfp8_values"]["torch_dtype"] == "float8_e4m3fn"


def _rewrite(source, target, *, drop=(), replace=None, add=None, manifest=None):
    """Copy a bundle, dropping / replacing / adding members or editing the manifest."""
    replace = dict(replace or {})
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            if info.filename in drop:
                continue
            data = replace.pop(info.filename, None) or src.read(info.filename)
            if info.filename == MANIFEST and manifest is not None:
                data = manifest(json.loads(data)) if callable(manifest) else manifest
                data = data if isinstance(data, bytes) else json.dumps(data).encode()
            dst.writestr(info.filename, data)
        for name, data in (add or {}).items():
            dst.writestr(name, data)
    return target


def _npy(array, allow_pickle=False) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=allow_pickle)
    return buffer.getvalue()


def _set(path, value):
    def edit(manifest):
        target = manifest
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return manifest
    return edit


def _delete(path):
    def edit(manifest):
        target = manifest
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
        return manifest
    return edit


X_FILE = "inputs/rank0.gemm2_permuted.npy"


def _malformed(path, tmp_path, kind):
    target = tmp_path / f"{kind}.mhcbundle"
    if kind == "truncated":
        data = path.read_bytes()
        target.write_bytes(data[: len(data) // 2])
    elif kind == "empty":
        target.write_bytes(b"")
    elif kind == "not a zip":
        target.write_text("hello")
    elif kind == "missing array":
        _rewrite(path, target, drop={X_FILE})
    elif kind == "missing manifest":
        _rewrite(path, target, drop={MANIFEST})
    elif kind == "wrong sha":
        with zipfile.ZipFile(path) as z:
            data = bytearray(z.read(X_FILE))
        data[-1] ^= 0x01
        _rewrite(path, target, replace={X_FILE: bytes(data)})
    elif kind == "bad manifest json":
        _rewrite(path, target, manifest=b"{not json")
    elif kind == "manifest not an object":
        _rewrite(path, target, manifest=b"[1, 2]")
    elif kind == "manifest missing key":
        _rewrite(path, target, manifest=_delete(["arrays"]))
    elif kind == "manifest wrong type":
        _rewrite(path, target, manifest=_set(["case", "tp"], "two"))
    elif kind == "future version":
        _rewrite(path, target, manifest=_set(["format_version"], FORMAT_VERSION + 1))
    elif kind == "other format":
        _rewrite(path, target, manifest=_set(["format"], "something-else"))
    elif kind == "wrong shape":
        _rewrite(path, target, manifest=_set(["arrays", "inputs/rank0.gemm2_permuted", "shape"], [1, 2]))
    elif kind == "seed of another case":
        _rewrite(path, target, manifest=_set(["seed"], 12345))
    elif kind == "case id disagrees":
        _rewrite(path, target, manifest=_set(["case", "id"], "tp2-H128-hc2-M3-finalize-mxfp8-normal"))
    elif kind == "object dtype in manifest":
        _rewrite(path, target, manifest=_set(["arrays", "inputs/rank0.gemm2_permuted", "numpy_dtype"], "|O"))
    elif kind == "unlisted member":
        _rewrite(path, target, add={"payload.pkl": b"\x80\x04K\x01."})
    elif kind == "pickle npy":
        # An object array (needs pickle) with a manifest entry whose sha256 matches it.
        data = _npy(np.array([{"a": 1}], dtype=object), allow_pickle=True)
        digest = hashlib.sha256(data).hexdigest()

        def edit(manifest):
            entry = manifest["arrays"]["inputs/rank0.gemm2_permuted"]
            entry.update(sha256=digest, shape=[1])
            return manifest

        _rewrite(path, target, replace={X_FILE: data}, manifest=edit)
    elif kind == "dtype differs from manifest":
        with zipfile.ZipFile(path) as z:
            stored = np.load(io.BytesIO(z.read(X_FILE)), allow_pickle=False)
        data = _npy(stored.view(np.float16))  # same size, other dtype
        _rewrite(path, target, replace={X_FILE: data},
                 manifest=_set(["arrays", "inputs/rank0.gemm2_permuted", "sha256"], hashlib.sha256(data).hexdigest()))
    elif kind == "oversized member":
        data = _npy(np.zeros(1 << 20, dtype=np.uint16))
        _rewrite(path, target, replace={X_FILE: data},
                 manifest=_set(["arrays", "inputs/rank0.gemm2_permuted", "sha256"], hashlib.sha256(data).hexdigest()))
    elif kind == "arrays do not fit the case":
        _rewrite(path, target, manifest=lambda m: _retarget(m, tp=3))  # 3 ranks claimed, 2 stored
    else:
        raise AssertionError(kind)
    return target


def _retarget(manifest, **fields):
    case = Case.from_dict(manifest["case"])
    data = {**case.to_dict(), **fields}
    other = Case.from_dict({k: v for k, v in data.items() if k not in ("id", "seed")})
    manifest["case"] = other.to_dict()
    manifest["seed"] = other.seed
    return manifest


MALFORMED = [
    ("truncated", "not a readable bundle|cannot be read"),
    ("empty", "not a readable bundle"),
    ("not a zip", "not a readable bundle"),
    ("missing array", "file inputs/rank0.gemm2_permuted.npy is missing"),
    ("missing manifest", "no manifest.json"),
    ("wrong sha", "sha256 differs"),
    ("bad manifest json", "not valid JSON"),
    ("manifest not an object", "not a JSON object"),
    ("manifest missing key", "missing required key 'arrays'"),
    ("manifest wrong type", r"\$\.case\.tp: expected integer"),
    ("future version", "format version 2"),
    ("other format", "not an mhc-ar-conformance-bundle"),
    ("wrong shape", "more than the|shape"),
    ("seed of another case", "seed 12345 does not belong"),
    ("case id disagrees", "does not match its fields"),
    ("object dtype in manifest", r"numpy_dtype: '\|O' is not one of"),
    ("unlisted member", "not listed in the manifest: payload.pkl"),
    ("pickle npy", "not a plain .npy array"),
    ("dtype differs from manifest", "stored as <f2"),
    ("oversized member", "more than the"),
    ("arrays do not fit the case", "do not fit case"),
]


@pytest.mark.parametrize("kind, message", MALFORMED, ids=[k for k, _ in MALFORMED])
def test_malformed_bundles_raise_bundle_error(bundle_path, tmp_path, kind, message):
    target = _malformed(bundle_path[0], tmp_path, kind)
    with pytest.raises(BundleError, match=message):
        load_bundle(target)


def test_bundle_error_is_a_value_error(tmp_path):
    assert issubclass(BundleError, ValueError)
    with pytest.raises(BundleError, match="no such bundle"):
        load_bundle(tmp_path / "absent.mhcbundle")
