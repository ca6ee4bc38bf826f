"""`mhc-ar-conformance` / `python -m conformance`: run, repro, measure-rsqrt, bench.

    mhc-ar-conformance run [--quick | --full] [--tp 1,2] [--hidden 4096] [--hc 4] [--m 1,129]
                           [--variant full,mxfp8,residual_only] [--op call,finalize]
                           [--family normal,...|all] [--case ID[,ID...]] [--out reports]
                           [--run-id ID [--overwrite]] [--seed-offset N] [--require-gpu] [--list]
    mhc-ar-conformance repro BUNDLE [--reference-only]
    mhc-ar-conformance measure-rsqrt --out PATH ...   (conformance.rsqrt_measure)
    mhc-ar-conformance bench ...                      (conformance.bench)

Exit status of run (RUN_EXIT_STATUS below, also in --help and README).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Sequence

from mhc_ar.config import Contribution, Variant

from .cases import Filters, Preset, parse_families, parse_list
from .report import EXIT_FAIL, EXIT_NOT_VERIFIED, EXIT_PASS, EXIT_USAGE

RUN_EXIT_STATUS = f"""\
verdict and exit status:
  PASS          kernel cases ran, and everything that ran matched and passed: exit {EXIT_PASS}
  FAIL          a mismatch, an error (a GPU that is visible but does not initialize is one) or a
                failed check: exit {EXIT_FAIL}
  NOT VERIFIED  no kernel case ran (no GPU, --device cpu) and nothing failed: exit {EXIT_PASS}, or
                exit {EXIT_NOT_VERIFIED} with --require-gpu (what a CI gate passes)
  bad usage (an option out of range, a device that is not there, an unwritable --out, a reused
  --run-id): one line on stderr, nothing written, exit {EXIT_USAGE}
axes: --tp, --hidden, --hc, --m, --variant and --op replace the preset's values on their axis;
  the run crosses them with the preset's choices on the axes not given (values the preset
  lacks, e.g. --tp 3 --hidden 1000, run too)."""

# Subcommands whose module lives elsewhere in the package and parses its own arguments:
# name -> (module with main(argv) -> exit code, one-line help).
EXTENSIONS = {
    "measure-rsqrt": ("conformance.rsqrt_measure", "measure the GPU's rsqrt.approx deviation table over [0.5, 2)"),
    "bench": ("conformance.bench", "latency of the fused kernels by M"),
    "bench-tp": ("conformance.bench_tp", "fused vs NCCL + unfused across real ranks (under torchrun)"),
    "merge": ("conformance.merge", "one coverage report from several runs' results.json"),
}


def _int(text: str) -> int:
    return int(text, 10)


def _filters(args) -> Filters:
    def parsed(name, convert):
        value = getattr(args, name)
        return None if value is None else parse_list(value, convert, name)

    return Filters(
        tp=parsed("tp", _int),
        hidden=parsed("hidden", _int),
        hc=parsed("hc", _int),
        m=parsed("m", _int),
        op=parsed("op", Contribution),
        variant=parsed("variant", Variant),
        family=None if args.family is None else parse_families(args.family),
    )


def _cmd_run(args) -> int:
    from .run import RunOptions, execute, select_cases

    from .run import parse_device, run_folder, writes_reports
    from .runner import PlantedFlip

    preset = Preset.QUICK if args.quick else Preset.FULL if args.full else Preset.DEFAULT
    try:
        options = RunOptions(
            preset=preset,
            filters=_filters(args),
            case_ids=tuple(i for chunk in args.case or () for i in chunk.split(",") if i.strip()),
            out=Path(args.out),
            run_id=args.run_id,
            seed_offset=args.seed_offset,
            device=args.device,
            compile_checks=not args.skip_compile_checks,
            reference_checks=not args.skip_reference_checks,
            max_reference_m=args.max_reference_m,
            max_bundles=args.max_bundles,
            case_timeout_s=args.case_timeout or None,
            progress=not args.no_progress,
            require_gpu=args.require_gpu,
            overwrite=args.overwrite,
            plants=tuple(PlantedFlip.parse(text) for text in args.plant or ()),
            impl=args.impl,
        )
        if args.impl is not None:
            from .impl import load_factory

            load_factory(args.impl)
            from .distributed import torchrun_world

            if args.impl != "mhc_ar" and torchrun_world() is not None:
                raise ValueError(f"--impl {args.impl} under torchrun: one rank's object per process is not supported yet")
            if options.plants:
                raise ValueError("--impl with --plant: the planted flips replace the implementation")
        options.filters.validate()
        label, cases = select_cases(options)
        if args.list:
            for case in cases:
                print(case.id)
            print(f"{len(cases)} cases ({label})")
            return EXIT_PASS
        device = parse_device(options.device)
        if args.require_gpu and ((device is not None and device.type == "cpu") or options.plants):
            raise ValueError(f"--require-gpu with {'--plant' if options.plants else '--device cpu'}: no kernel case could run")
        if writes_reports():
            run_folder(options, label)
    except ValueError as error:
        print(f"mhc-ar-conformance run: {error}", file=sys.stderr)
        return EXIT_USAGE
    report = execute(options)
    run_dir = Path(options.out) / report.run_id
    print(report.summary_line())
    print(f"report: {run_dir / 'index.html'}  results: {run_dir / 'results.json'}  junit: {run_dir / 'junit.xml'}")
    return report.exit_code


def _cmd_repro(args) -> int:
    from .bundle import BundleError, is_captured, load_bundle, read_archive
    from .capture import load_call, replay_call
    from .repro import replay

    try:
        manifest, _ = read_archive(args.bundle, arrays=False)
        if is_captured(manifest):  # a call recorded by mhc_ar.capture: every rank's file of it
            captured = load_call(args.bundle)
        else:
            bundle = load_bundle(args.bundle)
    except BundleError as error:
        print(f"mhc-ar-conformance repro: {error}", file=sys.stderr)
        return 2
    if is_captured(manifest):
        return replay_call(captured, reference_only=args.reference_only, device=args.device)
    return replay(bundle, reference_only=args.reference_only, device=args.device)


def _extension(module_name: str):
    """The module of an extension subcommand, or the reason it cannot be loaded."""
    try:
        return importlib.import_module(module_name), None
    except ModuleNotFoundError as error:
        if error.name == module_name:
            return None, f"{module_name} is not part of this installation yet"
        return None, f"{module_name} cannot be imported: {error}"
    except Exception as error:  # a broken extension must not break `run` and `repro`
        return None, f"{module_name} cannot be imported: {type(error).__name__}: {error}"


def _call_extension(name: str, argv: list[str]) -> int:
    """Hand the arguments after the subcommand to the module's own main(argv)."""
    module_name = EXTENSIONS[name][0]
    module, why = _extension(module_name)
    if module is None:
        print(f"mhc-ar-conformance {name}: {why}", file=sys.stderr)
        return 2
    code = module.main(argv)
    return 0 if code is None else int(code)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mhc-ar-conformance",
        description="Bit-exactness gate, reproducer and coverage report of the mhc-ar kernels.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)

    run = subparsers.add_parser(
        "run",
        help="run the case matrix, write reports/<run-id>/",
        epilog=RUN_EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = run.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a small covering subset (~50 cases) for CI")
    size.add_argument("--full", action="store_true", help="the complete matrix (3492 cases)")
    for name, what in (
        ("tp", "TP sizes"),
        ("hidden", "hidden sizes"),
        ("hc", "hc values"),
        ("m", "token counts M"),
        ("variant", "full, mxfp8, residual_only"),
        ("op", "call, finalize"),
    ):
        run.add_argument(f"--{name}", help=f"comma list of {what}")
    run.add_argument(
        "--family",
        help="comma list of input families (or 'all'): every selected shape is run with each; "
        "default: the family the matrix assigns to each shape",
    )
    run.add_argument("--case", action="append", help="run exactly these case ids (comma list; repeatable)")
    run.add_argument("--out", default="reports", help="report directory (default: reports)")
    run.add_argument("--run-id", help="name of the run's subdirectory (default: time and preset); an existing one is refused")
    run.add_argument("--overwrite", action="store_true", help="replace the folder of an existing --run-id")
    run.add_argument("--impl", metavar="NAME|MODULE:FACTORY",
                     help="the implementation judged: mhc_ar (default), reference, torch-unfused, or MODULE:FACTORY "
                          "(the adapter protocol: conformance.impl, README)")
    run.add_argument("--plant", action="append", metavar="OUTPUT@RANK:INDEX",
                     help="no kernel: the reference plays it, with the lowest byte of element INDEX of OUTPUT on RANK "
                          "flipped (repeatable); mismatches and bundles as a kernel bug would give, without a GPU")
    run.add_argument("--require-gpu", action="store_true",
                     help=f"no kernel case run (NOT VERIFIED) exits {EXIT_NOT_VERIFIED}: for CI gates")
    run.add_argument("--seed-offset", type=int, default=0, help="added to every case's id-derived seed")
    run.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda if available)")
    run.add_argument("--max-reference-m", type=int, default=16, help="reference-vs-float64 checks for cases with M <= this")
    run.add_argument("--max-bundles", type=int, default=20, help="write at most this many reproducer bundles")
    run.add_argument("--case-timeout", type=float, default=300.0, help="seconds before a hung case aborts the run (0: never)")
    run.add_argument("--skip-compile-checks", action="store_true", help="do not compile for every arch / check PTX")
    run.add_argument("--skip-reference-checks", action="store_true", help="do not check the reference against float64")
    run.add_argument("--no-progress", action="store_true", help="no progress output")
    run.add_argument("--list", action="store_true", help="print the selected case ids and exit")
    run.set_defaults(func=_cmd_run)

    repro = subparsers.add_parser("repro", help="replay a reproducer bundle")
    repro.add_argument("bundle", type=Path, help="a .mhcbundle file: a case's, or one rank's file of a call captured by mhc_ar.capture (the other ranks' files of that call beside it)")
    repro.add_argument("--reference-only", action="store_true", help="compare the recorded kernel outputs only (no GPU needed)")
    repro.add_argument("--device", help="GPU to rerun the kernel on (default: cuda)")
    repro.set_defaults(func=_cmd_repro)

    for name, (module_name, help_text) in EXTENSIONS.items():
        # Listed for --help only: main() hands their arguments to the module's own parser.
        subparsers.add_parser(name, help=f"{help_text} ({module_name}; see '{name} --help')", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in EXTENSIONS:
            return _call_extension(argv[0], argv[1:])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except BrokenPipeError:
        # The reader left (`run --list | head`): no traceback, and none at interpreter exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PASS


if __name__ == "__main__":
    sys.exit(main())
