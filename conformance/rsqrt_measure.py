"""`python -m conformance measure-rsqrt`: measure rsqrt.approx.ftz.f32 on the GPU present.

Runs the consumer's own instruction (mhc_ar.kernels.rsqrt_probe) on every float32 in [0.5, 2),
turns the results into the deviation table the reference's CPU emulation reads
(reference/rsqrt.py describes the format), and checks the two facts the emulation rests on:

1. power-of-4 scaling: rsqrt(m * 4^k) == rsqrt(m) / 2^k exactly, for every m in [0.5, 2) and
   every k in [-K, K] (K = 30 by default), so the table covers every normal input;
2. torch.rsqrt on a CUDA float32 tensor equals the instruction on every positive normal float
   (the reference calls torch.rsqrt on CUDA tensors).

Another architecture may differ: run this there and ship its table beside the sm_90 one.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import torch

from reference.bits import f32_from_u32, u32
from reference.rsqrt import TABLE_BASE_BITS, TABLE_SIZE, load_table, rsqrt_delta_from_measurement, write_table


@dataclass
class Measurement:
    table: torch.Tensor  # int8 [2^24]
    device_name: str
    capability: tuple[int, int]
    scaling_mismatches: int = 0
    scaling_checked: int = 0
    torch_mismatches: int = 0
    torch_checked: int = 0
    first_problems: list[str] = field(default_factory=list)

    def counts(self) -> dict[int, int]:
        values, counts = torch.unique(self.table, return_counts=True)
        return {int(v): int(c) for v, c in zip(values, counts)}


def _probe():
    from mhc_ar.kernels.rsqrt_probe import compile_rsqrt_probe

    kernel = compile_rsqrt_probe()

    def run(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        kernel(x, out, x.numel())
        return out

    return run


def _unit_floats(device) -> torch.Tensor:
    index = torch.arange(TABLE_SIZE, dtype=torch.int64, device=device)
    return f32_from_u32(TABLE_BASE_BITS + index)


def measure(device: torch.device | None = None, max_power: int = 30, check_torch: bool = True) -> Measurement:
    device = torch.device("cuda") if device is None else device
    probe = _probe()
    unit = _unit_floats(device)
    hardware = probe(unit)
    torch.cuda.synchronize(device)
    hw_bits = u32(hardware)  # int64 of the unsigned pattern
    result = Measurement(
        table=rsqrt_delta_from_measurement(hardware.view(torch.int32)),
        device_name=torch.cuda.get_device_name(device),
        capability=torch.cuda.get_device_capability(device),
    )
    # 1. rsqrt(m * 4^k) == rsqrt(m) / 2^k: the exponent field moves by -k, nothing else changes.
    for k in range(-max_power, max_power + 1):
        scaled = f32_from_u32(u32(unit) + 2 * k * (1 << 23))
        got = u32(probe(scaled))
        expected = hw_bits - k * (1 << 23)
        bad = got != expected
        result.scaling_checked += unit.numel()
        if bool(bad.any()):
            result.scaling_mismatches += int(bad.sum())
            i = int(bad.nonzero()[0, 0])
            result.first_problems.append(f"k={k}: x bits {int(u32(scaled)[i]):#010x}: {int(got[i]):#010x} != {int(expected[i]):#010x}")
    # 2. torch.rsqrt == the instruction on every positive normal float (biased exponents 1..254).
    if check_torch:
        step = 1 << 23  # one binade per launch
        for exponent in range(1, 255):
            x = f32_from_u32(torch.arange(exponent << 23, (exponent << 23) + step, dtype=torch.int64, device=device))
            got, expected = u32(torch.rsqrt(x)), u32(probe(x))
            bad = got != expected
            result.torch_checked += step
            if bool(bad.any()):
                result.torch_mismatches += int(bad.sum())
                i = int(bad.nonzero()[0, 0])
                result.first_problems.append(f"torch.rsqrt x bits {(exponent << 23) + i:#010x}: {int(got[i]):#010x} != {int(expected[i]):#010x}")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance measure-rsqrt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the *.i8.zlib table")
    parser.add_argument("--compare", action="append", default=[], help="another table to compare with (repeatable)")
    parser.add_argument("--max-power", type=int, default=30, help="check scalings by 4^k for |k| <= this")
    parser.add_argument("--skip-torch-check", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("measure-rsqrt needs a CUDA GPU", file=sys.stderr)
        return 2
    start = time.time()
    result = measure(max_power=args.max_power, check_torch=not args.skip_torch_check)
    write_table(args.out, result.table)
    print(f"device: {result.device_name} (sm_{result.capability[0]}{result.capability[1]})")
    print(f"table written to {args.out}: deviation counts (ulp: entries) {result.counts()}")
    print(f"power-of-4 scaling: {result.scaling_mismatches} mismatches in {result.scaling_checked} checks")
    if not args.skip_torch_check:
        print(f"torch.rsqrt vs instruction: {result.torch_mismatches} mismatches in {result.torch_checked} normal floats")
    for problem in result.first_problems[:10]:
        print("  ", problem)
    status = 0 if result.scaling_mismatches == 0 and result.torch_mismatches == 0 else 1
    for other in args.compare:
        table = load_table(other)
        differ = int((table != result.table).sum())
        print(f"compared with {other}: {differ} entries differ")
        status = status or (1 if differ else 0)
    print(f"measure-rsqrt: {'ok' if status == 0 else 'FAILED'} in {time.time() - start:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
