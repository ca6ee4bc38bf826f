"""A few eager TP = 1 fused calls of one shape, for Nsight Compute (issue 13's diagnosis).

At TP = 1 a call is one kernel (mhc_ar.config.ConsumerSpec.direct), so profiling the last launch
profiles the consumer on warm caches and compiled code:

    ncu --clock-control none --kernel-name regex:ConsumerKernel --launch-skip 4 --launch-count 1 --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats \
        python scripts/ncu_consumer.py --hidden 5120 --hc 4 --m 1024 [--mxfp8]

Each call reads a fresh input set (as conformance.bench does), so the profiled call does not
find its inputs in L2.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conformance.bench import FusedSide, make_inputs  # noqa: E402

CALLS = 5


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--hc", type=int, default=4)
    parser.add_argument("--m", type=int, default=1024)
    parser.add_argument("--mxfp8", action="store_true")
    args = parser.parse_args(argv)
    from mhc_ar import EmulatedAllReduceMHC

    op = EmulatedAllReduceMHC(tp_size=1, hidden_size=args.hidden, hc_mult=args.hc, max_num_tokens=args.m, quantize_layer_input=args.mxfp8)
    sides = [FusedSide(op, make_inputs(1, args.m, args.hidden, args.hc, seed), mxfp8=args.mxfp8) for seed in range(CALLS)]
    for side in sides:
        side.call()
    torch.cuda.synchronize()
    print(f"{CALLS} calls: tp=1 H={args.hidden} hc={args.hc} M={args.m} {'mxfp8' if args.mxfp8 else 'full'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
