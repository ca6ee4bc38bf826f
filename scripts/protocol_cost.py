"""Same-run cost of a protocol change: the fused call of this tree's mhc_ar against an earlier
copy of the package, importable as `mhc_ar_before` (its imports are relative, so a copy of the
folder under that name is a second, independent package), timed the same way in one process.

    cp -r <old checkout>/mhc_ar DIR/mhc_ar_before
    PYTHONPATH=DIR:$PYTHONPATH python scripts/protocol_cost.py [--m 1,16,1024] [--tp 1,8]

For each TP size (emulated: all publishes, then all consumers, as conformance.bench's TP rows)
and M: the median per-call time of a CUDA graph of conformance.bench.CALLS_PER_GRAPH calls
(conformance.bench.graph_time_us), before and after alternately for ROUNDS rounds; printed is
the median of each side's rounds and after / before - 1. H=5120, hc=4, full variant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conformance.bench import FusedSide, _input_sets, graph_time_us  # noqa: E402

HIDDEN, HC = 5120, 4
ROUNDS = 5


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="1,16,1024")
    parser.add_argument("--tp", default="1,8")
    args = parser.parse_args(argv)
    ms = [int(v) for v in args.m.split(",")]
    packages = {"before": importlib.import_module("mhc_ar_before"), "after": importlib.import_module("mhc_ar")}
    print(f"device {torch.cuda.get_device_name()}; before = {packages['before'].__file__}", flush=True)
    for tp in [int(v) for v in args.tp.split(",")]:
        ops = {name: p.EmulatedAllReduceMHC(tp_size=tp, hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=max(ms)) for name, p in packages.items()}
        for m in ms:
            sets = _input_sets(tp, m, HIDDEN, HC, seed=m)
            sides = {name: [FusedSide(op, s, mxfp8=False) for s in sets] for name, op in ops.items()}
            times = {name: [] for name in ops}
            for _ in range(ROUNDS):
                for name, side in sides.items():
                    times[name].append(graph_time_us([f.call for f in side]))
            before, after = (statistics.median(times[n]) for n in ("before", "after"))
            print(f"tp={tp} H={HIDDEN} hc={HC} M={m}: before {before:.2f} us, after {after:.2f} us, "
                  f"{100 * (after / before - 1):+.1f}% (rounds: before {', '.join(f'{t:.2f}' for t in times['before'])}; "
                  f"after {', '.join(f'{t:.2f}' for t in times['after'])})", flush=True)
        del ops, sides
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
