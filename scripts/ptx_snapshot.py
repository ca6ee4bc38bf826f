"""The PTX of every kernel the contract compiles (reference shape, TP 8 and TP 1) and of the
one-call launchers, for every target arch, to compare two trees.

    python scripts/ptx_snapshot.py --out DIR                  # write DIR/<arch>/<kernel>.ptx
    python scripts/ptx_snapshot.py --out DIR2 --compare DIR   # and compare with an earlier snapshot

A refactor that must not change the kernels (issue 16's guard) takes a snapshot before and
after: the comparison ignores only symbol names (the kernel entry's mangled name carries the
Python module and class path) and the PTX header's compiler comments; anything else that differs
is printed as the first differing line of each kernel, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mhc_ar.compile import (  # noqa: E402
    TARGET_ARCHS,
    compile_publish_then_consume,
    compile_spec,
    compile_tensor_launcher,
    consumer_name,
    kernel_variants,
    publish_name,
)
from mhc_ar.config import ConsumerSpec, Contribution, PublishSpec, Variant  # noqa: E402

# Entry names and their parameters (kernel_cutlass_kernel_<module path>_..._param_N): they carry
# the Python module and class path, so a rename changes them; they are numbered, not compared.
_SYMBOL = re.compile(r"\bkernel_cutlass_\w+")


def normalized(ptx: str) -> list[str]:
    """The PTX lines that matter: comments dropped, symbols numbered in order of appearance."""
    names: dict[str, str] = {}
    lines = []
    for line in ptx.splitlines():
        line = line.split("//", 1)[0].rstrip()
        if line:
            lines.append(_SYMBOL.sub(lambda m: names.setdefault(m.group(0), f"sym{len(names)}"), line))
    return lines


def _kernels(arch: str):
    """(name, compile) of every kernel the contract compiles for the reference shape, at TP 8
    and TP 1 (one kernel: ConsumerSpec.direct), and of the one-call launchers AllReduceMHC uses
    (addresses and tensors) for each contribution and variant."""
    for tp in (8, 1):
        specs = kernel_variants(tp=tp)
        for spec in specs:
            name = publish_name(spec) if isinstance(spec, PublishSpec) else consumer_name(spec)
            yield name, lambda spec=spec: compile_spec(spec, arch, keep_ptx=True)
        publishes = {p.contribution: p for p in specs if isinstance(p, PublishSpec) and not p.multicast}
        for consumer in (s for s in specs if isinstance(s, ConsumerSpec)):
            for contribution in Contribution:
                if consumer.direct and consumer.contribution is not contribution:
                    continue
                publish = publishes.get(contribution) or _publish_like(consumer, contribution)
                name = f"launch-{contribution.value}+{consumer_name(consumer)}"
                yield name, lambda p=publish, c=consumer: compile_publish_then_consume(p, c, arch, keep_ptx=True)
                if consumer.variant is not Variant.MXFP8:
                    yield f"{name}-from-tensors", lambda p=publish, c=consumer: compile_tensor_launcher(p, c, arch, keep_ptx=True)


def _publish_like(consumer: ConsumerSpec, contribution: Contribution) -> PublishSpec:
    """The publish spec an engine pairs with a tp = 1 consumer (never launched there)."""
    return PublishSpec(hidden_size=consumer.hidden_size, tp=consumer.tp, capacity=consumer.capacity, contribution=contribution,
                       top_k=consumer.top_k, multicast=False, hc=consumer.hc)


def snapshot(out: Path) -> list[Path]:
    written = []
    for arch in TARGET_ARCHS:
        for name, build in _kernels(arch):
            path = out / arch / f"{name}.ptx"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(build().ptx)
            written.append(path)
    return written


def compare(new: Path, old: Path) -> int:
    differing = 0
    for path in sorted(new.rglob("*.ptx")):
        relative = path.relative_to(new)
        before = old / relative
        if not before.exists():
            print(f"{relative}: new (no such kernel before)")
            differing += 1
            continue
        a, b = normalized(before.read_text()), normalized(path.read_text())
        if a != b:
            differing += 1
            diff = list(difflib.unified_diff(a, b, lineterm="", n=0))[3:5]  # the first changed lines
            print(f"{relative}: differs ({len(a)} -> {len(b)} lines): {' | '.join(diff)}")
    missing = [p.relative_to(old) for p in old.rglob("*.ptx") if not (new / p.relative_to(old)).exists()]
    for relative in missing:
        print(f"{relative}: gone")
    total = len(list(new.rglob("*.ptx")))
    print(f"{total - differing} of {total} kernels identical apart from symbol names; {differing} differ, {len(missing)} gone")
    return 1 if differing or missing else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compare", type=Path, help="an earlier snapshot")
    args = parser.parse_args(argv)
    written = snapshot(args.out)
    print(f"{len(written)} PTX files under {args.out}")
    return compare(args.out, args.compare) if args.compare else 0


if __name__ == "__main__":
    raise SystemExit(main())
