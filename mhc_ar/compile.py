"""Compile the kernels once per static configuration, without tensors and without a GPU.

`compile_publish` / `compile_consumer` take only hashable specs (mhc_ar.config) and an optional
target arch, and are memoized: an AllReduceMHC builds its two kernels at construction and reuses
them for every M (M is a runtime argument). With `arch` given (e.g. "sm_90a", "sm_100a",
"sm_103a") nothing touches a GPU, so the CPU suite compiles every variant for every target and
checks its PTX.
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from .config import ConsumerSpec, Contribution, PublishSpec, Variant, choose_consumer_tiling
from .kernels.consumer import ConsumerKernel
from .kernels.layer_call import PublishThenConsume
from .kernels.publish import PublishKernel
from .protocol import STATE_WORDS

TARGET_ARCHS = ("sm_90a", "sm_100a", "sm_103a")


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    spec: Any
    arch: str | None
    function: Any  # TVM-FFI callable

    @property
    def ptx(self) -> str | None:
        return self.function.__ptx__


def _options(arch: str | None, keep_ptx: bool) -> str:
    options = ["--enable-tvm-ffi"]
    if arch is not None:
        options.append(f"--gpu-arch={arch}")
    if keep_ptx:
        # The DSL also writes the PTX to a file: keep it out of the working directory.
        options += ["--keep-ptx", f"--dump-dir={_dump_dir()}"]
    return " ".join(options)


@functools.cache
def _dump_dir() -> str:
    return tempfile.mkdtemp(prefix="mhc_ar_ptx_")


def _fake_state():
    return make_fake_compact_tensor(cutlass.Int32, (STATE_WORDS,), assumed_align=16)


@functools.cache
def compile_publish(spec: PublishSpec, arch: str | None = None, keep_ptx: bool = False) -> CompiledKernel:
    zero = Int64(0)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    addresses = [zero] * 4 + [_fake_state()] + [zero] * 9  # source..routes, state, 8 peers, multicast
    function = cute.compile(
        PublishKernel(spec), *addresses, Int32(0), Int32(1), stream, options=_options(arch, keep_ptx)
    )
    return CompiledKernel(publish_name(spec), spec, arch, function)


@functools.cache
def compile_consumer(spec: ConsumerSpec, arch: str | None = None, keep_ptx: bool = False) -> CompiledKernel:
    zero = Int64(0)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    function = cute.compile(
        ConsumerKernel(spec),
        zero,
        _fake_state(),
        *([zero] * 9),
        Float32(1e-6),
        Int32(1),
        stream,
        options=_options(arch, keep_ptx),
    )
    return CompiledKernel(consumer_name(spec), spec, arch, function)


@functools.cache
def compile_publish_then_consume(
    publish: PublishSpec, consumer: ConsumerSpec, arch: str | None = None, keep_ptx: bool = False
) -> CompiledKernel:
    """Both kernels behind one host function (one launch call per eager AllReduceMHC call)."""
    zero = Int64(0)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    function = cute.compile(
        PublishThenConsume(publish, consumer),
        _fake_state(),
        *([zero] * 9),  # 8 peers, multicast
        Int32(0),  # rank
        *([zero] * 14),  # mailbox, source .. routes, residual .. mx_scales
        Float32(1e-6),
        Int32(1),
        stream,
        options=_options(arch, keep_ptx),
    )
    return CompiledKernel(f"{publish_name(publish)}+{consumer_name(consumer)}", (publish, consumer), arch, function)


def publish_name(spec: PublishSpec) -> str:
    transport = "multicast" if spec.multicast else "unicast"
    return f"publish-{spec.contribution.value}-{transport}-H{spec.hidden_size}-tp{spec.tp}-k{spec.top_k}"


def consumer_name(spec: ConsumerSpec) -> str:
    omitted = "".join(f"-no_{stage}" for stage in sorted(spec.omit))
    return f"consumer-{spec.variant.value}-H{spec.hidden_size}-hc{spec.hc}-tp{spec.tp}{omitted}"


def kernel_variants(hidden_size: int = 5120, hc: int = 4, tp: int = 8, capacity: int = 128, top_k: int = 8):
    """Every kernel variant the package builds, for one shape: 4 publish + 3 consumer specs."""
    specs: list[PublishSpec | ConsumerSpec] = []
    for contribution in Contribution:
        for multicast in (False, True):
            specs.append(
                PublishSpec(
                    hidden_size=hidden_size,
                    tp=tp,
                    capacity=capacity,
                    contribution=contribution,
                    top_k=top_k if contribution is Contribution.FINALIZE else 0,
                    multicast=multicast,
                )
            )
    tiling = choose_consumer_tiling(hidden_size)
    for variant in Variant:
        specs.append(ConsumerSpec(tiling, hc=hc, tp=tp, capacity=capacity, variant=variant))
    return specs


def compile_spec(spec, arch: str | None = None, keep_ptx: bool = False) -> CompiledKernel:
    if isinstance(spec, PublishSpec):
        return compile_publish(spec, arch, keep_ptx)
    return compile_consumer(spec, arch, keep_ptx)
