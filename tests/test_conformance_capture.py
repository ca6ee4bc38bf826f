"""Capture on the CPU: the recorder, the files of a call, and their reference-only replay.

No GPU here, so the reference plays the kernel (as `run --plant` does): a fake engine gives the
recorder the instance's configuration, the reference's outputs stand for the kernel's, and a
flipped byte in a recorded output stands for a kernel bug. tests/test_gpu_capture.py records
real calls of the kernels on a GPU.
"""

from __future__ import annotations

import io
import types
import warnings

import pytest
import torch

import mhc_ar
from conformance.bundle import BundleError, read_archive, write_archive
from conformance.capture import Recorder, bundle_file, load_call, replay_call
from conformance.cases import Case, Family
from conformance.cli import main as cli_main
from conformance.inputs import make_inputs
from conformance.runner import expected_outputs
from mhc_ar import recording
from mhc_ar.config import Contribution, Variant, choose_consumer_tiling
from reference import MixInputs, ReductionTree, all_reduce_mhc

H, HC, CAPACITY = 256, 2, 16


def _engine(variant=Variant.FULL, top_k=0):
    validator = types.SimpleNamespace(hidden_size=H, hc=HC, capacity=CAPACITY, top_k=top_k, variant=variant,
                                      device=torch.device("cpu"))
    return types.SimpleNamespace(validator=validator, consumer_spec=types.SimpleNamespace(tiling=choose_consumer_tiling(H)))


def _tree():
    return ReductionTree(**choose_consumer_tiling(H).reduction_tree_args())


def _call(m, op=Contribution.CALL, variant=Variant.FULL, family="normal", tp=2, seed_offset=0):
    """Inputs of a drawn case and the reference's outputs standing for the kernel's."""
    case = Case(tp=tp, hidden=H, hc=HC, m=m, op=op, variant=variant, family=family, capacity=CAPACITY, seed_offset=seed_offset)
    inputs = make_inputs(case)
    mxfp8 = variant is Variant.MXFP8
    reference = expected_outputs(all_reduce_mhc(inputs.ranks, inputs.mix, tree=_tree(), mxfp8=mxfp8))
    return case, inputs, reference


def _views(case, inputs, reference, mixes=None):
    """ranks= of Recorder.record: every rank's (contribution, mix, results, mxfp8_out)."""
    views = {}
    for r, rank in enumerate(inputs.ranks):
        mix = (mixes or {}).get(r, inputs.mix)
        if rank.x is not None:
            contribution = {"x": rank.x}
        else:
            contribution = {n: getattr(rank, n) for n in ("gemm2_permuted", "expert_weights", "expanded_idx_to_permuted_idx", "shared_output")}
        mx = None
        if reference["mxfp8_values"] is not None:
            mx = (reference["mxfp8_values"].clone(), reference["mxfp8_scales"].clone())
        results = (reference["new_residual"].clone(), None if reference["layer_input"] is None else reference["layer_input"].clone())
        views[r] = (contribution, (mix.residual, mix.post, mix.comb, mix.pre, mix.norm_weight), results, mx)
    return views


def _record(recorder, case, inputs, reference, *, ranks=None, mixes=None, variant=Variant.FULL):
    views = _views(case, inputs, reference, mixes)
    if ranks is not None:
        views = {r: views[r] for r in ranks}
    finalize = case.op is Contribution.FINALIZE
    recorder.record(source="EmulatedAllReduceMHC", engine=_engine(variant, case.top_k), tp=case.tp, finalize=finalize,
                    eps=inputs.mix.eps, ranks=views)
    recorder.flush()  # what the end of `with mhc_ar.capture(...)` does


def test_capture_is_off_unless_asked():
    assert recording.recorder is None  # MHC_AR_CAPTURE is not set in the test environment


def test_every_and_limit_number_the_calls_from_the_first(tmp_path):
    recorder = Recorder(tmp_path, every=2, limit=2, max_bytes=1 << 30)
    with pytest.warns(UserWarning, match="2 calls per rank recorded"):
        for k in range(6):
            _record(recorder, *_call(3, seed_offset=k))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [bundle_file(0, 0, 2), bundle_file(0, 1, 2), bundle_file(2, 0, 2), bundle_file(2, 1, 2)]
    assert recorder.calls == {0: 6, 1: 6} and recorder.recorded == {0: 2, 1: 2}
    manifest, _ = read_archive(tmp_path / bundle_file(2, 1, 2), arrays=False)
    assert manifest["capture"] == {"call": 2, "rank": 1, "tp": 2, "source": "EmulatedAllReduceMHC", "every": 2}
    assert manifest["case"]["family"] == "captured" and manifest["case"]["capacity"] == CAPACITY
    assert manifest["reduction_tree"] == choose_consumer_tiling(H).reduction_tree_args()


def test_byte_limit_stops_recording(tmp_path):
    recorder = Recorder(tmp_path, every=1, limit=100, max_bytes=30_000)
    with pytest.warns(UserWarning, match="over the 30000 allowed"):
        for m in (2, 16, 2):
            _record(recorder, *_call(m))
    assert recorder.recorded == {0: 1, 1: 1} and max(recorder.bytes.values()) <= 30_000
    assert sorted(p.name for p in tmp_path.iterdir()) == [bundle_file(0, 0, 2), bundle_file(0, 1, 2)]


def test_a_folder_with_an_earlier_capture_is_not_mixed_into(tmp_path):
    _record(Recorder(tmp_path, every=1, limit=4, max_bytes=1 << 30), *_call(2))
    later = Recorder(tmp_path, every=1, limit=4, max_bytes=1 << 30)
    with pytest.warns(UserWarning, match="already holds rank 0's bundles"):
        _record(later, *_call(2, seed_offset=1))
    assert later.written == [] and later.recorded[0] == 0


@pytest.mark.parametrize("op, variant, family", [
    (Contribution.CALL, Variant.FULL, "normal"),
    (Contribution.FINALIZE, Variant.MXFP8, "signed_zeros"),
    (Contribution.CALL, Variant.RESIDUAL_ONLY, "nan_inf"),
])
def test_replay_of_a_faithful_call_finds_no_difference(tmp_path, op, variant, family):
    recorder = Recorder(tmp_path, every=1, limit=4, max_bytes=1 << 30)
    case, inputs, reference = _call(5, op, variant, family, tp=3)
    _record(recorder, case, inputs, reference, variant=variant)
    captured = load_call(tmp_path / bundle_file(0, 2, 3))
    assert captured.case.family is Family.CAPTURED and captured.case.op is op and captured.case.m == 5
    text = io.StringIO()
    assert replay_call(captured, reference_only=True, out=text) == 0, text.getvalue()
    assert text.getvalue().count("recorded") >= 3 and "no difference" in text.getvalue()


def test_replay_names_the_first_differing_byte(tmp_path):
    recorder = Recorder(tmp_path, every=1, limit=4, max_bytes=1 << 30)
    case, inputs, reference = _call(4)
    _record(recorder, case, inputs, reference)
    # Rank 1's recorded layer_input, one element off by one ulp: what a kernel bug leaves.
    path = tmp_path / bundle_file(0, 1, 2)
    manifest, tensors = read_archive(path)
    bad = tensors["kernel/rank1.layer_input"].view(torch.int16).clone()
    bad[3, 17] += 1
    tensors["kernel/rank1.layer_input"] = bad.view(torch.bfloat16)
    path.unlink()
    write_archive(path, {k: v for k, v in manifest.items() if k != "arrays"}, tensors)
    text = io.StringIO()
    assert replay_call(load_call(tmp_path / bundle_file(0, 0, 2)), reference_only=True, out=text) == 1
    out = text.getvalue()
    assert "rank 0, recorded (new_residual, layer_input): equal to the reference" in out
    assert "first difference: layer_input, rank 1, index (3, 17)" in out
    assert "intermediates of row 3, column 17" in out


def test_each_rank_is_judged_with_its_own_mix(tmp_path):
    """comb and pre are a rank's own (README): a rank whose mix differs gets its own reference."""
    case, inputs, reference = _call(3)
    other = MixInputs(inputs.mix.residual, inputs.mix.post, inputs.mix.comb.flip(-1).contiguous(), inputs.mix.pre,
                      inputs.mix.norm_weight, inputs.mix.eps)
    other_reference = expected_outputs(all_reduce_mhc(inputs.ranks, other, tree=_tree(), mxfp8=False))
    assert not torch.equal(other_reference["new_residual"].view(torch.int16), reference["new_residual"].view(torch.int16))
    views = _views(case, inputs, reference, {1: other})
    views[1] = (views[1][0], views[1][1], (other_reference["new_residual"], other_reference["layer_input"]), None)
    recorder = Recorder(tmp_path, every=1, limit=1, max_bytes=1 << 30)
    recorder.record(source="AllReduceMHC", engine=_engine(), tp=2, finalize=False, eps=inputs.mix.eps, ranks=views)
    recorder.flush()
    text = io.StringIO()
    assert replay_call(load_call(tmp_path / bundle_file(0, 0, 2)), reference_only=True, out=text) == 0, text.getvalue()


def test_real_tp_ranks_write_their_own_files_and_replay_needs_all(tmp_path):
    """Under torchrun each process records its own rank: one recorder per rank, one folder."""
    case, inputs, reference = _call(2)
    for rank in (0, 1):
        _record(Recorder(tmp_path, every=1, limit=1, max_bytes=1 << 30), case, inputs, reference, ranks=[rank])
    assert replay_call(load_call(tmp_path / bundle_file(0, 1, 2)), reference_only=True, out=io.StringIO()) == 0
    (tmp_path / bundle_file(0, 0, 2)).unlink()
    with pytest.raises(BundleError, match=r"missing beside it: call000000-rank0of2\.mhcbundle"):
        load_call(tmp_path / bundle_file(0, 1, 2))


def test_cli_repro_replays_a_captured_call(tmp_path, capsys):
    _record(Recorder(tmp_path, every=1, limit=1, max_bytes=1 << 30), *_call(6, Contribution.FINALIZE))
    assert cli_main(["repro", str(tmp_path / bundle_file(0, 1, 2)), "--reference-only"]) == 0
    assert "captured call 0 of EmulatedAllReduceMHC" in capsys.readouterr().out
    (tmp_path / bundle_file(0, 0, 2)).unlink()
    assert cli_main(["repro", str(tmp_path / bundle_file(0, 1, 2)), "--reference-only"]) == 2
    assert "missing beside it" in capsys.readouterr().err


def test_capture_arguments_and_environment(tmp_path):
    for bad in (dict(every=0), dict(limit=-1), dict(max_bytes=1.5), dict(every=True)):
        with pytest.raises(ValueError, match="must be a positive int"):
            with mhc_ar.capture(tmp_path, **bad):
                pass
    with mhc_ar.capture(tmp_path, every=3) as active:
        assert recording.recorder is active and active.every == 3
    assert recording.recorder is None
    try:
        pending = recording.start_from_environment({"MHC_AR_CAPTURE": str(tmp_path), "MHC_AR_CAPTURE_LIMIT": "2"})
        assert recording.recorder is pending and pending.settings["limit"] == 2
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _record(recording.recorder, *_call(2))  # the first call makes the real recorder
        assert isinstance(recording.recorder, Recorder) and len(recording.recorder.written) == 2
    finally:
        recording.stop()
    with pytest.raises(ValueError, match="MHC_AR_CAPTURE_EVERY must be a positive int"):
        recording.start_from_environment({"MHC_AR_CAPTURE": str(tmp_path), "MHC_AR_CAPTURE_EVERY": "x"})
    assert recording.start_from_environment({}) is None and recording.recorder is None
