"""The unicast transport (torch symmetric memory peer addresses) with real processes.

On a machine with one GPU, `world` processes share it: each allocates its mailbox in symmetric
memory, rendezvous gives every peer's address, and the publish kernels store into the other
processes' mailboxes. The processes' kernels time-slice on the GPU, so a consumer spinning on a
peer's data only makes progress because the GPU preempts it: slow, but the same kernels, the
same transport code and the same protocol as one process per GPU.
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from mhc_ar.transport import MULTICAST_OFF_ENV

pytestmark = pytest.mark.gpu

HIDDEN, HC, CAPACITY = 4096, 4, 64
SIZES = (1, 17, 64, 3, 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, finalize: bool, results) -> None:
    try:
        os.environ.update(MULTICAST_OFF_ENV)
        import torch.distributed as dist

        from conformance.compare import first_mismatch
        from mhc_ar import AllReduceMHC

        import sys

        sys.path.insert(0, os.path.dirname(__file__))
        from gpu_cases import random_inputs
        from reference import ReductionTree, all_reduce_mhc

        torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        op = AllReduceMHC(hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=CAPACITY, top_k=4, device="cuda:0")
        tree = ReductionTree(**op.consumer_tiling.reduction_tree_args())
        problems = []
        for m in SIZES:
            ranks, mix = random_inputs(world, m, HIDDEN, HC, finalize=finalize, top_k=4, seed=m)
            mine = ranks[rank]
            if finalize:
                new_residual, layer_input = op.finalize(
                    mine.gemm2_permuted, mine.expert_weights, mine.expanded_idx_to_permuted_idx, mine.shared_output,
                    mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight, mix.eps,
                )
            else:
                new_residual, layer_input = op(mine.x, mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight, mix.eps)
            torch.cuda.synchronize()
            ref = all_reduce_mhc(ranks, mix, tree=tree, mxfp8=False)
            for name, got, want in (("new_residual", new_residual, ref.new_residual), ("layer_input", layer_input, ref.layer_input)):
                mismatch = first_mismatch(want, got, output=name, rank=rank)
                if mismatch is not None:
                    problems.append(f"M={m}: {mismatch.describe()}")
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, problems))
    except Exception:  # report, never hang the parent
        results.put((rank, [traceback.format_exc()]))


@pytest.mark.parametrize("world,finalize", [(2, False), (3, True)])
def test_unicast_processes_sharing_one_gpu(world, finalize):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, finalize, results)) for r in range(world)]
    for p in procs:
        p.start()
    reports = {}
    try:
        for _ in range(world):
            rank, problems = results.get(timeout=240)
            reports[rank] = problems
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert sorted(reports) == list(range(world)), f"ranks that reported: {sorted(reports)}"
    for rank, problems in reports.items():
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
