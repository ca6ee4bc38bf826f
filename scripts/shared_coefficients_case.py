"""Small TP = 1 calls at hc > 4, where the consumer stages the mix coefficients in shared memory
(mhc_ar.config.ConsumerSpec.coefficients_in_shared), for compute-sanitizer racecheck, synccheck
and memcheck:

    compute-sanitizer --tool racecheck --report-api-errors no python scripts/shared_coefficients_case.py [--case H,HC,M,OP,VARIANT ...]
(API errors off: the DSL runtime probes driver entry points with cuGetProcAddress, which the
sanitizer reports as CUDA_ERROR_INVALID_VALUE; they are not the kernel's.)
Each case's outputs are compared with the reference's bytes; prints one line per case and exits 1
if any differs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from gpu_cases import check_outputs, random_inputs, reference_for, run_kernel  # noqa: E402
from mhc_ar import EmulatedAllReduceMHC  # noqa: E402
from mhc_ar.config import WIDE_FORM_MIN_TOKENS  # noqa: E402

# hidden, hc, M, finalize, variant: a one-CTA cluster; two fragments per thread, predicated, odd hc; no norm;
# then two at WIDE_FORM_MIN_TOKENS tokens, where the wide form runs (ConsumerSpec.wide)
CASES = [(1024, 8, 3, True, "mxfp8"), (16392, 5, 2, False, "full"), (1032, 6, 2, False, "residual_only"),
         (1024, 8, WIDE_FORM_MIN_TOKENS, True, "mxfp8"), (1032, 6, WIDE_FORM_MIN_TOKENS, False, "residual_only")]


def _case(text: str):
    hidden, hc, m, op, variant = text.split(",")
    if op not in ("call", "finalize") or variant not in ("full", "mxfp8", "residual_only"):
        raise argparse.ArgumentTypeError(f"expected H,HC,M,call|finalize,full|mxfp8|residual_only, got {text}")
    return int(hidden), int(hc), int(m), op == "finalize", variant


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", type=_case, action="append", help="H,HC,M,call|finalize,VARIANT instead of CASES (repeatable)")
    args = parser.parse_args(argv)
    failed = 0
    for hidden, hc, m, finalize, variant in args.case or CASES:
        mxfp8, residual_only = variant == "mxfp8", variant == "residual_only"
        op = EmulatedAllReduceMHC(tp_size=1, hidden_size=hidden, hc_mult=hc, max_num_tokens=m, top_k=4,
                                  quantize_layer_input=mxfp8, residual_only=residual_only)
        ranks, mix = random_inputs(1, m, hidden, hc, finalize=finalize, top_k=4, seed=hidden + hc, residual_only=residual_only)
        out, mx = run_kernel(op, ranks, mix, mxfp8=mxfp8)
        torch.cuda.synchronize()
        differ = []
        check_outputs(out, mx, reference_for(op, ranks, mix, mxfp8=mxfp8),
                      lambda a, b, name: differ.append(name) if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)) else None)
        same = not differ
        failed += not same
        spec = op._engine.consumer_spec
        print(f"H{hidden} hc{hc} M{m} {'finalize' if finalize else 'call'} {variant}: coefficients in shared memory "
              f"{spec.coefficients_in_shared} ({'wide' if m >= WIDE_FORM_MIN_TOKENS else 'narrow'} form), "
              f"{spec.tiling.threads_per_cta} threads x {spec.tiling.cluster_size} CTAs, "
              f"outputs equal the reference: {same}" + ("" if same else f" (differ: {', '.join(differ)})"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
