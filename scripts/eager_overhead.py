"""Same-run eager host time of a call, this tree's mhc_ar against earlier copies of the package
(as scripts/protocol_cost.py: each copy importable under its own name), e.g. what the capture
switch (mhc_ar.recording) costs a call while capture is off.

    cp -r <old checkout>/mhc_ar DIR/mhc_ar_before
    PYTHONPATH=DIR:$PYTHONPATH python scripts/eager_overhead.py --packages mhc_ar_before,mhc_ar

For each package: AllReduceMHC over a one-process group (unicast transport, the eager path a
real rank takes) and EmulatedAllReduceMHC with tp=1, H=5120, hc=4, M=1 and 16, the call
without out= (fresh outputs); host wall time per call (conformance.bench._per_call_us: 2000
calls in 5 batches, median), the packages alternating for ROUNDS rounds; printed is the median of
each package's rounds and its change against the first package (protocol_cost.print_rounds).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conformance.bench import _per_call_us, make_inputs  # noqa: E402
from protocol_cost import print_rounds  # noqa: E402  (scripts/, this file's folder, is on sys.path)

HIDDEN, HC = 5120, 4
ROUNDS = 7


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packages", default="mhc_ar_before,mhc_ar", help="the first is the baseline")
    parser.add_argument("--m", default="1,16")
    args = parser.parse_args(argv)
    from mhc_ar.transport import disable_multicast_env

    disable_multicast_env()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    names = args.packages.split(",")
    packages = {name: importlib.import_module(name) for name in names}
    print(f"device {torch.cuda.get_device_name()}; " + "; ".join(f"{n} = {p.__file__}" for n, p in packages.items()), flush=True)
    capture_state = {n: getattr(getattr(p, "recording", None), "recorder", "no capture switch") for n, p in packages.items()}
    print(f"capture recorder per package (None: off): {capture_state}", flush=True)
    for kind in ("AllReduceMHC", "EmulatedAllReduceMHC"):
        ops = {}
        for name, p in packages.items():
            if kind == "AllReduceMHC":
                ops[name] = p.AllReduceMHC(hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=16, device="cuda")
            else:
                ops[name] = p.EmulatedAllReduceMHC(tp_size=1, hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=16)
        for m in [int(v) for v in args.m.split(",")]:
            i = make_inputs(1, m, HIDDEN, HC, seed=m)
            x = i.xs[0] if kind == "AllReduceMHC" else i.xs
            def eager_call_us(name):
                op = ops[name]
                return _per_call_us(lambda: op(x, i.residual, i.post, i.comb, i.pre, i.norm_weight, i.eps))

            print_rounds(f"{kind} eager call M={m}", names, eager_call_us, rounds=ROUNDS)
        del ops
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
