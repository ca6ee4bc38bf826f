"""Every intermediate of the contract for one output element: what a reproducer prints.

`explain_element` recomputes only the element's row (the operation is row-independent; the
RMSNorm and the MXFP8 block need the whole row, nothing more), so it is cheap at any M.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .bits import u16, u32
from .compose import MixInputs, RankInputs, all_reduce_mhc, validate_inputs
from .mxfp8 import BLOCK_SIZE, e4m3_decode
from .rms_norm import ReductionTree


@dataclass(frozen=True)
class Step:
    """One intermediate: name, value as a Python float, bit pattern as hex, and its dtype
    ("fp32", "bf16", "ue8m0" for a scale byte, "e4m3" for an MXFP8 value byte)."""

    name: str
    value: float
    bits: str
    dtype: str


def explain_element(
    ranks: Sequence[RankInputs],
    mix: MixInputs,
    tree: ReductionTree | None,
    *,
    row: int,
    col: int,
    target: int | None = None,
    mxfp8: bool = False,
) -> list[Step]:
    """Intermediates of element (row, col), in computation order.

    target: show the post-mix of this residual stream only (None: every stream). The collapse
    always uses all streams. Inputs are validated like `all_reduce_mhc`.
    """
    validate_inputs(ranks, mix, tree=tree, mxfp8=mxfp8)
    m, hc, hidden = mix.residual.shape
    if not 0 <= row < m:
        raise ValueError(f"row: must be in 0 .. {m - 1}, got {row}")
    if not 0 <= col < hidden:
        raise ValueError(f"col: must be in 0 .. {hidden - 1}, got {col}")
    if target is not None and not 0 <= target < hc:
        raise ValueError(f"target: must be None or in 0 .. {hc - 1}, got {target}")

    one_row = all_reduce_mhc(
        [rank.rows(row, row + 1) for rank in ranks],
        mix.rows(row, row + 1),
        tree=tree,
        mxfp8=mxfp8,
        intermediates=True,
    )
    rec = {name: t.cpu() for name, t in one_row.intermediates.items()}
    steps: list[Step] = []

    for r, rank in enumerate(ranks):
        if rank.is_finalize:
            acc = rec["finalize_acc"][r, :, 0, col]
            top_k = acc.shape[0] - 1
            idx = rank.expanded_idx_to_permuted_idx[row].tolist()
            for k in range(top_k):
                rows = rank.gemm2_permuted.shape[0]
                note = f"row {idx[k]}" if 0 <= idx[k] < rows else "skipped (-1)" if idx[k] == -1 else f"invalid {idx[k]}, skipped"
                steps.append(_fp32(f"rank{r}.finalize.route{k} [{note}]", acc[k]))
            steps.append(_fp32(f"rank{r}.finalize.plus_shared", acc[top_k]))
        steps.append(_bf16(f"rank{r}.contribution (scrubbed)", rec["contribution"][r, 0, col]))
    for r in range(len(ranks)):
        steps.append(_fp32(f"reduce.sum_after_rank{r}", rec["reduce_partial_sum"][r, 0, col]))
    steps.append(_bf16("y", rec["y"][0, col]))

    for t in range(hc) if target is None else [target]:
        acc = rec["post_mix_acc"][0, t, :, col]
        steps.append(_fp32(f"post_mix[t={t}].y_times_post", acc[0]))
        for s in range(hc):
            steps.append(_fp32(f"post_mix[t={t}].fma_source{s}", acc[s + 1]))
        steps.append(_bf16(f"new_residual[t={t}]", rec["new_residual"][0, t, col]))

    if not mix.residual_only:
        for t in range(hc):
            steps.append(_fp32(f"collapse.fma_stream{t}", rec["collapse_acc"][0, t, col]))
        steps.append(_bf16("p", rec["p"][0, col]))
        steps.append(_fp32("rms_norm.ss (row)", rec["ss"][0]))
        steps.append(_fp32("rms_norm.mean (row)", rec["mean"][0]))
        steps.append(_fp32("rms_norm.inv (row)", rec["inv"][0]))
        steps.append(_bf16("layer_input", rec["layer_input"][0, col]))

    if mxfp8:
        block = col // BLOCK_SIZE
        steps.append(_fp32(f"mxfp8.amax (block {block})", rec["mxfp8_amax"][0, block]))
        steps.append(_fp32("mxfp8.nm", rec["mxfp8_nm"][0, block]))
        scale = int(rec["mxfp8_scale"][0, block])
        steps.append(Step("mxfp8.scale", 2.0 ** (scale - 127), f"0x{scale:02x}", "ue8m0"))
        steps.append(_fp32("mxfp8.inv_scale", rec["mxfp8_inv_scale"][0, block]))
        steps.append(_fp32("mxfp8.q (clamped)", rec["mxfp8_q"][0, col]))
        code = int(rec["mxfp8_values"][0, col])
        steps.append(Step("mxfp8.value", float(e4m3_decode(torch.tensor(code))), f"0x{code:02x}", "e4m3"))
    return steps


def format_steps(steps: Sequence[Step]) -> str:
    """Steps -> an aligned text table (name, dtype, bits, value)."""
    width = max((len(step.name) for step in steps), default=4)
    lines = [f"{'step':<{width}}  dtype  {'bits':<10}  value"]
    for step in steps:
        lines.append(f"{step.name:<{width}}  {step.dtype:<5}  {step.bits:<10}  {step.value!r}")
    return "\n".join(lines)


def _fp32(name: str, value: torch.Tensor) -> Step:
    return Step(name, float(value), f"0x{int(u32(value.reshape(1))[0]):08x}", "fp32")


def _bf16(name: str, value: torch.Tensor) -> Step:
    return Step(name, float(value.float()), f"0x{int(u16(value.reshape(1))[0]):04x}", "bf16")
