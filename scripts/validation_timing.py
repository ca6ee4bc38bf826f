"""Host time of the call validation on this machine's CPU (no GPU needed):
`CallValidator.check_call` and `check_finalize` with output allocation, for H=5120, hc=4, M=1;
and the host side of `AllReduceMHC.__call__` / `finalize` on either path, with TVM-FFI's no-op
test function standing in for the compiled launcher (same arguments: the tensor path converts
its torch tensors through DLPack exactly as it would for the kernels). Also `torch.empty(0)`, the
bench's host probe, to compare this host with the one a bench ran on.

    python scripts/validation_timing.py [--device cuda]

With --device cuda (a GPU host) the tensors live on the GPU, so the allocation rows time the CUDA
caching allocator and the tensor path's DLPack conversion includes its stream query; the
kernels are still not launched (see the bench's eager table for that).
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import tvm_ffi

from mhc_ar.allreduce_mhc import AllReduceMHC
from mhc_ar.call_check import CallValidator
from mhc_ar.config import Variant


def per_call_us(fn, calls: int = 50_000, batches: int = 9) -> float:
    """Fastest batch: the least disturbed estimate of the host time per call."""
    for _ in range(2000):
        fn()
    best = float("inf")
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls // batches):
            fn()
        best = min(best, (time.perf_counter() - start) * 1e6 / (calls // batches))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="where the tensors live (default cpu)")
    device = torch.device(parser.parse_args().device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    h, hc, m, k = 5120, 4, 1, 8
    v = CallValidator(hidden_size=h, hc_mult=hc, max_num_tokens=1024, top_k=k, variant=Variant.FULL, device=device)
    bf16 = torch.bfloat16
    x = torch.randn(m, h, device=device).to(bf16)
    mix = tuple(
        t.to(device)
        for t in (torch.randn(m, hc, h).to(bf16), torch.rand(m, hc), torch.rand(m, hc, hc), torch.rand(m, hc), torch.ones(h).to(bf16))
    )
    gemm2, weights = torch.zeros(m * k, h, dtype=bf16, device=device), torch.rand(m, k, device=device)
    routes = torch.zeros(m, k, dtype=torch.int32, device=device)
    op = _host_only_op(v)
    residual_size = m * hc * h
    rows = {
        "check_call": lambda: v.check_call(x, mix, 1e-6, None, None),
        "check_finalize": lambda: v.check_finalize(gemm2, weights, routes, x, mix, 1e-6, None, None),
        "__call__, tensor launcher (no-op kernels)": lambda: op(x, *mix, 1e-6),
        "__call__, validation + address launcher (no-op kernels)": lambda: op(x, *mix, 1e-6, out=op.out),
        "finalize, tensor launcher (no-op kernels)": lambda: op.finalize(gemm2, weights, routes, x, *mix, 1e-6),
        "fresh outputs (CallValidator.fresh_outputs)": lambda: v.fresh_outputs(m),
        "allocation: one buffer cut by as_strided": lambda: _cut(torch.empty(residual_size + m * h, dtype=bf16, device=device), m, hc, h),
        "allocation: two torch.empty": lambda: (torch.empty(m, hc, h, dtype=bf16, device=device), torch.empty(m, h, dtype=bf16, device=device)),
        "host probe: torch.empty(0)": lambda: torch.empty(0),
    }
    for name, fn in rows.items():
        print(f"{name}: {per_call_us(fn):.2f} us")


def _cut(buffer, m, hc, h):
    return buffer.as_strided((m, hc, h), (hc * h, h, 1)), buffer.as_strided((m, h), (h, 1), m * hc * h)


def _host_only_op(validator: CallValidator) -> AllReduceMHC:
    """An AllReduceMHC without a GPU: its bound launchers replaced by TVM-FFI's no-op function
    with this rank's arguments bound as in AllReduceMHC.__init__ (a CPU tensor as `state`)."""
    nop = tvm_ffi.get_global_func("testing.nop")
    per_rank = (torch.zeros(4, dtype=torch.int32, device=validator.device), *([0] * 9), 0, 0)  # state, peers, multicast, rank, mailbox
    op = object.__new__(AllReduceMHC)
    op._capacity = validator.capacity
    op._fresh_outputs = validator.fresh_outputs
    op._check_call = validator.check_call
    op._engine = type("Engine", (), {"validator": validator})()
    op._rejected = 0
    for name in ("_launch_call", "_launch_finalize", "_call_tensors", "_finalize_tensors"):
        setattr(op, name, functools.partial(nop, *per_rank))
    m, h, hc = 1, validator.hidden_size, validator.hc
    # Caller-given outputs: the only path then is CallValidator + the address launcher.
    device = validator.device
    op.out = (torch.empty(m, hc, h, dtype=torch.bfloat16, device=device), torch.empty(m, h, dtype=torch.bfloat16, device=device))
    return op


if __name__ == "__main__":
    main()
