"""The reference against the float64 model (reference.float64_model), per case (small M).

The model recomputes each stage from the reference's own inputs of that stage, in float64,
with the error bound of the contract's fp32 chain over the same terms (cancellation in an
accumulating stage is explained by it, a wrong order or rounding is not). A stage passes when
NaN/Inf sit at the same places and the distance beyond that bound is within ULP_BOUND bf16 ulps.

That distance is measured here in value space, |reference - model| - bound, in ulps of the
larger of the two: check_against_float64's `max_unexplained_ulps` subtracts the bound from the
ordered-ulp distance, which overstates it by thousands of ulps when the bound interval contains
0 (a cancelling sum whose reference and model values have opposite signs: -8.5e-5 vs 3.1e-4
under a bound of 7e-3 in tp4-H7168-hc4-M16-call-residual_only-wide_range). The MXFP8 stages
(codes and scale steps, no fp32 chain) are judged by check_against_float64 as they are.

Not judged where float64 is no model of the contract, recorded with the reason (NOT_JUDGED): the
rms_norm of a case whose fp32 sum of squares overflowed to Inf (wide_range rows of 2^60-sized
values; the contract's inv is then 0, float64's is not).

Known deviations of the model itself (KNOWN_DEVIATIONS) are strict: where one applies, the
stage is expected to fail; if it passes, that is an "unexpected pass" and the check fails, so a
fixed model forces the entry out of the ledger.
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from mhc_ar.config import Contribution, Variant
from reference import all_reduce_mhc, check_against_float64
from reference import float64_model

from .cases import Case, Family
from .inputs import CaseInputs, make_inputs
from .runner import tiling_tree
from .status import CheckStatus

ULP_BOUND = 1  # unexplained bf16 ulps (or e4m3 codes, or scale steps) allowed per stage
_BF16_MIN_ULP = 2.0**-133
_BF16_MANTISSA_BITS = 7
# stage -> (reason, applies(intermediates)): where float64 cannot model the contract.
NOT_JUDGED: dict[str, tuple[str, Callable[[dict], bool]]] = {
    "rms_norm": (
        "the fp32 sum of squares overflowed to Inf (inv = 0); float64 does not overflow",
        lambda rec: bool(torch.isinf(rec["ss"]).any()),
    ),
}


@dataclass(frozen=True)
class KnownDeviation:
    """A stage where the float64 model is known to be wrong for such inputs, and why."""

    family: Family
    op: Contribution
    stage: str
    reason: str
    applies: Callable[[CaseInputs], bool]


KNOWN_DEVIATIONS: tuple = ()  # none known: the model left skipped routes out instead of weighting them by 0


@dataclass
class StageResult:
    stage: str
    max_ulps: int
    max_unexplained_ulps: int
    ill_conditioned: int  # elements whose fp32 error bound reaches an ulp (cancellation)
    nonfinite_mismatches: int
    elements: int
    judged: bool
    passed: bool
    note: str | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class ReferenceCheck:
    case: Case
    status: CheckStatus  # pass | fail | error
    stages: list[StageResult] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None

    def to_dict(self) -> dict:
        return {
            "case": self.case.id,
            "family": self.case.family.value,
            "m": self.case.m,
            "status": CheckStatus(self.status).value,
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
    """Reference vs float64 model for one case; never raises (an exception is status error)."""
    start = time.perf_counter()
    try:
        inputs = make_inputs(case, device)
        tree = tiling_tree(case.hidden)
        outputs = all_reduce_mhc(
            inputs.ranks, inputs.mix, tree=tree, mxfp8=case.variant is Variant.MXFP8, intermediates=True
        )
        report = check_against_float64(inputs.ranks, inputs.mix, tree, outputs)
        value_space = unexplained_in_value_space(inputs, outputs.intermediates)
        stages = [
            _judge(case, inputs, outputs.intermediates, name, check, value_space.get(name))
            for name, check in report.stages.items()
        ]
    except Exception:
        return ReferenceCheck(case, CheckStatus.ERROR, seconds=time.perf_counter() - start, error=traceback.format_exc())
    status = CheckStatus.PASS if all(s.passed for s in stages) else CheckStatus.FAIL
    return ReferenceCheck(case, status, stages, time.perf_counter() - start)


def _judge(case: Case, inputs: CaseInputs, rec: dict, stage: str, check, value_space) -> StageResult:
    unexplained, nonfinite = (check.max_unexplained_ulps, check.nonfinite_mismatches) if value_space is None else value_space
    within = unexplained <= ULP_BOUND and nonfinite == 0
    result = StageResult(
        stage,
        max_ulps=check.max_ulps,
        max_unexplained_ulps=unexplained,
        ill_conditioned=check.ill_conditioned,
        nonfinite_mismatches=nonfinite,
        elements=check.elements,
        judged=True,
        passed=within,
    )
    if not within:
        result.note = (
            f"{unexplained} ulp beyond the fp32 error bound (allowed {ULP_BOUND}), "
            f"{nonfinite} NaN/Inf positions differ"
        )
    if stage in NOT_JUDGED:
        why_not, applies = NOT_JUDGED[stage]
        if applies(rec):
            result.judged, result.passed, result.note = False, True, f"not judged: {why_not}"
            return result
    for deviation in KNOWN_DEVIATIONS:
        if (deviation.family, deviation.op, deviation.stage) != (case.family, case.op, stage):
            continue
        if deviation.applies(inputs):
            if within:
                result.passed = False
                result.note = f"unexpected pass of a known deviation (remove it from the ledger): {deviation.reason}"
            else:
                result.passed = True
                result.note = f"known deviation (expected failure): {deviation.reason}"
    return result


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (float64), never below the smallest bf16 subnormal."""
    exponent = torch.floor(torch.log2(x.abs().clamp(min=2.0**-126)))
    return torch.exp2(exponent - _BF16_MANTISSA_BITS).clamp(min=_BF16_MIN_ULP)


def _beyond_bound(reference: torch.Tensor, model: torch.Tensor, bound: torch.Tensor) -> tuple[int, int]:
    """(largest ceil((|reference - model| - bound) / ulp) over finite elements, 0 at least;
    elements whose NaN/Inf status differs)."""
    got, want = reference.double(), model.double()
    finite = torch.isfinite(got) & torch.isfinite(want)
    same_special = (torch.isnan(got) & torch.isnan(want)) | (torch.isinf(got) & (got == want))
    nonfinite = int((~finite & ~same_special).sum())
    ulp = _bf16_ulp(torch.maximum(got.abs(), want.abs()))
    excess = torch.where(finite, ((got - want).abs() - bound.double()) / ulp, 0.0)
    worst = float(excess.max()) if excess.numel() else 0.0
    return max(0, math.ceil(worst)), nonfinite


def unexplained_in_value_space(inputs: CaseInputs, rec: dict) -> dict[str, tuple[int, int]]:
    """stage -> (unexplained ulps, NaN/Inf mismatches) for every bf16 stage, from the model's
    own per-stage (value, bound) functions."""
    mix = inputs.mix
    out = {}
    if inputs.ranks[0].is_finalize:
        per_rank = [_beyond_bound(rec["contribution"][r], *float64_model.finalize_f64(rank)) for r, rank in enumerate(inputs.ranks)]
        out["contribution"] = (max(u for u, _ in per_rank), sum(n for _, n in per_rank))
    out["reduce"] = _beyond_bound(rec["y"], *float64_model.reduce_f64(rec["contribution"]))
    out["post_mix"] = _beyond_bound(rec["new_residual"], *float64_model.post_mix_f64(rec["y"], mix.residual, mix.post, mix.comb))
    if not mix.residual_only:
        out["collapse"] = _beyond_bound(rec["p"], *float64_model.collapse_f64(rec["new_residual"], mix.pre))
        out["rms_norm"] = _beyond_bound(rec["layer_input"], *float64_model.rms_norm_f64(rec["p"], mix.norm_weight, mix.eps))
    return out


def reference_check_cases(cases: Sequence[Case], max_m: int) -> list[Case]:
    """The CPU-sized subset: cases with M <= max_m."""
    return [case for case in cases if case.m <= max_m]


__all__ = [
    "KNOWN_DEVIATIONS",
    "KnownDeviation",
    "NOT_JUDGED",
    "ReferenceCheck",
    "StageResult",
    "ULP_BOUND",
    "check_reference",
    "reference_check_cases",
    "unexplained_in_value_space",
]
