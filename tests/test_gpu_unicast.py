"""Transports beyond the emulated one, as far as one GPU allows.

* AllReduceMHC over a one-process group: the unicast transport's code path (torch symmetric
  memory allocation and rendezvous, peer addresses from the handle) on one GPU.
* Processes sharing one GPU through CUDA IPC mailboxes: each process runs one rank's kernels and
  publishes into the other processes' mailboxes, so the Lamport protocol crosses processes and
  CUDA contexts exactly as it crosses GPUs. (torch symmetric memory itself refuses two ranks on
  one device: "detected allocations from overlapping devices from different ranks".) The
  processes' kernels time-slice on the GPU; a consumer spinning on a peer's data only makes
  progress because the GPU preempts it.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from conformance.compare import assert_bitwise_equal, first_mismatch
from mhc_ar.transport import MULTICAST_OFF_ENV

from gpu_cases import random_inputs, reference_for

pytestmark = pytest.mark.gpu

HIDDEN, HC, CAPACITY, TOP_K = 4096, 4, 64, 4
SIZES = (1, 17, 64, 3, 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_rank_group():
    import torch.distributed as dist

    os.environ.update(MULTICAST_OFF_ENV)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


@pytest.mark.parametrize("variant", ["full", "mxfp8"])
def test_unicast_one_rank_group_matches_reference(one_rank_group, variant):
    from mhc_ar import AllReduceMHC, mxfp8_scale_bytes

    mxfp8 = variant == "mxfp8"
    op = AllReduceMHC(hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K, device="cuda",
                      group=one_rank_group, quantize_layer_input=mxfp8)
    for m in SIZES:
        for finalize in (False, True):
            ranks, mix = random_inputs(1, m, HIDDEN, HC, finalize=finalize, top_k=TOP_K, seed=m)
            mx = None
            if mxfp8:
                mx = (torch.empty(m, HIDDEN, dtype=torch.float8_e4m3fn, device="cuda"),
                      torch.full((mxfp8_scale_bytes(m, HIDDEN),), 0xFF, dtype=torch.uint8, device="cuda"))
            out = None
            if m == 17:  # caller-given outputs, poisoned
                out = (torch.full((m, HC, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda"),
                       torch.full((m, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda"))
            args = (mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight, mix.eps)
            r = ranks[0]
            if finalize:
                new_residual, layer_input = op.finalize(r.gemm2_permuted, r.expert_weights, r.expanded_idx_to_permuted_idx,
                                                        r.shared_output, *args, mxfp8_out=mx, out=out)
            else:
                new_residual, layer_input = op(r.x, *args, mxfp8_out=mx, out=out)
            if out is not None:
                assert new_residual is out[0] and layer_input is out[1]
            ref = reference_for(op, ranks, mix, mxfp8=mxfp8)
            assert_bitwise_equal(new_residual, ref.new_residual, f"M={m} finalize={finalize} new_residual")
            assert_bitwise_equal(layer_input, ref.layer_input, f"M={m} finalize={finalize} layer_input")
            if mxfp8:
                assert_bitwise_equal(mx[0].view(torch.uint8), ref.mxfp8_values, f"M={m} mxfp8 values")
                assert_bitwise_equal(mx[1], ref.mxfp8_scales, f"M={m} mxfp8 scales")


def _ipc_worker(rank: int, world: int, mailboxes, results) -> None:
    try:
        os.environ.update(MULTICAST_OFF_ENV)
        sys.path.insert(0, os.path.dirname(__file__))
        from gpu_cases import random_inputs as inputs_for
        from mhc_ar.allreduce_mhc import _Engine
        from mhc_ar.config import Variant
        from mhc_ar.protocol import STATE_WORDS
        from mhc_ar.transport import RankEndpoint, _pad
        from reference import ReductionTree, all_reduce_mhc

        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        engine = _Engine(hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K, tp=world, device=device,
                         variant=Variant.FULL, multicast=False, spin_timeout_s=60.0)
        endpoint = RankEndpoint(rank, world, mailboxes[rank], torch.zeros(STATE_WORDS, dtype=torch.int32, device=device),
                                _pad([mailbox.data_ptr() for mailbox in mailboxes]))
        tree = ReductionTree(**engine.consumer_spec.tiling.reduction_tree_args())
        problems = []
        for m in SIZES:
            finalize = m % 2 == 1
            ranks, mix = inputs_for(world, m, HIDDEN, HC, finalize=finalize, top_k=TOP_K, seed=m)
            mine, mixed = ranks[rank], (mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight)
            if finalize:
                launch = engine.validator.check_finalize(mine.gemm2_permuted, mine.expert_weights, mine.expanded_idx_to_permuted_idx,
                                                         mine.shared_output, mixed, mix.eps, None, None)
            else:
                launch = engine.validator.check_call(mine.x, mixed, mix.eps, None, None)
            engine.publish(endpoint, launch, m, finalize)
            engine.consume(endpoint, launch, mix.eps, m)
            torch.cuda.synchronize()
            ref = all_reduce_mhc(ranks, mix, tree=tree, mxfp8=False)
            for name, got, want in zip(("new_residual", "layer_input"), launch.results, (ref.new_residual, ref.layer_input)):
                mismatch = first_mismatch(want, got, output=name, rank=rank)
                if mismatch is not None:
                    problems.append(f"M={m}: {mismatch.describe()}")
        results.put((rank, problems))
    except Exception:  # report, never hang the parent
        results.put((rank, [traceback.format_exc()]))


@pytest.mark.parametrize("world", [2, 3])
def test_processes_sharing_one_gpu_through_ipc_mailboxes(world):
    from mhc_ar.protocol import SENTINEL_BF16, mailbox_shape

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    sentinel = SENTINEL_BF16 - (1 << 16)
    mailboxes = [
        torch.full(mailbox_shape(world, CAPACITY, HIDDEN), sentinel, dtype=torch.int16, device="cuda").view(torch.bfloat16)
        for _ in range(world)
    ]
    procs = [ctx.Process(target=_ipc_worker, args=(r, world, mailboxes, results)) for r in range(world)]
    for p in procs:
        p.start()
    reports = {}
    try:
        for _ in range(world):
            rank, problems = results.get(timeout=300)
            reports[rank] = problems
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert sorted(reports) == list(range(world)), f"ranks that reported: {sorted(reports)}"
    for rank, problems in reports.items():
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
    armed = all(bool((m.view(torch.int16) == sentinel).all()) for m in mailboxes)
    assert armed, "a consumed mailbox slot was not re-armed"
