"""scripts/hinted_copy.py: the copy it writes is a second package whose consumer PTX (sm_90a,
compiled here) carries the hinted opcodes exactly where the streamed accesses are, and every
other access as before; it refuses a source that lacks the accesses it edits."""

from __future__ import annotations

import collections
import importlib
import importlib.util
import pathlib
import sys

import pytest

from conformance.ptx_contract import parse_instructions

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("hinted_copy", _ROOT / "scripts" / "hinted_copy.py")
hinted_copy = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(hinted_copy)

H, HC = 1024, 4  # TP = 1: one fragment per thread (H / 8 = 128 vectors, one CTA of 128 threads)


def _opcode_counts(ptx: str) -> collections.Counter:
    return collections.Counter(instruction.opcode for instruction in parse_instructions(ptx))


def _consumer_ptx(package) -> str:
    spec = package.config.ConsumerSpec(package.config.choose_consumer_tiling(H), hc=HC, tp=1, capacity=16,
                                       variant=package.config.Variant.FULL)
    return package.compile.compile_consumer(spec, "sm_90a", keep_ptx=True).ptx


@pytest.mark.parametrize("loads", ["cs", "nc"])
def test_the_copy_streams_the_residual_loads_and_output_stores_only(tmp_path, monkeypatch, loads):
    name = f"mhc_ar_hinted_{loads}"
    hinted_copy.make_copy(_ROOT / "mhc_ar", tmp_path / name, loads)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        copy = importlib.import_module(name)
        importlib.import_module(f"{name}.compile")
        import mhc_ar
        import mhc_ar.compile  # noqa: F401

        original, hinted = _opcode_counts(_consumer_ptx(mhc_ar)), _opcode_counts(_consumer_ptx(copy))
    finally:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]
    load, store = hinted_copy.LOADS[loads], hinted_copy.STORE
    # Per fragment: hc residual loads (x stays a plain load); hc new_residual stores and one
    # layer_input store (the full variant has no other 16-byte store at tp = 1).
    assert (original.get(load, 0), hinted.get(load, 0)) == (0, HC)
    assert hinted["ld.global.v4.b32"] == original["ld.global.v4.b32"] - HC
    assert (original.get(store, 0), hinted.get(store, 0)) == (0, HC + 1)
    assert hinted.get("st.global.v4.b32", 0) == original["st.global.v4.b32"] - (HC + 1)
    others = {op: n for op, n in hinted.items() if op not in (load, store, "ld.global.v4.b32", "st.global.v4.b32")}
    assert others == {op: n for op, n in original.items() if op not in ("ld.global.v4.b32", "st.global.v4.b32")}


def test_a_source_without_the_accesses_is_refused(tmp_path):
    hinted_copy.make_copy(_ROOT / "mhc_ar", tmp_path / "once", "cs")
    with pytest.raises(ValueError, match=r"expected one 'return \[ptx.ld_global_v4\(residual \+'"):
        hinted_copy.make_copy(tmp_path / "once", tmp_path / "twice", "cs")
