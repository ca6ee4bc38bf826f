"""Registers, spills and SASS instruction counts of TP = 1 consumers, on a machine without a GPU.

What a kernel change does to the instruction stream, before any GPU time is spent: each
consumer is compiled for sm_90a with its PTX kept (as scripts/ptx_snapshot.py does), assembled
by `ptxas -v` and disassembled by `nvdisasm`; the table gives registers, spill bytes, the total
instruction count and the most frequent opcodes (the part before the first dot).

    python scripts/sass_counts.py --cuda-bin DIR [--shapes 5120x4,7168x8] [--mxfp8] [--residual-only]
        [--top 8] [--keep OUTDIR]

--keep writes each kernel's PTX and SASS (OUTDIR/<kernel>.ptx, .sass) for reading where the
figures point, e.g. where ptxas placed the loads, the shared-memory reads or the spills.

DIR holds ptxas and nvdisasm of CUDA 13 or newer (the system's ptxas may read PTX only up to an
older ISA version than the DSL writes). Without a CUDA toolkit, the wheels provide them:
`python3 -m venv /tmp/ct && /tmp/ct/bin/pip install nvidia-cuda-nvcc nvidia-cuda-nvdisasm`, then
DIR = /tmp/ct/lib/python3.11/site-packages/nvidia/cu13/bin.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARCH = "sm_90a"
# One instruction line of `nvdisasm -c`: "/*0a40*/  @!P0 FFMA R4, R5, R6, R7 ;" (predicate optional).
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", re.MULTILINE)
_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def opcode_counts(sass: str) -> collections.Counter:
    """Opcode (without modifiers) -> count, over every instruction line of nvdisasm's output."""
    return collections.Counter(_INSTRUCTION.findall(sass))


def ptxas_figures(log: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from `ptxas -v` output."""
    registers = _REGISTERS.search(log)
    spills = _SPILLS.search(log)
    if registers is None or spills is None:
        raise ValueError(f"no register or spill line in the ptxas output:\n{log}")
    return int(registers.group(1)), int(spills.group(1)), int(spills.group(2))


def measure(ptx: str, cuda_bin: Path, keep: Path | None = None) -> dict:
    """ptxas -v and nvdisasm of one kernel's PTX; with `keep`, the PTX and SASS are written as
    keep.ptx and keep.sass."""
    with tempfile.TemporaryDirectory() as folder:
        source, cubin = Path(folder) / "kernel.ptx", Path(folder) / "kernel.cubin"
        source.write_text(ptx)
        assembled = subprocess.run([str(cuda_bin / "ptxas"), f"-arch={ARCH}", "-v", "-o", str(cubin), str(source)],
                                   capture_output=True, text=True, check=True)
        registers, spill_stores, spill_loads = ptxas_figures(assembled.stdout + assembled.stderr)
        sass = subprocess.run([str(cuda_bin / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    if keep is not None:
        keep.with_suffix(".ptx").write_text(ptx)
        keep.with_suffix(".sass").write_text(sass)
    counts = opcode_counts(sass)
    return {"registers": registers, "spill_stores": spill_stores, "spill_loads": spill_loads,
            "instructions": sum(counts.values()), "opcodes": counts}


def main(argv=None) -> int:
    from conformance.bench import parse_shapes
    from mhc_ar.compile import compile_consumer, consumer_name
    from mhc_ar.config import ConsumerSpec, Variant, choose_consumer_tiling

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda-bin", type=Path, required=True, help="folder holding ptxas and nvdisasm")
    parser.add_argument("--shapes", default="5120x4,7168x4,7168x8", help="HIDDENxHC comma list")
    parser.add_argument("--mxfp8", action="store_true", help="the MXFP8 variant beside the full one")
    parser.add_argument("--residual-only", action="store_true", help="the residual-only variant too")
    parser.add_argument("--capacity", type=int, default=8192)
    parser.add_argument("--top", type=int, default=8, help="opcodes shown per kernel")
    parser.add_argument("--keep", type=Path, help="write each kernel's .ptx and .sass into this folder")
    args = parser.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as error:
        parser.error(str(error))
    for tool in ("ptxas", "nvdisasm"):
        if not (args.cuda_bin / tool).is_file():
            parser.error(f"--cuda-bin: no {tool} in {args.cuda_bin}")
    variants = (Variant.FULL,) + ((Variant.MXFP8,) if args.mxfp8 else ()) + ((Variant.RESIDUAL_ONLY,) if args.residual_only else ())
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    for hidden, hc in shapes:
        for variant in variants:
            spec = ConsumerSpec(tiling=choose_consumer_tiling(hidden), hc=hc, tp=1, capacity=args.capacity, variant=variant)
            keep = None if args.keep is None else args.keep / consumer_name(spec)
            figures = measure(compile_consumer(spec, ARCH, keep_ptx=True).ptx, args.cuda_bin, keep)
            top = ", ".join(f"{op} {n}" for op, n in figures["opcodes"].most_common(args.top))
            print(f"{consumer_name(spec)} ({spec.tiling.threads_per_cta} threads x {spec.tiling.cluster_size} CTAs): "
                  f"{figures['registers']} registers, spills {figures['spill_stores']}/{figures['spill_loads']} bytes, "
                  f"{figures['instructions']} instructions: {top}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
