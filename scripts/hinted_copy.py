"""A copy of an mhc_ar package whose consumer moves its streamed data with cache hints, for a
same-run cost comparison (scripts/protocol_cost.py): an experiment build, never the package.

    python scripts/hinted_copy.py SRC DST --loads cs|nc

The consumer's residual loads (read once) become `ld.global.cs.v4` (--loads cs: evict-first in
L1 and L2) or `ld.global.nc.L1::no_allocate.v4` (--loads nc: the read-only path, not kept in L1;
safe because outputs may not alias inputs, README "Outputs"), and its new_residual and
layer_input stores `st.global.cs.v4` (evict-first). Values and their order are unchanged, so the
outputs stay bit-exact; only the opcodes differ (the PTX contract, which looks for
ld.global.v4.b32, would need to learn them before such a copy became the package).

DST is written afresh; the copy imports relatively, so it loads beside the original under its
own name (PYTHONPATH=DST's parent).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

LOADS = {"cs": "ld.global.cs.v4.b32", "nc": "ld.global.nc.L1::no_allocate.v4.b32"}
STORE = "st.global.cs.v4.b32"

_HELPERS = '''

@dsl_user_op
def ld_stream_v4(address: Int64, predicate=None, *, loc=None, ip=None):
    """16-byte load of data read once ({load})."""
    return _load_v4("{load}", address, predicate, False, loc, ip)


@dsl_user_op
def st_stream_v4(address: Int64, w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32, predicate=None, *, loc=None, ip=None) -> None:
    """16-byte store of an output ({store})."""
    values = [Int64(address), Uint32(w0), Uint32(w1), Uint32(w2), Uint32(w3)]
    _store("{store} [$0], {{$1, $2, $3, $4}};", "l,r,r,r,r", values, predicate, loc, ip)
'''

# The consumer's streamed accesses, each found exactly once in mhc_ar/kernels/consumer.py.
_EDITS = [
    ("return [ptx.ld_global_v4(residual +", "return [ptx.ld_stream_v4(residual +"),
    ("ptx.st_global_v4(new_residual +", "ptx.st_stream_v4(new_residual +"),
    ("ptx.st_global_v4(layer_input +", "ptx.st_stream_v4(layer_input +"),
]


def make_copy(source: Path, destination: Path, loads: str) -> None:
    shutil.rmtree(destination, ignore_errors=True)
    shutil.copytree(source, destination, ignore=shutil.ignore_patterns("__pycache__"))
    ptx = destination / "ptx.py"
    ptx.write_text(ptx.read_text() + _HELPERS.format(load=LOADS[loads], store=STORE))
    consumer = destination / "kernels" / "consumer.py"
    text = consumer.read_text()
    for old, new in _EDITS:
        if text.count(old) != 1:
            raise ValueError(f"expected one {old!r} in {consumer}, found {text.count(old)}")
        text = text.replace(old, new)
    consumer.write_text(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("destination", type=Path)
    parser.add_argument("--loads", choices=sorted(LOADS), required=True)
    args = parser.parse_args(argv)
    make_copy(args.source, args.destination, args.loads)
    print(f"{args.destination}: residual loads {LOADS[args.loads]}, output stores {STORE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
