"""Smallest end-to-end check on a GPU: compile, one emulated call per variant, bitwise compare.

Prints compile times and the first mismatch, if any; a hang is bounded by the kernels' spin
timeout and by the caller's `timeout`.
"""

import sys
import time

import torch

sys.path.insert(0, "tests")
from gpu_cases import random_inputs, reference_for, run_kernel  # noqa: E402

from conformance.compare import first_mismatch  # noqa: E402
from mhc_ar import EmulatedAllReduceMHC  # noqa: E402


def first_difference(actual: torch.Tensor, expected: torch.Tensor) -> str:
    mismatch = first_mismatch(expected, actual)
    return "equal" if mismatch is None else mismatch.describe()


def main() -> int:
    print(torch.cuda.get_device_name(), torch.__version__)
    failures = 0
    for tp, hidden, hc, m, finalize, variant in [
        (1, 4096, 4, 1, False, "full"),
        (2, 4096, 4, 5, False, "full"),
        (2, 5120, 4, 3, True, "full"),
        (4, 7168, 2, 9, False, "mxfp8"),
        (2, 5120, 4, 130, False, "residual_only"),
    ]:
        mxfp8, residual_only = variant == "mxfp8", variant == "residual_only"
        start = time.time()
        op = EmulatedAllReduceMHC(tp_size=tp, hidden_size=hidden, hc_mult=hc, max_num_tokens=256, top_k=8,
                                  quantize_layer_input=mxfp8, residual_only=residual_only)
        built = time.time() - start
        ranks, mix = random_inputs(tp, m, hidden, hc, finalize=finalize, seed=1, residual_only=residual_only)
        start = time.time()
        out, mx = run_kernel(op, ranks, mix, mxfp8=mxfp8)
        torch.cuda.synchronize()
        ran = time.time() - start
        ref = reference_for(op, ranks, mix, mxfp8=mxfp8)
        results = [("new_residual", out[0][0], ref.new_residual)]
        if not residual_only:
            results.append(("layer_input", out[0][1], ref.layer_input))
        if mxfp8:
            results += [("mxfp8 values", mx[0][0].view(torch.uint8), ref.mxfp8_values), ("mxfp8 scales", mx[0][1], ref.mxfp8_scales)]
        for rank in range(1, tp):
            results.append((f"rank {rank} new_residual", out[rank][0], out[0][0]))
        line = []
        for name, a, b in results:
            verdict = first_difference(a, b)
            failures += verdict != "equal"
            line.append(f"{name}: {verdict}")
        print(f"tp{tp} H{hidden} hc{hc} M{m} {'finalize' if finalize else 'call'} {variant}: build {built:.1f} s, first call {ran:.2f} s | " + " | ".join(line))
    print("smoke:", "ok" if failures == 0 else f"{failures} mismatching outputs")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
