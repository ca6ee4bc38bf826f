"""One aliasing rule (README "Outputs"): an output sharing memory with x or shared_output (what
the publish reads) is refused with a ValueError before any launch, on real CUDA tensors, and the
instance's next calls are bit-exact, eager and replayed in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from conformance.compare import assert_bitwise_equal
from conformance.runner import POISON_BF16

from gpu_cases import check_outputs, poisoned_outputs, random_inputs, reference_for, run_kernel
from mhc_ar import EmulatedAllReduceMHC

pytestmark = pytest.mark.gpu

TP, M, HIDDEN, HC, TOP_K = 2, 3, 1024, 4, 4


@pytest.mark.parametrize("finalize", [False, True], ids=["call", "finalize"])
def test_layer_input_aliasing_what_the_publish_reads_is_refused_and_the_instance_stays_exact(finalize):
    op = EmulatedAllReduceMHC(tp_size=TP, hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=M, top_k=TOP_K)
    ranks, mix = random_inputs(TP, M, HIDDEN, HC, finalize=finalize, top_k=TOP_K, seed=31)
    out, _ = poisoned_outputs(op, M, HIDDEN, HC, mxfp8=False, residual_only=False)
    read = [r.shared_output if finalize else r.x for r in ranks]
    aliased = [(out[0][0], read[0][:, :])] + out[1:]  # rank 0's layer_input is its own x / shared_output
    name = "shared_output" if finalize else "x"
    with pytest.raises(ValueError, match=rf"layer_input\) overlaps {name}"):
        run_kernel(op, ranks, mix, mxfp8=False, out=aliased)
    torch.cuda.synchronize()
    for rank, (new_residual, layer_input) in enumerate(out):  # nothing launched: still poison
        for name, tensor in (("new_residual", new_residual), ("layer_input", layer_input)):
            assert bool((tensor.view(torch.int16) == POISON_BF16).all()), f"a refused call wrote rank {rank}'s {name}"

    # Eager: the next call is exact on every rank (no rank left out of step by the refusal).
    good, mix2 = random_inputs(TP, M, HIDDEN, HC, finalize=finalize, top_k=TOP_K, seed=32)
    result, _ = run_kernel(op, good, mix2, mxfp8=False)
    check_outputs(result, None, reference_for(op, good, mix2, mxfp8=False), assert_bitwise_equal)

    # In a CUDA graph: captured once, replayed with new inputs copied in place.
    static, static_mix = random_inputs(TP, M, HIDDEN, HC, finalize=finalize, top_k=TOP_K, seed=33)
    graph_out, _ = poisoned_outputs(op, M, HIDDEN, HC, mxfp8=False, residual_only=False)
    run_kernel(op, static, static_mix, mxfp8=False, out=graph_out)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_kernel(op, static, static_mix, mxfp8=False, out=graph_out)
    for seed in (34, 35):
        fresh, fresh_mix = random_inputs(TP, M, HIDDEN, HC, finalize=finalize, top_k=TOP_K, seed=seed)
        for target, source in zip(static, fresh):
            for field in ("x", "gemm2_permuted", "expert_weights", "expanded_idx_to_permuted_idx", "shared_output"):
                if getattr(target, field) is not None:
                    getattr(target, field).copy_(getattr(source, field))
        for field in ("residual", "post", "comb", "pre", "norm_weight"):
            getattr(static_mix, field).copy_(getattr(fresh_mix, field))
        graph.replay()
        torch.cuda.synchronize()
        check_outputs(graph_out, None, reference_for(op, static, static_mix, mxfp8=False), assert_bitwise_equal)
