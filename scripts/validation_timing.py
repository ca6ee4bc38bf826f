"""Host time of the call validation on this machine's CPU (no GPU needed):
`CallValidator.check_call` and `check_finalize` with output allocation, for H=5120, hc=4, M=1.
Also `torch.empty(0)`, the bench's host probe, to compare this host with the one a bench ran on.

    python scripts/validation_timing.py
"""

from __future__ import annotations

import time

import torch

from mhc_ar.allreduce_mhc import CallValidator
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
    h, hc, m, k = 5120, 4, 1, 8
    v = CallValidator(hidden_size=h, hc_mult=hc, max_num_tokens=1024, top_k=k, variant=Variant.FULL, device=torch.device("cpu"))
    x = torch.randn(m, h).bfloat16()
    mix = (torch.randn(m, hc, h).bfloat16(), torch.rand(m, hc), torch.rand(m, hc, hc), torch.rand(m, hc), torch.ones(h).bfloat16())
    gemm2, weights, routes = torch.zeros(m * k, h).bfloat16(), torch.rand(m, k), torch.zeros(m, k, dtype=torch.int32)
    rows = {
        "check_call": lambda: v.check_call(x, mix, 1e-6, None, None),
        "check_finalize": lambda: v.check_finalize(gemm2, weights, routes, x, mix, 1e-6, None, None),
        "host probe: torch.empty(0)": lambda: torch.empty(0),
    }
    for name, fn in rows.items():
        print(f"{name}: {per_call_us(fn):.2f} us")


if __name__ == "__main__":
    main()
