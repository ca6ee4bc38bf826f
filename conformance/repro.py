"""Replaying a bundle: name the first differing element and every intermediate behind it.

On a GPU the kernel is rebuilt for the case and rerun on the recorded inputs; on a CPU (or
with reference_only) the recorded kernel outputs are compared with the reference. Either way
the first difference is printed with both values (float and bits), followed by the
reference's intermediates for that element (reference.explain_element).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, TextIO

import torch

from mhc_ar.config import Variant
from reference import all_reduce_mhc, explain_element, format_steps, swizzle_offset
from reference.mxfp8 import BLOCK_SIZE, padded_scale_cols

from .bundle import Bundle
from .compare import Mismatch
from .runner import EmulatedKernelBackend, compare_outputs, flashinfer_mxfp8, tiling_tree


@dataclass(frozen=True)
class Element:
    """Where an output element comes from: token row, column, residual stream (new_residual)."""

    row: int
    col: int
    target: int | None = None
    padding: bool = False  # an MXFP8 scale byte of a padding row/column (must be 0)


def locate(mismatch: Mismatch, m: int, hidden: int) -> Element:
    """The (row, column, stream) an output index belongs to."""
    index = mismatch.index
    if mismatch.output == "new_residual":
        return Element(row=index[0], col=index[2], target=index[1])
    if mismatch.output in ("layer_input", "mxfp8_values"):
        return Element(row=index[0], col=index[1])
    if mismatch.output == "mxfp8_scales":
        cols = padded_scale_cols(hidden)
        rows = -(-m // 128) * 128
        r = torch.arange(rows).view(-1, 1).expand(rows, cols)
        c = torch.arange(cols).view(1, -1).expand(rows, cols)
        hit = (swizzle_offset(r, c, cols) == index[0]).nonzero()
        if hit.numel() == 0:
            raise ValueError(f"scale byte {index[0]} is outside the {rows} x {cols} scale layout")
        row, block = int(hit[0, 0]), int(hit[0, 1])
        padding = row >= m or block >= hidden // BLOCK_SIZE
        return Element(row=row, col=block * BLOCK_SIZE, padding=padding)
    raise ValueError(f"unknown output {mismatch.output!r}")


def _values(m: Mismatch) -> tuple[str, str]:
    expected_from = {"reference": "reference", "flashinfer": "flashinfer", "rank0": "rank 0"}[m.oracle]
    return (
        f"  {expected_from + ':':<11} {m.shown(m.expected_value, m.expected_bits):<24} bits {m.hex(m.expected_bits)}",
        f"  {'kernel:':<11} {m.shown(m.actual_value, m.actual_bits):<24} bits {m.hex(m.actual_bits)}",
    )


def replay(bundle: Bundle, *, reference_only: bool = False, out: TextIO | None = None, device=None) -> int:
    """Replay and print; returns 1 if the kernel still differs, 0 if not."""
    out = out or sys.stdout
    write: Callable[[str], None] = lambda line="": print(line, file=out)
    case = bundle.case
    mxfp8 = case.variant is Variant.MXFP8
    use_gpu = not reference_only and torch.cuda.is_available()
    write(f"bundle {bundle.path}")
    write(f"case   {case.id} (seed {case.seed})")
    recorded = bundle.manifest.get("first_mismatch")
    if recorded:
        write(f"recorded first difference: {Mismatch.from_dict(recorded).describe()}")

    second_oracle = None
    if use_gpu:
        backend = EmulatedKernelBackend(device or "cuda")
        inputs = bundle.inputs.to(backend.device)
        write(f"rerunning the kernel on {torch.cuda.get_device_name(backend.device)}")
        kernel = backend.run(case, inputs)
        tree = backend.tree(case)
        if bundle.tree is not None and tree != bundle.tree:
            write(f"note: this build's consumer tiling {tree} differs from the recorded {bundle.tree}")
        second_oracle = flashinfer_mxfp8 if mxfp8 else None
    else:
        why = "--reference-only" if reference_only else "no GPU"
        write(f"comparing the recorded kernel outputs with the reference on the CPU ({why})")
        inputs, kernel = bundle.inputs, bundle.kernel
        tree = bundle.tree if bundle.tree is not None else tiling_tree(case.hidden)

    reference = all_reduce_mhc(inputs.ranks, inputs.mix, tree=tree, mxfp8=mxfp8)
    mismatches = compare_outputs(case, kernel, reference, second_oracle=second_oracle)
    if not mismatches:
        write("no difference: every output of every rank matches the reference bit for bit")
        return 0

    write(f"{len(mismatches)} comparisons differ:")
    for m in mismatches:
        write(f"  {m.describe()}  [vs {m.oracle}]")
    explain_first(write, mismatches[0], case, inputs.ranks, inputs.mix, tree, mxfp8)
    return 1


def explain_first(write: Callable[[str], None], first: Mismatch, case, ranks, mix, tree, mxfp8: bool) -> None:
    """Print the first difference (both values, float and bits) and the reference's
    intermediates of the element it belongs to."""
    where = f"{first.output}, rank {first.rank}, index {first.index}"
    write("")
    write(f"first difference: {where}")
    for line in _values(first):
        write(line)

    element = locate(first, case.m, case.hidden)
    if element.padding:
        write(f"scale byte of padding (row {element.row}, block {element.col // BLOCK_SIZE}): the layout requires 0")
        return
    target = f", stream {element.target}" if element.target is not None else ""
    write("")
    write(f"intermediates of row {element.row}, column {element.col}{target} (reference):")
    steps = explain_element(ranks, mix, tree, row=element.row, col=element.col, target=element.target, mxfp8=mxfp8)
    write(format_steps(steps))


__all__ = ["Element", "explain_first", "locate", "replay"]
