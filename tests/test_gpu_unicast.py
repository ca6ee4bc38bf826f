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
        from mhc_ar.engine import Engine
        from mhc_ar.config import Variant
        from mhc_ar.protocol import STATE_WORDS
        from mhc_ar.transport import RankEndpoint, _pad
        from reference import ReductionTree, all_reduce_mhc

        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        engine = Engine(hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K, tp=world, device=device,
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
            engine.consume(endpoint, launch, mix.eps, m, finalize)
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


# AllReduceMHC's tensor launcher: the eager path of calls without caller-given outputs.

def _one_rank_op(group, **kwargs):
    from mhc_ar import AllReduceMHC

    return AllReduceMHC(hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K, device="cuda", group=group, **kwargs)


def _python_validation_forbidden(op):
    """Make the Python validation path fail loudly, so a passing call proves the tensor launcher ran."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the call went through CallValidator, not the tensor launcher")

    op._check_call = forbidden
    op._engine.validator.check_finalize = forbidden


def _poisoned_fresh_outputs(op):
    """Replace the op's output allocation by NaN-poisoned tensors of the same shapes, so an
    element the kernels do not write cannot pass; returns the list of what it handed out."""
    from conformance.runner import POISON_BF16

    real, handed_out = op._fresh_outputs, []

    def poisoned(m):
        outputs = tuple(None if t is None else t.view(torch.int16).fill_(POISON_BF16).view(torch.bfloat16) for t in real(m))
        handed_out.append(outputs)
        return outputs

    op._fresh_outputs = poisoned
    return handed_out


def _call(op, rank, mix, eps=None):
    eps = mix.eps if eps is None else eps
    args = (mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight, eps)
    if rank.is_finalize:
        return op.finalize(rank.gemm2_permuted, rank.expert_weights, rank.expanded_idx_to_permuted_idx, rank.shared_output, *args)
    return op(rank.x, *args)


@pytest.mark.parametrize("residual_only", [False, True])
def test_tensor_launcher_matches_reference(one_rank_group, residual_only):
    op = _one_rank_op(one_rank_group, residual_only=residual_only)
    _python_validation_forbidden(op)
    handed_out = _poisoned_fresh_outputs(op)
    for m in SIZES + (CAPACITY - 1,):
        for finalize in (False, True):
            ranks, mix = random_inputs(1, m, HIDDEN, HC, finalize=finalize, top_k=TOP_K, seed=50 + m, residual_only=residual_only)
            new_residual, layer_input = _call(op, ranks[0], mix)
            assert new_residual is handed_out[-1][0] and layer_input is handed_out[-1][1]
            ref = reference_for(op, ranks, mix, mxfp8=False)
            assert_bitwise_equal(new_residual, ref.new_residual, f"M={m} finalize={finalize} new_residual")
            if residual_only:
                assert layer_input is None
            else:
                assert_bitwise_equal(layer_input, ref.layer_input, f"M={m} finalize={finalize} layer_input")


def _bad_calls(m):
    """(what, field, bad value): each breaks one rule CallValidator enforces."""
    dev = "cuda"
    misaligned = torch.rand(m * HC + 1, device=dev)[1:].view(m, HC)  # 4 bytes past a 16-byte boundary
    return [
        ("x dtype", "x", torch.randn(m, HIDDEN, device=dev).half()),
        ("x shape", "x", torch.randn(m, HIDDEN + 8, device=dev).bfloat16()),
        ("x on the CPU", "x", torch.randn(m, HIDDEN).bfloat16()),
        ("residual M", "residual", torch.randn(m + 1, HC, HIDDEN, device=dev).bfloat16()),
        ("residual strided", "residual", torch.randn(m, HC, 2 * HIDDEN, device=dev).bfloat16()[:, :, :HIDDEN]),
        ("post shape", "post", torch.rand(m, HC + 1, device=dev)),
        ("comb transposed", "comb", torch.rand(m, HC, HC, device=dev).mT),
        ("pre misaligned", "pre", misaligned),
        ("pre float64", "pre", torch.rand(m, HC, device=dev, dtype=torch.float64)),
        ("pre missing", "pre", None),
        ("norm_weight shape", "norm_weight", torch.ones(HIDDEN + 8, device=dev).bfloat16()),
        ("norm_weight on the CPU", "norm_weight", torch.ones(HIDDEN).bfloat16()),
        ("gemm2 strided", "gemm2_permuted", torch.randn(m * TOP_K, 2 * HIDDEN, device=dev).bfloat16()[:, ::2]),
        ("weights shape", "expert_weights", torch.rand(m, TOP_K + 1, device=dev)),
        ("routes int64", "expanded_idx_to_permuted_idx", torch.zeros(m, TOP_K, dtype=torch.int64, device=dev)),
        ("shared_output M", "shared_output", torch.randn(m + 1, HIDDEN, device=dev).bfloat16()),
    ]


def test_tensor_launcher_rejects_what_validation_rejects_and_launches_nothing(one_rank_group):
    """Each bad argument: the compiled launcher itself refuses it (called directly), the API
    raises CallValidator's ValueError, and no kernel ran (state and mailbox unchanged)."""
    from dataclasses import replace

    from mhc_ar.engine import REJECTED_BEFORE_LAUNCH
    from mhc_ar.protocol import SENTINEL_BF16

    op = _one_rank_op(one_rank_group)
    m = 5
    endpoint = op._endpoint
    torch.cuda.synchronize()
    state, mailbox = endpoint.state.clone(), endpoint.mailbox.clone()
    for what, field, bad in _bad_calls(m):
        finalize = field in ("gemm2_permuted", "expert_weights", "expanded_idx_to_permuted_idx", "shared_output")
        ranks, mix = random_inputs(1, m, HIDDEN, HC, finalize=finalize, top_k=TOP_K, seed=7)
        rank = ranks[0]
        if hasattr(mix, field):
            mix = replace(mix, **{field: bad})
        else:
            rank = replace(rank, **{field: bad})
        source = rank.shared_output if finalize else rank.x
        contribution = (source, rank.gemm2_permuted, rank.expert_weights, rank.expanded_idx_to_permuted_idx) if finalize else (source, None, None, None)
        launch = op._finalize_tensors if finalize else op._call_tensors
        outputs = op._fresh_outputs(m)
        with pytest.raises(REJECTED_BEFORE_LAUNCH):
            launch(*contribution, mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight, *outputs, mix.eps, 0)
        with pytest.raises(ValueError):
            _call(op, rank, mix)
        torch.cuda.synchronize()
        assert torch.equal(endpoint.state, state), f"{what}: the protocol state changed"
        assert torch.equal(endpoint.mailbox.view(torch.int16), mailbox.view(torch.int16)), f"{what}: a mailbox changed"
    sentinel = SENTINEL_BF16 - (1 << 16)
    assert bool((endpoint.mailbox.view(torch.int16) == sentinel).all())
    ranks, mix = random_inputs(1, m, HIDDEN, HC, seed=8)
    new_residual, layer_input = _call(op, ranks[0], mix)
    ref = reference_for(op, ranks, mix, mxfp8=False)
    assert_bitwise_equal(new_residual, ref.new_residual, "valid call after the rejections: new_residual")
    assert_bitwise_equal(layer_input, ref.layer_input, "valid call after the rejections: layer_input")


def test_valid_calls_the_tensor_launcher_does_not_take_still_run(one_rank_group):
    """post as [M, hc, 1] and an int eps are valid API input the compiled signature does not take:
    they go through CallValidator and the address launcher (one launch, same bytes)."""
    op = _one_rank_op(one_rank_group)
    ranks, mix = random_inputs(1, 9, HIDDEN, HC, seed=9)
    from dataclasses import replace

    for changed in (replace(mix, post=mix.post.unsqueeze(-1)), replace(mix, eps=0)):
        new_residual, layer_input = _call(op, ranks[0], changed)
        ref = reference_for(op, ranks, replace(changed, post=mix.post), mxfp8=False)
        assert_bitwise_equal(new_residual, ref.new_residual, "new_residual")
        assert_bitwise_equal(layer_input, ref.layer_input, "layer_input")


def test_tensor_launcher_in_a_cuda_graph(one_rank_group):
    """Captured on a side stream (the launcher takes its stream from torch's current stream),
    with M = 16, 1, 33 and the outputs allocated inside the capture; replayed with new inputs."""
    op = _one_rank_op(one_rank_group)
    _python_validation_forbidden(op)
    sizes = (16, 1, 33)
    static = [random_inputs(1, m, HIDDEN, HC, seed=200 + m) for m in sizes]
    for ranks, mix in static:  # warm up (first-call module loading) outside the capture
        _call(op, ranks[0], mix)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [_call(op, ranks[0], mix) for ranks, mix in static]
    for replay in range(5):
        for (ranks, mix), m in zip(static, sizes):
            fresh_ranks, fresh_mix = random_inputs(1, m, HIDDEN, HC, seed=300 + 10 * replay + m)
            ranks[0].x.copy_(fresh_ranks[0].x)
            for name in ("residual", "post", "comb", "pre", "norm_weight"):
                getattr(mix, name).copy_(getattr(fresh_mix, name))
        graph.replay()
        torch.cuda.synchronize()
        for (ranks, mix), (new_residual, layer_input), m in zip(static, outputs, sizes):
            ref = reference_for(op, ranks, mix, mxfp8=False)
            assert_bitwise_equal(new_residual, ref.new_residual, f"replay {replay} M={m} new_residual")
            assert_bitwise_equal(layer_input, ref.layer_input, f"replay {replay} M={m} layer_input")
