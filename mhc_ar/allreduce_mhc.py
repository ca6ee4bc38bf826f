"""AllReduceMHC: the fused TP all-reduce + mHC post-mix + collapse + RMSNorm (+ MXFP8).

Per call, two kernels chained with PDL on the current stream: the publish (this rank's
contribution into every rank's mailbox) and the consumer (spin, reduce, mix, normalize, re-arm).
At TP = 1 there is nothing to exchange: one kernel, the consumer reading the contribution
itself (mhc_ar.config.ConsumerSpec.direct).
Both are compiled once at construction (M is a runtime argument), all protocol state lives on the
device, so eager calls and CUDA graph replays behave the same.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Sequence

import torch

from . import recording
from . import routes as routes_check
from . import validation as check
from .compile import compile_consumer, compile_publish, compile_publish_then_consume, compile_tensor_launcher, consumer_specs
from .config import (
    DEFAULT_SPIN_TIMEOUT_NS,
    ConsumerSpec,
    Contribution,
    PublishSpec,
    Transport,
    Variant,
    choose_consumer_tiling,
    mxfp8_scale_bytes,
)
from .transport import RankEndpoint, emulated_endpoints, make_transport, multicast_endpoint, unicast_endpoint

INT32_MAX = 2**31 - 1


class _Launch(NamedTuple):
    """Validated addresses of one rank's call, ready to launch (a tuple: cheap to build)."""

    contribution: tuple[int, int, int, int]  # source, gemm2, weights, routes
    mix: tuple[int, int, int, int, int]  # residual, post, comb, pre, norm_weight
    outputs: tuple[int, int, int, int]  # new_residual, layer_input, mx_values, mx_scales
    results: tuple  # what the caller gets back
    gemm2_rows: int = 0  # gemm2_permuted's row count (finalize): the publish reads no row past it


class CallValidator:
    """Checks one rank's call against the static configuration: pure, raises ValueError naming
    the argument, touches no device state (so a rejected call leaves everything usable)."""

    def __init__(self, *, hidden_size, hc_mult, max_num_tokens, top_k, variant, device):
        for name, value in (("hidden_size", hidden_size), ("hc_mult", hc_mult), ("max_num_tokens", max_num_tokens), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {type(value).__name__}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        self.hidden_size, self.hc, self.capacity, self.top_k = hidden_size, hc_mult, max_num_tokens, top_k
        self.variant = variant
        self.device = device

    # ---- validation (pure: raises ValueError, changes nothing) ------------------------------

    def check_call(self, x, mix, eps, mxfp8_out, out, tokens=None) -> _Launch:
        m = check.check_tokens(x, "x", self.capacity) if tokens is None else tokens
        address = check.check_tensor(x, "x", shape=(m, self.hidden_size), dtype=torch.bfloat16, device=self.device)
        return self._check_mix((address, 0, 0, 0), (("x", x),), m, mix, eps, mxfp8_out, out)

    def fresh_outputs(self, m: int):
        """(new_residual [M, hc, H], layer_input [M, H] or None) for a call without out=.
        Two torch.empty calls: on the H200's host, one allocation cut in two by as_strided took
        8.8 us against 4.8 (`scripts/validation_timing.py --device cuda`)."""
        h, hc, bf16, device = self.hidden_size, self.hc, torch.bfloat16, self.device
        new_residual = torch.empty(m, hc, h, dtype=bf16, device=device)
        if self.variant is Variant.RESIDUAL_ONLY:
            return new_residual, None
        return new_residual, torch.empty(m, h, dtype=bf16, device=device)

    def check_finalize(self, gemm2, weights, routes, shared, mix, eps, mxfp8_out, out) -> _Launch:
        if self.top_k < 1:
            raise ValueError("finalize needs an instance built with top_k >= 1")
        m = check.check_tokens(shared, "shared_output", self.capacity)
        h, k, dev = self.hidden_size, self.top_k, self.device
        if not isinstance(gemm2, torch.Tensor) or gemm2.dim() != 2:
            raise ValueError("gemm2_permuted must be a 2-D [rows, hidden_size] tensor")
        if gemm2.shape[0] > INT32_MAX:
            raise ValueError(f"gemm2_permuted has {gemm2.shape[0]} rows; at most {INT32_MAX} (int32 route indices)")
        contribution = (
            check.check_tensor(shared, "shared_output", shape=(m, h), dtype=torch.bfloat16, device=dev),
            check.check_tensor(gemm2, "gemm2_permuted", shape=(gemm2.shape[0], h), dtype=torch.bfloat16, device=dev),
            check.check_tensor(weights, "expert_weights", shape=(m, k), dtype=torch.float32, device=dev),
            check.check_tensor(routes, "expanded_idx_to_permuted_idx", shape=(m, k), dtype=torch.int32, device=dev),
        )
        launch = self._check_mix(contribution, _finalize_sources(gemm2, weights, routes, shared), m, mix, eps, mxfp8_out, out)
        return launch._replace(gemm2_rows=gemm2.shape[0])

    def _check_mix(self, contribution, sources, m, mix, eps, mxfp8_out, out) -> _Launch:
        residual, post, comb, pre, norm_weight = mix
        h, hc, dev = self.hidden_size, self.hc, self.device
        f32, bf16 = torch.float32, torch.bfloat16
        inputs = [("residual", check.check_tensor(residual, "residual", shape=(m, hc, h), dtype=bf16, device=dev), m * hc * h * 2)]
        post_shape = (m, hc, 1) if isinstance(post, torch.Tensor) and post.dim() == 3 else (m, hc)
        inputs.append(("post", check.check_tensor(post, "post", shape=post_shape, dtype=f32, device=dev), m * hc * 4))
        inputs.append(("comb", check.check_tensor(comb, "comb", shape=(m, hc, hc), dtype=f32, device=dev), m * hc * hc * 4))
        check.check_eps(eps)
        residual_only = self.variant is Variant.RESIDUAL_ONLY
        if residual_only:
            for name, value in (("pre", pre), ("norm_weight", norm_weight)):
                if value is not None:
                    raise ValueError(f"{name} must be None for a residual_only instance (no layer input is computed)")
            pre_address = weight_address = 0
        else:
            pre_address = check.check_tensor(pre, "pre", shape=(m, hc), dtype=f32, device=dev)
            weight_address = check.check_tensor(norm_weight, "norm_weight", shape=(h,), dtype=bf16, device=dev)
            inputs += [("pre", pre_address, m * hc * 4), ("norm_weight", weight_address, h * 2)]

        outputs = []
        mx_values = mx_scales = 0
        if self.variant is Variant.MXFP8:
            if not isinstance(mxfp8_out, (tuple, list)) or len(mxfp8_out) != 2:
                raise ValueError("mxfp8_out=(values, scales) is required by a quantize_layer_input instance")
            values, scales = mxfp8_out
            scale_bytes = mxfp8_scale_bytes(m, h)
            mx_values = check.check_tensor(values, "mxfp8_out[0] (values)", shape=(m, h), dtype=torch.float8_e4m3fn, device=dev)
            mx_scales = check.check_tensor(scales, "mxfp8_out[1] (scales)", shape=(scale_bytes,), dtype=torch.uint8, device=dev)
            outputs += [("mxfp8_out[0] (values)", mx_values, m * h), ("mxfp8_out[1] (scales)", mx_scales, scale_bytes)]
            _check_early_scales(mx_scales, scale_bytes, sources)
        elif mxfp8_out is not None:
            raise ValueError("mxfp8_out given, but this instance was built with quantize_layer_input=False")

        if out is None:
            check.check_no_overlap(outputs, inputs + _spans(sources))
            check.check_disjoint(outputs)
            new_residual, layer_input = self.fresh_outputs(m)
        else:
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise ValueError("out must be a (new_residual, layer_input) pair")
            new_residual, layer_input = out
            address = check.check_tensor(new_residual, "out[0] (new_residual)", shape=(m, hc, h), dtype=bf16, device=dev)
            outputs.append(("out[0] (new_residual)", address, m * hc * h * 2))
            if residual_only:
                if layer_input is not None:
                    raise ValueError("out[1] must be None for a residual_only instance")
            else:
                address = check.check_tensor(layer_input, "out[1] (layer_input)", shape=(m, h), dtype=bf16, device=dev)
                outputs.append(("out[1] (layer_input)", address, m * h * 2))
            # The publish's sources too (x, or shared_output and the expert tensors): one rule for
            # every input, as README states it, rather than a PDL-ordering argument per output.
            check.check_no_overlap(outputs, inputs + _spans(sources))
            check.check_disjoint(outputs)

        return _Launch(
            contribution,
            (inputs[0][1], inputs[1][1], inputs[2][1], pre_address, weight_address),
            (new_residual.data_ptr(), 0 if layer_input is None else layer_input.data_ptr(), mx_values, mx_scales),
            (new_residual, layer_input),
        )


def _finalize_sources(gemm2, weights, routes, shared):
    return (("shared_output", shared), ("gemm2_permuted", gemm2), ("expert_weights", weights), ("expanded_idx_to_permuted_idx", routes))


def _spans(sources):
    """(name, address, nbytes) of the publish's sources (validated tensors)."""
    return [(name, tensor.data_ptr(), tensor.numel() * tensor.element_size()) for name, tensor in sources]


def _check_early_scales(address: int, nbytes: int, sources) -> None:
    """The consumer zeroes the MXFP8 padding scales before its PDL wait, while the publish may
    still read its sources: the scales must not share memory with them (checked first, so the
    message says why)."""
    check.check_no_overlap([("mxfp8_out[1] (scales)", address, nbytes)], _spans(sources))


class _Engine:
    """The compiled kernels of one configuration and their launches.

    `together`: also build the publish and the consumer behind one host function, so an eager
    call is one TVM-FFI call (AllReduceMHC), in two forms: one taking addresses (after
    CallValidator), one taking the tensors (checked by TVM-FFI in C; calls without caller-given
    outputs). The emulated object launches all publishes before all consumers, so it keeps them
    apart."""

    def __init__(self, *, hidden_size, hc_mult, max_num_tokens, top_k, tp, device, variant, multicast, spin_timeout_s, together=False):
        if isinstance(spin_timeout_s, bool) or not isinstance(spin_timeout_s, (int, float)) or not spin_timeout_s > 0:
            raise ValueError(f"spin_timeout_s must be a positive number of seconds, got {spin_timeout_s!r}")
        self.validator = CallValidator(
            hidden_size=hidden_size, hc_mult=hc_mult, max_num_tokens=max_num_tokens, top_k=top_k, variant=variant, device=device
        )
        self.capacity = max_num_tokens
        self.together = together
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
        if self.together:
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

    def publish(self, endpoint: RankEndpoint, launch: _Launch, tokens: int, finalize: bool, rejected: int = 0) -> None:
        """The publish alone; `rejected`: this rank's calls rejected since its last launch. At
        tp = 1 there is none (the consumer reads the contribution): nothing is launched."""
        if self.direct:
            return
        post = launch.mix[1]
        self._publish[finalize](*launch.contribution, post, *endpoint.publish_arguments, tokens, rejected, launch.gemm2_rows)

    def consume(self, endpoint: RankEndpoint, launch: _Launch, eps: float, tokens: int, finalize: bool = False) -> None:
        self._consume[finalize](endpoint.mailbox_address, endpoint.state, *launch.contribution, *launch.mix, *launch.outputs, eps,
                                tokens, launch.gemm2_rows)

    def launcher(self, endpoint: RankEndpoint, finalize: bool):
        """One rank's whole call as one host call, its per-rank arguments bound:
        launcher(endpoint, finalize)(*launch.contribution, *launch.mix, *launch.outputs, eps, M,
        rejected, launch.gemm2_rows).
        Needs an engine built `together`."""
        return functools.partial(self._both[finalize], *endpoint.publish_arguments, endpoint.mailbox_address)

    def tensor_launcher(self, endpoint: RankEndpoint, finalize: bool):
        """Like `launcher`, for the tensors themselves (None where the variant has none: MXFP8):
        tensor_launcher(endpoint, finalize)(source, gemm2, weights, routes, residual, post, comb,
        pre, norm_weight, new_residual, layer_input, eps, rejected), None for what the variant or the
        contribution does not use. Raises TypeError or ValueError before launching anything if a
        tensor breaks the compiled signature."""
        function = self._tensors.get(finalize)
        if function is None:
            return None
        return functools.partial(function, *endpoint.publish_arguments, endpoint.mailbox_address)


# What the tensor launcher raises for an argument that breaks its signature (TVM-FFI: TypeError,
# ValueError; torch's DLPack export: RuntimeError, BufferError), always before it launches. A
# failed launch raises the DSL's CUDA error, which derives from none of these and propagates.
_REJECTED_BEFORE_LAUNCH = (TypeError, ValueError, RuntimeError, BufferError)


def _positional(function):
    """The compiled kernel's underlying TVM-FFI function: called positionally it skips the DSL's
    keyword-argument wrapper (about a microsecond of Python per launch)."""
    raw = getattr(function, "__tvm_ffi_object__", None)
    raw = raw() if raw is not None else None
    return raw if raw is not None else function


def _variant(quantize_layer_input: bool, residual_only: bool) -> Variant:
    if quantize_layer_input and residual_only:
        raise ValueError("quantize_layer_input and residual_only exclude each other (residual_only has no layer input)")
    if quantize_layer_input:
        return Variant.MXFP8
    return Variant.RESIDUAL_ONLY if residual_only else Variant.FULL


def _device(device) -> torch.device:
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class AllReduceMHC:
    """One TP rank of the fused operation (real TP: one process per GPU).

    Construction is collective over `group` (every rank of that group, same arguments).

    Args:
        hidden_size: H, a multiple of 8 (of 128 with quantize_layer_input).
        hc_mult: number of residual streams, 1..8.
        max_num_tokens: capacity; every call has 1 <= M <= capacity.
        top_k: routes per token of `finalize` (0: no finalize).
        device: this rank's CUDA device.
        quantize_layer_input: also write layer_input as MXFP8 (mxfp8_out=).
        residual_only: only new_residual (pre and norm_weight must be None).
        group: the TP process group (default: the default group).
        transport: "unicast" (torch symmetric memory) or "multicast" (GB200/GB300 only).
        spin_timeout_s: a consumer that waits this long for a peer's data traps (the launch fails
            with a CUDA error on this rank) instead of hanging the GPU forever.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        hc_mult: int,
        max_num_tokens: int,
        top_k: int = 0,
        device=None,
        quantize_layer_input: bool = False,
        residual_only: bool = False,
        group=None,
        transport: Transport | str = Transport.UNICAST,
        spin_timeout_s: float = DEFAULT_SPIN_TIMEOUT_NS / 1e9,
        check_routes: bool | None = None,
    ):
        import torch.distributed as dist

        transport = make_transport(transport)
        if transport is Transport.EMULATED:
            raise ValueError("transport='emulated' is EmulatedAllReduceMHC (tp virtual ranks on one GPU)")
        if not dist.is_initialized():
            raise ValueError("AllReduceMHC needs torch.distributed initialized (or use EmulatedAllReduceMHC)")
        group = dist.group.WORLD if group is None else group
        device = _device(device)
        variant = _variant(quantize_layer_input, residual_only)
        tp = dist.get_world_size(group)
        self._engine = engine = _Engine(
            hidden_size=hidden_size,
            hc_mult=hc_mult,
            max_num_tokens=max_num_tokens,
            top_k=top_k,
            tp=tp,
            device=device,
            variant=variant,
            multicast=transport is Transport.MULTICAST,
            spin_timeout_s=spin_timeout_s,
            together=True,
        )
        check_routes = routes_check.check_enabled(check_routes)
        make_endpoint = multicast_endpoint if transport is Transport.MULTICAST else unicast_endpoint
        self._bind(engine, make_endpoint(group, max_num_tokens, hidden_size, device))
        self._check_routes = check_routes

    @classmethod
    def _for_endpoint(cls, engine: "_Engine", endpoint: RankEndpoint) -> "AllReduceMHC":
        """One rank of an emulated group (mhc_ar.concurrent): the same object, its mailboxes in
        one GPU's memory. `engine` must be built `together`."""
        op = cls.__new__(cls)
        op._engine = engine
        op._bind(engine, endpoint)
        return op

    def _bind(self, engine: "_Engine", endpoint: RankEndpoint) -> None:
        # Bound once (each eager call pays for every attribute lookup; see the bench's eager table).
        # A call without caller-given outputs first tries the tensor launcher, whose argument
        # checks run in C; anything it rejects, or does not take (out=, mxfp8_out=, post as
        # [M, hc, 1]), goes through CallValidator, which names the argument and the rule, and
        # the address launcher.
        self._endpoint = endpoint
        self.rank, self.tp_size = endpoint.rank, endpoint.tp
        finalize = True in engine.publish_specs
        self._capacity = engine.capacity
        self._fresh_outputs = engine.validator.fresh_outputs
        self._check_call = engine.validator.check_call
        self._launch_call = engine.launcher(endpoint, finalize=False)
        self._launch_finalize = engine.launcher(endpoint, finalize=True) if finalize else None
        self._call_tensors = engine.tensor_launcher(endpoint, finalize=False)
        self._finalize_tensors = engine.tensor_launcher(endpoint, finalize=True) if finalize else None
        # Calls rejected with ValueError since the last launch. They count in the call sequence the
        # next publish tags its data with (mhc_ar.protocol), so a call refused on this rank alone
        # leaves it visibly out of step with its peers instead of silently one call behind.
        self._rejected = 0
        self._check_routes = routes_check.check_enabled(None)
        self._invalid_routes_seen = 0

    @property
    def consumer_tiling(self):
        return self._engine.consumer_spec.tiling

    def invalid_routes(self) -> int:
        """How many expanded_idx_to_permuted_idx entries of this rank's finalize calls so far were
        neither -1 nor a row of gemm2_permuted (each skipped as -1; mhc_ar.routes). Synchronizes
        the device."""
        return routes_check.read_counts([self._endpoint.state], self._engine.validator.device)[0]

    def __call__(self, x, residual, post, comb, pre=None, norm_weight=None, eps: float = 1e-6, *, mxfp8_out=None, out=None):
        """x [M, H] bf16 (this rank's partial); residual [M, hc, H] bf16; post [M, hc] fp32;
        comb [M, hc, hc] fp32; pre [M, hc] fp32; norm_weight [H] bf16.
        Returns (new_residual [M, hc, H] bf16, layer_input [M, H] bf16 or None)."""
        if out is None and mxfp8_out is None:
            results = self._launch_fresh(self._call_tensors, x, (x, None, None, None, residual, post, comb, pre, norm_weight), eps)
            if results is not None:
                if recording.recorder is not None:  # capture (mhc_ar.recording): off, this read is all
                    self._record(False, {"x": x}, (residual, post, comb, pre, norm_weight), eps, results, mxfp8_out)
                return results
        launch = self._validated(self._check_call, x, (residual, post, comb, pre, norm_weight), eps, mxfp8_out, out)
        self._launch_call(*launch.contribution, *launch.mix, *launch.outputs, float(eps), x.shape[0], self._rejected, 0)
        self._rejected = 0
        if recording.recorder is not None:
            self._record(False, {"x": x}, (residual, post, comb, pre, norm_weight), eps, launch.results, mxfp8_out)
        return launch.results

    def finalize(
        self,
        gemm2_permuted,
        expert_weights,
        expanded_idx_to_permuted_idx,
        shared_output,
        residual,
        post,
        comb,
        pre=None,
        norm_weight=None,
        eps: float = 1e-6,
        *,
        mxfp8_out=None,
        out=None,
    ):
        """Same as __call__ with the MoE output unfinalized: this rank's contribution is
        sum_k expert_weights[:, k] * gemm2_permuted[idx[:, k]] (idx -1 skipped) + shared_output."""
        routes = expanded_idx_to_permuted_idx
        # TVM-FFI takes uint32 for int32 (both are i32 to the compiler): the dtype is checked here.
        if out is None and mxfp8_out is None and getattr(routes, "dtype", None) is torch.int32:
            tensors = (shared_output, gemm2_permuted, expert_weights, routes, residual, post, comb, pre, norm_weight)
            results = self._launch_fresh(self._finalize_tensors, shared_output, tensors, eps)
            if results is not None:
                if recording.recorder is not None:
                    self._record(True, _finalize_contribution(gemm2_permuted, expert_weights, routes, shared_output),
                                 (residual, post, comb, pre, norm_weight), eps, results, mxfp8_out)
                if self._check_routes:
                    self._raise_on_invalid_routes(routes, gemm2_permuted.shape[0])
                return results
        mix = (residual, post, comb, pre, norm_weight)
        check = self._engine.validator.check_finalize
        launch = self._validated(check, gemm2_permuted, expert_weights, routes, shared_output, mix, eps, mxfp8_out, out)
        self._launch_finalize(*launch.contribution, *launch.mix, *launch.outputs, float(eps), shared_output.shape[0], self._rejected,
                              launch.gemm2_rows)
        self._rejected = 0
        if recording.recorder is not None:
            self._record(True, _finalize_contribution(gemm2_permuted, expert_weights, routes, shared_output), mix, eps,
                         launch.results, mxfp8_out)
        if self._check_routes:
            self._raise_on_invalid_routes(routes, launch.gemm2_rows)
        return launch.results

    def _record(self, finalize: bool, contribution: dict, mix: tuple, eps, results, mxfp8_out) -> None:
        """Capture is on (mhc_ar.recording): hand this rank's launched call to the recorder."""
        recording.recorder.record(
            source="AllReduceMHC", engine=self._engine, tp=self.tp_size, finalize=finalize, eps=eps,
            ranks={self.rank: (contribution, mix, results, mxfp8_out)},
        )

    def _raise_on_invalid_routes(self, routes, rows: int) -> None:
        """The debug mode, after a finalize: ValueError if its publish counted invalid entries."""
        count = self.invalid_routes()
        new, self._invalid_routes_seen = count - self._invalid_routes_seen, count
        if new:
            raise routes_check.invalid_route_error(routes, rows, new)

    def _validated(self, check, *args) -> _Launch:
        """CallValidator's verdict; a rejected call counts in the call sequence (see _bind)."""
        try:
            return check(*args)
        except ValueError:
            self._rejected += 1
            raise

    def _launch_fresh(self, launch, tokens_from, tensors, eps):
        """The common eager case in as few Python operations as possible: fresh outputs, the
        tensors handed to the tensor launcher, whose compiled signature checks them in C. Returns
        the outputs, or None (nothing launched) when the call is not of that kind or the launcher
        rejects an argument; the caller then validates in Python, which names the argument."""
        if launch is None or type(eps) is not float or not 0.0 <= eps < math.inf:
            return None
        shape = getattr(tokens_from, "shape", None)
        if shape is None or len(shape) != 2 or not 0 < shape[0] <= self._capacity:
            return None
        new_residual, layer_input = self._fresh_outputs(shape[0])
        try:
            launch(*tensors, new_residual, layer_input, eps, self._rejected)
        except _REJECTED_BEFORE_LAUNCH:
            return None
        self._rejected = 0
        return new_residual, layer_input


def _per_rank(value, name: str, tp: int) -> list:
    """One tensor (the same for every virtual rank) or a sequence of tp tensors."""
    if value is None or isinstance(value, torch.Tensor):
        return [value] * tp
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != tp:
            raise ValueError(f"{name} must hold one entry per rank ({tp}), got {len(value)}")
        return list(value)
    raise ValueError(f"{name} must be a tensor or a sequence of {tp} tensors, got {type(value).__name__}")


class EmulatedAllReduceMHC:
    """tp virtual ranks on one GPU: the same kernels as AllReduceMHC, each rank with its own
    mailbox and generation state; rank r's publish stores into all tp mailboxes.

    Per-rank arguments are sequences of tp tensors (a single tensor means the same tensor for
    every rank, for replicated inputs). Returns a list of tp (new_residual, layer_input) pairs.
    """

    def __init__(
        self,
        *,
        tp_size: int,
        hidden_size: int,
        hc_mult: int,
        max_num_tokens: int,
        top_k: int = 0,
        device=None,
        quantize_layer_input: bool = False,
        residual_only: bool = False,
        spin_timeout_s: float = DEFAULT_SPIN_TIMEOUT_NS / 1e9,
        check_routes: bool | None = None,
    ):
        if isinstance(tp_size, bool) or not isinstance(tp_size, int):
            raise ValueError(f"tp_size must be an int, got {type(tp_size).__name__}")
        device = _device(device)
        self._engine = _Engine(
            hidden_size=hidden_size,
            hc_mult=hc_mult,
            max_num_tokens=max_num_tokens,
            top_k=top_k,
            tp=tp_size,
            device=device,
            variant=_variant(quantize_layer_input, residual_only),
            multicast=False,
            spin_timeout_s=spin_timeout_s,
        )
        self.endpoints = emulated_endpoints(tp_size, max_num_tokens, hidden_size, device)
        self.tp_size = tp_size
        self._rejected = 0  # calls rejected since the last launch (as AllReduceMHC's, every rank)
        self._check_routes = routes_check.check_enabled(check_routes)
        self._invalid_routes_seen = [0] * tp_size

    @property
    def consumer_tiling(self):
        return self._engine.consumer_spec.tiling

    def _mix(self, residual, post, comb, pre, norm_weight):
        tp = self.tp_size
        columns = [_per_rank(v, n, tp) for v, n in ((residual, "residual"), (post, "post"), (comb, "comb"), (pre, "pre"), (norm_weight, "norm_weight"))]
        return list(zip(*columns))

    def __call__(self, x, residual, post, comb, pre=None, norm_weight=None, eps: float = 1e-6, *, mxfp8_out=None, out=None):
        launches, tokens = self._counted(self._check_calls, x, residual, post, comb, pre, norm_weight, eps, mxfp8_out, out)
        results = self._run(launches, tokens, float(eps), finalize=False)
        if recording.recorder is not None:  # capture (mhc_ar.recording): off, this read is all
            contributions = [{"x": x_r} for x_r in _per_rank(x, "x", self.tp_size)]
            self._record(False, contributions, (residual, post, comb, pre, norm_weight), eps, results, mxfp8_out)
        return results

    def _check_calls(self, x, residual, post, comb, pre, norm_weight, eps, mxfp8_out, out):
        tp, engine = self.tp_size, self._engine
        xs = _per_rank(x, "x", tp)
        tokens = check.check_tokens(xs[0], "x[0]", engine.capacity)
        mixes = self._mix(residual, post, comb, pre, norm_weight)
        mx, outs = _per_rank_pairs(mxfp8_out, "mxfp8_out", tp), _per_rank_pairs(out, "out", tp)
        return [engine.validator.check_call(xs[r], mixes[r], eps, mx[r], outs[r], tokens) for r in range(tp)], tokens

    def _counted(self, check_all, *args):
        """Validation of every rank's call; a rejected call counts in the call sequence of every
        virtual rank alike (see AllReduceMHC._bind)."""
        try:
            return check_all(*args)
        except ValueError:
            self._rejected += 1
            raise

    def finalize(
        self,
        gemm2_permuted,
        expert_weights,
        expanded_idx_to_permuted_idx,
        shared_output,
        residual,
        post,
        comb,
        pre=None,
        norm_weight=None,
        eps: float = 1e-6,
        *,
        mxfp8_out=None,
        out=None,
    ):
        arguments = (gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output, residual, post, comb, pre, norm_weight, eps, mxfp8_out, out)
        launches, tokens = self._counted(self._check_finalizes, *arguments)
        results = self._run(launches, tokens, float(eps), finalize=True)
        if recording.recorder is not None:
            tp = self.tp_size
            columns = [_per_rank(v, n, tp) for v, n in zip(arguments[:4], _FINALIZE_NAMES)]
            contributions = [_finalize_contribution(*sources) for sources in zip(*columns)]
            self._record(True, contributions, (residual, post, comb, pre, norm_weight), eps, results, mxfp8_out)
        if self._check_routes:
            self._raise_on_invalid_routes(_per_rank(expanded_idx_to_permuted_idx, "expanded_idx_to_permuted_idx", self.tp_size),
                                          [launch.gemm2_rows for launch in launches])
        return results

    def _record(self, finalize: bool, contributions: list, mix: tuple, eps, results: list, mxfp8_out) -> None:
        """Capture is on (mhc_ar.recording): every virtual rank's view of the launched call."""
        mixes = self._mix(*mix)
        mx = _per_rank_pairs(mxfp8_out, "mxfp8_out", self.tp_size)
        ranks = {r: (contributions[r], mixes[r], results[r], mx[r]) for r in range(self.tp_size)}
        recording.recorder.record(source="EmulatedAllReduceMHC", engine=self._engine, tp=self.tp_size, finalize=finalize,
                                  eps=eps, ranks=ranks)

    def invalid_routes(self) -> list[int]:
        """Per virtual rank, as AllReduceMHC.invalid_routes. Synchronizes the device."""
        return routes_check.read_counts([endpoint.state for endpoint in self.endpoints], self._engine.validator.device)

    def _raise_on_invalid_routes(self, routes, rows) -> None:
        counts = self.invalid_routes()
        new = [c - seen for c, seen in zip(counts, self._invalid_routes_seen)]
        self._invalid_routes_seen = counts
        for r, n in enumerate(new):
            if n:
                raise routes_check.invalid_route_error(routes[r], rows[r], n, name=f"expanded_idx_to_permuted_idx[{r}]")

    def _check_finalizes(self, gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output, residual, post, comb, pre, norm_weight, eps, mxfp8_out, out):
        tp, engine = self.tp_size, self._engine
        sources = (gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output)
        per_rank = [_per_rank(v, n, tp) for v, n in zip(sources, _FINALIZE_NAMES)]
        tokens = check.check_tokens(per_rank[3][0], "shared_output[0]", engine.capacity)
        mixes = self._mix(residual, post, comb, pre, norm_weight)
        mx, outs = _per_rank_pairs(mxfp8_out, "mxfp8_out", tp), _per_rank_pairs(out, "out", tp)
        launches = []
        for r in range(tp):
            gemm2, weights, routes, shared = (column[r] for column in per_rank)
            if shared.shape[0] != tokens:
                raise ValueError(f"shared_output[{r}] has {shared.shape[0]} tokens, rank 0 has {tokens}")
            launches.append(engine.validator.check_finalize(gemm2, weights, routes, shared, mixes[r], eps, mx[r], outs[r]))
        return launches, tokens

    def _run(self, launches, tokens, eps, finalize):
        # All publishes, then all consumers: in stream order nothing ever waits on a kernel that
        # has not been launched, so the virtual ranks need no co-residency.
        for endpoint, launch in zip(self.endpoints, launches):
            self._engine.publish(endpoint, launch, tokens, finalize, self._rejected)
        self._rejected = 0
        for endpoint, launch in zip(self.endpoints, launches):
            self._engine.consume(endpoint, launch, eps, tokens, finalize)
        return [launch.results for launch in launches]

    def reset(self) -> None:
        """Re-arm all mailboxes and restart generations (only between calls, for tests)."""
        for endpoint in self.endpoints:
            endpoint.reset()
        self._rejected = 0
        self._invalid_routes_seen = [0] * self.tp_size


_FINALIZE_NAMES = ("gemm2_permuted", "expert_weights", "expanded_idx_to_permuted_idx", "shared_output")


def _finalize_contribution(gemm2_permuted, expert_weights, routes, shared_output) -> dict:
    return dict(zip(_FINALIZE_NAMES, (gemm2_permuted, expert_weights, routes, shared_output)))


def _per_rank_pairs(value, name: str, tp: int) -> list:
    """None, or a sequence of tp pairs."""
    if value is None:
        return [None] * tp
    if not isinstance(value, Sequence) or len(value) != tp:
        raise ValueError(f"{name} must be a sequence of {tp} pairs (one per rank)")
    return list(value)
