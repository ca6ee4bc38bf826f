"""Where a consumer's warps stall, from the SASS page that `gpu_round.sh ncu-...` writes.

That step saves `ncu --page source --print-source sass --csv` as STEP.sass.csv. This script
prints, from that csv alone (no GPU), each stall reason's share of all warp stall samples and the
instructions with the most samples, each with its dominant reason.

    python scripts/ncu_stalls.py notes/ncu-h200-s26/ncu-7168x8x1024.sass.csv [--top 12]
"""

import argparse
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"


def stall_profile(path: str) -> tuple[float, list[tuple[float, str]], list[tuple[float, str, str]]]:
    """(total samples, [(share, reason)] largest first, [(share, instruction, its dominant reason)]
    largest first) of one SASS csv."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[1], rows[2:]  # row 0 names the kernel
    column = {name: i for i, name in enumerate(header)}
    reasons = [name for name in header if name.startswith("stall_") and "(Not Issued)" not in name]

    def value(row, name):
        return float(row[column[name]] or 0)

    total = sum(value(row, SAMPLES) for row in body)
    shares = sorted(((sum(value(row, r) for row in body) / total, r) for r in reasons), reverse=True)
    instructions = sorted(
        ((value(row, SAMPLES) / total, row[column["Source"]].strip(), max(reasons, key=lambda r: value(row, r)))
         for row in body),
        key=lambda item: -item[0])
    return total, shares, instructions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", nargs="+", help="STEP.sass.csv files")
    parser.add_argument("--top", type=int, default=12, help="instructions to list (default 12)")
    args = parser.parse_args()
    for path in args.csv:
        total, shares, instructions = stall_profile(path)
        print(f"{path}: {total:.0f} warp stall samples")
        print("  " + ", ".join(f"{r} {share:.1%}" for share, r in shares if share >= 0.01))
        for share, source, reason in instructions[: args.top]:
            print(f"  {share:6.1%}  {source:58.58s} {reason}")


if __name__ == "__main__":
    main()
