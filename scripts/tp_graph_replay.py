"""CUDA graph replay across real ranks (unicast transport), bit-exact on every replay:

    torchrun --nproc-per-node N scripts/tp_graph_replay.py [--replays 100]

Each rank captures one graph of AllReduceMHC calls (MXFP8 variant) with M = 16, 1, 129, 3, 64,
then replays it --replays times, copying new inputs into the captured buffers before each
replay (every process builds every rank's inputs from the same seeds, so each can compute the
reference). After each replay every rank compares every byte of its outputs with the reference;
the first differing element is printed with both values. Rank 0 prints the total; the exit
status is 1 if any rank saw a difference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

SIZES = (16, 1, 129, 3, 64)
HIDDEN, HC = 5120, 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replays", type=int, default=100)
    args = parser.parse_args()

    import torch.distributed as dist

    from conformance.compare import first_mismatch
    from conformance.distributed import init_torchrun
    from gpu_cases import random_inputs
    from mhc_ar import AllReduceMHC, mxfp8_scale_bytes
    from reference import ReductionTree, all_reduce_mhc

    rank, world, device = init_torchrun("nccl", min_world=1)
    op = AllReduceMHC(hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=max(SIZES), device=device, quantize_layer_input=True)
    tree = ReductionTree(**op.consumer_tiling.reduction_tree_args())
    static = [random_inputs(world, m, HIDDEN, HC, seed=m, device=device) for m in SIZES]
    buffers = [
        (
            (torch.empty(m, HC, HIDDEN, dtype=torch.bfloat16, device=device), torch.empty(m, HIDDEN, dtype=torch.bfloat16, device=device)),
            (torch.empty(m, HIDDEN, dtype=torch.float8_e4m3fn, device=device), torch.empty(mxfp8_scale_bytes(m, HIDDEN), dtype=torch.uint8, device=device)),
        )
        for m in SIZES
    ]

    def calls():
        for (ranks, mix), (out, mx) in zip(static, buffers):
            op(ranks[rank].x, mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight, mix.eps, out=out, mxfp8_out=mx)

    calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    torch.cuda.synchronize()

    mismatches = 0
    for replay in range(args.replays):
        for i, m in enumerate(SIZES):
            fresh_ranks, fresh_mix = random_inputs(world, m, HIDDEN, HC, seed=10_000 * (replay + 1) + i, device=device)
            ranks, mix = static[i]
            for dst, src in zip(ranks, fresh_ranks):
                dst.x.copy_(src.x)
            for name in ("residual", "post", "comb", "pre", "norm_weight"):
                getattr(mix, name).copy_(getattr(fresh_mix, name))
            out, mx = buffers[i]  # poisoned before every replay: an unwritten byte cannot pass
            for tensor in (*out, *mx):
                tensor.view(torch.uint8).fill_(0xA5)
        graph.replay()
        torch.cuda.synchronize()
        for m, (ranks, mix), (out, mx) in zip(SIZES, static, buffers):
            ref = all_reduce_mhc(ranks, mix, tree=tree, mxfp8=True)
            pairs = ((ref.new_residual, out[0], "new_residual"), (ref.layer_input, out[1], "layer_input"),
                     (ref.mxfp8_values, mx[0].view(torch.uint8), "mxfp8_values"), (ref.mxfp8_scales, mx[1], "mxfp8_scales"))
            for expected, actual, name in pairs:
                found = first_mismatch(expected, actual, output=name, rank=rank)
                if found is not None:
                    mismatches += 1
                    print(f"rank {rank} replay {replay} M={m}: {found.describe()}", flush=True)
    total = torch.tensor([mismatches], dtype=torch.int64, device=device)
    dist.all_reduce(total)
    if rank == 0:
        print(f"tp{world}: {args.replays} replays x {len(SIZES)} calls (M = {', '.join(map(str, SIZES))}), "
              f"{int(total.item())} outputs differing from the reference over all ranks", flush=True)
    dist.destroy_process_group()
    return 1 if int(total.item()) else 0


if __name__ == "__main__":
    sys.exit(main())
