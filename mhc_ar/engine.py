"""The compiled kernels of one configuration and their launches, shared by every rank of an
instance (AllReduceMHC, EmulatedAllReduceMHC, ConcurrentRanks), and KernelParts: the same
launches one by one, the public hook for benchmarks and diagnostics.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import torch

from .call_check import CallValidator, Launch
from .compile import compile_consumer, compile_publish, compile_publish_then_consume, compile_tensor_launcher, consumer_specs
from .config import ConsumerSpec, Contribution, PublishSpec, Variant, choose_consumer_tiling
from .transport import RankEndpoint


class Launches(enum.Enum):
    """How an instance's host code launches the kernels of a call."""

    # Publish and consumer each by its own host call (EmulatedAllReduceMHC: every virtual rank's
    # publish first, then every consumer, so no consumer waits on a kernel not yet launched).
    PER_KERNEL = "per-kernel"
    # Also both behind one host function, so an eager call is one TVM-FFI call (AllReduceMHC,
    # ConcurrentRanks' ranks), in two forms: one taking addresses (after CallValidator), one taking
    # the tensors (checked by TVM-FFI in C; calls without caller-given outputs).
    ONE_CALL = "one-call"


class Engine:
    """The compiled kernels of one configuration and their launches (`launches`: see Launches)."""

    def __init__(self, *, hidden_size, hc_mult, max_num_tokens, top_k, tp, device, variant, multicast, spin_timeout_s,
                 launches: Launches = Launches.PER_KERNEL):
        if isinstance(spin_timeout_s, bool) or not isinstance(spin_timeout_s, (int, float)) or not spin_timeout_s > 0:
            raise ValueError(f"spin_timeout_s must be a positive number of seconds, got {spin_timeout_s!r}")
        self.validator = CallValidator(
            hidden_size=hidden_size, hc_mult=hc_mult, max_num_tokens=max_num_tokens, top_k=top_k, variant=variant, device=device
        )
        self.capacity = max_num_tokens
        self.launches = launches
        common = dict(hidden_size=hidden_size, tp=tp, capacity=max_num_tokens, multicast=multicast, hc=hc_mult)
        self.publish_specs = {False: PublishSpec(contribution=Contribution.CALL, top_k=0, **common)}
        if top_k >= 1:
            self.publish_specs[True] = PublishSpec(contribution=Contribution.FINALIZE, top_k=top_k, **common)
        spec = ConsumerSpec(
            choose_consumer_tiling(hidden_size),
            hc=hc_mult,
            tp=tp,
            capacity=max_num_tokens,
            variant=variant,
            spin_timeout_ns=int(spin_timeout_s * 1e9),
        )
        # At tp = 1 the consumer computes the contribution itself: no publish is built or launched.
        self.direct = spec.direct
        self._publish = {} if self.direct else {
            finalize: _positional(compile_publish(publish).function) for finalize, publish in self.publish_specs.items()
        }
        self._build_consumers(consumer_specs(spec, top_k))

    def _build_consumers(self, specs: dict) -> None:
        """specs: finalize -> ConsumerSpec (mhc_ar.compile.consumer_specs)."""
        self.consumer_specs = specs
        self.consumer_spec = specs[False]  # the call's (at tp > 1 the finalize's too)
        self._consume = {finalize: _positional(compile_consumer(spec).function) for finalize, spec in specs.items()}
        self._both, self._tensors = {}, {}
        if self.launches is Launches.ONE_CALL:
            self._both = {
                finalize: _positional(compile_publish_then_consume(publish, specs[finalize]).function)
                for finalize, publish in self.publish_specs.items()
            }
            if self.consumer_spec.variant is not Variant.MXFP8:
                self._tensors = {
                    finalize: _positional(compile_tensor_launcher(publish, specs[finalize]).function)
                    for finalize, publish in self.publish_specs.items()
                }

    def omit_for_diagnosis(self, stages) -> None:
        """Bench only: rebuild the consumers with stages of mhc_ar.config.DIAGNOSTIC_STAGES left
        out, to time what they cost. The outputs then break the numerics contract."""
        omit = frozenset(stages)
        self._build_consumers({finalize: dataclasses.replace(spec, omit=omit) for finalize, spec in self.consumer_specs.items()})

    def publish(self, endpoint: RankEndpoint, launch: Launch, tokens: int, finalize: bool, rejected: int = 0) -> None:
        """The publish alone; `rejected`: this rank's calls rejected since its last launch. At
        tp = 1 there is none (the consumer reads the contribution): nothing is launched."""
        if self.direct:
            return
        post = launch.mix[1]
        self._publish[finalize](*launch.contribution, post, *endpoint.rank_arguments, tokens, rejected, launch.gemm2_rows)

    def consume(self, endpoint: RankEndpoint, launch: Launch, eps: float, tokens: int, finalize: bool = False) -> None:
        self._consume[finalize](endpoint.mailbox_address, endpoint.state, *launch.contribution, *launch.mix, *launch.outputs, eps,
                                tokens, launch.gemm2_rows)

    def launcher(self, endpoint: RankEndpoint, finalize: bool):
        """One rank's whole call as one host call, its per-rank arguments bound:
        launcher(endpoint, finalize)(*launch.contribution, *launch.mix, *launch.outputs, eps, M,
        rejected, launch.gemm2_rows).
        Needs an engine built with Launches.ONE_CALL."""
        return functools.partial(self._both[finalize], *endpoint.rank_arguments, endpoint.mailbox_address)

    def tensor_launcher(self, endpoint: RankEndpoint, finalize: bool):
        """Like `launcher`, for the tensors themselves (None where the variant has none: MXFP8):
        tensor_launcher(endpoint, finalize)(source, gemm2, weights, routes, residual, post, comb,
        pre, norm_weight, new_residual, layer_input, eps, rejected), None for what the variant or the
        contribution does not use. Raises TypeError or ValueError before launching anything if a
        tensor breaks the compiled signature."""
        function = self._tensors.get(finalize)
        if function is None:
            return None
        return functools.partial(function, *endpoint.rank_arguments, endpoint.mailbox_address)


class KernelParts:
    """An instance's calls taken apart, for benchmarks and diagnostics (conformance.bench,
    scripts/protocol_cost.py): the validation, each kernel of a call on its own, the one-call
    launchers and diagnostic builds, for the instance's ranks (`ranks`: its one rank for an
    AllReduceMHC, every virtual rank for an EmulatedAllReduceMHC). A call runs exactly these."""

    def __init__(self, engine: Engine, endpoints: dict[int, RankEndpoint]):
        self._engine, self._endpoints = engine, endpoints
        self.ranks = list(endpoints)
        self.validator: CallValidator = engine.validator

    @property
    def one_kernel(self) -> bool:
        """TP = 1: a call is the consumer alone (no publish; mhc_ar.config.ConsumerSpec.direct)."""
        return self._engine.direct

    def publish(self, rank: int, launch: Launch, tokens: int, finalize: bool = False, rejected: int = 0) -> None:
        """Rank `rank`'s publish alone (nothing at TP = 1)."""
        self._engine.publish(self._endpoints[rank], launch, tokens, finalize, rejected)

    def consume(self, rank: int, launch: Launch, eps: float, tokens: int, finalize: bool = False) -> None:
        """Rank `rank`'s consumer alone."""
        self._engine.consume(self._endpoints[rank], launch, eps, tokens, finalize)

    def launcher(self, rank: int, finalize: bool = False):
        """Rank `rank`'s one-call launcher taking addresses (Engine.launcher), or None for an
        instance built with Launches.PER_KERNEL."""
        if self._engine.launches is not Launches.ONE_CALL:
            return None
        return self._engine.launcher(self._endpoints[rank], finalize)

    def tensor_launcher(self, rank: int, finalize: bool = False):
        """Rank `rank`'s one-call launcher taking tensors (Engine.tensor_launcher), or None."""
        if self._engine.launches is not Launches.ONE_CALL:
            return None
        return self._engine.tensor_launcher(self._endpoints[rank], finalize)

    def omit_for_diagnosis(self, stages) -> None:
        """Rebuild the consumers without these stages (mhc_ar.config.DIAGNOSTIC_STAGES): what
        they cost. The outputs then break the numerics contract; never for real calls."""
        self._engine.omit_for_diagnosis(stages)


# What the tensor launcher raises for an argument that breaks its signature (TVM-FFI: TypeError,
# ValueError; torch's DLPack export: RuntimeError, BufferError), always before it launches. A
# failed launch raises the DSL's CUDA error, which derives from none of these and propagates.
REJECTED_BEFORE_LAUNCH = (TypeError, ValueError, RuntimeError, BufferError)


def _positional(function):
    """The compiled kernel's underlying TVM-FFI function: called positionally it skips the DSL's
    keyword-argument wrapper (about a microsecond of Python per launch)."""
    raw = getattr(function, "__tvm_ffi_object__", None)
    raw = raw() if raw is not None else None
    return raw if raw is not None else function


def variant_of(quantize_layer_input: bool, residual_only: bool) -> Variant:
    if quantize_layer_input and residual_only:
        raise ValueError("quantize_layer_input and residual_only exclude each other (residual_only has no layer input)")
    if quantize_layer_input:
        return Variant.MXFP8
    return Variant.RESIDUAL_ONLY if residual_only else Variant.FULL


def cuda_device(device) -> torch.device:
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
