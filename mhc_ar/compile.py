"""Compile the kernels once per static configuration, without tensors and without a GPU.

`compile_publish` / `compile_consumer` take only hashable specs (mhc_ar.config) and an optional
target arch, and are memoized: an AllReduceMHC builds its two kernels at construction and reuses
them for every M (M is a runtime argument). With `arch` given (e.g. "sm_90a", "sm_100a",
"sm_103a") nothing touches a GPU, so the CPU suite compiles every variant for every target and
checks its PTX.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from cutlass.cute.typing import sym_int32

from .config import MXFP8_BLOCK, ConsumerSpec, Contribution, PublishSpec, Variant, choose_consumer_tiling
from .kernels.consumer import ConsumerKernel
from .kernels.layer_call import PublishThenConsume, PublishThenConsumeTensors
from .kernels.publish import PublishKernel
from .protocol import (
    CONSUMER_ARGUMENTS,
    FLOAT_ARGUMENTS,
    INT32_ARGUMENTS,
    LAYER_CALL_ARGUMENTS,
    PUBLISH_ARGUMENTS,
    STATE_WORDS,
    TENSOR_LAUNCHER_ARGUMENTS,
)
from .validation import ALIGNMENT

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


def _options(arch: str | None, dump_dir: str | None) -> str:
    options = ["--enable-tvm-ffi"]
    if arch is not None:
        options.append(f"--gpu-arch={arch}")
    if dump_dir is not None:
        # The cubin serves the co-residency bound (mhc_ar.residency: the driver's occupancy).
        options += ["--keep-ptx", "--keep-cubin", f"--dump-dir={dump_dir}"]
    return " ".join(options)


def _compile(kernel, *arguments, arch: str | None, keep_ptx: bool):
    """cute.compile; with keep_ptx the DSL writes the PTX and cubin to files and reads them back
    into the compiled function (__ptx__, __cubin__): in a folder of its own, removed after."""
    if not keep_ptx:
        return cute.compile(kernel, *arguments, options=_options(arch, None))
    with tempfile.TemporaryDirectory(prefix="mhc_ar_ptx_") as folder:
        return cute.compile(kernel, *arguments, options=_options(arch, folder))


def _fake_state():
    return make_fake_compact_tensor(cutlass.Int32, (STATE_WORDS,), assumed_align=16)


def _fake_arguments(names, **given) -> list:
    """Compile-time stand-ins for a kernel's arguments (mhc_ar.protocol's lists), in order:
    `given` by name, else the state tensor, 0 for an address or an int, 1e-6 for eps; then the
    stream (the TVM-FFI environment's)."""
    def fake(name):
        if name in given:
            return given[name]
        if name == "state":
            return _fake_state()
        if name in INT32_ARGUMENTS:
            return Int32(0)
        if name in FLOAT_ARGUMENTS:
            return Float32(1e-6)
        return Int64(0)

    return [fake(name) for name in names] + [make_fake_stream(use_tvm_ffi_env_stream=True)]


@functools.cache
def compile_publish(spec: PublishSpec, arch: str | None = None, keep_ptx: bool = False) -> CompiledKernel:
    arguments = _fake_arguments(PUBLISH_ARGUMENTS, num_tokens=Int32(1))
    function = _compile(PublishKernel(spec), *arguments, arch=arch, keep_ptx=keep_ptx)
    return CompiledKernel(publish_name(spec), spec, arch, function)


@functools.cache
def compile_consumer(spec: ConsumerSpec, arch: str | None = None, keep_ptx: bool = False) -> CompiledKernel:
    arguments = _fake_arguments(CONSUMER_ARGUMENTS, num_tokens=Int32(1))
    function = _compile(ConsumerKernel(spec), *arguments, arch=arch, keep_ptx=keep_ptx)
    return CompiledKernel(consumer_name(spec), spec, arch, function)


@functools.cache
def compile_publish_then_consume(
    publish: PublishSpec, consumer: ConsumerSpec, arch: str | None = None, keep_ptx: bool = False
) -> CompiledKernel:
    """Both kernels behind one host function (one launch call per eager AllReduceMHC call)."""
    arguments = _fake_arguments(LAYER_CALL_ARGUMENTS, num_tokens=Int32(1))
    function = _compile(PublishThenConsume(publish, consumer), *arguments, arch=arch, keep_ptx=keep_ptx)
    return CompiledKernel(f"{publish_name(publish)}+{consumer_name(consumer)}", (publish, consumer), arch, function)


@functools.cache
def compile_tensor_launcher(
    publish: PublishSpec, consumer: ConsumerSpec, arch: str | None = None, keep_ptx: bool = False
) -> CompiledKernel:
    """Both kernels behind one host function that takes the call's tensors (see
    PublishThenConsumeTensors): for calls without caller-given outputs, so not MXFP8."""
    if consumer.variant is Variant.MXFP8:
        raise ValueError("the tensor launcher allocates its outputs: MXFP8 calls take caller-given mxfp8_out")
    m = sym_int32(symbol="M")
    h, hc = publish.hidden_size, consumer.hc
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    finalize = publish.contribution is Contribution.FINALIZE
    layer_input = consumer.variant is not Variant.RESIDUAL_ONLY
    tensors = dict(
        source=_row_major(bf16, (m, h)),
        gemm2=_row_major(bf16, (sym_int32(symbol="rows"), h)) if finalize else None,
        weights=_row_major(f32, (m, publish.top_k)) if finalize else None,
        routes=_row_major(cutlass.Int32, (m, publish.top_k)) if finalize else None,
        residual=_row_major(bf16, (m, hc, h)),
        post=_row_major(f32, (m, hc)),
        comb=_row_major(f32, (m, hc, hc)),
        pre=_row_major(f32, (m, hc)) if layer_input else None,
        norm_weight=_row_major(bf16, (h,)) if layer_input else None,
        new_residual=_row_major(bf16, (m, hc, h)),
        layer_input=_row_major(bf16, (m, h)) if layer_input else None,
    )
    arguments = _fake_arguments(TENSOR_LAUNCHER_ARGUMENTS, **tensors)
    function = _compile(PublishThenConsumeTensors(publish, consumer), *arguments, arch=arch, keep_ptx=keep_ptx)
    name = f"{publish_name(publish)}+{consumer_name(consumer)}-from-tensors"
    return CompiledKernel(name, (publish, consumer), arch, function)


def _row_major(dtype, shape):
    """A fake contiguous row-major tensor with 16-byte alignment (what validation requires)."""
    return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=ALIGNMENT)


def publish_name(spec: PublishSpec) -> str:
    transport = "multicast" if spec.multicast else "unicast"
    return f"publish-{spec.contribution.value}-{transport}-H{spec.hidden_size}-hc{spec.hc}-tp{spec.tp}-k{spec.top_k}"


def consumer_name(spec: ConsumerSpec) -> str:
    omitted = "".join(f"-no_{stage}" for stage in sorted(spec.omit))
    direct = f"-{spec.contribution.value}-k{spec.top_k}" if spec.direct else ""
    return f"consumer-{spec.variant.value}-H{spec.hidden_size}-hc{spec.hc}-tp{spec.tp}{direct}{omitted}"


def kernel_variants(hidden_size: int = 5120, hc: int = 4, tp: int = 8, capacity: int = 128, top_k: int = 8):
    """Every kernel variant the package builds, for one shape: at tp > 1, 4 publish + 3 consumer
    specs (2 consumers where hidden_size % 128 rules the MXFP8 variant out); at tp = 1 no
    publish, and each consumer variant once per contribution (call, finalize)."""
    specs: list[PublishSpec | ConsumerSpec] = []
    if tp > 1:
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
                        hc=hc,
                    )
                )
    tiling = choose_consumer_tiling(hidden_size)
    for variant in Variant:
        if variant is Variant.MXFP8 and hidden_size % (4 * MXFP8_BLOCK):
            continue
        base = ConsumerSpec(tiling, hc=hc, tp=tp, capacity=capacity, variant=variant)
        specs += list(dict.fromkeys(consumer_specs(base, top_k).values()))  # one spec serves both at tp > 1
    return specs


def consumer_specs(spec: ConsumerSpec, top_k: int) -> dict[bool, ConsumerSpec]:
    """finalize (False, True where top_k >= 1) -> the consumer of those calls: one spec at
    tp > 1 (the publish computes the contribution), one per contribution at tp = 1 (direct)."""
    if not spec.direct:
        return {False: spec, True: spec} if top_k >= 1 else {False: spec}
    specs = {False: dataclasses.replace(spec, contribution=Contribution.CALL, top_k=0)}
    if top_k >= 1:
        specs[True] = dataclasses.replace(spec, contribution=Contribution.FINALIZE, top_k=top_k)
    return specs


def compile_spec(spec, arch: str | None = None, keep_ptx: bool = False) -> CompiledKernel:
    if isinstance(spec, PublishSpec):
        return compile_publish(spec, arch, keep_ptx)
    return compile_consumer(spec, arch, keep_ptx)
