"""The bench's report and target checks on fabricated measurements (the GPU run must not be the
first time this code runs): the shapes it sweeps and how the command line names them, the emulated
TP rows' consumer figures, each target met and each of issue 13's missed with the row that decides
it named, and the columns of bench.html and bench.json."""

from __future__ import annotations

import json

import pytest
import torch

from conformance import bench
from conformance.bench import (DIAGNOSIS_BUILDS, SHAPES, BenchResult, Row, parse_shapes, targets, tp_row,
                               write_report)

COPY_GBS = 2000.0
TP8_M1024_BYTES = 2 * 8 * 1024 * 5120 * 2 + 2 * 1024 * 4 * 5120 * 2 + 1024 * 5120 * 2  # consumer_bytes, by hand
ISSUE_13 = [
    "TP=1, M>=1024: fused bytes / fused time >= 85% of the copy ceiling",
    "TP=1: fused not slower than the torch.compile chain at any M",
    "TP=1, M<=16: fused <= 3.0 us and <= 0.5x compiled",
    "MXFP8 variant <= 8% over full at every M",
    "emulated TP=8, M=1024: consumer bytes / consumer time >= 80% of the copy ceiling",
]
EARLIER = [
    "M<=16, H=5120: fused <= 8 us",
    "M<=16, H=5120: >= 4x unfused",
    "M=1024: >= 10x unfused",
    "M=1024: consumer bytes / fused time >= 75% of copy bandwidth",
    "MXFP8 variant beats full + separate quantize",
    "eager call overhead < 20 us at M=1",
]


def _result(*, compiled: bool = True, tp8_consumer_us: float = 150.0) -> BenchResult:
    """Every target met: fused 2.5 us at M <= 16 (0.4x compiled), MXFP8 5% over full, 90% of the
    copy ceiling at M >= 1024, the TP=8 consumer at TP8_M1024_BYTES / 150 us = 87% of it."""
    result = BenchResult(device="fake", copy_gbs=COPY_GBS)
    for hidden, hc in SHAPES:
        for m in (1, 16, 1024, 8192):
            fused = 2.5 if m <= 16 else 40.0 * m / 1024
            result.rows.append(
                Row(hidden=hidden, hc=hc, m=m, tp=1, fused_us=fused, fused_mxfp8_us=fused * 1.05, publish_us=1.0,
                    unfused_us=fused * 12, unfused_mxfp8_us=fused * 13, full_plus_quant_us=fused * 1.3,
                    compiled_us=fused * 2.5 if compiled else None, compiled_mxfp8_us=fused * 2.6 if compiled else None,
                    consumer_bytes=int(1.6e9 * fused * 1e-6), consumer_gbs=1600.0,
                    fused_bytes=int(1.8e9 * fused * 1e-6), fused_ceiling_fraction=0.90)
            )
    for m, consumer_us in ((1, 2.0), (16, 3.0), (1024, tp8_consumer_us)):
        result.tp_rows.append(tp_row(8, 5120, 4, m, fused_us=100.0 + 8 * consumer_us, publish_us=100.0, copy_ceiling_gbs=COPY_GBS))
    result.eager_us = {"1": 15.0, "1 parts": {"call": 15.0, "launch": 4.0, "host probe: torch.empty(0) on the CPU": 0.5}}
    result.mxfp8_diagnosis = [{"hidden": 5120, "hc": 4, "m": 1, "full": 3.0, **{b: 3.5 for b in DIAGNOSIS_BUILDS}}]
    return result


def _row(result: BenchResult, hidden: int, hc: int, m: int) -> Row:
    return next(r for r in result.rows if (r.hidden, r.hc, r.m) == (hidden, hc, m))


def _missed(result: BenchResult) -> dict:
    """name -> figure of each target missed."""
    return {name: figure for name, ok, figure in targets(result) if not ok}


def test_every_target_met_issue_13_first():
    checks = targets(_result())
    assert [name for name, _, _ in checks] == ISSUE_13 + EARLIER
    assert all(ok for _, ok, _ in checks), checks
    measured = {name: figure for name, _, figure in checks}
    assert measured["eager call overhead < 20 us at M=1"] == "15.00 us (host probe 0.50 us)"
    assert measured[ISSUE_13[4]] == f"87.4% (tp8 H5120 hc4 M1024: {TP8_M1024_BYTES} bytes in 150.00 us per rank, 1748 of 2000 GB/s)"


def test_without_the_compiled_chain_its_targets_are_left_out():
    names = [name for name, _, _ in targets(_result(compiled=False))]
    assert ISSUE_13[1] not in names and ISSUE_13[2] not in names and ISSUE_13[0] in names and ISSUE_13[3] in names


def test_mxfp8_9_percent_over_misses_the_8_percent_target():
    result = _result()
    row = _row(result, 7168, 8, 8192)
    row.fused_mxfp8_us = row.fused_us * 1.09  # within the earlier 10%, beyond 8%
    assert _missed(result) == {ISSUE_13[3]: "max +9.0% (H7168 hc8 M8192: 348.80 us vs 320.00 us)"}


def test_tp8_consumer_under_80_percent_misses():
    # 170 us per rank: TP8_M1024_BYTES / 170 us = 1542 GB/s, 77.1% of 2000.
    missed = _missed(_result(tp8_consumer_us=170.0))
    assert missed == {ISSUE_13[4]: f"77.1% (tp8 H5120 hc4 M1024: {TP8_M1024_BYTES} bytes in 170.00 us per rank, 1542 of 2000 GB/s)"}


def test_tp8_consumer_without_time_left_misses():
    result = _result()
    result.tp_rows[-1] = tp_row(8, 5120, 4, 1024, fused_us=99.0, publish_us=100.0, copy_ceiling_gbs=COPY_GBS)
    assert _missed(result) == {ISSUE_13[4]: "tp8 H5120 hc4 M1024: all ranks 99.00 us - publishes 100.00 us leave no consumer time"}


def test_the_tp8_target_reads_tp8_at_m1024_only():
    result = _result()
    result.tp_rows.append(tp_row(8, 5120, 4, 16, fused_us=101.0, publish_us=100.0, copy_ceiling_gbs=COPY_GBS))  # slow, not M=1024
    result.tp_rows.append(tp_row(4, 5120, 4, 1024, fused_us=2000.0, publish_us=100.0, copy_ceiling_gbs=COPY_GBS))  # slow, tp 4
    assert _missed(result) == {}


def test_each_other_issue_13_target_missed_names_its_row():
    result = _result()
    _row(result, 7168, 4, 8192).fused_ceiling_fraction = 0.84
    assert _missed(result) == {ISSUE_13[0]: f"min 84.0% (H7168 hc4 M8192: {_row(result, 7168, 4, 8192).fused_bytes} bytes in 320.00 us)"}

    result = _result()
    _row(result, 7168, 8, 1024).compiled_us = 39.0
    assert _missed(result) == {ISSUE_13[1]: "worst H7168 hc8 M1024: fused 40.00 us, compiled 39.00 us"}

    result = _result()
    row = _row(result, 7168, 8, 1)
    row.fused_us, row.compiled_us = 3.2, 8.0  # over 3.0 us, at 0.4x compiled: the time alone misses
    assert _missed(result) == {ISSUE_13[2]: "slowest H7168 hc8 M1: 3.20 us; worst ratio H5120 hc4 M1: x0.40 of compiled"}

    result = _result()
    _row(result, 5120, 4, 16).compiled_us = 4.5  # 2.5 us is 0.56x of it
    assert _missed(result) == {ISSUE_13[2]: "slowest H5120 hc4 M1: 2.50 us; worst ratio H5120 hc4 M16: x0.56 of compiled"}


def test_tp_row_figures_by_hand():
    row = tp_row(8, 5120, 4, 1024, fused_us=1300.0, publish_us=100.0, copy_ceiling_gbs=COPY_GBS)
    assert (row.tp, row.hidden, row.hc, row.m) == (8, 5120, 4, 1024)
    assert row.consumer_us == 150.0 and row.consumer_bytes == TP8_M1024_BYTES
    assert row.consumer_ceiling_fraction == pytest.approx(TP8_M1024_BYTES / 150e-6 / 1e9 / COPY_GBS)
    assert row.consumer_gbs is None  # consumer bytes / fused time is a TP=1 figure
    assert bench._format_tp_row(row) == (
        f"tp8 H5120 hc4 M1024: all ranks 1300.00 us, publishes 100.00 us, consumer/rank 150.00 us, {TP8_M1024_BYTES} bytes at 87.4% of the copy ceiling"
    )
    assert tp_row(8, 5120, 4, 1, fused_us=5.0, publish_us=5.0, copy_ceiling_gbs=COPY_GBS).consumer_ceiling_fraction is None


def test_report_holds_every_table_and_the_new_columns(tmp_path):
    result = _result()
    _row(result, 7168, 8, 8192).fused_mxfp8_us = 400.0  # one target missed: shown as such
    write_report(result, tmp_path)
    html = (tmp_path / "bench.html").read_text()
    for heading in ("Targets", "Latency vs M", "MXFP8 cost, stage by stage", "Emulated TP", "Eager"):
        assert heading in html
    assert "mxfp8 without padding-scale zeroing" in html and "<svg" in html
    assert "<th>host probe: torch.empty(0) on the CPU</th>" in html and "<td>15.00</td>" in html
    assert "<tr><td>7168</td><td>8</td><td>8192</td><td>320.00</td><td>400.00</td>" in html
    assert "<th>hc</th>" in html and "<td>90.0%</td>" in html
    assert (f"<tr><td>8</td><td>5120</td><td>4</td><td>1024</td><td>1300.00</td><td>100.00</td><td>150.00</td>"
            f"<td>{TP8_M1024_BYTES}</td><td>87.4%</td><td>-</td><td>-</td></tr>") in html
    assert "<tr class='fail'><td>MXFP8 variant &lt;= 8% over full at every M</td><td>missed</td>" in html
    # One fused, eager unfused and torch.compile line per (H, hc).
    assert html.count("<polyline") == 3 * len(SHAPES)
    for hidden, hc in SHAPES:
        for kind in ("fused", "eager unfused", "torch.compile"):
            assert f">{kind} H{hidden} hc{hc}</text>" in html
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert {(r["hidden"], r["hc"]) for r in saved["rows"]} == set(SHAPES)
    tp1024 = saved["tp_rows"][-1]
    assert (tp1024["tp"], tp1024["hc"], tp1024["m"], tp1024["consumer_us"], tp1024["consumer_bytes"]) == (8, 4, 1024, 150.0, TP8_M1024_BYTES)
    assert tp1024["consumer_ceiling_fraction"] == pytest.approx(0.8738, abs=1e-4)
    assert saved["mxfp8_diagnosis"][0]["hc"] == 4
    assert [t[0] for t in saved["targets"]] == ISSUE_13 + EARLIER and saved["targets"][3][1] is False


def test_shapes_from_the_command_line():
    assert parse_shapes() == SHAPES == ((5120, 4), (7168, 4), (7168, 8))
    assert parse_shapes("5120x4, 7168X8") == ((5120, 4), (7168, 8))
    assert parse_shapes(hidden="5120") == ((5120, 4),)  # what `--hidden 5120` swept before --hc existed
    assert parse_shapes(hc="8") == ((5120, 8), (7168, 8))
    assert parse_shapes(hidden="4096,5120", hc="4,8") == ((4096, 4), (4096, 8), (5120, 4), (5120, 8))
    for text in ("5120", "5120x", "x4", "0x4", "5120x-4", "5120x4x2", "", "5120x4,"):
        with pytest.raises(ValueError, match="--shapes"):
            parse_shapes(text)
    with pytest.raises(ValueError, match="--hc: invalid value '0'"):
        parse_shapes(hc="0")
    with pytest.raises(ValueError, match="--shapes"):
        parse_shapes("5120x4", hidden="5120")


def test_the_cli_rejects_bad_shapes_before_looking_for_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # never a bench run, even on a GPU host
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--shapes", "5120"])
    assert exit_.value.code == 2 and "--shapes: invalid value '5120'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "5120x4", "--hc", "8"])
    assert "not both" in capsys.readouterr().err
    assert bench.main(["--shapes", "5120x4,7168x8", "--m", "1,8192"]) == 2
    assert "bench needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    help_text = capsys.readouterr().out
    assert "--shapes" in help_text and "--hc" in help_text and "5120x4,7168x4,7168x8" in help_text


def test_run_sweeps_each_shape_and_the_details_at_5120x4(monkeypatch):
    """run()'s plan, with the measurements replaced: every shape over M 1..8192 at capacity 8192,
    the eager table and MXFP8 diagnosis at H=5120 hc=4 only, emulated TP=8 at M 1, 16, 1024 there,
    the cache emptied after each shape."""
    events = []
    monkeypatch.setattr(bench, "_per_call_us", lambda fn, **kw: 0.5)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(bench, "copy_methods_gbs", lambda: {"copy_ in a graph": COPY_GBS - 1, "copy_ on the stream": COPY_GBS})
    monkeypatch.setattr(bench, "tp1_ops", lambda hidden, hc, capacity: events.append(("ops", hidden, hc, capacity)) or {"full": (hidden, hc)})
    monkeypatch.setattr(bench, "measure_tp1", lambda hidden, hc, ms, ops, **kw: [Row(hidden=hidden, hc=hc, m=m, tp=1, fused_us=1.0) for m in ms])
    monkeypatch.setattr(bench, "_measure_details", lambda result, hidden, hc, capacity, full_op: events.append(("details", hidden, hc, capacity, full_op)))
    monkeypatch.setattr(bench, "measure_tp", lambda tp, hidden, hc, ms, copy_ceiling_gbs: [
        tp_row(tp, hidden, hc, m, fused_us=10.0, publish_us=2.0, copy_ceiling_gbs=copy_ceiling_gbs) for m in ms])
    result = bench.run()
    assert bench.M_SWEEP == tuple(2**k for k in range(14))
    assert [(r.hidden, r.hc, r.m) for r in result.rows] == [(h, c, m) for h, c in SHAPES for m in bench.M_SWEEP]
    assert events == [
        ("ops", 5120, 4, 8192), ("details", 5120, 4, 8192, (5120, 4)), "empty_cache",
        ("ops", 7168, 4, 8192), "empty_cache",
        ("ops", 7168, 8, 8192), "empty_cache",
        "empty_cache",  # after the TP=8 rows
    ]
    assert [(r.tp, r.hidden, r.hc, r.m) for r in result.tp_rows] == [(8, 5120, 4, m) for m in (1, 16, 1024)]
    assert result.tp_rows[0].consumer_ceiling_fraction is not None
    # The ceiling is the best of the copy methods (the graph's copy_ was the slowest on the H200).
    assert result.copy_gbs == COPY_GBS and result.copy_methods_gbs["copy_ in a graph"] == COPY_GBS - 1
    events.clear()
    bench.run(shapes=((5120, 8),), ms=(1, 16), tps=())
    assert events == [("ops", 5120, 8, 16), "empty_cache"]  # no 5120x4: no eager table, no diagnosis


def test_input_sets_stop_at_one_for_the_largest_shape(monkeypatch):
    """At M=8192, H=7168, hc=8 one set moves far more than L2_SPILL_BYTES: one set (a residual
    alone is 940 MB), where at M=1 MAX_INPUT_SETS cycle."""
    monkeypatch.setattr(bench, "make_inputs", lambda tp, m, hidden, hc, seed: (tp, m, hidden, hc, seed))
    assert bench._input_sets(1, 8192, 7168, 8, seed=0) == [(1, 8192, 7168, 8, 0)]
    assert len(bench._input_sets(1, 1, 7168, 8, seed=0)) == bench.MAX_INPUT_SETS


def test_the_compiled_chain_is_the_eager_chain_through_inductor():
    """The bench's torch.compile baseline computes the eager chain's math (its own fusion and
    rounding: equal within bf16 rounding, not byte for byte), with M dynamic (one compile, two M)."""
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
    # tp=1 is one kernel reading x in place: x 48, residual in 96, new_residual out 96,
    # layer_input out 48; no mailbox traffic.
    assert fused_bytes(1, 3, 8, 2, False) == 48 + 96 + 96 + 48 == 288


def test_the_small_m_target_names_a_copy_of_the_same_bytes_when_measured():
    result = _result()
    row = _row(result, 7168, 8, 16)
    row.fused_us, row.compiled_us, row.same_bytes_copy_us = 3.01, 24.0, 2.40
    assert _missed(result) == {
        ISSUE_13[2]: f"slowest H7168 hc8 M16: 3.01 us (a copy of the same {row.fused_bytes} bytes: 2.40 us); "
                     "worst ratio H5120 hc4 M1: x0.40 of compiled"}
    row.fused_us = 2.9  # met now: the figure still says what the bytes alone took
    assert _missed(result) == {}
    assert dict((n, f) for n, _, f in targets(result))[ISSUE_13[2]].startswith(
        f"slowest H7168 hc8 M16: 2.90 us (a copy of the same {row.fused_bytes} bytes: 2.40 us)")


def test_the_same_bytes_copy_reads_half_and_writes_half(monkeypatch):
    """On the CPU (the GPU run must not be its first): each call copies one of `pairs` buffer
    pairs of nbytes / 2 bytes, bit for bit, and the calls cycle through them."""
    timed = []

    def run_each_once(calls, **kw):
        timed.append(len(calls))
        for call in calls:
            call()
        return 1.25

    made = []
    real_empty = torch.empty
    monkeypatch.setattr(bench.torch, "empty", lambda *a, **kw: made.append(real_empty(*a, **kw)) or made[-1])
    monkeypatch.setattr(bench, "graph_time_us", run_each_once)
    nbytes = 2 * 16 * 7168 * 2 * (1 + 8)  # fused_bytes at TP=1, H7168 hc8 M16
    assert bench.fused_bytes(1, 16, 7168, 8, False) == nbytes
    assert bench.same_bytes_copy_us(nbytes, pairs=3, device="cpu") == 1.25
    assert timed == [3] and len(made) == 6
    for src, dst in zip(made[::2], made[1::2]):
        assert src.dtype == dst.dtype == torch.int32 and src.numel() * 4 == dst.numel() * 4 == nbytes // 2
        assert torch.equal(src, dst) and src.any()


def test_report_shows_the_same_bytes_copy_column_and_series(tmp_path):
    result = _result()
    row = _row(result, 7168, 8, 16)
    row.same_bytes_copy_us = 2.0  # fused 2.5 us: 1.25x of it
    write_report(result, tmp_path)
    html = (tmp_path / "bench.html").read_text()
    assert "<th>copy of the same bytes us</th><th>fused / copy of the same bytes</th>" in html
    assert "<td>90.0%</td><td>2.00</td><td>1.25</td><td>-</td><td>-</td></tr>" in html  # no rounds in _result()
    assert "<td>90.0%</td><td>-</td><td>-</td><td>-</td><td>-</td></tr>" in html  # rows not measured
    assert ">same-bytes copy H7168 hc8</text>" in html and ">same-bytes copy H5120 hc4</text>" not in html
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][-3]["same_bytes_copy_us"] == 2.0


def test_render_rebuilds_the_report_from_a_saved_bench_json(tmp_path, monkeypatch, capsys):
    result = _result()
    _row(result, 7168, 8, 8192).fused_mxfp8_us = 400.0  # missed, as saved
    write_report(result, tmp_path / "run")
    saved = json.loads((tmp_path / "run" / "bench.json").read_text())
    loaded = bench.load_result(tmp_path / "run" / "bench.json")
    assert loaded == result and targets(loaded) == [tuple(t) for t in saved["targets"]]
    # A bench.json from before a Row field existed loads with that field at its default.
    del saved["rows"][0]["same_bytes_copy_us"]
    (tmp_path / "old.json").write_text(json.dumps(saved))
    assert bench.load_result(tmp_path / "old.json").rows[0].same_bytes_copy_us is None

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU needed
    assert bench.main(["--render", str(tmp_path / "old.json"), "--out", str(tmp_path / "html")]) == 0
    printed = capsys.readouterr().out
    assert f"[MISSED] {ISSUE_13[3]}: max +25.0% (H7168 hc8 M8192: 400.00 us vs 320.00 us)" in printed
    assert sorted(p.name for p in (tmp_path / "html").iterdir()) == ["bench.html"]
    html = (tmp_path / "html" / "bench.html").read_text()
    assert f"Re-rendered from {tmp_path / 'old.json'}" in html
    assert html.replace(f"<p><b>Re-rendered from {tmp_path / 'old.json'}</b>", "<p><b>Re-rendered from X</b>") == \
        (tmp_path / "run" / "bench.html").read_text().replace("<h1>mhc-ar benchmark</h1>", "<h1>mhc-ar benchmark</h1>" + bench._rendered_note("X"))

    (tmp_path / "bad.json").write_text('{"rows": [{"m": 1}]}')
    (tmp_path / "list.json").write_text("[]")
    for source in (tmp_path / "missing.json", tmp_path / "bad.json", tmp_path / "list.json"):
        assert bench.main(["--render", str(source), "--out", str(tmp_path / "bad")]) == 2
        assert f"--render: cannot read a bench result from {source}" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_interleaved_rounds_take_the_sides_in_turn():
    order = []
    figures = {"a": iter([3.0, 3.2, 3.1]), "b": iter([4.0, 3.9, 4.4])}

    def measure(name):
        order.append(name)
        return next(figures[name])

    times = bench.interleaved_times_us({"a": lambda: measure("a"), "b": lambda: measure("b")}, rounds=3)
    assert order == ["a", "b"] * 3
    assert times == {"a": [3.0, 3.2, 3.1], "b": [4.0, 3.9, 4.4]}


class _FakeSide:
    def __init__(self, op, inputs, mxfp8):
        self.mxfp8, self.out = mxfp8, [(None, torch.zeros(1, 32, dtype=torch.bfloat16))]

    def call(self):
        pass

    def publish_only(self):
        pass


def _side_of(calls) -> str:
    """Which side a graph_time_us call times, from the calls measure_tp1 / measure_tp pass."""
    call = calls[0]
    if hasattr(call, "side"):
        return call.side
    owner = getattr(call, "__self__", None)
    if owner is None:
        return "full+quant"  # measure_tp1's lambda: side.call, then mxfp8_quantize
    return {"call": "mxfp8" if owner.mxfp8 else "fused", "publish_only": "publishes"}[call.__name__]


ROUND_FIGURES = {  # medians 3.1, 3.15, 4.5: not the first round's, not the mean
    "fused": [3.2, 3.0, 3.1, 3.4, 3.05], "mxfp8": [3.3, 3.1, 3.15, 3.5, 3.12], "full+quant": [4.0, 5.0, 4.5, 6.0, 4.2],
}


def _fake_measurements(monkeypatch, figures):
    """measure_tp1 / measure_tp with their GPU parts replaced: graph_time_us hands out `figures`
    per side (the rest 50.0), recording the sides in the order it times them."""
    timed = []
    figures = {side: iter(values) for side, values in figures.items()}

    def graph_time_us(calls, **kw):
        side = _side_of(calls)
        timed.append(side)
        return next(figures[side]) if side in figures else 50.0

    def unfused_chain(inputs, mxfp8, compiled=False):
        call = lambda: None  # noqa: E731
        call.side = ("compiled" if compiled else "unfused") + ("+quant" if mxfp8 else "")
        return call

    monkeypatch.setattr(bench, "graph_time_us", graph_time_us)
    monkeypatch.setattr(bench, "_input_sets", lambda tp, m, hidden, hc, seed: ["set 0", "set 1"])
    monkeypatch.setattr(bench, "FusedSide", _FakeSide)
    monkeypatch.setattr(bench, "unfused_chain", unfused_chain)
    monkeypatch.setattr(bench, "same_bytes_copy_us", lambda nbytes, pairs: 1.0)
    return timed


def test_a_tp1_row_reports_the_median_of_interleaved_rounds(monkeypatch):
    """The full, MXFP8 and full + quantize sides (the MXFP8 targets' ratios) are timed in turn
    for ROUNDS rounds; the row's figures are their medians, every round kept."""
    timed = _fake_measurements(monkeypatch, ROUND_FIGURES)

    class Op:
        parts = type("Parts", (), {"one_kernel": True})()

    (row,) = bench.measure_tp1(7168, 8, [16], {"full": Op(), "mxfp8": Op()}, copy_ceiling_gbs=3000.0)
    assert bench.ROUNDS == 5
    assert timed == ["fused", "mxfp8", "full+quant"] * 5 + ["unfused", "unfused+quant", "compiled", "compiled+quant"]
    assert (row.fused_us, row.fused_mxfp8_us, row.full_plus_quant_us) == (3.1, 3.15, 4.5)
    assert row.rounds_us == ROUND_FIGURES
    assert bench._format_row(row).endswith("; 5 rounds, fused 3.00-3.40, mxfp8 3.10-3.50 us")


def test_a_tp_row_reports_the_median_of_interleaved_rounds(monkeypatch):
    import mhc_ar

    figures = {"fused": [1300.0, 1250.0, 1400.0, 1290.0, 1310.0], "publishes": [100.0, 90.0, 120.0, 95.0, 101.0]}
    timed = _fake_measurements(monkeypatch, figures)
    monkeypatch.setattr(mhc_ar, "EmulatedAllReduceMHC", lambda **kw: kw)
    (row,) = bench.measure_tp(8, 5120, 4, [1024], copy_ceiling_gbs=COPY_GBS)
    assert timed == ["fused", "publishes"] * 5
    assert (row.fused_us, row.publish_us, row.consumer_us) == (1300.0, 100.0, 150.0)
    assert row.rounds_us == {"all ranks": figures["fused"], "publishes": figures["publishes"]}
    assert bench._format_tp_row(row).endswith("; 5 rounds, all ranks 1250.00-1400.00, publishes 90.00-120.00 us")


def test_report_shows_the_rounds_spread_only_where_measured(tmp_path):
    result = _result()
    _row(result, 7168, 8, 16).rounds_us = ROUND_FIGURES
    result.tp_rows[-1].rounds_us = {"all ranks": [1300.0, 1310.0], "publishes": [100.0, 99.0]}
    write_report(result, tmp_path)
    html = (tmp_path / "bench.html").read_text()
    assert "<td>3.00-3.40</td><td>3.10-3.50</td></tr>" in html
    assert "<td>1300.00-1310.00</td><td>99.00-100.00</td></tr>" in html
    assert "the median of 5 such figures, the sides timed in turn" in html
    assert bench.load_result(tmp_path / "bench.json") == result
    write_report(_result(), tmp_path / "none")  # a result from before the rounds claims none
    assert "such figures" not in (tmp_path / "none" / "bench.html").read_text()
