"""scripts/sass_counts.py's parsing of ptxas -v and nvdisasm output (the tools themselves are
not on the CI machine). The lines below have their output's form: the predicated ones and the
spill line are copied from the H7168 hc8 TP 1 consumer's, the others written after them."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "sass_counts.py"
_SPEC = importlib.util.spec_from_file_location("sass_counts", _PATH)
sass_counts = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sass_counts)

SASS = """\
	.target	sm_90a
//--------------------- .text.kernel_cutlass_kernel_x --------------------------
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*00c0*/              @!P1 MOV R0, 0x1c ;
        /*00d0*/                   @!UP0 UIADD3 UR4, -UR5, 0x100000, URZ ;
        /*0100*/                   @!UP0 SYNCS.EXCH.64 URZ, [UR6+0x30], UR4 ;
        /*0110*/                   FFMA R4, R5, R6, R4 ;
        /*0120*/               @P0 FFMA R8, R9, R6, R8 ;
        /*0130*/                   F2FP.BF16.F32.PACK_AB R4, R8, R4 ;
.L_x_35:
        /*0140*/                   EXIT ;
"""


def test_opcodes_are_counted_without_modifiers_or_predicates():
    counts = sass_counts.opcode_counts(SASS)
    assert counts == {"LDC": 1, "MOV": 1, "UIADD3": 1, "SYNCS": 1, "FFMA": 2, "F2FP": 1, "EXIT": 1}
    assert sum(counts.values()) == 8


def test_ptxas_figures_read_registers_and_spills():
    log = ("ptxas info    : Compiling entry function 'kernel_x' for 'sm_90a'\n"
           "ptxas info    : Function properties for kernel_x\n"
           "    16 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 128 registers, used 1 barriers, 16 bytes cumulative stack size\n")
    assert sass_counts.ptxas_figures(log) == (128, 16, 12)
    with pytest.raises(ValueError, match="no register or spill line"):
        sass_counts.ptxas_figures("ptxas fatal   : Unsupported .version 9.2")


def test_measure_keeps_the_ptx_and_sass_where_asked(tmp_path, monkeypatch):
    """--keep: measure() writes the kernel's PTX and nvdisasm's SASS beside its figures (ptxas
    and nvdisasm replaced by canned output here: they are not on the CI machine)."""
    log = ("    16 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 128 registers, used 1 barriers\n")

    def fake_run(command, **_):
        tool = pathlib.Path(command[0]).name
        stdout = {"ptxas": "", "nvdisasm": SASS}[tool]
        return type("Done", (), {"stdout": stdout, "stderr": log if tool == "ptxas" else ""})()

    monkeypatch.setattr(sass_counts.subprocess, "run", fake_run)
    keep = tmp_path / "consumer-x"
    figures = sass_counts.measure(".version 9.0\n.target sm_90a\n", tmp_path, keep)
    assert (figures["registers"], figures["spill_stores"], figures["instructions"]) == (128, 16, 8)
    assert keep.with_suffix(".ptx").read_text() == ".version 9.0\n.target sm_90a\n"
    assert keep.with_suffix(".sass").read_text() == SASS
    assert sass_counts.measure(".version 9.0\n", tmp_path)["registers"] == 128
    assert sorted(p.name for p in tmp_path.iterdir()) == ["consumer-x.ptx", "consumer-x.sass"]
