"""Capture of real calls on a GPU (mhc_ar.capture): a toy two-layer loop, eager and in a CUDA
graph, recorded and replayed bit-exact through the kernels and, on the CPU, the reference alone;
and ranks on their own streams (mhc_ar.ConcurrentRanks) recording without host synchronization."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import pytest
import torch

import mhc_ar
from conformance.capture import bundle_file, load_call, replay_call
from conformance.compare import assert_bitwise_equal
from mhc_ar import EmulatedAllReduceMHC, mxfp8_scale_bytes

from gpu_cases import check_outputs, random_inputs, reference_for

pytestmark = pytest.mark.gpu

TP, M, H, HC, TOP_K, STEPS = 2, 6, 1024, 4, 4, 3


class ToyModel:
    """Two layers per step: attention (a plain call) then MoE (a finalize, MXFP8 layer input),
    the residual streams carried from one to the next."""

    def __init__(self):
        self.attention = EmulatedAllReduceMHC(tp_size=TP, hidden_size=H, hc_mult=HC, max_num_tokens=16)
        self.moe = EmulatedAllReduceMHC(tp_size=TP, hidden_size=H, hc_mult=HC, max_num_tokens=16, top_k=TOP_K,
                                        quantize_layer_input=True)
        self.mx = [(torch.empty(M, H, dtype=torch.float8_e4m3fn, device="cuda"),
                    torch.empty(mxfp8_scale_bytes(M, H), dtype=torch.uint8, device="cuda")) for _ in range(TP)]

    def step(self, residual, attention_inputs, moe_inputs):
        (ranks_a, mix_a), (ranks_b, mix_b) = attention_inputs, moe_inputs
        out_a = self.attention([r.x for r in ranks_a], residual, mix_a.post, mix_a.comb, mix_a.pre, mix_a.norm_weight, mix_a.eps)
        residual = out_a[0][0]
        out_b = self.moe.finalize([r.gemm2_permuted for r in ranks_b], [r.expert_weights for r in ranks_b],
                                  [r.expanded_idx_to_permuted_idx for r in ranks_b], [r.shared_output for r in ranks_b],
                                  residual, mix_b.post, mix_b.comb, mix_b.pre, mix_b.norm_weight, mix_b.eps, mxfp8_out=self.mx)
        return out_a, out_b


def _step_inputs(seed):
    return random_inputs(TP, M, H, HC, seed=seed), random_inputs(TP, M, H, HC, finalize=True, top_k=TOP_K, seed=seed + 1000)


def _replays_clean(folder, calls):
    for call in range(calls):
        captured = load_call(folder / bundle_file(call, 0, TP))
        for reference_only in (False, True):  # the kernels again, then the reference alone on the CPU
            text = io.StringIO()
            assert replay_call(captured, reference_only=reference_only, out=text) == 0, text.getvalue()
            assert ("rerunning the kernels" in text.getvalue()) != reference_only
        print(f"call {call}: {captured.case.id}, replayed bit-exact on the GPU and reference-only on the CPU")


def test_toy_loop_is_captured_eager_and_replays_bit_exact(tmp_path):
    model = ToyModel()
    residual = random_inputs(TP, M, H, HC, seed=99)[1].residual
    with mhc_ar.capture(tmp_path / "eager", limit=100) as recorder:
        for step in range(STEPS):
            out_a, out_b = model.step(residual, *_step_inputs(step))
            residual = out_b[0][0]
    names = sorted(p.name for p in (tmp_path / "eager").iterdir())
    assert names == sorted(bundle_file(c, r, TP) for c in range(2 * STEPS) for r in range(TP)), names
    assert len(recorder.written) == 2 * STEPS * TP
    _replays_clean(tmp_path / "eager", 2 * STEPS)


def test_every_and_limit_on_real_calls(tmp_path):
    model = ToyModel()
    residual = random_inputs(TP, M, H, HC, seed=98)[1].residual
    with pytest.warns(UserWarning, match="2 calls per rank recorded"):
        with mhc_ar.capture(tmp_path, every=3, limit=2):
            for step in range(STEPS):  # calls 0..5: 0 and 3 recorded
                residual = model.step(residual, *_step_inputs(10 + step))[1][0][0]
            model.step(residual, *_step_inputs(20))  # call 6: past the limit
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(bundle_file(c, r, TP) for c in (0, 3) for r in range(TP))
    first, second = load_call(tmp_path / bundle_file(0, 1, TP)), load_call(tmp_path / bundle_file(3, 1, TP))
    assert first.case.op.value == "call" and second.case.op.value == "finalize" and second.mxfp8
    for captured in (first, second):
        text = io.StringIO()
        assert replay_call(captured, out=text) == 0, text.getvalue()


def test_graph_capture_records_nothing_and_says_so_once(tmp_path):
    model = ToyModel()
    static = [random_inputs(TP, M, H, HC, seed=50)[1].residual, *_step_inputs(51)]
    model.step(*static)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.warns(UserWarning, match="CUDA graph capture are not recorded") as said:
        with mhc_ar.capture(tmp_path):
            with torch.cuda.graph(graph):
                out_a, out_b = model.step(*static)
    assert len([w for w in said if "CUDA graph" in str(w.message)]) == 1
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
    for k in range(3):  # the graph still computes the right bytes, replay after replay
        new = [random_inputs(TP, M, H, HC, seed=60 + k)[1].residual, *_step_inputs(61 + k)]
        static[0].copy_(new[0])
        for (ranks_old, mix_old), (ranks_new, mix_new) in zip(static[1:], new[1:]):
            for old, fresh in zip(ranks_old + [mix_old], ranks_new + [mix_new]):
                for name, value in vars(old).items():
                    if isinstance(value, torch.Tensor):
                        value.copy_(getattr(fresh, name))
        graph.replay()
        torch.cuda.synchronize()
        (ranks_a, mix_a), (ranks_b, mix_b) = static[1], static[2]
        mix_a.residual = static[0]
        check_outputs(out_a, None, reference_for(model.attention, ranks_a, mix_a, mxfp8=False), assert_bitwise_equal)
        mix_b.residual = out_a[0][0]
        check_outputs(out_b, model.mx, reference_for(model.moe, ranks_b, mix_b, mxfp8=True), assert_bitwise_equal)


CONCURRENT = textwrap.dedent(
    """
    import sys, io, torch
    from pathlib import Path
    sys.path.insert(0, "tests")
    import mhc_ar
    from gpu_cases import random_inputs
    from mhc_ar.concurrent import ConcurrentRanks
    from conformance.capture import bundle_file, load_call, replay_call
    folder = Path(sys.argv[1])
    ranks = ConcurrentRanks(tp_size=3)
    ops = ranks.add(hidden_size=2048, hc_mult=4, max_num_tokens=4, spin_timeout_s=5.0)
    calls = [random_inputs(3, 4, 2048, 4, seed=s) for s in range(3)]
    torch.cuda.synchronize()
    with mhc_ar.capture(folder):
        for inputs, mix in calls:  # each rank launches its calls with no host sync, rank 2 held back
            for r in range(3):
                ranks.delay(r, 200.0 * r)
                with ranks.on(r):
                    ops[r](inputs[r].x, mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight, mix.eps)
        ranks.synchronize()
    for call in range(3):
        text = io.StringIO()
        rc = replay_call(load_call(folder / bundle_file(call, 0, 3)), out=text)
        print(f"call {call}: replay rc {rc}")
        if rc:
            print(text.getvalue())
    """
)


def test_ranks_on_their_own_streams_record_without_host_sync(tmp_path):
    """AllReduceMHC objects of mhc_ar.ConcurrentRanks (per-rank files, as under torchrun): a
    recorded call must not wait for its end (rank 0's consumer waits for rank 2, launched after
    it by this thread); a spin timeout would end the process, so it runs in one of its own."""
    result = subprocess.run([sys.executable, "-c", CONCURRENT, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-3000:]}"
    lines = [line for line in result.stdout.splitlines() if line.startswith("call ")]
    print("\n".join(lines))
    assert lines == [f"call {c}: replay rc 0" for c in range(3)], result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(bundle_file(c, r, 3) for c in range(3) for r in range(3))
