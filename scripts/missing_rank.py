"""What a rank that never publishes does to the others, across real GPUs:

    torchrun --nproc-per-node N scripts/missing_rank.py [--timeout 2]

Every rank builds AllReduceMHC (unicast, NVLink multicast off) with spin_timeout_s=--timeout;
every rank but the last then calls it, the last never does. Each caller prints how its call
ended and after how long: the consumer is expected to trap once the timeout passes, so the call
surfaces as a CUDA error on synchronize instead of hanging the GPU. A trapped rank's CUDA context
is unusable, so every process exits without collective teardown.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=2.0, help="spin_timeout_s of every rank")
    parser.add_argument("--m", type=int, default=4)
    args = parser.parse_args()

    import torch.distributed as dist

    from conformance.bench import make_inputs
    from conformance.distributed import init_torchrun
    from mhc_ar import AllReduceMHC

    rank, world, device = init_torchrun("nccl")
    hidden, hc = 5120, 4
    op = AllReduceMHC(hidden_size=hidden, hc_mult=hc, max_num_tokens=args.m, device=device, spin_timeout_s=args.timeout)
    inputs = make_inputs(1, args.m, hidden, hc, seed=rank)
    dist.barrier()
    torch.cuda.synchronize()
    if rank == world - 1:
        print(f"rank {rank}: never publishes (skips the call)", flush=True)
        time.sleep(3 * args.timeout)
    else:
        start = time.time()
        try:
            op(inputs.xs[0], inputs.residual, inputs.post, inputs.comb, inputs.pre, inputs.norm_weight, inputs.eps)
            torch.cuda.synchronize()
            print(f"rank {rank}: the call returned without error after {time.time() - start:.2f} s (unexpected)", flush=True)
        except RuntimeError as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            print(f"rank {rank}: CUDA error {time.time() - start:.2f} s after the call (timeout {args.timeout} s): {first_line}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
