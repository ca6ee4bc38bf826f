"""Probe kernel: out[i] = rsqrt.approx.ftz.f32(x[i]), the exact instruction the consumer uses.

It exists to measure the hardware's reciprocal square root on whatever GPU is present
(`python -m conformance measure-rsqrt`), which the reference's CPU emulation is built from.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from .. import ptx

_THREADS = 256


class RsqrtProbe:
    @cute.jit
    def __call__(self, x: cute.Tensor, out: cute.Tensor, count: Int32, stream):
        blocks = (count + (_THREADS - 1)) // _THREADS
        self.kernel(x, out, count).launch(grid=[blocks, 1, 1], block=[_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, out: cute.Tensor, count: Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        index = bid * _THREADS + tid
        if index < count:
            out[index] = ptx.rsqrt_approx_ftz(x[index])


@functools.cache
def compile_rsqrt_probe(arch: str | None = None):
    """Returns a callable f(x_fp32_1d, out_fp32_1d, count) launching on the current stream."""
    n = cute.sym_int()
    x = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
    out = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
    options = "--enable-tvm-ffi" + (f" --gpu-arch={arch}" if arch else "")
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(RsqrtProbe(), x, out, Int32(1), stream, options=options)
