"""scripts/ncu_stalls.py's reading of the SASS page ncu writes (`--page source --csv`); ncu is not
on the CI machine. The csv below has that page's form (a kernel-name row, then the header with
the sample column and per-reason columns, their "(Not Issued)" twins ignored), with figures
written by hand."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "ncu_stalls.py"
_SPEC = importlib.util.spec_from_file_location("ncu_stalls", _PATH)
ncu_stalls = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ncu_stalls)

CSV = '''\
"Kernel Name","kernel_x",
"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb","stall_barrier","stall_long_sb (Not Issued)"
"0x10","  LDG.E.128 R4, desc[UR8][R2.64]","10","2","8","99"
"0x20","@!P2  STS [R8+UR6+0x60], R33","60","60","0","99"
"0x30","  BAR.SYNC.DEFER_BLOCKING 0x0","30","0","30","99"
"0x40","  EXIT","",,"",""
'''


def test_shares_and_instructions_come_from_the_sample_columns(tmp_path):
    path = tmp_path / "k.sass.csv"
    path.write_text(CSV)
    total, shares, instructions = ncu_stalls.stall_profile(str(path))
    assert total == 100
    assert shares == [(pytest.approx(0.62), "stall_long_sb"), (pytest.approx(0.38), "stall_barrier")]
    assert [(share, source, reason) for share, source, reason in instructions[:3]] == [
        (pytest.approx(0.60), "@!P2  STS [R8+UR6+0x60], R33", "stall_long_sb"),
        (pytest.approx(0.30), "BAR.SYNC.DEFER_BLOCKING 0x0", "stall_barrier"),
        (pytest.approx(0.10), "LDG.E.128 R4, desc[UR8][R2.64]", "stall_barrier"),
    ]
    assert len(instructions) == 4
