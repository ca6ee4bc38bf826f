"""Virtual TP ranks that run at the same time on one GPU, the way real ranks do.

EmulatedAllReduceMHC launches all publishes before all consumers on one stream, so no consumer
ever spins while a peer still publishes. Here every virtual rank has its own CUDA stream and its
own AllReduceMHC (the same object real TP uses, bound to an emulated endpoint), and launches its
publish and consumer exactly as a real rank does, with no host synchronization between calls. A
rank can be skewed by a delay on its stream before a call. Several instances (different shapes
or variants) can be interleaved on the same ranks.

    ranks = ConcurrentRanks(tp_size=4)
    ops = ranks.add(hidden_size=5120, hc_mult=4, max_num_tokens=8, top_k=8)   # one op per rank
    for r in range(4):
        with ranks.on(r):
            ranks.delay(r, microseconds=20)
            new_residual, layer_input = ops[r](x[r], residual, post, comb, pre, norm_weight)

Concurrent consumers share the GPU's SMs: `add` refuses (ValueError) an instance whose
max_num_tokens exceeds the co-residency bound of mhc_ar.residency, which `max_tokens` computes.

While a consumer may spin waiting for a peer's call that the host has yet to launch, nothing
may synchronize the device: no host sync, no operation on a stream that synchronizes with the
ranks' streams, and no first launch of a kernel that CUDA loads lazily (loading may synchronize
the context; measured here: a reference computation's first kernels, launched while a consumer
waited for a call that never came, blocked until that consumer's spin timeout). Launch every
rank's calls, then wait; keep checks to copies, or run them after the ranks are in step.
"""

from __future__ import annotations

import torch

from .allreduce_mhc import AllReduceMHC
from .compile import compile_consumer, compile_publish
from .config import DEFAULT_SPIN_TIMEOUT_NS, VECTOR_ELEMS, Variant
from .engine import Engine, Launches, cuda_device, variant_of
from .residency import CoResidency, InstanceGrid, measure_footprint
from .transport import emulated_endpoints

_NO_CLUSTER_LIMIT = 1 << 30


class ConcurrentRanks:
    """tp virtual ranks on one GPU, each on its own CUDA stream (see the module docstring)."""

    def __init__(self, *, tp_size: int, device=None):
        if isinstance(tp_size, bool) or not isinstance(tp_size, int):
            raise ValueError(f"tp_size must be an int, got {type(tp_size).__name__}")
        self.device = cuda_device(device)
        self.tp_size = tp_size
        self.streams = [torch.cuda.Stream(self.device) for _ in range(tp_size)]
        # The sleep kernel of `delay`, loaded now: CUDA loads kernels lazily, and a first load
        # while a consumer spins for a peer the host has yet to launch can wait for that spin.
        with torch.cuda.device(self.device):
            torch.cuda._sleep(1)
            torch.cuda.synchronize(self.device)
        self._instances: list[tuple[InstanceGrid, int]] = []  # (grids, max_num_tokens)
        self._footprints: list = []
        properties = torch.cuda.get_device_properties(self.device)
        self._sms = properties.multi_processor_count
        self._cycles_per_us = _clock_khz(self.device) / 1000.0

    # ---- the co-residency bound -------------------------------------------------------------

    def co_residency(self, footprints=()) -> CoResidency:
        footprints = [*self._footprints, *footprints]
        clustered = [f.max_active_clusters for f in footprints if f.max_active_clusters is not None]
        return CoResidency(
            tp=self.tp_size,
            sms=self._sms,
            ctas_per_sm=min(f.ctas_per_sm for f in footprints),
            max_active_clusters=min(clustered, default=_NO_CLUSTER_LIMIT),
        )

    def describe(self) -> str:
        """The bound for the instances added so far, with its figures."""
        if not self._instances:
            return f"tp={self.tp_size}: no instance yet"
        return self.co_residency().describe(self._instances)

    def max_tokens(self, *, hidden_size: int, hc_mult: int, top_k: int = 0, quantize_layer_input: bool = False,
                   residual_only: bool = False) -> int:
        """The largest max_num_tokens `add` accepts for this instance beside the ones already added."""
        engine = self._engine(hidden_size, hc_mult, 1, top_k, quantize_layer_input, residual_only, DEFAULT_SPIN_TIMEOUT_NS / 1e9, Launches.PER_KERNEL)
        grid, footprints = self._measure(engine)
        return self.co_residency(footprints).max_tokens(grid, self._instances)

    def add(
        self,
        *,
        hidden_size: int,
        hc_mult: int,
        max_num_tokens: int,
        top_k: int = 0,
        quantize_layer_input: bool = False,
        residual_only: bool = False,
        spin_timeout_s: float = DEFAULT_SPIN_TIMEOUT_NS / 1e9,
        diagnostic_omit=(),
    ) -> list[AllReduceMHC]:
        """A new instance on these ranks: one AllReduceMHC per rank (call each under `on(rank)`).
        Raises ValueError if its max_num_tokens breaks the co-residency bound.
        `diagnostic_omit` (diagnosis only: outputs or checks then break the contract) builds the
        consumer with stages of mhc_ar.config.DIAGNOSTIC_STAGES left out."""
        engine = self._engine(hidden_size, hc_mult, max_num_tokens, top_k, quantize_layer_input, residual_only, spin_timeout_s, Launches.ONE_CALL)
        grid, footprints = self._measure(engine)
        bound = self.co_residency(footprints)
        grids = [*self._instances, (grid, max_num_tokens)]
        if not bound.fits(grids):
            limit = bound.max_tokens(grid, self._instances)
            raise ValueError(
                f"max_num_tokens={max_num_tokens} breaks the co-residency bound of {self.tp_size} concurrent ranks on "
                f"one GPU ({bound.describe(grids)}): at most {limit} for this instance here"
            )
        if diagnostic_omit:
            engine.omit_for_diagnosis(diagnostic_omit)
        self._instances.append((grid, max_num_tokens))
        self._footprints += footprints
        endpoints = emulated_endpoints(self.tp_size, max_num_tokens, hidden_size, self.device)
        return [AllReduceMHC._for_endpoint(engine, endpoint) for endpoint in endpoints]

    # ---- running ranks ----------------------------------------------------------------------

    def on(self, rank: int):
        """Context manager: what runs inside is rank `rank`'s (its stream is current)."""
        return torch.cuda.stream(self.streams[rank])

    def delay(self, rank: int, microseconds: float) -> None:
        """Hold rank `rank`'s stream for about this long before what it runs next (a GPU-side
        sleep of clock cycles at the device's reported clock)."""
        if microseconds > 0:
            with self.on(rank):
                torch.cuda._sleep(int(microseconds * self._cycles_per_us))

    def synchronize(self) -> None:
        for stream in self.streams:
            stream.synchronize()

    # ---- helpers ----------------------------------------------------------------------------

    def _engine(self, hidden_size, hc_mult, max_num_tokens, top_k, quantize_layer_input, residual_only, spin_timeout_s, launches):
        return Engine(
            hidden_size=hidden_size,
            hc_mult=hc_mult,
            max_num_tokens=max_num_tokens,
            top_k=top_k,
            tp=self.tp_size,
            device=self.device,
            variant=variant_of(quantize_layer_input, residual_only),
            multicast=False,
            spin_timeout_s=spin_timeout_s,
            launches=launches,
        )

    def _measure(self, engine: Engine):
        """The instance's grids and its kernels' footprints (the driver's occupancy)."""
        spec = engine.consumer_spec
        tiling = spec.tiling
        cluster = tiling.cluster_size if spec.variant is not Variant.RESIDUAL_ONLY else 1
        with torch.cuda.device(self.device):
            torch.cuda.current_stream()  # the primary context is current on this thread
            footprints = [
                measure_footprint(compile_consumer(consumer, keep_ptx=True), tiling.threads_per_cta, cluster)
                for consumer in dict.fromkeys(engine.consumer_specs.values())
            ]
            if not engine.direct:  # at tp = 1 no publish runs
                for publish in engine.publish_specs.values():
                    footprints.append(measure_footprint(compile_publish(publish, keep_ptx=True), publish.threads_per_cta))
        publish = engine.publish_specs[False]
        grid = InstanceGrid(tiling.cluster_size, publish.hidden_size // VECTOR_ELEMS, publish.threads_per_cta)
        return grid, footprints


def _clock_khz(device: torch.device) -> int:
    from cuda.bindings import driver

    error, khz = driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE, device.index)
    if int(error) != 0:
        raise RuntimeError(f"cuDeviceGetAttribute(CLOCK_RATE) failed: {error}")
    return khz


__all__ = ["ConcurrentRanks"]
