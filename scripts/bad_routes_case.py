"""One small emulated finalize whose routes hold every kind of invalid index (rows, rows + 10^9,
-2, -5), for compute-sanitizer memcheck: the publish must not read outside gemm2_permuted.

    compute-sanitizer --tool memcheck --report-api-errors no python scripts/bad_routes_case.py
(API errors off: the DSL runtime probes driver entry points with cuGetProcAddress, which memcheck
reports as CUDA_ERROR_INVALID_VALUE; they are not memory errors.)
Prints the device's invalid-route counts per rank (expected [4, 0]) and whether the outputs
equal the reference's bytes.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from gpu_cases import random_inputs, reference_for, run_kernel  # noqa: E402
from mhc_ar import EmulatedAllReduceMHC  # noqa: E402

TP, M, HIDDEN, HC, TOP_K = 2, 3, 256, 4, 4


def main() -> int:
    op = EmulatedAllReduceMHC(tp_size=TP, hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=M, top_k=TOP_K, check_routes=False)
    ranks, mix = random_inputs(TP, M, HIDDEN, HC, finalize=True, top_k=TOP_K, seed=5)
    rows = ranks[0].gemm2_permuted.shape[0]
    for (m, k), value in zip([(0, 0), (1, 1), (2, 2), (2, 3)], [rows, rows + 10**9, -2, -5]):
        ranks[0].expanded_idx_to_permuted_idx[m, k] = value
    out, _ = run_kernel(op, ranks, mix, mxfp8=False)
    ref = reference_for(op, ranks, mix, mxfp8=False)
    same = all(torch.equal(nr.view(torch.int16), ref.new_residual.view(torch.int16))
               and torch.equal(li.view(torch.int16), ref.layer_input.view(torch.int16)) for nr, li in out)
    print(f"invalid-route counts per rank: {op.invalid_routes()} (expected [4, 0]); outputs equal the reference: {same}")
    return 0 if same and op.invalid_routes() == [4, 0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
