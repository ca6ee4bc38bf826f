"""The fused kernels on a GPU, emulated TP: every byte against the reference, and the protocol's
hazards (signed zeros, float-compared spins, host-chosen generations, wrong re-arm, M shrinking
and growing, PDL ordering, rejected calls)."""

from __future__ import annotations

import random

import pytest
import torch

from conformance.compare import assert_bitwise_equal
from conformance.runner import POISON_BF16
from mhc_ar import EmulatedAllReduceMHC
from mhc_ar.config import WIDE_FORM_MIN_TOKENS
from mhc_ar.protocol import GENERATIONS, PUBLISH_GENERATION, SENTINEL_BF16
from reference import BF16_CANONICAL_NAN, MixInputs, RankInputs

from gpu_cases import check_outputs, poisoned_outputs, random_inputs, reference_for, run_kernel

pytestmark = pytest.mark.gpu

CAPACITY = 256
_OPS: dict = {}


def emulated(tp, hidden, hc, *, top_k=8, mxfp8=False, residual_only=False, capacity=CAPACITY) -> EmulatedAllReduceMHC:
    key = (tp, hidden, hc, top_k, mxfp8, residual_only, capacity)
    if key not in _OPS:
        _OPS.clear()  # one instance alive at a time bounds mailbox memory
        _OPS[key] = EmulatedAllReduceMHC(
            tp_size=tp,
            hidden_size=hidden,
            hc_mult=hc,
            max_num_tokens=capacity,
            top_k=top_k,
            quantize_layer_input=mxfp8,
            residual_only=residual_only,
        )
    return _OPS[key]


def mailboxes_armed(op: EmulatedAllReduceMHC) -> bool:
    sentinel = SENTINEL_BF16 - (1 << 16)
    return all(bool((e.mailbox.view(torch.int16) == sentinel).all()) for e in op.endpoints)


CASES = [
    # tp, hidden, hc, m, finalize, variant
    (1, 4096, 4, 1, False, "full"),
    (2, 5120, 4, 3, False, "full"),
    (3, 4096, 2, 17, True, "full"),
    (4, 7168, 8, 129, False, "mxfp8"),
    (8, 5120, 4, 64, True, "mxfp8"),
    (8, 7168, 1, 5, False, "residual_only"),
    (2, 4104, 3, 31, True, "full"),  # H not a multiple of 128: predicated tiling
    (5, 128, 8, 256, False, "mxfp8"),  # one CTA, capacity
    (6, 8, 1, 7, False, "full"),  # smallest hidden size
    # TP = 1: one kernel reading the contribution in place (ConsumerSpec.direct)
    (1, 4104, 3, 31, True, "full"),  # finalize, predicated tiling
    (1, 7168, 8, 129, False, "mxfp8"),
    (1, 5120, 4, 64, True, "mxfp8"),
    (1, 128, 2, 5, True, "residual_only"),
    # TP = 1, hc > 4: the coefficients staged in shared memory (ConsumerSpec.coefficients_in_shared)
    (1, 16392, 5, 33, True, "full"),  # odd hc, 2 fragments per thread, predicated
    (1, 4104, 6, 17, False, "residual_only"),  # no collapse
    (1, 5120, 7, 130, False, "mxfp8"),  # scale rows past one 128-row tile
    (1, 4096, 8, 3, True, "mxfp8"),
]


@pytest.mark.parametrize("tp,hidden,hc,m,finalize,variant", CASES)
def test_matches_reference(tp, hidden, hc, m, finalize, variant):
    mxfp8, residual_only = variant == "mxfp8", variant == "residual_only"
    op = emulated(tp, hidden, hc, mxfp8=mxfp8, residual_only=residual_only)
    ranks, mix = random_inputs(tp, m, hidden, hc, finalize=finalize, seed=hash((tp, hidden, m)) % 2**31, residual_only=residual_only)
    out, mx = run_kernel(op, ranks, mix, mxfp8=mxfp8)
    torch.cuda.synchronize()
    check_outputs(out, mx, reference_for(op, ranks, mix, mxfp8=mxfp8), assert_bitwise_equal)
    assert mailboxes_armed(op), "a consumed mailbox slot was not re-armed"


# TP = 1, hc > 4, from WIDE_FORM_MIN_TOKENS tokens: the consumer's wide form (ConsumerSpec.wide)
WIDE_CASES = [
    # hidden, hc, m, finalize, variant
    (7168, 8, WIDE_FORM_MIN_TOKENS, True, "full"),  # the first count that takes it
    (5120, 7, WIDE_FORM_MIN_TOKENS + 1, False, "mxfp8"),  # odd hc, a scale tile begun
    (16392, 5, WIDE_FORM_MIN_TOKENS, False, "full"),  # 256-thread CTAs, 2 fragments per thread, predicated
    (4104, 6, WIDE_FORM_MIN_TOKENS + 6, True, "residual_only"),  # no collapse, predicated
]


def _consumer_kernels_run(call) -> list[str]:
    """The names of the consumer kernels `call` launches (a CUDA profiler trace)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        call()
        torch.cuda.synchronize()
    return [e.name for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and ("ConsumerKernel" in e.name or "WideFormKernel" in e.name)]


@pytest.mark.parametrize("hidden,hc,m,finalize,variant", WIDE_CASES)
def test_wide_form_runs_from_its_token_count_and_matches_reference(hidden, hc, m, finalize, variant):
    """One instance (capacity m): a call of m tokens launches the wide form, one of
    WIDE_FORM_MIN_TOKENS - 1 the narrow form; both match the reference byte for byte."""
    mxfp8, residual_only = variant == "mxfp8", variant == "residual_only"
    op = emulated(1, hidden, hc, mxfp8=mxfp8, residual_only=residual_only, capacity=m)
    for tokens in (m, WIDE_FORM_MIN_TOKENS - 1):
        ranks, mix = random_inputs(1, tokens, hidden, hc, finalize=finalize, seed=tokens + hc, residual_only=residual_only)
        result = {}
        names = _consumer_kernels_run(lambda: result.update(zip(("out", "mx"), run_kernel(op, ranks, mix, mxfp8=mxfp8))))
        wide = tokens >= WIDE_FORM_MIN_TOKENS
        assert len(names) == 1 and ("WideFormKernel" in names[0]) == wide, f"M={tokens}: kernels run {names}"
        check_outputs(result["out"], result["mx"], reference_for(op, ranks, mix, mxfp8=mxfp8), assert_bitwise_equal)


def test_mxfp8_matches_flashinfer():
    from flashinfer import mxfp8_quantize

    op = emulated(2, 5120, 4, mxfp8=True)
    for m in (1, 127, 129):
        ranks, mix = random_inputs(2, m, 5120, 4, seed=m)
        out, mx = run_kernel(op, ranks, mix, mxfp8=True)
        values, scales = mxfp8_quantize(out[0][1], True, backend="cute-dsl")
        assert_bitwise_equal(mx[0][0].view(torch.uint8), values.view(torch.uint8), f"M={m} values vs flashinfer")
        assert_bitwise_equal(mx[0][1], scales.view(torch.uint8).reshape(-1), f"M={m} scales vs flashinfer")


def _special_inputs(tp, m, hidden, hc):
    ranks, mix = random_inputs(tp, m, hidden, hc, seed=7)
    xs = [r.x.clone() for r in ranks]
    # Order-sensitive columns: 2^24 + 1 - 2^24 is 0 in rank order, 1 in other orders.
    for r, v in enumerate((2.0**24, 1.0, -(2.0**24))[:tp]):
        xs[r][:, 0:8] = v
    for x in xs:
        x[:, 8:16] = -0.0  # every rank -0.0: the sum must be +0.0 after the scrub
    xs[0][0, 16] = float("nan")
    xs[-1][0, 17] = float("inf")
    xs[0][0, 18] = float("-inf")
    residual = mix.residual.clone()
    residual[:, :, 24:32] = -0.0
    residual[0, 0, 32] = float("nan")
    comb = mix.comb.clone()
    comb[0, 0, 0] = float("inf")
    return [RankInputs(x=x) for x in xs], MixInputs(residual, mix.post, comb, mix.pre, mix.norm_weight, mix.eps)


def test_special_values_and_canonical_nan():
    op = emulated(3, 4096, 4, mxfp8=True)
    ranks, mix = _special_inputs(3, 9, 4096, 4)
    out, mx = run_kernel(op, ranks, mix, mxfp8=True)
    ref = reference_for(op, ranks, mix, mxfp8=True)
    check_outputs(out, mx, ref, assert_bitwise_equal)
    layer_input = out[0][1].view(torch.int16)
    nan_lanes = torch.isnan(out[0][1])
    assert bool(nan_lanes.any()), "the special inputs were meant to produce NaN outputs"
    assert bool((layer_input[nan_lanes] == BF16_CANONICAL_NAN).all()), "cvt.rn.bf16x2.f32 NaN is not 0x7FFF"


def test_generation_advances_on_device_and_mailboxes_rearm():
    op = emulated(4, 5120, 4)
    op.reset()
    sizes = [5, 64, 1, 129, 3, 256, 2]  # shrink and grow: stale sentinels would hang or corrupt
    for calls, m in enumerate(sizes, start=1):
        ranks, mix = random_inputs(4, m, 5120, 4, seed=calls)
        out, mx = run_kernel(op, ranks, mix, mxfp8=False)
        check_outputs(out, mx, reference_for(op, ranks, mix, mxfp8=False), assert_bitwise_equal)
        assert mailboxes_armed(op)
        for endpoint in op.endpoints:
            assert int(endpoint.state[PUBLISH_GENERATION]) == calls % GENERATIONS


def test_rejected_call_changes_nothing():
    op = emulated(2, 4096, 2)
    ranks, mix = random_inputs(2, 8, 4096, 2, seed=3)
    states = [e.state.clone() for e in op.endpoints]
    bad_post = mix.post[:, :1]  # wrong shape
    with pytest.raises(ValueError, match="post"):
        op([r.x for r in ranks], mix.residual, bad_post, mix.comb, mix.pre, mix.norm_weight, mix.eps)
    with pytest.raises(ValueError, match="x"):
        op([ranks[0].x, ranks[1].x.float()], mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight, mix.eps)
    torch.cuda.synchronize()
    assert mailboxes_armed(op)
    assert all(torch.equal(s, e.state) for s, e in zip(states, op.endpoints))
    out, mx = run_kernel(op, ranks, mix, mxfp8=False)
    check_outputs(out, mx, reference_for(op, ranks, mix, mxfp8=False), assert_bitwise_equal)


def test_layer_chain_reads_previous_output_after_pdl_wait():
    """Call n+1's residual is call n's new_residual, written by the kernel right before: a
    consumer that loaded it before griddepcontrol.wait would read stale bytes."""
    tp, hidden, hc, m, layers = 2, 5120, 4, 33, 6
    op = emulated(tp, hidden, hc)
    inputs = [random_inputs(tp, m, hidden, hc, seed=100 + i) for i in range(layers)]
    ranks0, mix0 = inputs[0]
    residual = mix0.residual
    expected = []
    for ranks, mix in inputs:
        ref = reference_for(op, ranks, MixInputs(residual, mix.post, mix.comb, mix.pre, mix.norm_weight), mxfp8=False)
        expected.append(ref)
        residual = ref.new_residual

    def chain():
        residual = mix0.residual
        outs = []
        for ranks, mix in inputs:
            results = op([r.x for r in ranks], residual, mix.post, mix.comb, mix.pre, mix.norm_weight, mix.eps)
            residual = results[0][0]
            outs.append(results)
        return outs

    for layer, (results, ref) in enumerate(zip(chain(), expected)):
        for rank, (new_residual, layer_input) in enumerate(results):
            assert_bitwise_equal(new_residual, ref.new_residual, f"eager layer {layer} rank {rank} new_residual")
            assert_bitwise_equal(layer_input, ref.layer_input, f"eager layer {layer} rank {rank} layer_input")

    graph = torch.cuda.CUDAGraph()
    chain()  # warm-up outside capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = chain()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for layer, (results, ref) in enumerate(zip(captured, expected)):
            for rank, (new_residual, layer_input) in enumerate(results):
                assert_bitwise_equal(new_residual, ref.new_residual, f"graph layer {layer} rank {rank} new_residual")
                assert_bitwise_equal(layer_input, ref.layer_input, f"graph layer {layer} rank {rank} layer_input")


def test_graph_replay_with_changing_m_and_inputs():
    """A graph of calls with M shrinking and growing, replayed 100 times with new inputs copied
    into the captured buffers: bit-exact on every replay (generations advance on the device)."""
    tp, hidden, hc = 2, 5120, 4
    op = emulated(tp, hidden, hc, mxfp8=True)
    sizes = [16, 1, 129, 3, 64]
    static = [random_inputs(tp, m, hidden, hc, seed=m) for m in sizes]
    buffers = [poisoned_outputs(op, m, hidden, hc, mxfp8=True, residual_only=False) for m in sizes]

    def calls():
        for (ranks, mix), (out, mx) in zip(static, buffers):
            run_kernel(op, ranks, mix, mxfp8=True, out=out, mxfp8_out=mx)

    calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for replay in range(100):
        for i, m in enumerate(sizes):
            fresh_ranks, fresh_mix = random_inputs(tp, m, hidden, hc, seed=10_000 * replay + i)
            ranks, mix = static[i]
            for dst, src in zip(ranks, fresh_ranks):
                dst.x.copy_(src.x)
            for name in ("residual", "post", "comb", "pre", "norm_weight"):
                getattr(mix, name).copy_(getattr(fresh_mix, name))
        graph.replay()
        torch.cuda.synchronize()
        for (ranks, mix), (out, mx) in zip(static, buffers):
            ref = reference_for(op, ranks, mix, mxfp8=True)
            try:
                check_outputs(out, mx, ref, assert_bitwise_equal)
            except AssertionError as error:
                raise AssertionError(f"replay {replay}: {error}") from None
    assert mailboxes_armed(op)


def test_ten_thousand_eager_calls_random_m(monkeypatch):
    tp, hidden, hc = 2, 4096, 4
    op = emulated(tp, hidden, hc)
    fresh = op._engine.validator.fresh_outputs

    def poisoned_fresh_outputs(m):
        # The outputs the object allocates per call, NaN-poisoned: an element the kernel does not
        # write cannot pass on whatever the allocator handed back.
        new_residual, layer_input = fresh(m)
        new_residual.view(torch.int16).fill_(POISON_BF16)
        layer_input.view(torch.int16).fill_(POISON_BF16)
        return new_residual, layer_input

    monkeypatch.setattr(op._engine.validator, "fresh_outputs", poisoned_fresh_outputs)
    sets = []
    for i, m in enumerate((1, 2, 7, 16, 63, 128, 129, 256)):
        ranks, mix = random_inputs(tp, m, hidden, hc, seed=500 + i)
        ref = reference_for(op, ranks, mix, mxfp8=False)
        expected = torch.cat([ref.new_residual.view(torch.int16).flatten(), ref.layer_input.view(torch.int16).flatten()])
        sets.append((ranks, mix, expected))
    rng = random.Random(1234)
    for call in range(10_000):
        ranks, mix, expected = sets[rng.randrange(len(sets))]
        results = op([r.x for r in ranks], mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight, mix.eps)
        for rank, (new_residual, layer_input) in enumerate(results):
            got = torch.cat([new_residual.view(torch.int16).flatten(), layer_input.view(torch.int16).flatten()])
            if not torch.equal(got, expected):
                ref = reference_for(op, ranks, mix, mxfp8=False)
                assert_bitwise_equal(new_residual, ref.new_residual, f"call {call} rank {rank} new_residual")
                assert_bitwise_equal(layer_input, ref.layer_input, f"call {call} rank {rank} layer_input")
    assert mailboxes_armed(op)
