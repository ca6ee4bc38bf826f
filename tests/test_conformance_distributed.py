"""The torchrun backend's orchestration on the CPU: two gloo processes, each running its own rank
through a stand-in op (the reference, one planted flip on rank 1), outputs all-gathered, every
process comparing every rank. The real op (AllReduceMHC over NCCL) needs several GPUs."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.multiprocessing as mp

from conformance.cases import Case

CASE_ID = "tp2-H128-hc2-M3-call-mxfp8-normal"


class _ReferenceOp:
    """Writes this rank's outputs from the reference, flipping one byte on rank 1."""

    def __init__(self, case, rank, tree):
        self.case, self.rank, self.tree = case, rank, tree

    @property
    def consumer_tiling(self):
        from mhc_ar import choose_consumer_tiling

        return choose_consumer_tiling(self.case.hidden)

    def __call__(self, x, residual, post, comb, pre, norm_weight, eps, *, mxfp8_out, out):
        from conformance.inputs import make_inputs
        from reference import all_reduce_mhc

        inputs = make_inputs(self.case, torch.device("cpu"))
        ref = all_reduce_mhc(inputs.ranks, inputs.mix, tree=self.tree, mxfp8=True)
        out[0].copy_(ref.new_residual)
        out[1].copy_(ref.layer_input)
        mxfp8_out[0].view(torch.uint8).copy_(ref.mxfp8_values)
        mxfp8_out[1].copy_(ref.mxfp8_scales)
        if self.rank == 1:
            out[1].view(torch.int16)[2, 5] ^= 1


def _worker(rank, port, results):
    try:
        import torch.distributed as dist

        from conformance.distributed import DistributedKernelBackend
        from conformance.runner import run_case

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        case = Case.from_id(CASE_ID)
        from conformance.runner import tiling_tree

        backend = DistributedKernelBackend("cpu", make_op=lambda c: _ReferenceOp(c, rank, tiling_tree(c.hidden)))
        run = run_case(case, backend)
        found = [(m.output, m.rank, m.oracle, m.index) for m in run.result.mismatches]
        results.put((rank, run.result.status.value, found, run.result.error))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "exception", [], traceback.format_exc()))


def test_every_process_sees_every_rank_and_finds_the_planted_flip():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    reports = {}
    try:
        for _ in range(2):
            rank, status, found, error = results.get(timeout=180)
            reports[rank] = (status, found, error)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        status, found, error = reports[rank]
        assert status == "mismatch", (rank, status, error)
        # The flip is on rank 1's layer_input at [2, 5]: seen against the reference and rank 0.
        assert ("layer_input", 1, "reference", (2, 5)) in found, found
        assert ("layer_input", 1, "rank0", (2, 5)) in found, found
        assert all(m[1] == 1 for m in found), found
