"""The whole TP group: every stage of the numerics contract, in order, for one call.

`all_reduce_mhc` takes what each rank passes to the kernel and returns what every rank gets back
(all ranks' outputs are identical by construction, so one set is returned).

Intermediates (`intermediates=True`), by name:
  contribution        bf16 [tp, M, H]            each rank's contribution after the scrub
  finalize_acc        fp32 [tp, top_k + 1, M, H] finalize only: acc after each route, after shared
  reduce_partial_sum  fp32 [tp, M, H]            the rank-order sum after each rank's add
  y                   bf16 [M, H]
  post_mix_acc        fp32 [M, hc, hc + 1, H]    per target: a after the mul and every fma
  new_residual        bf16 [M, hc, H]
  -- unless residual-only --
  collapse_acc        fp32 [M, hc, H]            c after every fma
  p                   bf16 [M, H]
  ss, mean, inv       fp32 [M]
  layer_input         bf16 [M, H]
  -- with mxfp8 --
  mxfp8_amax, mxfp8_nm, mxfp8_inv_scale  fp32 [M, H/32];  mxfp8_scale  uint8 [M, H/32]
  mxfp8_q             fp32 [M, H]                 scaled and clamped, before the e4m3 rounding
  mxfp8_values        uint8 [M, H]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .collapse import collapse
from .contribution import contribution, finalize_contribution
from .mxfp8 import BLOCK_SIZE, mxfp8_quantize
from .post_mix import post_mix
from .reduce import reduce
from .rms_norm import ReductionTree, rms_norm
from .scrub import scrub


@dataclass
class RankInputs:
    """One rank's sublayer output: `x` [M, H] bf16 for a plain call, or the four finalize
    tensors (gemm2_permuted [rows, H] bf16, expert_weights [M, top_k] fp32,
    expanded_idx_to_permuted_idx [M, top_k] int32, shared_output [M, H] bf16)."""

    x: torch.Tensor | None = None
    gemm2_permuted: torch.Tensor | None = None
    expert_weights: torch.Tensor | None = None
    expanded_idx_to_permuted_idx: torch.Tensor | None = None
    shared_output: torch.Tensor | None = None

    @property
    def is_finalize(self) -> bool:
        return self.x is None

    def rows(self, start: int, stop: int) -> "RankInputs":
        """The same inputs restricted to tokens start .. stop-1 (gemm2_permuted is kept whole)."""
        def cut(t):
            return None if t is None else t[start:stop]
        return RankInputs(
            x=cut(self.x),
            gemm2_permuted=self.gemm2_permuted,
            expert_weights=cut(self.expert_weights),
            expanded_idx_to_permuted_idx=cut(self.expanded_idx_to_permuted_idx),
            shared_output=cut(self.shared_output),
        )


@dataclass
class MixInputs:
    """The mHC inputs, identical on every rank: residual [M, hc, H] bf16, post [M, hc] or
    [M, hc, 1] fp32, comb [M, hc, hc] fp32 ([source, target]), pre [M, hc] fp32 or None,
    norm_weight [H] bf16 or None (both None: residual-only), eps (RMSNorm epsilon)."""

    residual: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    pre: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    eps: float = 1e-6

    @property
    def residual_only(self) -> bool:
        return self.pre is None and self.norm_weight is None

    def rows(self, start: int, stop: int) -> "MixInputs":
        """The same inputs restricted to tokens start .. stop-1."""
        return MixInputs(
            residual=self.residual[start:stop],
            post=self.post[start:stop],
            comb=self.comb[start:stop],
            pre=None if self.pre is None else self.pre[start:stop],
            norm_weight=self.norm_weight,
            eps=self.eps,
        )


@dataclass
class ReferenceOutputs:
    """What every rank gets: new_residual [M, hc, H] bf16; layer_input [M, H] bf16 (None when
    residual-only); mxfp8_values uint8 [M, H] (float8_e4m3fn bits) and mxfp8_scales uint8
    [roundup(M, 128) * roundup(H/32, 4)] (None unless mxfp8); intermediates by name (see module
    docstring) when asked for."""

    new_residual: torch.Tensor
    layer_input: torch.Tensor | None = None
    mxfp8_values: torch.Tensor | None = None
    mxfp8_scales: torch.Tensor | None = None
    intermediates: dict[str, torch.Tensor] | None = field(default=None, repr=False)


def all_reduce_mhc(
    ranks: Sequence[RankInputs],
    mix: MixInputs,
    *,
    tree: ReductionTree | None,
    mxfp8: bool,
    intermediates: bool = False,
) -> ReferenceOutputs:
    """The fused operation for a TP group of len(ranks) ranks, bit for bit.

    tree: the kernel's sum-of-squares tree (required unless residual-only).
    mxfp8: also quantize layer_input (not with residual-only; H a multiple of 32).
    Raises ValueError naming the argument for any shape, dtype or device mismatch.
    """
    validate_inputs(ranks, mix, tree=tree, mxfp8=mxfp8)
    record: dict[str, torch.Tensor] = {}

    contributions = []
    finalize_accs = []
    for rank in ranks:
        if rank.is_finalize:
            c, acc = finalize_contribution(
                rank.gemm2_permuted,
                rank.expert_weights,
                rank.expanded_idx_to_permuted_idx,
                rank.shared_output,
                return_accumulators=True,
            )
            finalize_accs.append(acc)
        else:
            c = contribution(rank.x)
        contributions.append(scrub(c))
    record["contribution"] = torch.stack(contributions)
    if finalize_accs:
        record["finalize_acc"] = torch.stack(finalize_accs)

    y, record["reduce_partial_sum"] = reduce(contributions, return_partial_sums=True)
    record["y"] = y
    new_residual, record["post_mix_acc"] = post_mix(y, mix.residual, mix.post, mix.comb, return_accumulators=True)
    record["new_residual"] = new_residual
    outputs = ReferenceOutputs(new_residual=new_residual)

    if not mix.residual_only:
        p, record["collapse_acc"] = collapse(new_residual, mix.pre, return_accumulators=True)
        record["p"] = p
        layer_input, stats = rms_norm(p, mix.norm_weight, mix.eps, tree, return_stats=True)
        record.update(stats)
        record["layer_input"] = outputs.layer_input = layer_input
        if mxfp8:
            values, scales, blocks = mxfp8_quantize(layer_input, return_blocks=True)
            outputs.mxfp8_values, outputs.mxfp8_scales = values, scales
            record.update({f"mxfp8_{name}": t for name, t in blocks.items()})
            record["mxfp8_values"] = values

    if intermediates:
        outputs.intermediates = record
    return outputs


def validate_inputs(
    ranks: Sequence[RankInputs], mix: MixInputs, *, tree: ReductionTree | None, mxfp8: bool
) -> None:
    """Raise ValueError naming the first argument that is not what the operation takes."""
    residual = mix.residual
    _check(residual, "mix.residual", ndim=3, dtype=torch.bfloat16)
    m, hc, hidden = residual.shape
    if m < 1 or hc < 1 or hidden < 1:
        raise ValueError(f"mix.residual: every dimension of [M, hc, H] must be >= 1, got {tuple(residual.shape)}")
    device = residual.device
    post_shape = (m, hc, 1) if isinstance(mix.post, torch.Tensor) and mix.post.dim() == 3 else (m, hc)
    _check(mix.post, "mix.post", shape=post_shape, dtype=torch.float32, device=device)
    _check(mix.comb, "mix.comb", shape=(m, hc, hc), dtype=torch.float32, device=device)
    if (mix.pre is None) != (mix.norm_weight is None):
        raise ValueError("mix.pre, mix.norm_weight: give both (layer input) or neither (residual-only)")
    if not isinstance(mix.eps, (int, float)) or not math.isfinite(mix.eps) or mix.eps < 0:
        raise ValueError(f"mix.eps: must be a finite float >= 0, got {mix.eps!r}")
    if not mix.residual_only:
        _check(mix.pre, "mix.pre", shape=(m, hc), dtype=torch.float32, device=device)
        _check(mix.norm_weight, "mix.norm_weight", shape=(hidden,), dtype=torch.bfloat16, device=device)
        if not isinstance(tree, ReductionTree):
            raise ValueError("tree: a ReductionTree (the kernel's config) is required for the layer input")
        tree.check_hidden(hidden)
    if mxfp8:
        if mix.residual_only:
            raise ValueError("mxfp8: needs a layer input (pre and norm_weight), not residual-only")
        if hidden % BLOCK_SIZE:
            raise ValueError(f"mxfp8: hidden size {hidden} is not a multiple of {BLOCK_SIZE}")

    if len(ranks) == 0:
        raise ValueError("ranks: need at least one rank")
    finalize = ranks[0].is_finalize
    top_k = None
    for r, rank in enumerate(ranks):
        name = f"ranks[{r}]"
        if not isinstance(rank, RankInputs):
            raise ValueError(f"{name}: expected RankInputs, got {type(rank).__name__}")
        if rank.is_finalize != finalize:
            raise ValueError(f"{name}: every rank must be a plain (x) call or every rank a finalize call")
        if not finalize:
            _check(rank.x, f"{name}.x", shape=(m, hidden), dtype=torch.bfloat16, device=device)
            extra = [n for n in ("gemm2_permuted", "expert_weights", "expanded_idx_to_permuted_idx", "shared_output")
                     if getattr(rank, n) is not None]
            if extra:
                raise ValueError(f"{name}.{extra[0]}: a plain call (x given) takes no finalize tensors")
            continue
        _check(rank.gemm2_permuted, f"{name}.gemm2_permuted", ndim=2, dtype=torch.bfloat16, device=device)
        if rank.gemm2_permuted.shape[1] != hidden:
            raise ValueError(f"{name}.gemm2_permuted: expected [rows, {hidden}], got {tuple(rank.gemm2_permuted.shape)}")
        _check(rank.expert_weights, f"{name}.expert_weights", ndim=2, dtype=torch.float32, device=device)
        if top_k is None:
            top_k = rank.expert_weights.shape[1]
        _check(rank.expert_weights, f"{name}.expert_weights", shape=(m, top_k), dtype=torch.float32, device=device)
        idx_name = f"{name}.expanded_idx_to_permuted_idx"
        idx = rank.expanded_idx_to_permuted_idx
        _check(idx, idx_name, shape=(m, top_k), dtype=torch.int32, device=device)
        # Any int32 index is accepted: one outside the rows contributes nothing (contribution.routed).
        _check(rank.shared_output, f"{name}.shared_output", shape=(m, hidden), dtype=torch.bfloat16, device=device)


def _check(t, name: str, *, shape=None, ndim=None, dtype=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
