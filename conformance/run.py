"""One conformance run: compile + PTX contract, reference vs float64, every case, the reports.

`execute(options)` does the whole job and returns the RunReport; the CLI only parses
arguments. With a GPU the cases run on the real kernels (EmulatedKernelBackend); without one
every kernel cell is "not run: no GPU" while the compile/PTX and reference checks still run.
Tests pass their own backend (e.g. ReferenceKernelBackend with a planted flip).
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .bundle import bundle_name, write_bundle
from .distributed import DistributedKernelBackend, init_torchrun, torchrun_world
from .cases import FINALIZE_TOP_K, Case, Filters, Preset, cases_from_ids, preset_cases
from .environment import collect_environment
from .junit import write_junit
from .ptx_contract import check_compiled_variants
from .reference_checks import check_reference, reference_check_cases
from .report import RunReport, replay_command, rerun_command, write_html, write_results_json
from .runner import (
    CaseRun,
    EmulatedKernelBackend,
    KernelBackend,
    ReferenceKernelBackend,
    Status,
    Watchdog,
    errored,
    flashinfer_mxfp8,
    not_run,
    run_cases,
)

DEFAULT_MAX_BUNDLES = 20  # a systematic bug must not fill the disk with GBs of bundles
DEFAULT_CASE_TIMEOUT_S = 300.0  # includes the first compile of a new kernel instance
DEFAULT_MAX_REFERENCE_M = 16


@dataclass
class RunOptions:
    preset: Preset = Preset.DEFAULT
    filters: Filters = field(default_factory=Filters)
    case_ids: Sequence[str] = ()  # instead of a preset
    out: Path = Path("reports")
    run_id: str | None = None
    seed_offset: int = 0
    device: str | None = None  # None: cuda if available, else cpu
    compile_checks: bool = True
    archs: Sequence[str] | None = None  # None: mhc_ar.compile.TARGET_ARCHS
    reference_checks: bool = True
    max_reference_m: int = DEFAULT_MAX_REFERENCE_M
    max_bundles: int = DEFAULT_MAX_BUNDLES
    case_timeout_s: float | None = DEFAULT_CASE_TIMEOUT_S
    progress: bool = True
    require_gpu: bool = False  # no kernel case run: exit EXIT_NOT_VERIFIED instead of 0
    # The reference plays the kernel, with these byte flips (runner.PlantedFlip): a reproducer
    # bundle, and everything downstream of a mismatch, without a GPU.
    plants: Sequence = ()
    # The implementation judged: None or "mhc_ar" (the kernels), a built-in of conformance.impl,
    # or MODULE:FACTORY (the adapter protocol there).
    impl: str | None = None
    overwrite: bool = False  # replace an existing run folder of the same run id


def parse_device(text: str | None) -> torch.device | None:
    """--device: None (cuda if it initializes), cpu, cuda or cuda:N (N a visible CUDA device);
    a ValueError with the rule otherwise, before anything runs."""
    if text is None:
        return None
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {text}: expected cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        if device.index is not None:
            raise ValueError(f"--device {text}: the CPU takes no index (use cpu)")
        return device
    if device.type != "cuda":
        raise ValueError(f"--device {text}: expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {text}: CUDA is not available here ({_cuda_unavailable_reason()})")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device


def visible_gpus() -> list[str]:
    """The NVIDIA GPUs the operating system shows (device nodes), whether or not CUDA
    initializes on them; none when CUDA_VISIBLE_DEVICES hides every device."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return []
    return sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))


def _cuda_unavailable_reason() -> str:
    if not torch.backends.cuda.is_built():
        return f"this torch ({torch.__version__}) is built without CUDA"
    try:
        torch.cuda.init()
    except Exception as error:
        return str(error).strip().splitlines()[0]
    return "no CUDA device"


def writes_reports() -> bool:
    """Whether this process writes the run's folder: always, except under torchrun, where rank 0
    alone does (the other ranks would find it already made)."""
    world = torchrun_world()
    return world is None or world[0] == 0


def run_folder(options: RunOptions, preset: str) -> Path:
    """The run's folder, checked before anything runs: its parent must be creatable and
    writable, and an existing folder of the same run id is refused unless options.overwrite.
    Creates nothing."""
    out = Path(options.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: not writable ({existing} does not let this user create files)")
    if options.run_id is not None:
        if not options.run_id or "/" in options.run_id or options.run_id in (".", ".."):
            raise ValueError(f"--run-id {options.run_id!r}: a run id is one folder name")
        folder = out / options.run_id
        if folder.exists() and any(folder.iterdir()) and not options.overwrite:
            raise ValueError(f"--run-id {options.run_id}: {folder} already holds a run; pass --overwrite to replace it")
        return folder
    base = default_run_id(preset)
    folder, n = out / base, 1
    while folder.exists():  # two runs in the same second
        n += 1
        folder = out / f"{base}-{n}"
    return folder


def contract_specs(cases: Sequence[Case]) -> list:
    """The kernels the PTX contract compiles: every variant of the reference shape
    (mhc_ar.compile.kernel_variants()), and of the run's own shapes, so that each hidden size,
    hc and TP size among the selected cases is compiled at least once (the three cycled
    together, not crossed: a preset's whole product would take an hour on a CPU)."""
    from mhc_ar.compile import consumer_name, kernel_variants, publish_name
    from mhc_ar.config import PublishSpec

    def name(spec) -> str:
        return publish_name(spec) if isinstance(spec, PublishSpec) else consumer_name(spec)

    specs = {name(s): s for s in kernel_variants()}
    if cases:
        axes = [sorted({c.hidden for c in cases}), sorted({c.hc for c in cases}), sorted({c.tp for c in cases})]
        capacity = max(c.capacity for c in cases)
        top_k = max(c.top_k for c in cases) or FINALIZE_TOP_K
        for i in range(max(len(axis) for axis in axes)):
            hidden, hc, tp = (axis[i % len(axis)] for axis in axes)
            for spec in kernel_variants(hidden_size=hidden, hc=hc, tp=tp, capacity=capacity, top_k=top_k):
                specs.setdefault(name(spec), spec)
    return list(specs.values())


def select_cases(options: RunOptions) -> tuple[str, list[Case]]:
    """(preset label, cases); raises ValueError if nothing matches."""
    if options.case_ids:
        return "cases", cases_from_ids(options.case_ids, seed_offset=options.seed_offset)
    cases = preset_cases(options.preset, options.filters, seed_offset=options.seed_offset)
    if not cases:
        raise ValueError(f"no case of preset {Preset(options.preset).value} matches the filters {options.filters.to_dict()}")
    return Preset(options.preset).value, cases


class Progress:
    """tqdm on a terminal; elsewhere (CI logs) a line every tenth of the way."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.done = total, label, 0
        self.enabled = enabled and total > 0
        self.bar = None
        if self.enabled and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, file=sys.stdout, dynamic_ncols=True)
        self.every = max(1, total // 10)

    def update(self, note: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            if note:
                self.bar.set_postfix_str(note, refresh=False)
        elif self.done % self.every == 0 or self.done == self.total:
            print(f"[{self.label}] {self.done}/{self.total} {note}".rstrip(), flush=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def default_run_id(preset: str) -> str:
    return f"{_dt.datetime.now():%Y%m%d-%H%M%S}-{preset}"


def execute(options: RunOptions, *, backend: KernelBackend | None = None) -> RunReport:
    """Run everything and write index.html, results.json, junit.xml (and bundles/) under
    options.out / run_id. Returns the report (report.exit_code is the process exit code)."""
    start = time.perf_counter()
    started_at = _now()
    preset, cases = select_cases(options)
    if backend is None and options.plants:
        backend = ReferenceKernelBackend("cpu", plants=options.plants)
    if backend is None and options.impl not in (None, "mhc_ar"):
        from .impl import ImplementationBackend

        device = parse_device(options.device) or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        backend = ImplementationBackend(options.impl, device)
    requested = parse_device(options.device) if backend is None else None
    if writes_reports():
        run_dir = run_folder(options, preset)
        if run_dir.exists():  # options.overwrite: nothing of the earlier run stays
            shutil.rmtree(run_dir)
        (run_dir / "bundles").mkdir(parents=True, exist_ok=True)
    else:  # a torchrun rank other than 0: it reports nothing
        run_dir = Path(options.out) / (options.run_id or default_run_id(preset))
    run_id = run_dir.name
    # Under torchrun (several processes), real TP: this process is one rank, rank 0 reports.
    world = None
    if backend is None and torchrun_world() is not None and torch.cuda.is_available() and options.device != "cpu":
        rank, world, device = init_torchrun()
        backend = DistributedKernelBackend(device)
    elif backend is not None:
        device = torch.device(backend.device)
    else:
        device = requested or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # A GPU the system shows but CUDA cannot use is an error of every case, never "not run".
    broken_gpu = None
    if backend is None and requested is None and device.type == "cpu" and visible_gpus():
        broken_gpu = f"a GPU is visible ({', '.join(visible_gpus())}) but CUDA does not initialize: {_cuda_unavailable_reason()}"
    writer = world is None or backend.rank == 0
    mode = "gpu" if device.type == "cuda" else "cpu"
    report = RunReport(
        run_id=run_id,
        preset=preset,
        filters={} if options.case_ids else options.filters.to_dict(),
        seed_offset=options.seed_offset,
        mode=mode,
        started_at=started_at,
        finished_at=started_at,
        environment=collect_environment(device),
        timings={"total_s": 0.0, "compile_s": 0.0, "reference_checks_s": 0.0, "cases_s": 0.0},
        require_gpu=options.require_gpu,
        backend=_backend_label(backend),
        plants=[f"{p.output}@{p.rank}:{p.element}" for p in options.plants],
    )
    if options.case_ids:
        report.filters = {"case": list(options.case_ids)}

    def finish() -> RunReport:
        report.finished_at = _now()
        report.timings["total_s"] = time.perf_counter() - start
        if not writer:
            return report
        write_results_json(report, run_dir / "results.json")
        write_junit(report, run_dir / "junit.xml")
        write_html(report, run_dir / "index.html")
        return report

    if options.reference_checks and writer:
        t = time.perf_counter()
        subset = reference_check_cases(cases, options.max_reference_m)
        progress = Progress(len(subset), f"reference vs float64 (M <= {options.max_reference_m})", options.progress)
        for case in subset:
            check = check_reference(case, device)
            report.reference_checks.append(check)
            progress.update(case.id)
            if check.status != "pass":
                progress.write(check.summary())
        progress.close()
        report.timings["reference_checks_s"] = time.perf_counter() - t

    t = time.perf_counter()
    if backend is None and mode == "gpu":
        backend = EmulatedKernelBackend(device)
    if broken_gpu is not None:
        report.cases = [errored(case, broken_gpu) for case in cases]
    elif backend is None:
        reason = "not run: no GPU" if not torch.cuda.is_available() else f"not run: --device {device}"
        report.cases = [not_run(case, reason) for case in cases]
    elif world is not None:
        runnable = [case for case in cases if case.tp == world]
        ran = {r.case.id: r for r in _run_with_bundles(runnable, backend, options, run_dir, report, finish, writer)}
        reason = f"not run: needs TP={{}}; torchrun world size is {world}"
        report.cases = [ran.get(case.id) or not_run(case, reason.format(case.tp)) for case in cases]
    else:
        report.cases = _run_with_bundles(cases, backend, options, run_dir, report, finish)
    report.timings["cases_s"] = time.perf_counter() - t

    # Compiling for other archs comes last: nothing compiled for sm_100a/sm_103a can then
    # influence the kernels this run launches.
    if options.compile_checks and writer:
        t = time.perf_counter()
        archs = list(options.archs) if options.archs else None
        from mhc_ar.compile import TARGET_ARCHS

        specs = contract_specs(cases)
        total = len(archs or TARGET_ARCHS) * len(specs)
        progress = Progress(total, "compile + PTX contract", options.progress)

        def on_compiled(contract):
            progress.update(f"{contract.arch} {contract.kernel}")
            if contract.status != "pass":
                failed = [c.name for c in contract.checks if not c.passed] or ["compile error"]
                progress.write(f"FAIL     PTX {contract.arch} {contract.kernel}: {', '.join(failed)}")

        report.compile_checks = check_compiled_variants(archs, specs, ptx_dir=run_dir / "ptx", on_result=on_compiled)
        progress.close()
        report.timings["compile_s"] = time.perf_counter() - t

    return finish()


def _backend_label(backend) -> str:
    if isinstance(backend, ReferenceKernelBackend):
        return "reference"
    name = getattr(backend, "name", None)  # conformance.impl.ImplementationBackend
    return f"impl:{name}" if name else "kernels"


def _run_with_bundles(cases, backend, options: RunOptions, run_dir: Path, report: RunReport, finish, writer=True):
    progress = Progress(len(cases), "cases", options.progress)
    done: dict[str, object] = {}
    bundles_written = 0
    second_oracle = flashinfer_mxfp8 if torch.device(backend.device).type == "cuda" else None

    def on_run(run: CaseRun) -> None:
        nonlocal bundles_written
        result = run.result
        done[result.case.id] = result
        if result.status is Status.MISMATCH and writer:
            if bundles_written < options.max_bundles and run.inputs is not None and run.kernel is not None:
                path = run_dir / "bundles" / bundle_name(result.case)
                try:
                    write_bundle(
                        path,
                        case=result.case,
                        inputs=run.inputs,
                        kernel=run.kernel,
                        tree=run.tree,
                        mismatches=result.mismatches,
                        environment=report.environment,
                    )
                    result.bundle = f"bundles/{path.name}"
                    bundles_written += 1
                except Exception as error:  # a bundle problem must not hide the mismatch itself
                    result.note = f"bundle not written: {error}"
            else:
                result.note = f"bundle not written (limit of {options.max_bundles} reached)"
        if result.status in (Status.MISMATCH, Status.ERROR):
            progress.write(result.summary())
            progress.write(f"         re-run: {rerun_command(report, result.case)}")
            if result.bundle:
                progress.write(f"         replay: {replay_command(result.bundle, run_dir.resolve())}")
        progress.update(result.status.value)

    def on_timeout(case: Case) -> None:
        # The process is stuck in a CUDA call (a consumer spinning forever?): write what is
        # known and leave; nothing else can interrupt the hung kernel.
        results = []
        for c in cases:
            if c.id in done:
                results.append(done[c.id])
            elif c.id == case.id:
                hung = not_run(c, "")
                hung.status, hung.reason = Status.ERROR, None
                hung.error = f"timeout: no result after {options.case_timeout_s} s (kernel hang?); run aborted"
                results.append(hung)
            else:
                results.append(not_run(c, f"not run: run aborted after {case.id} timed out"))
        report.cases = results
        progress.write(f"ERROR    {case.id}: timed out after {options.case_timeout_s} s; writing the report and exiting")
        finish()
        print(report.summary_line(), flush=True)
        os._exit(1)

    watchdog = Watchdog(options.case_timeout_s, on_timeout)
    try:
        return run_cases(cases, backend, second_oracle=second_oracle, on_run=on_run, watchdog=watchdog)
    finally:
        watchdog.stop()
        progress.close()
        close = getattr(backend, "close", None)
        if close is not None:
            close()


__all__ = [
    "Progress",
    "RunOptions",
    "contract_specs",
    "default_run_id",
    "execute",
    "parse_device",
    "run_folder",
    "select_cases",
    "visible_gpus",
]
