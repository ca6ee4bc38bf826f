"""Running cases: the kernel through a backend, the reference beside it, every byte compared.

A `KernelBackend` turns (case, inputs) into every rank's outputs and says which reduction tree
its consumer uses. `EmulatedKernelBackend` runs the real kernels on one GPU (tp virtual ranks);
`ReferenceKernelBackend` plays the kernel with the reference's own outputs, optionally with
planted byte flips, so the whole harness (comparison, bundles, reports, repro) runs and is
tested on a CPU.

Per case: inputs are drawn on the backend's device, the kernel runs on outputs poisoned with
NaN (so an element the kernel forgot cannot pass), the reference runs on the same device, and
every rank's new_residual, layer_input and MXFP8 bytes are compared with the reference, rank 0
with every other rank, and (on a GPU, MXFP8 variant) the MXFP8 bytes with
flashinfer.mxfp8_quantize(layer_input, backend="cute-dsl") as a second oracle.
"""

from __future__ import annotations

import enum
import gc
import re
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from mhc_ar.config import Contribution, Variant, choose_consumer_tiling, mxfp8_scale_bytes
from reference import ReductionTree, ReferenceOutputs, all_reduce_mhc, invalid_routes

from .cases import Case
from .compare import Mismatch, first_mismatch
from .inputs import CaseInputs, make_inputs

# Poison written into every output before a kernel call: values the kernel can never produce
# (it writes the canonical NaN 0x7FFF, e4m3 satfinite never gives 0xFF, scales stop at 254).
POISON_BF16 = 0x7FC0
POISON_FP8 = 0xFF
POISON_SCALE = 0xFF

OUTPUTS = ("new_residual", "layer_input", "mxfp8_values", "mxfp8_scales")


class Status(str, enum.Enum):
    PASS = "pass"
    MISMATCH = "mismatch"
    ERROR = "error"
    NOT_RUN = "not_run"


@dataclass
class KernelOutputs:
    """Every rank's outputs: new_residual [M, hc, H] bf16; layer_input [M, H] bf16 (None for
    residual_only); mxfp8_values [M, H] float8_e4m3fn and mxfp8_scales uint8
    [mxfp8_scale_bytes(M, H)] (None unless MXFP8). Lists are indexed by rank."""

    new_residual: list[torch.Tensor]
    layer_input: list[torch.Tensor | None]
    mxfp8_values: list[torch.Tensor | None]
    mxfp8_scales: list[torch.Tensor | None]

    @property
    def tp(self) -> int:
        return len(self.new_residual)

    def get(self, output: str, rank: int) -> torch.Tensor | None:
        return getattr(self, output)[rank]

    def tensors(self) -> dict[str, torch.Tensor]:
        """rank{r}.{output} -> tensor, for every output that exists."""
        return {
            f"rank{r}.{name}": t
            for name in OUTPUTS
            for r, t in enumerate(getattr(self, name))
            if t is not None
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], tp: int) -> "KernelOutputs":
        lists = {name: [tensors.get(f"rank{r}.{name}") for r in range(tp)] for name in OUTPUTS}
        if any(t is None for t in lists["new_residual"]):
            raise ValueError("kernel outputs: new_residual is missing for some rank")
        return cls(**lists)


class KernelBackend(Protocol):
    """What runs the operation under test."""

    device: torch.device

    def run(self, case: Case, inputs: CaseInputs) -> KernelOutputs:
        """Every rank's outputs for one call with `inputs` (already on self.device)."""

    def tree(self, case: Case) -> ReductionTree:
        """The sum-of-squares order of the consumer that ran `case`."""


def tiling_tree(hidden: int) -> ReductionTree:
    """The reduction tree of the consumer tiling mhc_ar chooses for a hidden size."""
    return ReductionTree(**choose_consumer_tiling(hidden).reduction_tree_args())


# ----- the GPU backend ----------------------------------------------------------------------------


def instance_arguments(case: Case) -> dict:
    """The AllReduceMHC / EmulatedAllReduceMHC constructor arguments a case needs (but tp/group)."""
    return dict(
        hidden_size=case.hidden,
        hc_mult=case.hc,
        max_num_tokens=case.capacity,
        top_k=case.top_k,
        quantize_layer_input=case.variant is Variant.MXFP8,
        residual_only=case.variant is Variant.RESIDUAL_ONLY,
    )


def poisoned_outputs(case: Case, device) -> KernelOutputs:
    """Output tensors for every rank, filled with the poison patterns."""
    m, h, hc, tp = case.m, case.hidden, case.hc, case.tp
    has_layer_input = case.variant is not Variant.RESIDUAL_ONLY
    has_mxfp8 = case.variant is Variant.MXFP8

    def empty(dtype, *shape):
        return torch.empty(shape, dtype=dtype, device=device)

    outputs = KernelOutputs(
        new_residual=[empty(torch.bfloat16, m, hc, h) for _ in range(tp)],
        layer_input=[empty(torch.bfloat16, m, h) if has_layer_input else None for _ in range(tp)],
        mxfp8_values=[empty(torch.float8_e4m3fn, m, h) if has_mxfp8 else None for _ in range(tp)],
        mxfp8_scales=[empty(torch.uint8, mxfp8_scale_bytes(m, h)) if has_mxfp8 else None for _ in range(tp)],
    )
    poison(outputs)
    return outputs


def poison(outputs: KernelOutputs) -> None:
    """Fill every output buffer with its poison pattern (again, before a replay reuses them)."""
    patterns = {"new_residual": (torch.int16, POISON_BF16), "layer_input": (torch.int16, POISON_BF16),
                "mxfp8_values": (torch.uint8, POISON_FP8), "mxfp8_scales": (torch.uint8, POISON_SCALE)}
    for name, (view, fill) in patterns.items():
        for tensor in getattr(outputs, name):
            if tensor is not None:
                tensor.view(view).fill_(fill)


def call_rank(op, case: Case, inputs: CaseInputs, rank: int, outputs: KernelOutputs) -> None:
    """One rank's call of `case` through an AllReduceMHC `op`, into that rank's buffers of
    `outputs` (real TP under torchrun, and the concurrent ranks of conformance.stress)."""
    out = (outputs.new_residual[rank], outputs.layer_input[rank])
    mxfp8_out = (outputs.mxfp8_values[rank], outputs.mxfp8_scales[rank]) if case.variant is Variant.MXFP8 else None
    own, mix = inputs.ranks[rank], inputs.mix
    mixing = (mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight, mix.eps)
    if case.op is Contribution.CALL:
        op(own.x, *mixing, mxfp8_out=mxfp8_out, out=out)
    else:
        op.finalize(own.gemm2_permuted, own.expert_weights, own.expanded_idx_to_permuted_idx, own.shared_output,
                    *mixing, mxfp8_out=mxfp8_out, out=out)


class EmulatedKernelBackend:
    """The real kernels on one GPU: mhc_ar.EmulatedAllReduceMHC, tp virtual ranks.

    One instance per (tp, hidden, hc, capacity, top_k, variant) is kept; when a case needs
    another, the previous one is released first (mailboxes of tp=8, H=7168 take ~0.7 GB).
    """

    def __init__(self, device="cuda"):
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"EmulatedKernelBackend needs a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._key = None
        self._instance = None
        self._routes_seen = None

    def instance(self, case: Case):
        if case.instance_key != self._key:
            self.close()
            from mhc_ar import EmulatedAllReduceMHC

            self._instance = EmulatedAllReduceMHC(tp_size=case.tp, device=self.device, **instance_arguments(case))
            self._key = case.instance_key
        return self._instance

    def close(self) -> None:
        self._instance = None
        self._key = None
        self._routes_seen = None
        gc.collect()
        torch.cuda.empty_cache()

    def tree(self, case: Case) -> ReductionTree:
        return ReductionTree(**self.instance(case).consumer_tiling.reduction_tree_args())

    def run(self, case: Case, inputs: CaseInputs) -> KernelOutputs:
        instance = self.instance(case)
        outputs = poisoned_outputs(case, self.device)
        # GPU time of the call alone (every rank's publish and consumer), for the report's plot.
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call_emulated(instance, case, inputs, outputs)
        stop.record()
        torch.cuda.synchronize(self.device)
        self.last_kernel_gpu_s = start.elapsed_time(stop) / 1e3
        if case.op is Contribution.FINALIZE:
            self._check_route_counts(instance, inputs)
        return outputs

    def _check_route_counts(self, instance, inputs: CaseInputs) -> None:
        """The device's invalid-route count (mhc_ar.routes) must have grown, per rank, by what the
        reference counts in this case's routes (0 for every generated case)."""
        counts = instance.invalid_routes()
        seen = self._routes_seen or [0] * len(counts)
        new = [c - s for c, s in zip(counts, seen)]
        self._routes_seen = counts
        want = [invalid_routes(r.expanded_idx_to_permuted_idx, r.gemm2_permuted.shape[0]) for r in inputs.ranks]
        if new != want:
            raise RuntimeError(f"invalid-route count per rank {new} after this call, the reference counts {want}")


def call_emulated(obj, case: Case, inputs: CaseInputs, outputs: KernelOutputs) -> None:
    """One call of an object with EmulatedAllReduceMHC's interface (per-rank lists), its outputs
    written into `outputs`."""
    mix, ranks = inputs.mix, inputs.ranks
    out = list(zip(outputs.new_residual, outputs.layer_input))
    mxfp8_out = list(zip(outputs.mxfp8_values, outputs.mxfp8_scales)) if case.variant is Variant.MXFP8 else None
    mixing = (mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight, mix.eps)
    if case.op is Contribution.CALL:
        obj([rank.x for rank in ranks], *mixing, mxfp8_out=mxfp8_out, out=out)
    else:
        obj.finalize([r.gemm2_permuted for r in ranks], [r.expert_weights for r in ranks],
                     [r.expanded_idx_to_permuted_idx for r in ranks], [r.shared_output for r in ranks],
                     *mixing, mxfp8_out=mxfp8_out, out=out)


# ----- a CPU stand-in for the kernel -------------------------------------------------------------


@dataclass(frozen=True)
class PlantedFlip:
    """XOR `mask` into byte `byte` (of the flattened tensor) of `output` on `rank`. From the
    command line (`run --plant OUTPUT@RANK:INDEX`, see `parse`): `element` names a flat element
    index instead (its lowest byte is flipped), and cases without that output or rank are left
    alone (`everywhere`)."""

    output: str
    rank: int
    byte: int = 0
    mask: int = 0x01
    element: int | None = None
    everywhere: bool = False

    @classmethod
    def parse(cls, text: str) -> "PlantedFlip":
        """OUTPUT@RANK:INDEX, e.g. new_residual@1:4096; a ValueError with the form otherwise."""
        match = re.fullmatch(r"([a-z0-9_]+)@(\d+):(\d+)", text.strip())
        if not match or match.group(1) not in OUTPUTS:
            raise ValueError(f"--plant {text!r}: expected OUTPUT@RANK:INDEX with OUTPUT one of {', '.join(OUTPUTS)}")
        return cls(match.group(1), int(match.group(2)), element=int(match.group(3)), everywhere=True)

    def __str__(self) -> str:
        where = f"element {self.element}" if self.element is not None else f"byte {self.byte}"
        return f"{self.output} rank {self.rank} {where} ^ 0x{self.mask:02x}"


class ReferenceKernelBackend:
    """Plays the kernel with the reference's outputs (every rank identical), after planting
    the given byte flips: a harness self-test that needs no GPU."""

    def __init__(self, device="cpu", plants: Sequence[PlantedFlip] = ()):
        self.device = torch.device(device)
        self.plants = tuple(plants)

    def tree(self, case: Case) -> ReductionTree:
        return tiling_tree(case.hidden)

    def run(self, case: Case, inputs: CaseInputs) -> KernelOutputs:
        expected = all_reduce_mhc(inputs.ranks, inputs.mix, tree=self.tree(case), mxfp8=case.variant is Variant.MXFP8)
        per_rank = {name: getattr(expected, name) for name in OUTPUTS}
        if per_rank["mxfp8_values"] is not None:
            per_rank["mxfp8_values"] = per_rank["mxfp8_values"].view(torch.float8_e4m3fn)
        outputs = KernelOutputs(
            **{name: [None if t is None else t.clone() for _ in range(case.tp)] for name, t in per_rank.items()}
        )
        for plant in self.plants:
            if plant.everywhere and plant.rank >= case.tp:
                continue
            target = outputs.get(plant.output, plant.rank)
            if target is None:
                if plant.everywhere:
                    continue
                raise ValueError(f"cannot plant a flip in {plant.output}: this variant has none")
            byte = plant.byte if plant.element is None else plant.element * target.element_size()
            flat = target.view(torch.uint8).view(-1)
            if not 0 <= byte < flat.numel():
                raise ValueError(f"cannot plant a flip at byte {byte} of {plant.output}: it has {flat.numel()} bytes in {case.id}")
            flat[byte] ^= plant.mask
        return outputs


# ----- comparing ----------------------------------------------------------------------------------


def expected_outputs(reference: ReferenceOutputs) -> dict[str, torch.Tensor | None]:
    """The reference's outputs in the kernel's dtypes (MXFP8 values as float8_e4m3fn)."""
    values = reference.mxfp8_values
    return {
        "new_residual": reference.new_residual,
        "layer_input": reference.layer_input,
        "mxfp8_values": None if values is None else values.view(torch.float8_e4m3fn),
        "mxfp8_scales": reference.mxfp8_scales,
    }


def flashinfer_mxfp8(layer_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's MXFP8 of a bf16 [M, H] tensor: (values float8_e4m3fn [M, H], scales uint8,
    128x4 swizzled, flat). Only the cute-dsl backend: the default one is an empty stub below
    sm_100 (SPEC.md)."""
    from flashinfer import mxfp8_quantize

    values, scales = mxfp8_quantize(layer_input, True, backend="cute-dsl")
    return values, scales.reshape(-1).view(torch.uint8)


def compare_output(want: torch.Tensor | None, got: torch.Tensor | None, output: str, rank: int) -> Mismatch | None:
    """One output of one rank against the reference's; ValueError if only one side has it."""
    if want is None and got is None:
        return None
    if want is None or got is None:
        raise ValueError(f"{output} rank {rank}: {'kernel' if got is None else 'reference'} has no such output")
    return first_mismatch(want, got, output=output, rank=rank)


def second_oracle_mismatches(second_oracle, layer_input, values, scales, *, rank: int) -> list[Mismatch]:
    """A rank's MXFP8 values and scales against the second oracle applied to its layer_input."""
    want_values, want_scales = second_oracle(layer_input)
    found = []
    for output, want, got in (("mxfp8_values", want_values, values), ("mxfp8_scales", want_scales, scales)):
        mismatch = first_mismatch(want, got, output=output, rank=rank, oracle="flashinfer")
        if mismatch:
            found.append(mismatch)
    return found


def compare_outputs(
    case: Case,
    kernel: KernelOutputs,
    reference: ReferenceOutputs,
    *,
    second_oracle: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> list[Mismatch]:
    """Every comparison of one case, in this order: each output (new_residual, layer_input,
    MXFP8 values, scales) of each rank against the reference; rank 0's MXFP8 against the second
    oracle applied to rank 0's layer_input; every rank against rank 0."""
    expected = expected_outputs(reference)
    found = []
    for output in OUTPUTS:
        for rank in range(case.tp):
            mismatch = compare_output(expected[output], kernel.get(output, rank), output, rank)
            if mismatch:
                found.append(mismatch)
    if second_oracle is not None and case.variant is Variant.MXFP8:
        found += second_oracle_mismatches(second_oracle, kernel.layer_input[0], kernel.get("mxfp8_values", 0),
                                          kernel.get("mxfp8_scales", 0), rank=0)
    for output in OUTPUTS:
        for rank in range(1, case.tp):
            if kernel.get(output, 0) is None:
                continue
            mismatch = first_mismatch(kernel.get(output, 0), kernel.get(output, rank), output=output, rank=rank, oracle="rank0")
            if mismatch:
                found.append(mismatch)
    return found


# ----- one case -----------------------------------------------------------------------------------


@dataclass
class CaseResult:
    case: Case
    status: Status
    mismatches: list[Mismatch] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # traceback text (status error)
    reason: str | None = None  # why not run
    bundle: str | None = None  # bundle path relative to the report directory
    note: str | None = None
    # conformance.divergence.Divergence.to_dict() of a mismatching case: the first stage that
    # differs and the distances per output.
    divergence: dict | None = None

    @property
    def first_mismatch(self) -> Mismatch | None:
        return self.mismatches[0] if self.mismatches else None

    def mismatch_counts(self) -> dict[str, dict[str, int]]:
        """oracle -> output -> differing elements summed over ranks (only nonzero entries)."""
        counts: dict[str, dict[str, int]] = {}
        for m in self.mismatches:
            per_oracle = counts.setdefault(m.oracle, {})
            per_oracle[m.output] = per_oracle.get(m.output, 0) + m.count
        return counts

    def summary(self) -> str:
        """One line for the console: status, case, first difference or error."""
        line = f"{self.status.value.upper():8} {self.case.id}"
        if self.first_mismatch is not None:
            line += f": {self.first_mismatch.describe()}"
        elif self.error:
            line += f": {self.error.strip().splitlines()[-1]}"
        elif self.reason:
            line += f": {self.reason}"
        return line

    def to_dict(self) -> dict:
        return {
            **self.case.to_dict(),
            "status": self.status.value,
            "timings": {k: round(v, 6) for k, v in self.timings.items()},
            "mismatch_counts": self.mismatch_counts(),
            "first_mismatch": None if self.first_mismatch is None else self.first_mismatch.to_dict(),
            "mismatches": [m.to_dict() for m in self.mismatches],
            "error": self.error,
            "reason": self.reason,
            "bundle": self.bundle,
            "note": self.note,
            "repro": self.case.repro_command,
            "divergence": self.divergence,
        }


@dataclass
class CaseRun:
    """A case's result and what a bundle needs (inputs and kernel outputs, when they exist)."""

    result: CaseResult
    inputs: CaseInputs | None = None
    kernel: KernelOutputs | None = None
    tree: ReductionTree | None = None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(case: Case, backend: KernelBackend, *, second_oracle=None) -> CaseRun:
    """Run one case; never raises (an exception becomes status error with its traceback)."""
    timings: dict[str, float] = {}
    run = CaseRun(CaseResult(case, Status.ERROR, timings=timings))
    try:
        start = time.perf_counter()
        run.inputs = make_inputs(case, backend.device)
        _synchronize(backend.device)
        timings["inputs_s"] = time.perf_counter() - start

        start = time.perf_counter()
        run.kernel = backend.run(case, run.inputs)
        timings["kernel_s"] = time.perf_counter() - start
        if getattr(backend, "last_kernel_gpu_s", None) is not None:  # CUDA events around the call
            timings["kernel_gpu_s"] = backend.last_kernel_gpu_s

        start = time.perf_counter()
        run.tree = backend.tree(case)
        reference = all_reduce_mhc(
            run.inputs.ranks, run.inputs.mix, tree=run.tree, mxfp8=case.variant is Variant.MXFP8
        )
        _synchronize(backend.device)
        timings["reference_s"] = time.perf_counter() - start

        start = time.perf_counter()
        mismatches = compare_outputs(case, run.kernel, reference, second_oracle=second_oracle)
        timings["compare_s"] = time.perf_counter() - start
    except Exception:
        run.result.error = traceback.format_exc()
        return run
    run.result.mismatches = mismatches
    run.result.status = Status.MISMATCH if mismatches else Status.PASS
    if mismatches:
        from .divergence import first_divergence

        rank = next((m.rank for m in mismatches if m.oracle == "reference"), mismatches[0].rank) or 0
        try:
            run.result.divergence = first_divergence(case, run.inputs, run.tree, run.kernel, rank).to_dict()
        except Exception as error:  # an explanation problem must not hide the mismatch itself
            run.result.note = f"first divergence not found: {type(error).__name__}: {error}"
    return run


def not_run(case: Case, reason: str) -> CaseResult:
    return CaseResult(case, Status.NOT_RUN, reason=reason)


def errored(case: Case, error: str) -> CaseResult:
    """A case that could not run for a reason that is a failure (a GPU CUDA cannot use)."""
    return CaseResult(case, Status.ERROR, error=error)


# ----- many cases ---------------------------------------------------------------------------------


class Watchdog:
    """Calls `on_timeout(case)` from a timer thread if one case runs longer than `seconds` (a
    consumer spinning on a sentinel that never clears hangs the process inside a CUDA
    synchronize, where nothing else can interrupt it)."""

    def __init__(self, seconds: float | None, on_timeout: Callable[[Case], None]):
        self.seconds = seconds
        self.on_timeout = on_timeout
        self._timer: threading.Timer | None = None

    def start(self, case: Case) -> None:
        self.stop()
        if self.seconds:
            self._timer = threading.Timer(self.seconds, self.on_timeout, args=(case,))
            self._timer.daemon = True
            self._timer.start()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def run_cases(
    cases: Sequence[Case],
    backend: KernelBackend,
    *,
    second_oracle=None,
    on_run: Callable[[CaseRun], None] | None = None,
    watchdog: Watchdog | None = None,
) -> list[CaseResult]:
    """Run every case, grouped by kernel instance (fewest rebuilds); results in input order.

    on_run sees every CaseRun right after it finishes (progress, bundles); it may drop the
    tensors afterwards.
    """
    order = sorted(range(len(cases)), key=lambda i: (_key_order(cases[i].instance_key), i))
    results: list[CaseResult | None] = [None] * len(cases)
    for i in order:
        if watchdog is not None:
            watchdog.start(cases[i])
        run = run_case(cases[i], backend, second_oracle=second_oracle)
        if watchdog is not None:
            watchdog.stop()
        results[i] = run.result
        if on_run is not None:
            on_run(run)
    return results


def _key_order(key: tuple) -> tuple:
    return tuple(k.value if isinstance(k, enum.Enum) else k for k in key)


__all__ = [
    "CaseResult",
    "CaseRun",
    "EmulatedKernelBackend",
    "KernelBackend",
    "KernelOutputs",
    "OUTPUTS",
    "PlantedFlip",
    "ReferenceKernelBackend",
    "Status",
    "Watchdog",
    "call_emulated",
    "compare_outputs",
    "errored",
    "expected_outputs",
    "flashinfer_mxfp8",
    "not_run",
    "poisoned_outputs",
    "run_case",
    "run_cases",
    "tiling_tree",
]
