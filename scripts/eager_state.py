"""Does an eager call's host time change within one process as the bench's GPU sweep runs?

The bench measured the same code at 14.8 us (eager-only run) and 24.7 us (full run, a minute
later on the same machine), with its CPU-only probe at 0.7 and 1.75 us. This times the eager
parts (conformance.bench.eager_breakdown_us, AllReduceMHC over a 1-rank group, H=5120, M=1)
before any sweep, after each H's TP=1 sweep, and after a pause, with the host's load average,
this process's thread count and the number of Python objects alive.

    python scripts/eager_state.py
"""

from __future__ import annotations

import gc
import time

from conformance import bench


def host_state() -> str:
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    with open("/proc/self/status") as f:
        threads = next(line.split()[1] for line in f if line.startswith("Threads"))
    return f"loadavg {load}, threads {threads}, python objects {len(gc.get_objects())}"


def report(tag: str, op) -> None:
    parts = bench.eager_breakdown_us(op, bench.make_inputs(1, 1, 5120, 4, seed=1), emulated=False)
    print(f"{tag}: " + ", ".join(f"{k} {v:.2f} us" for k, v in parts.items()), flush=True)
    print(f"    {host_state()}", flush=True)


def main() -> None:
    capacity = max(bench.M_SWEEP)
    op, why = bench.single_rank_op(5120, 4, capacity)
    if op is None:
        raise SystemExit(f"no AllReduceMHC over a 1-rank group here: {why}")
    report("before any sweep", op)
    for hidden in (5120, 4096, 7168):
        ops = bench.tp1_ops(hidden, 4, capacity)
        start = time.time()
        bench.measure_tp1(hidden, 4, bench.M_SWEEP, ops)
        report(f"after the H{hidden} TP=1 sweep ({time.time() - start:.0f} s)", op)
        del ops
    time.sleep(10)
    report("after 10 s idle", op)


if __name__ == "__main__":
    main()
