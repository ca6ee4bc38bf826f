"""A float64 model of the same math, stage by stage: a sanity bound, not a bit-exact oracle.

Each stage is recomputed from the reference's own inputs of that stage (its bf16 intermediates),
in float64 (products of an fp32 and a bf16 are exact there; sums nearly so; 1/sqrt is the true
one), and rounded to bf16 once at the same point as the contract. Errors therefore do not
compound across stages.

How far apart may the two be? Both round to bf16 once, so 1 ulp, plus whatever the contract's
fp32 chain itself may lose before that rounding. For a chain of n roundings over terms t_i that
loss is at most about n * 2^-24 * sum |t_i| (the textbook recursive-summation bound); it is far
below a bf16 ulp unless the terms cancel, as they occasionally do in random data (partials near
0.5 summing to 1e-6). So each stage reports the raw distance (`max_ulps`) and the distance left
after subtracting that bound in whole ulps (`max_unexplained_ulps`): a wrong order, a missing
rounding or a wrong rule shows up there, cancellation does not.

The MXFP8 stage is compared in two parts: the scale byte against ceil(log2(amax / 448)) + 127
(the reference multiplies by fp32(1/448), so the two may differ by one just above a
448 * 2^k boundary), and the values under the reference's own scale (no slack).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .bits import bf16_ordered, bf16_rn, f32_bits
from .compose import MixInputs, RankInputs, ReferenceOutputs
from .contribution import gather_rows, routed
from .mxfp8 import BLOCK_SIZE, E4M3_MAX, E4M3_MAX_CODE, UE8M0_MAX, e4m3_decode
from .rms_norm import ReductionTree

# Unit roundoff of fp32 round-to-nearest; one more rounding than the chain has covers the
# float64 model's own (2^-53-sized) error.
_FP32_UNIT_ROUNDOFF = 2.0**-24
_BF16_MIN_QUANTUM_EXP = -133  # bf16 subnormal spacing 2^-133
_BF16_MANTISSA_BITS = 7


@dataclass(frozen=True)
class StageCheck:
    """One stage, over the elements where both are finite: the largest distance in ulps (bf16,
    e4m3 codes or scale bytes), the largest distance beyond the fp32 chain's own error bound,
    how many elements had a nonzero bound in ulps (cancellation), and how many elements disagree
    on NaN/Inf."""

    max_ulps: int
    max_unexplained_ulps: int
    ill_conditioned: int
    nonfinite_mismatches: int
    elements: int


@dataclass
class Float64Report:
    stages: dict[str, StageCheck] = field(default_factory=dict)

    def within(self, max_ulps: int) -> bool:
        """True if no stage is more than max_ulps beyond its fp32 error bound and no NaN/Inf
        position differs."""
        return all(
            s.max_unexplained_ulps <= max_ulps and s.nonfinite_mismatches == 0 for s in self.stages.values()
        )

    def __str__(self) -> str:
        return "\n".join(
            f"{name:<14} max {s.max_ulps} ulp ({s.max_unexplained_ulps} beyond the fp32 error bound,"
            f" {s.ill_conditioned} cancelling), {s.nonfinite_mismatches} NaN/Inf mismatches, {s.elements} elements"
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
        models = [finalize_f64(rank) for rank in ranks]
        report.stages["contribution"] = compare_bf16(
            rec["contribution"], torch.stack([m[0] for m in models]), torch.stack([m[1] for m in models])
        )
    report.stages["reduce"] = compare_bf16(rec["y"], *reduce_f64(rec["contribution"]))
    report.stages["post_mix"] = compare_bf16(
        rec["new_residual"], *post_mix_f64(rec["y"], mix.residual, mix.post, mix.comb)
    )
    if not mix.residual_only:
        report.stages["collapse"] = compare_bf16(rec["p"], *collapse_f64(rec["new_residual"], mix.pre))
        report.stages["rms_norm"] = compare_bf16(
            rec["layer_input"], *rms_norm_f64(rec["p"], mix.norm_weight, mix.eps)
        )
    if outputs.mxfp8_values is not None:
        scale_model = mxfp8_scale_f64(rec["layer_input"])
        report.stages["mxfp8_scale"] = _compare_keys(
            rec["mxfp8_scale"].to(torch.int64), scale_model, torch.zeros_like(scale_model, dtype=torch.bool)
        )
        values_model = mxfp8_values_f64(rec["layer_input"], rec["mxfp8_scale"])
        report.stages["mxfp8_values"] = compare_e4m3(outputs.mxfp8_values, values_model)
    return report


# ----- the model, one function per stage -----------------------------------------------------


def finalize_f64(rank: RankInputs):
    """sum_k w_k * gemm2[idx_k] + shared in float64 -> (bf16 [M, H], fp32 chain error bound)."""
    idx = rank.expanded_idx_to_permuted_idx
    rows = gather_rows(rank.gemm2_permuted, idx).double()  # [M, top_k, H]
    taken = routed(idx, rank.gemm2_permuted.shape[0])[..., None]
    # A skipped route (-1 or invalid) is left out (a zero term), not weighted by 0: 0 * Inf would be NaN.
    terms = torch.where(taken, rank.expert_weights.double()[..., None] * rows, 0.0)
    terms = torch.cat([terms, rank.shared_output.double()[:, None]], dim=1)
    return _rounded_sum(terms, dim=1)


def reduce_f64(contributions: torch.Tensor):
    """[tp, M, H] bf16 -> (bf16 [M, H], bound)."""
    return _rounded_sum(contributions.double(), dim=0)


def post_mix_f64(y, residual, post, comb):
    """a[t] = y * post[t] + sum_s residual[s] * comb[s, t] -> (bf16 [M, hc, H], bound)."""
    m, hc, _ = residual.shape
    post = post.reshape(m, hc).double()
    mixed = residual.double()[:, :, None, :] * comb.double()[..., None]  # [M, source, target, H]
    scaled = (y.double()[:, None, :] * post[..., None])[:, None]  # [M, 1, target, H]
    return _rounded_sum(torch.cat([scaled, mixed], dim=1), dim=1)


def collapse_f64(new_residual, pre):
    """sum_t new_residual[t] * pre[t] -> (bf16 [M, H], bound)."""
    return _rounded_sum(new_residual.double() * pre.double()[..., None], dim=1)


def rms_norm_f64(p, weight, eps: float):
    """p / sqrt(mean(p^2) + eps) * weight -> (bf16 [M, H], bound).

    Nothing cancels here; the bound is relative: H fmas plus at most 64 shuffle/warp/CTA adds
    for ss, the division, the eps add, rsqrt.approx (<= 2 fp32 ulp = 4 unit roundoffs) and two
    multiplies, all counted as if they added up at full strength.
    """
    p64 = p.double()
    hidden = p.shape[1]
    inv = 1.0 / torch.sqrt((p64 * p64).sum(dim=1, keepdim=True) / hidden + eps)
    exact = p64 * inv * weight.double()
    roundings = hidden + 64 + 1 + 1 + 4 + 2
    return bf16_from_f64(exact), exact.abs() * (roundings * _FP32_UNIT_ROUNDOFF)


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
    grid = e4m3_decode(torch.arange(E4M3_MAX_CODE + 1, device=q.device)).double()  # ascending magnitudes
    above = torch.searchsorted(grid, q.abs()).clamp(max=E4M3_MAX_CODE)
    below = (above - 1).clamp(min=0)
    d_above, d_below = grid[above] - q.abs(), q.abs() - grid[below]
    pick_below = (d_below < d_above) | ((d_below == d_above) & (below % 2 == 0))
    code = torch.where(pick_below, below, above)
    return torch.where(torch.signbit(q), code | 0x80, code)


def _rounded_sum(terms: torch.Tensor, dim: int):
    """float64 sum of terms along dim rounded once to bf16, and the error bound of the
    contract's fp32 chain over the same terms: (n + 1) * 2^-24 * sum |terms| (n roundings)."""
    roundings = terms.shape[dim] + 1
    bound = terms.abs().sum(dim=dim) * (roundings * _FP32_UNIT_ROUNDOFF)
    return bf16_from_f64(terms.sum(dim=dim)), bound


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


def compare_bf16(reference: torch.Tensor, model: torch.Tensor, bound: torch.Tensor | None = None) -> StageCheck:
    """Ordered-integer distance of two bf16 tensors; NaN and Inf positions must match exactly.

    bound: absolute error bound of the fp32 chain per element (None: 0); its size in ulps of
    the finer of the two values, rounded down, is forgiven in max_unexplained_ulps.
    """
    ref, mod = reference.cpu(), model.cpu()
    nonfinite = ~torch.isfinite(ref.float()) | ~torch.isfinite(mod.float())
    same_nonfinite = (torch.isnan(ref) & torch.isnan(mod)) | (torch.isinf(ref) & (ref == mod))
    mismatches = nonfinite & ~same_nonfinite
    slack = torch.zeros(ref.shape, dtype=torch.int64)
    if bound is not None:
        finer = torch.minimum(ref.double().abs(), mod.double().abs())
        _, exponent = torch.frexp(finer)  # finer = f * 2^exponent, f in [0.5, 1)
        quantum_exp = torch.clamp(exponent - 1 - _BF16_MANTISSA_BITS, min=_BF16_MIN_QUANTUM_EXP)
        quantum_exp = torch.where(finer == 0, _BF16_MIN_QUANTUM_EXP, quantum_exp)
        ulps = torch.ldexp(bound.cpu().double(), -quantum_exp)
        slack = torch.where(nonfinite | ~torch.isfinite(ulps), 0, torch.floor(ulps).clamp(max=2**40).to(torch.int64))
    check = _compare_keys(bf16_ordered(ref), bf16_ordered(mod), nonfinite, slack)
    return StageCheck(check.max_ulps, check.max_unexplained_ulps, check.ill_conditioned, int(mismatches.sum()), ref.numel())


def compare_e4m3(reference_codes: torch.Tensor, model_codes: torch.Tensor) -> StageCheck:
    """Ordered distance of float8_e4m3fn codes (satfinite never produces NaN: no exclusions)."""
    def key(codes):
        codes = codes.cpu().to(torch.int64)
        return torch.where(codes >= 0x80, -(codes & 0x7F), codes)
    ref = key(reference_codes)
    return _compare_keys(ref, key(model_codes), torch.zeros_like(ref, dtype=torch.bool))


def _compare_keys(ref_keys, model_keys, excluded, slack=None) -> StageCheck:
    distance = torch.where(excluded.cpu(), 0, (ref_keys.cpu() - model_keys.cpu()).abs())
    slack = torch.zeros_like(distance) if slack is None else slack
    unexplained = (distance - slack).clamp(min=0)
    if distance.numel() == 0:
        return StageCheck(0, 0, 0, 0, 0)
    return StageCheck(int(distance.max()), int(unexplained.max()), int((slack > 0).sum()), 0, ref_keys.numel())
