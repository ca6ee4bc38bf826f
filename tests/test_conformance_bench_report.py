"""The bench's report and target checks on fabricated measurements (the GPU run must not be the
first time this code runs)."""

from __future__ import annotations

import json

from conformance.bench import DIAGNOSIS_BUILDS, BenchResult, Row, targets, write_report


def _result(mxfp8_factor: float, eager_m1: float, consumer_gbs: float) -> BenchResult:
    result = BenchResult(device="fake", copy_gbs=2000.0)
    for m in (1, 16, 1024):
        fused = 3.0 if m < 1024 else 40.0
        result.rows.append(
            Row(hidden=5120, m=m, tp=1, fused_us=fused, fused_mxfp8_us=fused * mxfp8_factor, publish_us=1.0,
                unfused_us=fused * 12, unfused_mxfp8_us=fused * 13, full_plus_quant_us=fused * 1.3,
                consumer_bytes=int(1.6e9 * fused * 1e-6), consumer_gbs=consumer_gbs)
        )
    result.tp_rows.append(Row(hidden=5120, m=1, tp=2, fused_us=6.0, publish_us=2.0))
    result.eager_us = {"1": eager_m1, "1 parts": {"call": eager_m1, "launch": 4.0, "host probe: torch.empty(0) on the CPU": 0.5}}
    result.mxfp8_diagnosis = [{"hidden": 5120, "m": 1, "full": 3.0, **{b: 3.5 for b in DIAGNOSIS_BUILDS}}]
    return result


def test_targets_follow_the_figures():
    met = dict((name, ok) for name, ok, _ in targets(_result(1.05, 15.0, consumer_gbs=1600.0)))  # 80% of copy
    assert len(met) == 7 and all(met.values()), met
    measured = dict((name, figure) for name, _, figure in targets(_result(1.05, 15.0, consumer_gbs=1600.0)))
    assert measured["eager call overhead < 20 us at M=1"] == "15.00 us (host probe 0.50 us)"
    missed = dict((name, ok) for name, ok, _ in targets(_result(1.25, 25.0, consumer_gbs=1400.0)))  # 70%
    assert {name for name, ok in missed.items() if not ok} == {
        "MXFP8 variant <= 10% over full",
        "eager call overhead < 20 us at M=1",
        "M=1024: consumer bytes / fused time >= 75% of copy bandwidth",
    }


def test_report_holds_every_table(tmp_path):
    write_report(_result(1.25, 25.0, consumer_gbs=1400.0), tmp_path)
    html = (tmp_path / "bench.html").read_text()
    for heading in ("Targets", "Latency vs M", "MXFP8 cost, stage by stage", "Emulated TP", "Eager"):
        assert heading in html
    assert "mxfp8 without padding-scale zeroing" in html and "<svg" in html
    assert "<th>host probe: torch.empty(0) on the CPU</th>" in html and "<td>25.00</td>" in html
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["mxfp8_diagnosis"][0]["m"] == 1 and len(saved["targets"]) == 7


def test_the_compiled_chain_is_the_eager_chain_through_inductor():
    """The bench's torch.compile baseline computes the eager chain's math (its own fusion and
    rounding: equal within bf16 rounding, not byte for byte), with M dynamic (one compile, two M)."""
    import torch

    from conformance.bench import chain_math, compiled_math

    g = torch.Generator().manual_seed(3)
    for m in (3, 5):
        xs = [torch.randn(m, 64, generator=g).bfloat16() for _ in range(2)]
        residual = torch.randn(m, 4, 64, generator=g).bfloat16()
        post, comb, pre = torch.rand(m, 4, generator=g) + 0.5, torch.rand(m, 4, 4, generator=g) / 4, torch.rand(m, 4, generator=g) / 4
        weight = (1 + 0.1 * torch.randn(64, generator=g)).bfloat16()
        eager = chain_math(xs, residual, post, comb, pre, weight, 1e-6)
        compiled = compiled_math()(xs, residual, post, comb, pre, weight, 1e-6)
        for e, c in zip(eager, compiled):
            assert e.shape == c.shape and e.dtype == c.dtype == torch.bfloat16
            # A few bf16 roundings apart (8 significant bits), against the tensor's scale: where
            # a sum cancels, an element's own magnitude says nothing.
            assert float((e.float() - c.float()).abs().max()) <= 2 ** -6 * float(e.float().abs().max())


def test_fused_bytes_count_every_stream_once():
    from conformance.bench import fused_bytes

    # tp=2, M=3, H=8, hc=2, by hand: x 48, mailbox writes 96, reads 96, re-arm 96, residual in 96,
    # new_residual out 96, layer_input out 48; MXFP8 adds 24 value bytes and 0 whole scale bytes.
    assert fused_bytes(2, 3, 8, 2, False) == 48 + 96 + 96 + 96 + 96 + 96 + 48 == 576
    assert fused_bytes(2, 3, 8, 2, True) == 576 + 24
