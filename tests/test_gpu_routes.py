"""Route indices the host cannot see (mhc_ar.routes): an index outside gemm2_permuted's rows
never makes the publish read outside them, contributes nothing (the bytes the reference
specifies), is counted on the device, raises in the debug mode, and leaves the instance usable."""

from __future__ import annotations

import pytest
import torch

from conformance.compare import assert_bitwise_equal
from mhc_ar import EmulatedAllReduceMHC
from reference import invalid_routes

from gpu_cases import check_outputs, random_inputs, reference_for, run_kernel

pytestmark = pytest.mark.gpu

TP, M, HIDDEN, HC, TOP_K = 2, 5, 1024, 4, 4


def _with_bad_index(ranks, value_of_rows):
    """Rank 1's route [2, 1] set to value_of_rows(rows): the one invalid entry of the call."""
    rows = ranks[1].gemm2_permuted.shape[0]
    ranks[1].expanded_idx_to_permuted_idx[2, 1] = value_of_rows(rows)
    return rows


BAD = {"rows": lambda rows: rows, "rows+1e9": lambda rows: rows + 10**9, "-2": lambda rows: -2, "-5": lambda rows: -5}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_invalid_index_is_skipped_counted_and_the_next_call_is_exact(bad):
    op = EmulatedAllReduceMHC(tp_size=TP, hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=M, top_k=TOP_K, check_routes=False)
    ranks, mix = random_inputs(TP, M, HIDDEN, HC, finalize=True, top_k=TOP_K, seed=17)
    rows = _with_bad_index(ranks, BAD[bad])
    assert invalid_routes(ranks[1].expanded_idx_to_permuted_idx, rows) == 1
    out, _ = run_kernel(op, ranks, mix, mxfp8=False)
    torch.cuda.synchronize()  # no fault
    check_outputs(out, None, reference_for(op, ranks, mix, mxfp8=False), assert_bitwise_equal)
    assert op.invalid_routes() == [0, 1]
    good, mix2 = random_inputs(TP, M, HIDDEN, HC, finalize=True, top_k=TOP_K, seed=18)
    out, _ = run_kernel(op, good, mix2, mxfp8=False)
    check_outputs(out, None, reference_for(op, good, mix2, mxfp8=False), assert_bitwise_equal)
    assert op.invalid_routes() == [0, 1]


def test_debug_mode_raises_naming_the_entry_and_stays_usable():
    op = EmulatedAllReduceMHC(tp_size=TP, hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=M, top_k=TOP_K, check_routes=True)
    ranks, mix = random_inputs(TP, M, HIDDEN, HC, finalize=True, top_k=TOP_K, seed=19)
    rows = _with_bad_index(ranks, BAD["rows+1e9"])
    with pytest.raises(ValueError, match=rf"expanded_idx_to_permuted_idx\[1\]\[2, 1\] = {rows + 10**9} is neither -1 nor a row"):
        run_kernel(op, ranks, mix, mxfp8=False)
    good, mix2 = random_inputs(TP, M, HIDDEN, HC, finalize=True, top_k=TOP_K, seed=20)
    out, _ = run_kernel(op, good, mix2, mxfp8=False)  # no error: nothing new counted
    check_outputs(out, None, reference_for(op, good, mix2, mxfp8=False), assert_bitwise_equal)


def test_debug_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv("MHC_AR_CHECK_ROUTES", "1")
    op = EmulatedAllReduceMHC(tp_size=TP, hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=M, top_k=TOP_K)
    ranks, mix = random_inputs(TP, M, HIDDEN, HC, finalize=True, top_k=TOP_K, seed=21)
    _with_bad_index(ranks, BAD["-5"])
    with pytest.raises(ValueError, match=r"\[2, 1\] = -5 is neither"):
        run_kernel(op, ranks, mix, mxfp8=False)


@pytest.mark.parametrize("hc", [HC, 8])
@pytest.mark.parametrize("bad", ["rows", "-2"])
def test_at_tp1_the_consumer_skips_and_counts_invalid_indices(bad, hc):
    """TP = 1 computes the contribution in the consumer (ConsumerSpec.direct): the same skip, the
    same count, the same bytes, with the coefficients in registers (hc 4) or shared memory (hc 8)."""
    op = EmulatedAllReduceMHC(tp_size=1, hidden_size=HIDDEN, hc_mult=hc, max_num_tokens=M, top_k=TOP_K, check_routes=False)
    assert op._engine.consumer_spec.coefficients_in_shared == (hc > 4)
    ranks, mix = random_inputs(1, M, HIDDEN, hc, finalize=True, top_k=TOP_K, seed=23)
    rows = ranks[0].gemm2_permuted.shape[0]
    ranks[0].expanded_idx_to_permuted_idx[2, 1] = BAD[bad](rows)
    out, _ = run_kernel(op, ranks, mix, mxfp8=False)
    torch.cuda.synchronize()
    check_outputs(out, None, reference_for(op, ranks, mix, mxfp8=False), assert_bitwise_equal)
    assert op.invalid_routes() == [1]
