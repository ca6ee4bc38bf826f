"""`torchrun --nproc-per-node N -m conformance bench-tp`: the fused call on N real ranks (one GPU
each, unicast transport) against NCCL all-reduce followed by the unfused PyTorch chain, and against
NCCL all-reduce followed by the same chain through torch.compile (`--no-compiled` leaves it out).

All three are measured in the same run, the same way: each is captured in a CUDA graph of
CALLS_PER_GRAPH calls on every rank. Before each timed replay the ranks meet at a barrier, then
each times its own replay with CUDA events; a rank's figure is its median per call over REPEATS
replays, and the reported figure is the maximum over ranks (the slowest rank sets the layer's
time). NVLink multicast stays off in every process (mhc_ar.transport.MULTICAST_OFF_ENV). Rank 0
writes bench_tp.json and bench_tp.html.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from html import escape as html_escape
from pathlib import Path

import torch

# Timed as the single-GPU bench times: the same graph length and number of replays.
from .bench import CALLS_PER_GRAPH, REPEATS, SMALL_M
from .bench import SMALL_M_FUSED_US as FUSED_TARGET_US

M_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128)
# The targets: fused <= FUSED_TARGET_US at M <= SMALL_M, and >= SPEEDUP_TARGET x NCCL + unfused.
SPEEDUP_TARGET = 2.5


@dataclass
class TpRow:
    m: int
    fused_us: float  # max over ranks of each rank's median per call
    baseline_us: float  # NCCL all-reduce + unfused chain, same
    compiled_us: float | None = None  # NCCL all-reduce + the torch.compile chain, same (None: --no-compiled)

    @property
    def speedup(self) -> float:
        return self.baseline_us / self.fused_us

    @property
    def compiled_speedup(self) -> float | None:
        return None if self.compiled_us is None else self.compiled_us / self.fused_us


@dataclass
class TpBenchResult:
    tp: int
    hidden: int
    hc: int
    device: str
    topology: str
    rows: list[TpRow] = field(default_factory=list)
    seconds: float = 0.0


def max_over_ranks(value: float, group=None) -> float:
    """The largest of every rank's `value` (a collective: every rank calls it)."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor.item())


def rank_max_time_us(calls, group=None) -> float:
    """Median per call of this rank's replays of a graph of `calls` (the ranks meet at a barrier
    before each replay), maximum over ranks."""
    import torch.distributed as dist

    from .bench import graph_time_us

    def barrier():
        dist.barrier(group=group)
        torch.cuda.synchronize()

    median = graph_time_us(calls, calls_per_graph=CALLS_PER_GRAPH, repeats=REPEATS, before_each_replay=barrier)
    return max_over_ranks(median, group)


def _sides(op, rank: int, m: int, hidden: int, hc: int, compiled: bool = True):
    """This rank's fused call, its NCCL + unfused baseline and its NCCL + torch.compile baseline
    (None unless `compiled`), on the same inputs (the mix inputs are the same on every rank, x is
    this rank's own)."""
    import torch.distributed as dist

    from .bench import Inputs, make_inputs, unfused_chain

    shared = make_inputs(1, m, hidden, hc, seed=m)
    x = make_inputs(1, m, hidden, hc, seed=10_000 * (rank + 1) + m).xs[0]
    out = (torch.empty(m, hc, hidden, dtype=torch.bfloat16, device="cuda"), torch.empty(m, hidden, dtype=torch.bfloat16, device="cuda"))
    mix = (shared.residual, shared.post, shared.comb, shared.pre, shared.norm_weight, shared.eps)

    def fused():
        op(x, *mix, out=out)

    def nccl_then_chain(compiled_chain: bool):
        reduced = x.clone()  # all-reduced in place every call: values grow, the time does not
        chain = unfused_chain(Inputs([reduced], shared.residual, shared.post, shared.comb, shared.pre, shared.norm_weight, shared.eps),
                              mxfp8=False, compiled=compiled_chain)

        def baseline():
            dist.all_reduce(reduced)
            chain()

        return baseline

    return fused, nccl_then_chain(False), nccl_then_chain(True) if compiled else None


def topology() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        return f"nvidia-smi topo -m: {error}"
    return out.stdout if out.returncode == 0 else f"nvidia-smi topo -m exited {out.returncode}: {out.stderr}"


def run(ms=M_SWEEP, hidden: int = 5120, hc: int = 4, compiled: bool = True) -> TpBenchResult:
    import torch.distributed as dist

    from mhc_ar import AllReduceMHC

    from .distributed import init_torchrun

    rank, world, device = init_torchrun("nccl", min_world=1)  # 1 rank: a smoke run on one GPU
    start = time.time()
    result = TpBenchResult(tp=world, hidden=hidden, hc=hc, device=torch.cuda.get_device_name(device), topology=topology() if rank == 0 else "")
    op = AllReduceMHC(hidden_size=hidden, hc_mult=hc, max_num_tokens=max(ms), device=device)
    for m in ms:
        fused, baseline, compiled_baseline = _sides(op, rank, m, hidden, hc, compiled)
        row = TpRow(m=m, fused_us=rank_max_time_us([fused]), baseline_us=rank_max_time_us([baseline]))
        if compiled_baseline is not None:  # `compiled` is the same on every rank: each calls the collective
            row.compiled_us = rank_max_time_us([compiled_baseline])
        result.rows.append(row)
        if rank == 0:
            print(_format_row(result, row), flush=True)
    dist.barrier()
    result.seconds = time.time() - start
    return result


def _format_row(result: TpBenchResult, row: TpRow) -> str:
    line = f"tp{result.tp} H{result.hidden} M{row.m}: fused {row.fused_us:.2f} us, NCCL + unfused {row.baseline_us:.2f} us (x{row.speedup:.1f})"
    if row.compiled_us is not None:
        line += f", NCCL + compiled {row.compiled_us:.2f} us (x{row.compiled_speedup:.2f})"
    return line


def targets(result: TpBenchResult) -> list[tuple[str, bool, str]]:
    """The targets, each (name, met?, measured figures): issue 13's first, then the earlier ones."""
    checks = []
    compiled = [r for r in result.rows if r.compiled_us is not None]
    if compiled:  # against what a user would pick instead
        worst = min(compiled, key=lambda r: r.compiled_speedup)
        checks.append((f"TP={result.tp}: fused faster than NCCL + compiled at every M", worst.fused_us < worst.compiled_us,
                       f"worst M{worst.m}: fused {worst.fused_us:.2f} us, NCCL + compiled {worst.compiled_us:.2f} us (x{worst.compiled_speedup:.2f})"))
    small = [r for r in result.rows if r.m <= SMALL_M]
    if small:
        worst = max(r.fused_us for r in small)
        checks.append((f"TP={result.tp}, M<={SMALL_M}: fused <= {FUSED_TARGET_US:g} us", worst <= FUSED_TARGET_US, f"max {worst:.2f} us"))
    if result.rows:
        ratio = min(r.speedup for r in result.rows)
        checks.append((f"TP={result.tp}: >= {SPEEDUP_TARGET:g}x NCCL + unfused", ratio >= SPEEDUP_TARGET, f"min x{ratio:.1f}"))
    return checks


def write_report(result: TpBenchResult, out: Path) -> None:
    from .plots import line_plot_svg

    out.mkdir(parents=True, exist_ok=True)
    rows = [asdict(r) | {"speedup": r.speedup, "compiled_speedup": r.compiled_speedup} for r in result.rows]
    (out / "bench_tp.json").write_text(json.dumps(asdict(result) | {"rows": rows, "targets": targets(result)}, indent=1))
    series = {"fused": [(r.m, r.fused_us) for r in result.rows], "NCCL + unfused": [(r.m, r.baseline_us) for r in result.rows]}
    if any(r.compiled_us is not None for r in result.rows):
        series["NCCL + torch.compile"] = [(r.m, r.compiled_us) for r in result.rows]
    svg = line_plot_svg(series, x_label="M (tokens)", y_label="us per call (max over ranks)", log_x=True, log_y=True)
    table = "".join(
        f"<tr><td>{r.m}</td><td>{r.fused_us:.2f}</td><td>{r.baseline_us:.2f}</td><td>{r.speedup:.1f}</td>"
        f"<td>{_or_dash(r.compiled_us, '.2f')}</td><td>{_or_dash(r.compiled_speedup, '.2f')}</td></tr>"
        for r in result.rows
    )
    checks = "".join(
        f"<tr class='{'pass' if ok else 'fail'}'><td>{html_escape(name)}</td><td>{'met' if ok else 'missed'}</td><td>{figure}</td></tr>"
        for name, ok, figure in targets(result)
    )
    html = f"""<!doctype html><html><head><meta charset="utf-8"><title>mhc-ar bench, TP={result.tp}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}
tr.pass td{{background:#dfd}}tr.fail td{{background:#fdd}}pre{{background:#f6f6f6;padding:.5em}}</style></head><body>
<h1>mhc-ar across {result.tp} ranks</h1><p>{html_escape(result.device)} x {result.tp}, H={result.hidden}, hc={result.hc}; each figure is
the maximum over ranks of each rank's median per call over {REPEATS} replays of a CUDA graph of {CALLS_PER_GRAPH} calls; total {result.seconds:.0f} s.</p>
<h2>Targets</h2><table><tr><th>target</th><th>result</th><th>measured</th></tr>{checks}</table>
<h2>Latency vs M</h2>{svg}
<table><tr><th>M</th><th>fused us</th><th>NCCL all-reduce + unfused us</th><th>speed-up</th>
<th>NCCL all-reduce + torch.compile us</th><th>speed-up over compiled</th></tr>{table}</table>
<h2>Topology (nvidia-smi topo -m)</h2><pre>{html_escape(result.topology)}</pre></body></html>"""
    (out / "bench_tp.html").write_text(html)


def _or_dash(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv=None) -> int:
    from .distributed import torchrun_world

    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m conformance bench-tp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="report folder (default reports/bench-tp<N>-<time>)")
    parser.add_argument("--m", default=",".join(map(str, M_SWEEP)))
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--hc", type=int, default=4)
    parser.add_argument("--no-compiled", action="store_true", help="leave NCCL + the torch.compile chain out (it compiles on every rank)")
    args = parser.parse_args(argv)
    if torchrun_world(min_world=1) is None or not torch.cuda.is_available():
        print("bench-tp runs under torchrun, one process per GPU", file=sys.stderr)
        return 2
    result = run(ms=tuple(int(v) for v in args.m.split(",") if v), hidden=args.hidden, hc=args.hc, compiled=not args.no_compiled)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        out = Path(args.out) if args.out else Path("reports") / time.strftime(f"bench-tp{result.tp}-%Y%m%d-%H%M%S")
        write_report(result, out)
        print(f"\nbench-tp: TP={result.tp}, {len(result.rows)} rows in {result.seconds:.0f} s -> {out}/bench_tp.html")
        for name, ok, figure in targets(result):
            print(f"  [{'met' if ok else 'MISSED'}] {name}: {figure}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
