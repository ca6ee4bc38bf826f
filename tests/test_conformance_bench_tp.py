"""The multi-rank bench's CPU-testable parts: the max over ranks (gloo, two processes), the target
checks (NCCL + the compiled chain among them, met and missed) and the report on fabricated
figures, with and without the compiled baseline, and the refusal outside torchrun. (Its timing
needs several GPUs: see scripts/gpu_round.sh tp-bench.)"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch.multiprocessing as mp

from conformance import cli
from conformance import bench_tp
from conformance.bench_tp import TpBenchResult, TpRow, _format_row, max_over_ranks, targets, write_report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results[rank] = max_over_ranks(1.5 + 10.0 * rank)
    finally:
        dist.destroy_process_group()


def test_max_over_ranks_takes_the_slowest_rank():
    world = 2
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world, _free_port(), results), nprocs=world, join=True)
        assert dict(results) == {0: 11.5, 1: 11.5}


COMPILED_TARGET = "TP=4: fused faster than NCCL + compiled at every M"


def _result(fused_small: float, speedup: float, compiled_speedup: float | None = 1.5) -> TpBenchResult:
    """Three M; NCCL + unfused at `speedup` x fused, NCCL + compiled at `compiled_speedup` x
    fused (None: a --no-compiled run)."""
    result = TpBenchResult(tp=4, hidden=5120, hc=4, device="fake", topology="GPU0 X NV18 <b>")
    for m in (1, 16, 128):
        fused = fused_small if m <= 16 else 20.0
        compiled = None if compiled_speedup is None else fused * compiled_speedup
        result.rows.append(TpRow(m=m, fused_us=fused, baseline_us=fused * speedup, compiled_us=compiled))
    return result


def test_targets():
    checks = targets(_result(5.0, 3.0))
    assert [name for name, _, _ in checks] == [COMPILED_TARGET, "TP=4, M<=16: fused <= 8 us", "TP=4: >= 2.5x NCCL + unfused"]
    assert [ok for _, ok, _ in checks] == [True, True, True]
    assert [ok for _, ok, _ in targets(_result(9.0, 2.0))] == [True, False, False]


def test_compiled_target_missed_at_one_m_names_it():
    result = _result(5.0, 3.0)
    result.rows[2].compiled_us = 19.0  # NCCL + compiled beats fused (20 us) at M=128 only
    assert [(name, ok, figure) for name, ok, figure in targets(result) if not ok] == [
        (COMPILED_TARGET, False, "worst M128: fused 20.00 us, NCCL + compiled 19.00 us (x0.95)")]
    result.rows[2].compiled_us = 20.0  # a tie is not faster
    assert dict((name, ok) for name, ok, _ in targets(result))[COMPILED_TARGET] is False


def test_without_the_compiled_baseline_its_target_is_left_out():
    checks = targets(_result(5.0, 3.0, compiled_speedup=None))
    assert [name for name, _, _ in checks] == ["TP=4, M<=16: fused <= 8 us", "TP=4: >= 2.5x NCCL + unfused"]


def test_printed_row():
    result = _result(5.0, 3.0)
    assert _format_row(result, result.rows[0]) == "tp4 H5120 M1: fused 5.00 us, NCCL + unfused 15.00 us (x3.0), NCCL + compiled 7.50 us (x1.50)"
    assert _format_row(result, TpRow(m=2, fused_us=5.0, baseline_us=15.0)) == "tp4 H5120 M2: fused 5.00 us, NCCL + unfused 15.00 us (x3.0)"


def test_report(tmp_path):
    write_report(_result(5.0, 3.0), tmp_path)
    html = (tmp_path / "bench_tp.html").read_text()
    assert "across 4 ranks" in html and "<svg" in html and "GPU0 X NV18 &lt;b&gt;" in html
    assert "<th>NCCL all-reduce + torch.compile us</th>" in html and "<tr><td>128</td><td>20.00</td><td>60.00</td><td>3.0</td><td>30.00</td><td>1.50</td></tr>" in html
    assert html.count("<polyline") == 3 and ">NCCL + torch.compile</text>" in html
    saved = json.loads((tmp_path / "bench_tp.json").read_text())
    assert [r["speedup"] for r in saved["rows"]] == [3.0, 3.0, 3.0] and len(saved["targets"]) == 3
    assert [r["compiled_us"] for r in saved["rows"]] == [7.5, 7.5, 30.0] and [r["compiled_speedup"] for r in saved["rows"]] == [1.5, 1.5, 1.5]
    assert saved["targets"][0][:2] == [COMPILED_TARGET, True]


def test_report_without_the_compiled_baseline(tmp_path):
    write_report(_result(5.0, 3.0, compiled_speedup=None), tmp_path)
    html = (tmp_path / "bench_tp.html").read_text()
    assert "<tr><td>128</td><td>20.00</td><td>60.00</td><td>3.0</td><td>-</td><td>-</td></tr>" in html
    assert html.count("<polyline") == 2 and "NCCL + torch.compile</text>" not in html
    saved = json.loads((tmp_path / "bench_tp.json").read_text())
    assert saved["rows"][0]["compiled_us"] is None and saved["rows"][0]["compiled_speedup"] is None


def test_run_times_the_compiled_baseline_beside_the_others(monkeypatch):
    """run()'s plan, with the ranks and GPUs replaced: per M, the fused call, NCCL + unfused and
    NCCL + compiled, each through rank_max_time_us; --no-compiled leaves the third out."""
    import torch
    import torch.distributed as dist

    import mhc_ar
    from conformance import distributed

    monkeypatch.setattr(distributed, "init_torchrun", lambda backend, min_world: (0, 4, "cuda:0"))
    monkeypatch.setattr(mhc_ar, "AllReduceMHC", lambda **kw: "op")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    monkeypatch.setattr(dist, "barrier", lambda *a, **kw: None)
    monkeypatch.setattr(bench_tp, "topology", lambda: "")
    monkeypatch.setattr(bench_tp, "_sides", lambda op, rank, m, hidden, hc, compiled: (
        ("fused", m), ("NCCL + unfused", m), ("NCCL + compiled", m) if compiled else None))
    timed = []
    times = {"fused": 2.0, "NCCL + unfused": 6.0, "NCCL + compiled": 3.0}
    monkeypatch.setattr(bench_tp, "rank_max_time_us", lambda calls: timed.append(calls[0]) or times[calls[0][0]] * calls[0][1])
    result = bench_tp.run(ms=(1, 2))
    assert timed == [(side, m) for m in (1, 2) for side in ("fused", "NCCL + unfused", "NCCL + compiled")]
    assert [(r.m, r.fused_us, r.baseline_us, r.compiled_us) for r in result.rows] == [(1, 2.0, 6.0, 3.0), (2, 4.0, 12.0, 6.0)]
    timed.clear()
    result = bench_tp.run(ms=(1,), compiled=False)
    assert timed == [("fused", 1), ("NCCL + unfused", 1)] and result.rows[0].compiled_us is None


def test_refused_outside_torchrun(monkeypatch, capsys):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert cli.main(["bench-tp"]) == 2
    assert "torchrun" in capsys.readouterr().err
    assert cli.main(["bench-tp", "--no-compiled"]) == 2  # the option parses; the run still needs torchrun
    assert "torchrun" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_tp.main(["--help"])
    assert "--no-compiled" in capsys.readouterr().out


@pytest.mark.skipif(os.environ.get("WORLD_SIZE") is not None, reason="inside torchrun")
def test_bench_tp_is_listed_in_the_cli_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "bench-tp" in capsys.readouterr().out
