"""The reference against a float64 model of the same math, per case (CPU-sized: small M).

Two kinds of stages:

* rounding-only stages (rms_norm, mxfp8_scale, mxfp8_values): `reference.check_against_float64`
  recomputes each from the reference's own inputs of that stage; with one rounding at the same
  point (and positive sums only), a correct reference is within ULP_BOUND of it.
* accumulating stages (contribution, reduce, post_mix, collapse): an fp32 chain of n roundings
  of partial sums is not within one bf16 ulp of the exact value when its terms cancel (y * post
  rounded to fp32 and then cancelled by the residual terms is 38 bf16 ulps off in a plain
  normal case). These are judged against the exact float64 value with the classic bound
      |reference - exact| <= n * 2^-24 * sum|terms| + n * 2^-150 + ulp_bf16(result)
  (each fp32 rounding errs by at most 2^-24 of a partial sum, which is at most sum|terms|, or
  by 2^-150 when subnormal; then one bf16 rounding), and NaN/Inf must sit where the exact
  value has them. check_against_float64's ulps for these stages are recorded too, unjudged.

Not judged (recorded with the reason): the rms_norm of wide_range, whose rows of 2^60-sized
values overflow the fp32 sum of squares (inv = 0) where float64 does not.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Sequence

import torch

from mhc_ar.config import Variant
from reference import all_reduce_mhc, check_against_float64

from .cases import Case, Family
from .inputs import CaseInputs, make_inputs
from .runner import tiling_tree

ULP_BOUND = 1  # rounding-only stages: bf16 ulps (or e4m3 codes, or scale steps) from the model
ACCUMULATING_STAGES = ("contribution", "reduce", "post_mix", "collapse")
NOT_JUDGED: dict[Family, dict[str, str]] = {
    Family.WIDE_RANGE: {"rms_norm": "the fp32 sum of squares overflows (inv = 0), float64 does not"},
}
_F32_EPSILON = 2.0**-24  # unit roundoff of fp32
_F32_SUBNORMAL_ERROR = 2.0**-150  # half the smallest fp32 subnormal
_BF16_MIN_ULP = 2.0**-133
_BF16_MANTISSA_BITS = 7


@dataclass
class StageResult:
    stage: str
    max_ulps: int  # from check_against_float64
    nonfinite_mismatches: int  # from check_against_float64
    elements: int
    judged: bool
    passed: bool
    bound_ratio: float | None = None  # accumulating stages: max |error| / allowed error
    note: str | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class ReferenceCheck:
    case: Case
    status: str  # pass | fail | error
    stages: list[StageResult] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None

    def to_dict(self) -> dict:
        return {
            "case": self.case.id,
            "family": self.case.family.value,
            "m": self.case.m,
            "status": self.status,
            "ulp_bound": ULP_BOUND,
            "seconds": round(self.seconds, 4),
            "stages": [s.to_dict() for s in self.stages],
            "error": self.error,
        }

    def summary(self) -> str:
        if self.error:
            return f"{self.status.upper():8} {self.case.id}: {self.error.strip().splitlines()[-1]}"
        failed = [s for s in self.stages if not s.passed]
        detail = "; ".join(f"{s.stage}: {s.note}" for s in failed)
        return f"{self.status.upper():8} {self.case.id}" + (f": {detail}" if detail else "")


def check_reference(case: Case, device="cpu") -> ReferenceCheck:
    """Reference vs float64 for one case; never raises (an exception is status error)."""
    start = time.perf_counter()
    try:
        inputs = make_inputs(case, device)
        tree = tiling_tree(case.hidden)
        outputs = all_reduce_mhc(
            inputs.ranks, inputs.mix, tree=tree, mxfp8=case.variant is Variant.MXFP8, intermediates=True
        )
        report = check_against_float64(inputs.ranks, inputs.mix, tree, outputs)
        bounds = accumulation_bounds(inputs, outputs.intermediates)
        stages = []
        for name, model in report.stages.items():
            stages.append(_judge(case, name, model, bounds.get(name)))
        for name in bounds.keys() - report.stages.keys():  # e.g. a stage the model skips
            stages.append(_judge(case, name, None, bounds[name]))
    except Exception:
        return ReferenceCheck(case, "error", seconds=time.perf_counter() - start, error=traceback.format_exc())
    status = "pass" if all(s.passed for s in stages) else "fail"
    return ReferenceCheck(case, status, stages, time.perf_counter() - start)


def _judge(case: Case, stage: str, model, bound) -> StageResult:
    result = StageResult(
        stage,
        max_ulps=-1 if model is None else model.max_ulps,
        nonfinite_mismatches=-1 if model is None else model.nonfinite_mismatches,
        elements=0 if model is None else model.elements,
        judged=True,
        passed=True,
    )
    why_not = NOT_JUDGED.get(case.family, {}).get(stage)
    if why_not:
        result.judged, result.note = False, f"not judged: {why_not}"
    elif bound is not None:
        ratio, nonfinite, elements = bound
        result.bound_ratio, result.elements = ratio, elements
        result.passed = ratio <= 1.0 and nonfinite == 0
        if not result.passed:
            result.note = f"error {ratio:.3g} x the fp32 accumulation bound, {nonfinite} NaN/Inf positions differ"
    else:
        result.passed = model.max_ulps <= ULP_BOUND and model.nonfinite_mismatches == 0
        if not result.passed:
            result.note = f"{model.max_ulps} ulp from float64 (bound {ULP_BOUND}), {model.nonfinite_mismatches} NaN/Inf differ"
    return result


# ----- the accumulation bound -------------------------------------------------------------------


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (float64), never below the smallest bf16 subnormal."""
    exponent = torch.floor(torch.log2(x.abs().clamp(min=2.0**-126)))
    return torch.exp2(exponent - _BF16_MANTISSA_BITS).clamp(min=_BF16_MIN_ULP)


def _within_bound(result_bf16: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, roundings: int):
    """(max error / allowed error over finite elements, NaN/Inf position mismatches, elements)."""
    got = result_bf16.double()
    finite = torch.isfinite(got) & torch.isfinite(exact)
    same_special = (torch.isnan(got) & torch.isnan(exact)) | (torch.isinf(got) & (got == exact))
    nonfinite = int((~finite & ~same_special).sum())
    allowed = roundings * (_F32_EPSILON * magnitude + _F32_SUBNORMAL_ERROR) + _bf16_ulp(torch.maximum(got.abs(), exact.abs()))
    error = torch.where(finite, (got - exact).abs() / allowed, 0.0)
    return (float(error.max()) if error.numel() else 0.0), nonfinite, got.numel()


def accumulation_bounds(inputs: CaseInputs, rec: dict) -> dict[str, tuple[float, int, int]]:
    """Each accumulating stage of the reference (from its intermediates) against its exact
    float64 value: stage -> (max error ratio, NaN/Inf mismatches, elements)."""
    mix = inputs.mix
    out = {}
    if inputs.ranks[0].is_finalize:
        ratios = []
        for r, rank in enumerate(inputs.ranks):
            idx = rank.expanded_idx_to_permuted_idx.long()
            taken = (idx != -1)[..., None]
            rows = rank.gemm2_permuted.double()[idx.clamp(min=0)]  # [M, top_k, H]
            # A skipped route is left out, not multiplied by 0 (0 * Inf would be NaN).
            terms = torch.where(taken, rank.expert_weights.double()[..., None] * rows, 0.0)
            shared = rank.shared_output.double()
            exact = terms.sum(dim=1) + shared
            magnitude = terms.abs().sum(dim=1) + shared.abs()
            ratios.append(_within_bound(rec["contribution"][r], exact, magnitude, idx.shape[1] + 1))
        out["contribution"] = _worst(ratios)
    contributions = rec["contribution"].double()  # [tp, M, H], after the scrub
    out["reduce"] = _within_bound(rec["y"], contributions.sum(dim=0), contributions.abs().sum(dim=0), len(inputs.ranks))
    m, hc, _ = mix.residual.shape
    y = rec["y"].double()[:, None, :]
    post = mix.post.reshape(m, hc).double()[..., None]
    products = mix.residual.double()[:, :, None, :] * mix.comb.double()[..., None]  # [M, s, t, H]
    exact = y * post + products.sum(dim=1)
    magnitude = (y * post).abs() + products.abs().sum(dim=1)
    out["post_mix"] = _within_bound(rec["new_residual"], exact, magnitude, hc + 1)
    if mix.pre is not None:
        terms = rec["new_residual"].double() * mix.pre.double()[..., None]  # [M, t, H]
        out["collapse"] = _within_bound(rec["p"], terms.sum(dim=1), terms.abs().sum(dim=1), hc)
    return out


def _worst(results):
    return max(r[0] for r in results), sum(r[1] for r in results), sum(r[2] for r in results)


def reference_check_cases(cases: Sequence[Case], max_m: int) -> list[Case]:
    """The CPU-sized subset: cases with M <= max_m."""
    return [case for case in cases if case.m <= max_m]


__all__ = [
    "ACCUMULATING_STAGES",
    "NOT_JUDGED",
    "ReferenceCheck",
    "StageResult",
    "ULP_BOUND",
    "accumulation_bounds",
    "check_reference",
    "reference_check_cases",
]
