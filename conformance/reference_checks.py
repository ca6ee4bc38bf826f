"""The reference against reference.check_against_float64, per case (CPU-sized: small M).

The float64 model recomputes each stage from the reference's own inputs of that stage and
reports, per stage, the raw distance in bf16 ulps (e4m3 codes, scale steps) and the distance
left after the fp32 chain's own error bound (`max_unexplained_ulps`: cancellation in an
accumulating stage is explained, a wrong order or rounding is not). A stage passes when the
unexplained distance is within ULP_BOUND and NaN/Inf sit at the same places.

Not judged where float64 is no model of the contract, recorded with the reason (NOT_JUDGED): the
rms_norm of a case whose fp32 sum of squares overflowed to Inf (wide_range rows of 2^60-sized
values; the contract's inv is then 0, float64's is not).

Known deviations of the model itself (KNOWN_DEVIATIONS) are strict: where one applies, the
stage is expected to fail; if it passes, that is an "unexpected pass" and the check fails, so a
fixed model forces the entry out of the ledger.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from mhc_ar.config import Contribution, Variant
from reference import all_reduce_mhc, check_against_float64

from .cases import Case, Family
from .inputs import CaseInputs, make_inputs
from .runner import tiling_tree

ULP_BOUND = 1  # unexplained bf16 ulps (or e4m3 codes, or scale steps) allowed per stage
# stage -> (reason, applies(intermediates)): where float64 cannot model the contract.
NOT_JUDGED: dict[str, tuple[str, Callable[[dict], bool]]] = {
    "rms_norm": (
        "the fp32 sum of squares overflowed to Inf (inv = 0); float64 does not overflow",
        lambda rec: bool(torch.isinf(rec["ss"]).any()),
    ),
}


def _skipped_route_meets_special_row0(inputs: CaseInputs) -> bool:
    """Some rank routes a token to -1 while its gemm2_permuted row 0 holds a NaN or Inf."""
    for rank in inputs.ranks:
        if rank.gemm2_permuted is None:
            continue
        row0_special = not bool(torch.isfinite(rank.gemm2_permuted[0].float()).all())
        if row0_special and bool((rank.expanded_idx_to_permuted_idx == -1).any()):
            return True
    return False


@dataclass(frozen=True)
class KnownDeviation:
    """A stage where the float64 model is known to be wrong for such inputs, and why."""

    family: Family
    op: Contribution
    stage: str
    reason: str
    applies: Callable[[CaseInputs], bool]


KNOWN_DEVIATIONS = (
    KnownDeviation(
        Family.NAN_INF,
        Contribution.FINALIZE,
        "contribution",
        "reference/float64_model.finalize_f64 weights a skipped route (-1) by 0 after clamping its "
        "index to row 0 instead of leaving it out, so a NaN/Inf in gemm2_permuted row 0 becomes "
        "0 * Inf = NaN in every token with a skipped route",
        _skipped_route_meets_special_row0,
    ),
)


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
    """Reference vs float64 model for one case; never raises (an exception is status error)."""
    start = time.perf_counter()
    try:
        inputs = make_inputs(case, device)
        tree = tiling_tree(case.hidden)
        outputs = all_reduce_mhc(
            inputs.ranks, inputs.mix, tree=tree, mxfp8=case.variant is Variant.MXFP8, intermediates=True
        )
        report = check_against_float64(inputs.ranks, inputs.mix, tree, outputs)
        stages = [_judge(case, inputs, outputs.intermediates, name, check) for name, check in report.stages.items()]
    except Exception:
        return ReferenceCheck(case, "error", seconds=time.perf_counter() - start, error=traceback.format_exc())
    status = "pass" if all(s.passed for s in stages) else "fail"
    return ReferenceCheck(case, status, stages, time.perf_counter() - start)


def _judge(case: Case, inputs: CaseInputs, rec: dict, stage: str, check) -> StageResult:
    within = check.max_unexplained_ulps <= ULP_BOUND and check.nonfinite_mismatches == 0
    result = StageResult(
        stage,
        max_ulps=check.max_ulps,
        max_unexplained_ulps=check.max_unexplained_ulps,
        ill_conditioned=check.ill_conditioned,
        nonfinite_mismatches=check.nonfinite_mismatches,
        elements=check.elements,
        judged=True,
        passed=within,
    )
    if not within:
        result.note = (
            f"{check.max_unexplained_ulps} ulp beyond the fp32 error bound (allowed {ULP_BOUND}), "
            f"{check.nonfinite_mismatches} NaN/Inf positions differ"
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
]
