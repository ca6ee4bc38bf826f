"""Co-residency of virtual ranks on one GPU: how many tokens concurrent ranks may use.

Real TP has one rank per GPU: a consumer spinning on its GPU never keeps a peer's publish from
running on the peer's GPU. Virtual ranks that run at the same time on one GPU (mhc_ar.concurrent)
share its SMs, and a spinning consumer CTA holds its SM until every rank's data has arrived. If
the spinning consumers (and publishes parked in griddepcontrol.wait) filled the GPU while some
rank's publish still needed room, nothing would move until the spin timeout traps.

The condition, from what the driver says the GPU keeps resident (`cuOccupancy*` on the compiled
kernels):

* In flight per rank: on one stream at most two kernels are launched and unfinished at once
  (PDL lets kernel k+1 start once kernel k has triggered its dependents, and no kernel of ours
  triggers before its own griddepcontrol.wait has returned, i.e. before kernel k-1 finished).
  So at most ``consumer_ctas + publish_ctas`` CTAs per rank, at the largest M of any instance.
* Every CTA in flight fits at once: ``tp * (consumer_ctas + publish_ctas) <= SMs * s``, where s is
  the fewest CTAs per SM of any of the kernels (an SM holding fewer than s of them has room for
  one more of any). Then a pending publish CTA always finds a free SM slot.
* Every consumer cluster fits at once: ``tp * M <= max active clusters`` of each consumer (the
  driver's figure, which accounts for clusters needing their CTAs within one GPC).

`max_tokens` is the largest M meeting both; mhc_ar.concurrent refuses any instance whose
max_num_tokens exceeds it, with a ValueError, before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass

_DYNAMIC_SHARED_BYTES = 0  # the kernels' shared memory is static (in the cubin)
_CLUSTER_PROBE_GRID = 1024  # clusters in the grid asked about (any number above what fits)


@dataclass(frozen=True)
class KernelFootprint:
    """What the GPU keeps resident of one compiled kernel."""

    name: str
    threads_per_cta: int
    ctas_per_sm: int  # cuOccupancyMaxActiveBlocksPerMultiprocessor
    cluster_size: int = 1
    max_active_clusters: int | None = None  # cuOccupancyMaxActiveClusters (clustered kernels)
    registers: int | None = None  # per thread (for the record)


@dataclass(frozen=True)
class InstanceGrid:
    """The grids of one instance's kernels as functions of M."""

    cluster_size: int  # consumer CTAs per token
    publish_vectors_per_token: int  # H / 8: one publish thread each
    publish_threads_per_cta: int

    def consumer_ctas(self, tokens: int) -> int:
        return tokens * self.cluster_size

    def publish_ctas(self, tokens: int) -> int:
        return -(-tokens * self.publish_vectors_per_token // self.publish_threads_per_cta)


@dataclass(frozen=True)
class CoResidency:
    """The bound for tp concurrent ranks on a GPU of `sms` SMs (see the module docstring)."""

    tp: int
    sms: int
    ctas_per_sm: int  # fewest CTAs per SM of any kernel in the group
    max_active_clusters: int  # fewest of any consumer in the group

    @property
    def resident_ctas(self) -> int:
        return self.sms * self.ctas_per_sm

    def in_flight_ctas(self, grids: list[tuple[InstanceGrid, int]]) -> int:
        """CTAs that can be launched and unfinished at once, for instances at their capacities."""
        consumer = max(grid.consumer_ctas(m) for grid, m in grids)
        publish = max(grid.publish_ctas(m) for grid, m in grids)
        return self.tp * (consumer + publish)

    def fits(self, grids: list[tuple[InstanceGrid, int]]) -> bool:
        clusters = max(m for _, m in grids) * self.tp
        return self.in_flight_ctas(grids) <= self.resident_ctas and clusters <= self.max_active_clusters

    def max_tokens(self, grid: InstanceGrid, others: list[tuple[InstanceGrid, int]] = ()) -> int:
        """The largest M an instance with these grids may have beside `others` (0: none)."""
        m = 0
        while self.fits([*others, (grid, m + 1)]):
            m += 1
        return m

    def describe(self, grids: list[tuple[InstanceGrid, int]]) -> str:
        clusters = max(m for _, m in grids) * self.tp
        return (
            f"tp={self.tp}: {self.in_flight_ctas(grids)} CTAs can be in flight at once (at most two kernels per "
            f"rank's stream, largest consumer + publish grid), the GPU keeps {self.resident_ctas} resident "
            f"({self.sms} SMs x {self.ctas_per_sm}); {clusters} consumer clusters against {self.max_active_clusters}"
        )


def measure_footprint(compiled, threads_per_cta: int, cluster_size: int = 1) -> KernelFootprint:
    """The driver's occupancy figures for a kernel compiled with keep_ptx=True (its cubin), on the
    current CUDA device. Needs a GPU."""
    from cuda.bindings import driver

    cubin = compiled.function.__cubin__
    if not cubin:
        raise ValueError(f"{compiled.name} was compiled without its cubin (compile with keep_ptx=True)")
    [symbol] = list(compiled.function.kernel_info)
    module = _checked(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
    try:
        function = _checked(driver.cuModuleGetFunction(module, symbol.encode()), "cuModuleGetFunction")
        per_sm = _checked(
            driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, threads_per_cta, _DYNAMIC_SHARED_BYTES),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        )
        registers = _checked(
            driver.cuFuncGetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, function), "cuFuncGetAttribute"
        )
        clusters = None
        if cluster_size > 1:
            clusters = _checked(driver.cuOccupancyMaxActiveClusters(function, _cluster_config(threads_per_cta, cluster_size)),
                                "cuOccupancyMaxActiveClusters")
        return KernelFootprint(compiled.name, threads_per_cta, int(per_sm), cluster_size, clusters, int(registers))
    finally:
        driver.cuModuleUnload(module)


def _cluster_config(threads_per_cta: int, cluster_size: int):
    from cuda.bindings import driver

    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attribute.value.clusterDim.x = cluster_size
    attribute.value.clusterDim.y = 1
    attribute.value.clusterDim.z = 1
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = cluster_size * _CLUSTER_PROBE_GRID, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = threads_per_cta, 1, 1
    config.sharedMemBytes = _DYNAMIC_SHARED_BYTES
    config.attrs = [attribute]
    config.numAttrs = 1
    return config


def _checked(result, what: str):
    error, *values = result
    if int(error) != 0:
        raise RuntimeError(f"{what} failed: {error}")
    return values[0] if len(values) == 1 else values
