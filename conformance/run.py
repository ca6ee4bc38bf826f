"""One conformance run: compile + PTX contract, reference vs float64, every case, the reports.

`execute(options)` does the whole job and returns the RunReport; the CLI only parses
arguments. It first chooses what plays the kernel (`choose_backend`), then runs the phases in
order. With a GPU the cases run on the real kernels (EmulatedKernelBackend, or one rank of real
TP under torchrun); without one every kernel cell is "not run: no GPU" while the compile/PTX and
reference checks still run. Tests pass their own backend (e.g. ReferenceKernelBackend with a
planted flip).
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, Sequence

import torch

from .bundle import bundle_name, write_bundle
from .cases import FINALIZE_TOP_K, Case, Filters, Preset, cases_from_ids, preset_cases
from .distributed import DistributedKernelBackend, init_torchrun, torchrun_world
from .environment import collect_environment
from .junit import write_junit
from .ptx_contract import check_compiled_variants
from .reference_checks import check_reference, reference_check_cases
from .report import EXIT_FAIL, RunReport, replay_command, rerun_command, write_html, write_results_json
from .runner import (
    CaseResult,
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
from .status import CheckStatus

DEFAULT_MAX_BUNDLES = 20  # a systematic bug must not fill the disk with GBs of bundles
DEFAULT_CASE_TIMEOUT_S = 300.0  # includes the first compile of a new kernel instance
DEFAULT_MAX_REFERENCE_M = 16
BUNDLE_FOLDER = "bundles"  # in the run's folder


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
    together, not crossed: a preset's whole product would take an hour on a CPU); and, where
    the cases have TP = 1 with hc > 4, that consumer too (its coefficients staged in shared
    memory: ConsumerSpec.coefficients_in_shared), whose code no other variant shares."""
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
        direct = [kernel_variants(hidden_size=hidden, hc=hc, tp=1, capacity=capacity, top_k=top_k)
                  for hidden, hc in sorted({(c.hidden, c.hc) for c in cases if c.tp == 1})]
        shared = [variants for variants in direct if any(s.coefficients_in_shared for s in variants)]
        for spec in shared[-1] if shared else []:
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
    options.out / run_id. Returns the report (report.exit_code is the process exit code).

    What plays the kernel is decided first (choose_backend); then the phases run in order:
    reference vs float64, the cases, compile + PTX contract."""
    start, started_at = time.perf_counter(), _now()
    preset, cases = select_cases(options)
    choice = choose_backend(options, backend)
    run_dir = _make_run_folder(options, preset)
    report = _new_report(options, preset, run_dir.name, started_at, choice)
    state = _RunState(options, cases, choice, run_dir, report, start)
    if options.reference_checks and choice.writes_report:
        _reference_phase(state)
    _cases_phase(state)
    # Compiling for other archs comes last: nothing compiled for sm_100a/sm_103a can then
    # influence the kernels this run launches.
    if options.compile_checks and choice.writes_report:
        _compile_phase(state)
    return state.finish()


# ----- what plays the kernel ----------------------------------------------------------------------


@dataclass
class BackendChoice:
    """What plays the kernel in a run, and the device the run uses, decided before anything runs.

    backend None: no kernel case runs; every case is then an error if `broken_gpu` says why (a
    GPU the system shows but CUDA cannot use), else not run (no GPU, or --device cpu).
    world: the torchrun world size when this process is one rank of real TP, else None.
    """

    backend: KernelBackend | None
    device: torch.device
    world: int | None = None
    broken_gpu: str | None = None

    @property
    def mode(self) -> str:
        return "gpu" if self.device.type == "cuda" else "cpu"

    @property
    def writes_report(self) -> bool:
        """Whether this process writes the reports and bundles (under real TP, rank 0 alone)."""
        return self.world is None or self.backend.rank == 0


def choose_backend(options: RunOptions, backend: KernelBackend | None = None) -> BackendChoice:
    """The first that applies: `backend` as given (tests); the reference with the planted flips
    (--plant); an --impl adapter; under torchrun with CUDA, this process's rank of real TP (it
    joins the process group); the kernels with tp ranks emulated on one GPU; or none. A
    ValueError for a bad --device."""
    if backend is None and options.plants:
        backend = ReferenceKernelBackend("cpu", plants=options.plants)
    if backend is None and options.impl not in (None, "mhc_ar"):
        from .impl import ImplementationBackend

        backend = ImplementationBackend(options.impl, parse_device(options.device) or _default_device())
    if backend is not None:
        return BackendChoice(backend, torch.device(backend.device))
    requested = parse_device(options.device)
    if torchrun_world() is not None and torch.cuda.is_available() and options.device != "cpu":
        _, world, device = init_torchrun()
        return BackendChoice(DistributedKernelBackend(device), device, world=world)
    device = requested or _default_device()
    if device.type == "cuda":
        return BackendChoice(EmulatedKernelBackend(device), device)
    if requested is None and visible_gpus():  # an error of every case, never "not run"
        why = f"a GPU is visible ({', '.join(visible_gpus())}) but CUDA does not initialize: {_cuda_unavailable_reason()}"
        return BackendChoice(None, device, broken_gpu=why)
    return BackendChoice(None, device)


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _backend_label(backend) -> str:
    if isinstance(backend, ReferenceKernelBackend):
        return "reference"
    name = getattr(backend, "name", None)  # conformance.impl.ImplementationBackend
    return f"impl:{name}" if name else "kernels"


# ----- the run's folder and report ----------------------------------------------------------------


def _make_run_folder(options: RunOptions, preset: str) -> Path:
    """The run's folder, emptied, with its bundles/ folder; a torchrun rank other than 0 (which
    reports nothing) only gets its name."""
    if not writes_reports():
        return Path(options.out) / (options.run_id or default_run_id(preset))
    run_dir = run_folder(options, preset)
    if run_dir.exists():  # options.overwrite: nothing of the earlier run stays
        shutil.rmtree(run_dir)
    (run_dir / BUNDLE_FOLDER).mkdir(parents=True, exist_ok=True)
    return run_dir


def _new_report(options: RunOptions, preset: str, run_id: str, started_at: str, choice: BackendChoice) -> RunReport:
    return RunReport(
        run_id=run_id,
        preset=preset,
        filters={"case": list(options.case_ids)} if options.case_ids else options.filters.to_dict(),
        seed_offset=options.seed_offset,
        mode=choice.mode,
        started_at=started_at,
        finished_at=started_at,
        environment=collect_environment(choice.device),
        timings={"total_s": 0.0, "compile_s": 0.0, "reference_checks_s": 0.0, "cases_s": 0.0},
        require_gpu=options.require_gpu,
        backend=_backend_label(choice.backend),
        plants=[f"{p.output}@{p.rank}:{p.element}" for p in options.plants],
    )


@dataclass
class _RunState:
    """A run in progress: what every phase reads, and the report they fill."""

    options: RunOptions
    cases: list[Case]
    choice: BackendChoice
    run_dir: Path
    report: RunReport
    start: float  # time.perf_counter() when the run began

    def finish(self) -> RunReport:
        """Stamp the end; the process that reports writes results.json, junit.xml, index.html."""
        self.report.finished_at = _now()
        self.report.timings["total_s"] = time.perf_counter() - self.start
        if self.choice.writes_report:
            write_results_json(self.report, self.run_dir / "results.json")
            write_junit(self.report, self.run_dir / "junit.xml")
            write_html(self.report, self.run_dir / "index.html")
        return self.report


# ----- the phases ---------------------------------------------------------------------------------


def _reference_phase(state: _RunState) -> None:
    """The reference against its float64 model, on the cases of at most max_reference_m tokens."""
    options, start = state.options, time.perf_counter()
    subset = reference_check_cases(state.cases, options.max_reference_m)
    progress = Progress(len(subset), f"reference vs float64 (M <= {options.max_reference_m})", options.progress)
    for case in subset:
        check = check_reference(case, state.choice.device)
        state.report.reference_checks.append(check)
        progress.update(case.id)
        if check.status != CheckStatus.PASS:
            progress.write(check.summary())
    progress.close()
    state.report.timings["reference_checks_s"] = time.perf_counter() - start


def _cases_phase(state: _RunState) -> None:
    """Every case through the chosen backend, or each case's reason for not running."""
    start, choice, cases = time.perf_counter(), state.choice, state.cases
    if choice.broken_gpu is not None:
        state.report.cases = [errored(case, choice.broken_gpu) for case in cases]
    elif choice.backend is None:
        reason = "not run: no GPU" if not torch.cuda.is_available() else f"not run: --device {choice.device}"
        state.report.cases = [not_run(case, reason) for case in cases]
    elif choice.world is not None:  # real TP: only the cases of the world's size can run
        runnable = [case for case in cases if case.tp == choice.world]
        ran = {r.case.id: r for r in _CaseLoop(state, runnable).run_all()}
        reason = f"not run: needs TP={{}}; torchrun world size is {choice.world}"
        state.report.cases = [ran.get(case.id) or not_run(case, reason.format(case.tp)) for case in cases]
    else:
        state.report.cases = _CaseLoop(state, cases).run_all()
    state.report.timings["cases_s"] = time.perf_counter() - start


def _compile_phase(state: _RunState) -> None:
    """Every kernel variant of contract_specs(cases), compiled for each arch, its PTX checked."""
    options, start = state.options, time.perf_counter()
    archs = list(options.archs) if options.archs else None
    from mhc_ar.compile import TARGET_ARCHS

    specs = contract_specs(state.cases)
    progress = Progress(len(archs or TARGET_ARCHS) * len(specs), "compile + PTX contract", options.progress)

    def on_compiled(contract) -> None:
        progress.update(f"{contract.arch} {contract.kernel}")
        if contract.status != CheckStatus.PASS:
            failed = [c.name for c in contract.checks if not c.passed] or ["compile error"]
            progress.write(f"FAIL     PTX {contract.arch} {contract.kernel}: {', '.join(failed)}")

    state.report.compile_checks = check_compiled_variants(archs, specs, ptx_dir=state.run_dir / "ptx", on_result=on_compiled)
    progress.close()
    state.report.timings["compile_s"] = time.perf_counter() - start


# ----- running the cases --------------------------------------------------------------------------


class BundleWriter:
    """Writes the reproducer bundle of a mismatching case into the run's bundles/ folder, at most
    `limit` of them (a systematic bug must not fill the disk with GBs of bundles). A bundle not
    written is a note on the case's result, never an exception."""

    def __init__(self, run_dir: Path, limit: int, environment: dict):
        self.run_dir, self.limit, self.environment = run_dir, limit, environment
        self.written = 0

    def write(self, case_run: CaseRun) -> None:
        """Sets the result's bundle (a path relative to the run folder), or its note."""
        result = case_run.result
        if self.written >= self.limit or case_run.inputs is None or case_run.kernel is None:
            result.note = f"bundle not written (limit of {self.limit} reached)"
            return
        path = self.run_dir / BUNDLE_FOLDER / bundle_name(result.case)
        try:
            write_bundle(
                path,
                case=result.case,
                inputs=case_run.inputs,
                kernel=case_run.kernel,
                tree=case_run.tree,
                mismatches=result.mismatches,
                environment=self.environment,
            )
        except Exception as error:  # a bundle problem must not hide the mismatch itself
            result.note = f"bundle not written: {error}"
            return
        result.bundle = f"{BUNDLE_FOLDER}/{path.name}"
        self.written += 1


class _CaseLoop:
    """Cases through the chosen backend, under a watchdog. After each case: its progress line,
    its bundle if it mismatched (in the process that reports), and for a mismatch or an error
    the re-run and replay commands. If a case hangs, the watchdog ends the run
    (_write_report_and_exit)."""

    def __init__(self, state: _RunState, cases: Sequence[Case]):
        self.state, self.cases = state, list(cases)
        self.progress = Progress(len(self.cases), "cases", state.options.progress)
        writes = state.choice.writes_report
        self.bundles = BundleWriter(state.run_dir, state.options.max_bundles, state.report.environment) if writes else None
        self.done: dict[str, CaseResult] = {}

    def run_all(self) -> list[CaseResult]:
        backend = self.state.choice.backend
        second_oracle = flashinfer_mxfp8 if torch.device(backend.device).type == "cuda" else None
        watchdog = Watchdog(self.state.options.case_timeout_s, self.on_timeout)
        try:
            return run_cases(self.cases, backend, second_oracle=second_oracle, on_run=self.on_run, watchdog=watchdog)
        finally:
            watchdog.stop()
            self.progress.close()
            close = getattr(backend, "close", None)
            if close is not None:
                close()

    def on_run(self, case_run: CaseRun) -> None:
        result = case_run.result
        self.done[result.case.id] = result
        if result.status is Status.MISMATCH and self.bundles is not None:
            self.bundles.write(case_run)
        if result.status in (Status.MISMATCH, Status.ERROR):
            self.progress.write(result.summary())
            self.progress.write(f"         re-run: {rerun_command(self.state.report, result.case)}")
            if result.bundle:
                self.progress.write(f"         replay: {replay_command(result.bundle, self.state.run_dir.resolve())}")
        self.progress.update(result.status.value)

    def on_timeout(self, hung: Case) -> NoReturn:
        """From the watchdog's thread: the hung case is an error, the cases after it not run."""
        timeout_s = self.state.options.case_timeout_s
        results = []
        for case in self.cases:
            if case.id in self.done:
                results.append(self.done[case.id])
            elif case.id == hung.id:
                results.append(errored(case, f"timeout: no result after {timeout_s} s (kernel hang?); run aborted"))
            else:
                results.append(not_run(case, f"not run: run aborted after {hung.id} timed out"))
        self.state.report.cases = results
        self.progress.write(f"ERROR    {hung.id}: timed out after {timeout_s} s; writing the report and exiting")
        _write_report_and_exit(self.state)


def _write_report_and_exit(state: _RunState) -> NoReturn:
    """The one way out of a case that hangs (a consumer spinning on a sentinel that never
    clears). The main thread is stuck inside a CUDA call that nothing can interrupt: this runs
    on the watchdog's thread, where sys.exit would end that thread alone, and the main thread
    would only see an interrupt once the call returns, which it never does. So the report is
    written as it stands, the summary line printed (the CLI never gets to it), and the process
    ends at once through os._exit, without unwinding or exit handlers."""
    state.finish()
    print(state.report.summary_line(), flush=True)
    os._exit(EXIT_FAIL)


__all__ = [
    "BackendChoice",
    "BundleWriter",
    "Progress",
    "RunOptions",
    "choose_backend",
    "contract_specs",
    "default_run_id",
    "execute",
    "parse_device",
    "run_folder",
    "select_cases",
    "visible_gpus",
]
