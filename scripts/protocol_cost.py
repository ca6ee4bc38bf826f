"""Same-run cost of a protocol change: the fused call of this tree's mhc_ar against earlier
copies of the package, each importable under its own name (its imports are relative, so a copy
of the folder under another name is a second, independent package), timed the same way in one
process.

    cp -r <old checkout>/mhc_ar DIR/mhc_ar_before
    PYTHONPATH=DIR:$PYTHONPATH python scripts/protocol_cost.py [--m 1,16,1024] [--tp 1,8]
        [--packages mhc_ar_before,mhc_ar_other,mhc_ar]

For each TP size (emulated: all publishes, then all consumers, as conformance.bench's TP rows)
and M: the median per-call time of a CUDA graph of conformance.bench.CALLS_PER_GRAPH calls
(conformance.bench.graph_time_us), the packages in turn for ROUNDS rounds; printed is the
median of each package's rounds and its change against the first package. Full variant, at
each of --shapes (H x hc, default 5120x4); --mxfp8 adds the MXFP8 variant. At TP = 1 there is
no publish to time alone (one kernel: mhc_ar.config.ConsumerSpec.direct).
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conformance.bench import ROUNDS, FusedSide, _input_sets, graph_time_us, interleaved_times_us  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="1,16,1024")
    parser.add_argument("--tp", default="1,8")
    parser.add_argument("--packages", default="mhc_ar_before,mhc_ar", help="the first is the baseline")
    parser.add_argument("--shapes", default="5120x4", help="H x hc, comma-separated")
    parser.add_argument("--mxfp8", action="store_true", help="also the MXFP8 variant")
    parser.add_argument("--publish", action="store_true", help="also time the publishes alone (FusedSide.publish_only; TP > 1)")
    args = parser.parse_args(argv)
    ms = [int(v) for v in args.m.split(",")]
    names = args.packages.split(",")
    packages = {name: importlib.import_module(name) for name in names}
    print(f"device {torch.cuda.get_device_name()}; " + "; ".join(f"{n} = {p.__file__}" for n, p in packages.items()), flush=True)
    for shape in args.shapes.split(","):
        hidden, hc = (int(v) for v in shape.split("x"))
        for tp in [int(v) for v in args.tp.split(",")]:
            for mxfp8 in (False, True) if args.mxfp8 else (False,):
                _compare_packages(packages, names, tp, hidden, hc, ms, mxfp8, args.publish and tp > 1)
    return 0


def _compare_packages(packages, names, tp, hidden, hc, ms, mxfp8, publish):
    ops = {name: p.EmulatedAllReduceMHC(tp_size=tp, hidden_size=hidden, hc_mult=hc, max_num_tokens=max(ms), quantize_layer_input=mxfp8)
           for name, p in packages.items()}
    variant = "mxfp8" if mxfp8 else "full"
    for m in ms:
        sets = _input_sets(tp, m, hidden, hc, seed=m)
        sides = {name: [FusedSide(op, s, mxfp8=mxfp8) for s in sets] for name, op in ops.items()}
        _compare(names, sides, f"tp={tp} H={hidden} hc={hc} {variant} M={m}", lambda f: f.call)
        if publish:
            _compare(names, sides, f"  publish only, tp={tp} M={m}", lambda f: f.publish_only)
        del sets, sides
    del ops
    torch.cuda.empty_cache()


def _compare(names, sides, label, launch):
    print_rounds(label, names, lambda name: graph_time_us([launch(f) for f in sides[name]]))


def print_rounds(label: str, names, measure, rounds: int = ROUNDS) -> None:
    """measure(name) for each package in turn, `rounds` times; prints each package's median,
    its change against the first package's, and every round's figure."""
    times = interleaved_times_us({name: lambda name=name: measure(name) for name in names}, rounds)
    base = statistics.median(times[names[0]])
    parts = []
    for name in names:
        median = statistics.median(times[name])
        change = "" if name == names[0] else f" ({100 * (median / base - 1):+.1f}%)"
        parts.append(f"{name} {median:.2f} us{change} [{', '.join(f'{t:.2f}' for t in times[name])}]")
    print(f"{label}: " + "; ".join(parts), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
