"""A float64 model of the same math, stage by stage: a sanity bound, not a bit-exact oracle.

Each stage is recomputed from the reference's own inputs of that stage (its bf16 intermediates),
in float64 (products of an fp32 and a bf16 are exact there; sums nearly so; 1/sqrt is the true
one), and rounded to bf16 once at the same point as the contract. Errors therefore do not
compound across stages, and a stage whose reference result is more than about one bf16 ulp away
from the model has a wrong order, a missing rounding or a wrong rule, not accumulated noise.

The MXFP8 stage is compared in two parts: the scale byte against ceil(log2(amax / 448)) + 127
(the reference multiplies by fp32(1/448), so the two may differ by one just above a
448 * 2^k boundary), and the values under the reference's own scale.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .bits import bf16_ordered, bf16_rn, f32_bits
from .compose import MixInputs, RankInputs, ReferenceOutputs
from .contribution import SKIPPED_ROUTE
from .mxfp8 import BLOCK_SIZE, E4M3_MAX, E4M3_MAX_CODE, UE8M0_MAX, e4m3_decode
from .rms_norm import ReductionTree


@dataclass(frozen=True)
class StageCheck:
    """One stage: the largest distance in ulps (bf16, or e4m3 codes, or scale bytes) over the
    elements where both are finite, and how many elements disagree on NaN/Inf."""

    max_ulps: int
    nonfinite_mismatches: int
    elements: int


@dataclass
class Float64Report:
    stages: dict[str, StageCheck] = field(default_factory=dict)

    def within(self, max_ulps: int) -> bool:
        """True if every stage is within max_ulps and no NaN/Inf position differs."""
        return all(s.max_ulps <= max_ulps and s.nonfinite_mismatches == 0 for s in self.stages.values())

    def __str__(self) -> str:
        return "\n".join(
            f"{name:<14} max {s.max_ulps} ulp, {s.nonfinite_mismatches} NaN/Inf mismatches, {s.elements} elements"
            for name, s in self.stages.items()
        )


def check_against_float64(
    ranks: Sequence[RankInputs],
    mix: MixInputs,
    tree: ReductionTree | None,
    outputs: ReferenceOutputs,
) -> Float64Report:
    """Compare each stage of `outputs` (computed with intermediates=True) with the float64 model.

    tree is accepted for symmetry with the reference; an exact sum has no order to model.
    """
    rec = outputs.intermediates
    if rec is None:
        raise ValueError("outputs: compute them with intermediates=True")
    report = Float64Report()
    if ranks[0].is_finalize:
        # The model sees each rank's published value; scrub(-0.0) = +0.0 has distance 0 anyway.
        model = torch.stack([finalize_f64(rank) for rank in ranks])
        report.stages["contribution"] = compare_bf16(rec["contribution"], model)
    report.stages["reduce"] = compare_bf16(rec["y"], reduce_f64(rec["contribution"]))
    report.stages["post_mix"] = compare_bf16(
        rec["new_residual"], post_mix_f64(rec["y"], mix.residual, mix.post, mix.comb)
    )
    if not mix.residual_only:
        report.stages["collapse"] = compare_bf16(rec["p"], collapse_f64(rec["new_residual"], mix.pre))
        report.stages["rms_norm"] = compare_bf16(rec["layer_input"], rms_norm_f64(rec["p"], mix.norm_weight, mix.eps))
    if outputs.mxfp8_values is not None:
        scale_model = mxfp8_scale_f64(rec["layer_input"])
        report.stages["mxfp8_scale"] = _compare_keys(
            rec["mxfp8_scale"].to(torch.int64), scale_model, torch.zeros_like(scale_model, dtype=torch.bool)
        )
        values_model = mxfp8_values_f64(rec["layer_input"], rec["mxfp8_scale"])
        report.stages["mxfp8_values"] = compare_e4m3(outputs.mxfp8_values, values_model)
    return report


# ----- the model, one function per stage -----------------------------------------------------


def finalize_f64(rank: RankInputs) -> torch.Tensor:
    """sum_k w_k * gemm2[idx_k] + shared in float64 -> bf16 [M, H]."""
    idx = rank.expanded_idx_to_permuted_idx.to(torch.int64)
    rows = rank.gemm2_permuted.double()[idx.clamp(min=0)]  # [M, top_k, H]
    weights = torch.where(idx != SKIPPED_ROUTE, rank.expert_weights.double(), 0.0)
    acc = (weights[..., None] * rows).sum(dim=1) + rank.shared_output.double()
    return bf16_from_f64(acc)


def reduce_f64(contributions: torch.Tensor) -> torch.Tensor:
    """[tp, M, H] bf16 -> bf16 [M, H]."""
    return bf16_from_f64(contributions.double().sum(dim=0))


def post_mix_f64(y, residual, post, comb) -> torch.Tensor:
    """a[t] = y * post[t] + sum_s residual[s] * comb[s, t] -> bf16 [M, hc, H]."""
    m, hc, _ = residual.shape
    post = post.reshape(m, hc).double()
    mixed = torch.einsum("msh,mst->mth", residual.double(), comb.double())
    return bf16_from_f64(y.double()[:, None, :] * post[..., None] + mixed)


def collapse_f64(new_residual, pre) -> torch.Tensor:
    """sum_t new_residual[t] * pre[t] -> bf16 [M, H]."""
    return bf16_from_f64(torch.einsum("mth,mt->mh", new_residual.double(), pre.double()))


def rms_norm_f64(p, weight, eps: float) -> torch.Tensor:
    """p / sqrt(mean(p^2) + eps) * weight -> bf16 [M, H]."""
    p64 = p.double()
    inv = 1.0 / torch.sqrt((p64 * p64).sum(dim=1, keepdim=True) / p.shape[1] + eps)
    return bf16_from_f64(p64 * inv * weight.double())


def mxfp8_scale_f64(layer_input) -> torch.Tensor:
    """Scale byte ceil(log2(amax / 448)) + 127 in 0 .. 254 (int64 [M, H/32]), amax ignoring NaN."""
    m, hidden = layer_input.shape
    v = layer_input.double().reshape(m, hidden // BLOCK_SIZE, BLOCK_SIZE)
    amax = torch.where(torch.isnan(v), -1.0, v.abs()).amax(dim=-1)
    ratio = amax / E4M3_MAX
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)
    e = torch.clamp(ceil_log2 + 127, 0, UE8M0_MAX)
    e = torch.where(ratio <= 0, 0, e)
    return torch.where((amax < 0) | torch.isinf(amax), UE8M0_MAX, e).to(torch.int64)


def mxfp8_values_f64(layer_input, scale_bytes) -> torch.Tensor:
    """Values under the given scale bytes: nearest e4m3 (ties to even code) of
    clamp(v / 2^(e - 127), +-448), NaN -> 448, inverse scale 0 for e = 0 or 254 -> codes int64."""
    m, hidden = layer_input.shape
    e = scale_bytes.to(torch.int64)
    inverse = torch.where((e == 0) | (e == UE8M0_MAX), 0.0, torch.ldexp(torch.ones_like(e, dtype=torch.float64), 127 - e))
    q = layer_input.double().reshape(m, hidden // BLOCK_SIZE, BLOCK_SIZE) * inverse[..., None]
    q = torch.where(torch.isnan(q), E4M3_MAX, q.clamp(-E4M3_MAX, E4M3_MAX)).reshape(m, hidden)
    grid = e4m3_decode(torch.arange(E4M3_MAX_CODE + 1)).double()  # ascending magnitudes
    above = torch.searchsorted(grid, q.abs()).clamp(max=E4M3_MAX_CODE)
    below = (above - 1).clamp(min=0)
    d_above, d_below = grid[above] - q.abs(), q.abs() - grid[below]
    pick_below = (d_below < d_above) | ((d_below == d_above) & (below % 2 == 0))
    code = torch.where(pick_below, below, above)
    return torch.where(torch.signbit(q), code | 0x80, code)


def bf16_from_f64(x: torch.Tensor) -> torch.Tensor:
    """float64 -> bf16 with a single rounding (RNE): round to odd at fp32, then bf16_rn.

    Round-to-odd at 24 bits followed by RNE at 8 bits equals direct RNE, since 24 >= 8 + 2.
    """
    r = x.float()
    bits = f32_bits(r)
    inexact = torch.isfinite(r) & (r != 0) & (r.double() != x)
    towards = torch.where((x.abs() > r.double().abs()), 1, -1).to(torch.int32)
    odd = torch.where(inexact & ((bits & 1) == 0), bits + towards, bits)
    return bf16_rn(odd.view(torch.float32))


# ----- distances -----------------------------------------------------------------------------


def compare_bf16(reference: torch.Tensor, model: torch.Tensor) -> StageCheck:
    """Ordered-integer distance of two bf16 tensors; NaN and Inf positions must match exactly."""
    ref, mod = reference.cpu(), model.cpu()
    nonfinite = ~torch.isfinite(ref.float()) | ~torch.isfinite(mod.float())
    same_nonfinite = (torch.isnan(ref) & torch.isnan(mod)) | (torch.isinf(ref) & (ref == mod))
    mismatches = nonfinite & ~same_nonfinite
    check = _compare_keys(bf16_ordered(ref), bf16_ordered(mod), nonfinite)
    return StageCheck(check.max_ulps, int(mismatches.sum()), ref.numel())


def compare_e4m3(reference_codes: torch.Tensor, model_codes: torch.Tensor) -> StageCheck:
    """Ordered distance of float8_e4m3fn codes (satfinite never produces NaN: no exclusions)."""
    def key(codes):
        codes = codes.cpu().to(torch.int64)
        return torch.where(codes >= 0x80, -(codes & 0x7F), codes)
    ref = key(reference_codes)
    return _compare_keys(ref, key(model_codes), torch.zeros_like(ref, dtype=torch.bool))


def _compare_keys(ref_keys, model_keys, excluded) -> StageCheck:
    distance = torch.where(excluded, 0, (ref_keys.cpu() - model_keys.cpu()).abs())
    return StageCheck(int(distance.max()) if distance.numel() else 0, 0, ref_keys.numel())
