"""AllReduceMHC: the fused TP all-reduce + mHC post-mix + collapse + RMSNorm (+ MXFP8).

Per call, two kernels chained with PDL on the current stream: the publish (this rank's
contribution into every rank's mailbox) and the consumer (spin, reduce, mix, normalize, re-arm).
At TP = 1 there is nothing to exchange: one kernel, the consumer reading the contribution
itself (mhc_ar.config.ConsumerSpec.direct).
Both are compiled once at construction (M is a runtime argument), all protocol state lives on the
device, so eager calls and CUDA graph replays behave the same.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from . import recording
from . import routes as routes_check
from . import validation as check
from .call_check import Launch
from .config import DEFAULT_SPIN_TIMEOUT_NS, Transport
from .engine import REJECTED_BEFORE_LAUNCH, Engine, KernelParts, Launches, cuda_device, variant_of
from .transport import RankEndpoint, emulated_endpoints, make_transport, multicast_endpoint, unicast_endpoint


class _Operation:
    """What AllReduceMHC and EmulatedAllReduceMHC share: the finalize signature, the consumer
    tiling and the KernelParts hook. Each implements `_finalize(sources, mix, eps, mxfp8_out,
    out)`, sources = (gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx,
    shared_output), mix = (residual, post, comb, pre, norm_weight)."""

    _engine: Engine

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
        """Same as the call with the MoE output unfinalized: a rank's contribution is
        sum_k expert_weights[:, k] * gemm2_permuted[idx[:, k]] (idx -1 skipped) + shared_output.
        (EmulatedAllReduceMHC: per-rank sequences, as its call takes.)"""
        sources = (gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output)
        return self._finalize(sources, (residual, post, comb, pre, norm_weight), eps, mxfp8_out, out)

    @property
    def consumer_tiling(self):
        return self._engine.consumer_spec.tiling

    @property
    def parts(self) -> KernelParts:
        """This instance's calls taken apart (validation, each kernel alone, the launchers): for
        benchmarks and diagnostics; see mhc_ar.engine.KernelParts."""
        return KernelParts(self._engine, self._rank_endpoints())


class AllReduceMHC(_Operation):
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
        device = cuda_device(device)
        variant = variant_of(quantize_layer_input, residual_only)
        tp = dist.get_world_size(group)
        self._engine = engine = Engine(
            hidden_size=hidden_size,
            hc_mult=hc_mult,
            max_num_tokens=max_num_tokens,
            top_k=top_k,
            tp=tp,
            device=device,
            variant=variant,
            multicast=transport is Transport.MULTICAST,
            spin_timeout_s=spin_timeout_s,
            launches=Launches.ONE_CALL,
        )
        check_routes = routes_check.check_enabled(check_routes)
        make_endpoint = multicast_endpoint if transport is Transport.MULTICAST else unicast_endpoint
        self._bind(engine, make_endpoint(group, max_num_tokens, hidden_size, device))
        self._check_routes = check_routes

    @classmethod
    def _for_endpoint(cls, engine: "Engine", endpoint: RankEndpoint) -> "AllReduceMHC":
        """One rank of an emulated group (mhc_ar.concurrent): the same object, its mailboxes in
        one GPU's memory. `engine` must be built with Launches.ONE_CALL."""
        op = cls.__new__(cls)
        op._engine = engine
        op._bind(engine, endpoint)
        return op

    def _rank_endpoints(self) -> dict[int, RankEndpoint]:
        return {self.rank: self._endpoint}

    def _bind(self, engine: "Engine", endpoint: RankEndpoint) -> None:
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

    def _finalize(self, sources, mix, eps, mxfp8_out, out):
        gemm2_permuted, expert_weights, routes, shared_output = sources
        residual, post, comb, pre, norm_weight = mix
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

    def _validated(self, check, *args) -> Launch:
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
        except REJECTED_BEFORE_LAUNCH:
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


class EmulatedAllReduceMHC(_Operation):
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
        device = cuda_device(device)
        self._engine = Engine(
            hidden_size=hidden_size,
            hc_mult=hc_mult,
            max_num_tokens=max_num_tokens,
            top_k=top_k,
            tp=tp_size,
            device=device,
            variant=variant_of(quantize_layer_input, residual_only),
            multicast=False,
            spin_timeout_s=spin_timeout_s,
        )
        self.endpoints = emulated_endpoints(tp_size, max_num_tokens, hidden_size, device)
        self.tp_size = tp_size
        self._rejected = 0  # calls rejected since the last launch (as AllReduceMHC's, every rank)
        self._check_routes = routes_check.check_enabled(check_routes)
        self._invalid_routes_seen = [0] * tp_size

    def _rank_endpoints(self) -> dict[int, RankEndpoint]:
        return dict(enumerate(self.endpoints))

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

    def _finalize(self, sources, mix, eps, mxfp8_out, out):
        residual, post, comb, pre, norm_weight = mix
        arguments = (*sources, *mix, eps, mxfp8_out, out)
        launches, tokens = self._counted(self._check_finalizes, *arguments)
        results = self._run(launches, tokens, float(eps), finalize=True)
        if recording.recorder is not None:
            tp = self.tp_size
            columns = [_per_rank(v, n, tp) for v, n in zip(arguments[:4], _FINALIZE_NAMES)]
            contributions = [_finalize_contribution(*sources) for sources in zip(*columns)]
            self._record(True, contributions, (residual, post, comb, pre, norm_weight), eps, results, mxfp8_out)
        if self._check_routes:
            self._raise_on_invalid_routes(_per_rank(sources[2], "expanded_idx_to_permuted_idx", self.tp_size),
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
