"""The multi-rank bench's CPU-testable parts: the max over ranks (gloo, two processes), the target
checks and the report on fabricated figures, and the refusal outside torchrun. (Its timing needs
several GPUs: see scripts/gpu_round.sh tp-bench.)"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch.multiprocessing as mp

from conformance import cli
from conformance.bench_tp import TpBenchResult, TpRow, max_over_ranks, targets, write_report


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


def _result(fused_small: float, speedup: float) -> TpBenchResult:
    result = TpBenchResult(tp=4, hidden=5120, hc=4, device="fake", topology="GPU0 X NV18 <b>")
    for m in (1, 16, 128):
        fused = fused_small if m <= 16 else 20.0
        result.rows.append(TpRow(m=m, fused_us=fused, baseline_us=fused * speedup))
    return result


def test_targets():
    assert [ok for _, ok, _ in targets(_result(5.0, 3.0))] == [True, True]
    assert [ok for _, ok, _ in targets(_result(9.0, 2.0))] == [False, False]


def test_report(tmp_path):
    write_report(_result(5.0, 3.0), tmp_path)
    html = (tmp_path / "bench_tp.html").read_text()
    assert "across 4 ranks" in html and "<svg" in html and "GPU0 X NV18 &lt;b&gt;" in html
    saved = json.loads((tmp_path / "bench_tp.json").read_text())
    assert [r["speedup"] for r in saved["rows"]] == [3.0, 3.0, 3.0] and len(saved["targets"]) == 2


def test_refused_outside_torchrun(monkeypatch, capsys):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert cli.main(["bench-tp"]) == 2
    assert "torchrun" in capsys.readouterr().err


@pytest.mark.skipif(os.environ.get("WORLD_SIZE") is not None, reason="inside torchrun")
def test_bench_tp_is_listed_in_the_cli_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "bench-tp" in capsys.readouterr().out
