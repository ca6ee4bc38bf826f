"""Calls captured from a running model (mhc_ar.capture) as bundles, and their replay.

Files. Call n of a capture (calls are numbered from 0 when capture starts, over every instance
of the process, so all ranks of a TP group number the same calls alike) is recorded as one
bundle per rank, ``call{n:06d}-rank{r}of{tp}.mhcbundle``, each in the bundle format
(conformance.bundle) with a ``capture`` manifest section (call, rank, tp, source). Rank r's
file holds rank r's view: its contribution (x, or the four finalize tensors), its mix inputs
(residual, post, comb, pre, norm_weight, eps), its outputs, the consumer tiling that ran it
(its RMSNorm reduction tree) and the environment. Under real TP each process writes its own
rank's file; EmulatedAllReduceMHC writes all tp of them. The case (``family`` "captured") says
tp, H, hc, M, op, variant, top_k and the instance's capacity.

Replay (`mhc-ar-conformance repro FILE`): the files of every rank of that call must lie in
FILE's folder (copy them together from the ranks' machines). Every rank's view is judged: the
reference (all ranks' contributions, that rank's mix, the recorded tiling) against the recorded
outputs; on a GPU the kernels also run again on the recorded inputs (EmulatedAllReduceMHC,
tp virtual ranks, each with its own mix) and their outputs are judged the same way, and an
MXFP8 rerun against FlashInfer's quantizer. The first difference is explained as `repro`
explains a case's (conformance.repro.explain_first).
"""

from __future__ import annotations

import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

import torch

from mhc_ar.config import Contribution, Variant
from reference import MixInputs, RankInputs, ReductionTree, all_reduce_mhc, validate_inputs

from .bundle import SUFFIX, BundleError, is_captured, manifest_fields, read_archive, write_archive
from .cases import Case, Family
from .compare import Mismatch
from .inputs import MIX_FIELDS, RANK_FIELDS
from .runner import OUTPUTS, compare_output, expected_outputs, flashinfer_mxfp8, second_oracle_mismatches

def bundle_file(call: int, rank: int, tp: int) -> str:
    return f"call{call:06d}-rank{rank}of{tp}{SUFFIX}"


# ----- recording ----------------------------------------------------------------------------------


class Recorder:
    """What mhc_ar.capture turns on. Numbers each rank's calls from 0, records every `every`-th
    (from the first) until `limit` calls or `max_bytes` of arrays of that rank are recorded, and
    says once why it stopped. Per rank, so that ranks sharing a process (EmulatedAllReduceMHC,
    mhc_ar.ConcurrentRanks) record the same calls as ranks in processes of their own.

    A recorded call's tensors are copied on the device behind the call on its stream, without
    waiting for it (a rank waiting for its call to end could wait for a peer that this thread
    has not launched yet); the file is written at a later call once the copies are done, or by
    `flush` (at the end of the `with mhc_ar.capture(...)` block, and at exit). `written` lists
    the files."""

    def __init__(self, directory, *, every: int, limit: int, max_bytes: int):
        self.directory = Path(directory)
        self.every, self.limit, self.max_bytes = every, limit, max_bytes
        self.calls: dict[int, int] = defaultdict(int)  # per rank: calls seen since capture started
        self.recorded: dict[int, int] = defaultdict(int)  # per rank: calls recorded
        self.bytes: dict[int, int] = defaultdict(int)  # per rank: bytes of arrays recorded
        self.written: list[Path] = []
        self._pending: list[tuple[Path, dict, dict, object]] = []  # (path, manifest, arrays, event)
        self._said: set[str] = set()
        self._environment: dict | None = None
        self._clean_ranks: set[int] = set()  # ranks whose earlier files in the folder were checked
        self._full: set[int] = set()  # ranks that reached max_bytes
        self._stream = None  # the stream the snapshots go to the host on (see _to_host)

    def record(self, *, source: str, engine, tp: int, finalize: bool, eps, ranks: dict) -> None:
        """One launched call: `ranks` maps each rank this process ran to (contribution dict,
        (residual, post, comb, pre, norm_weight), (new_residual, layer_input), mxfp8_out)."""
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not capturing:  # (inside a graph capture no copy to the host may run)
            self.flush(wait=False)
        chosen = {}
        for rank, view in ranks.items():
            call = self.calls[rank]
            self.calls[rank] += 1
            if call % self.every:
                continue
            if capturing:
                self._say("graph", "mhc_ar.capture: calls inside a CUDA graph capture are not recorded (nothing can be "
                          "copied while capturing; replays are not calls)")
                continue
            if rank in self._full:
                continue
            if self.recorded[rank] >= self.limit:
                self._say("limit", f"mhc_ar.capture: {self.limit} calls per rank recorded (limit); later calls are not")
                continue
            nbytes = _view_bytes(view)
            if self.bytes[rank] + nbytes > self.max_bytes:
                self._say("bytes", f"mhc_ar.capture: rank {rank}'s call {call} needs {nbytes} bytes, over the "
                          f"{self.max_bytes} allowed per rank ({self.bytes[rank]} used); it and later calls are not recorded")
                self._full.add(rank)  # nothing after it either: the recorded calls stay in one piece
                continue
            if not self._folder_ready(rank, tp):
                continue
            chosen[rank] = (call, view, nbytes)
        if not chosen:
            return
        validator = engine.validator
        _, first_view, _ = next(iter(chosen.values()))
        _, (residual, *_), _, _ = first_view  # (contribution, mix, results, mxfp8_out)
        m = residual.shape[0]
        case = Case(
            tp=tp, hidden=validator.hidden_size, hc=validator.hc, m=m,
            op=Contribution.FINALIZE if finalize else Contribution.CALL, variant=validator.variant,
            family=Family.CAPTURED, top_k=validator.top_k if finalize else 0, capacity=validator.capacity,
        )
        tree = ReductionTree(**engine.consumer_spec.tiling.reduction_tree_args())
        for rank, (call, view, nbytes) in chosen.items():
            arrays, event = _snapshot(rank, *view)
            manifest = manifest_fields(case, float(eps), tree, self._environment_of(validator.device))
            manifest["capture"] = {"call": call, "rank": rank, "tp": tp, "source": source, "every": self.every}
            self._pending.append((self.directory / bundle_file(call, rank, tp), manifest, arrays, event))
            self.recorded[rank] += 1
            self.bytes[rank] += nbytes

    def flush(self, *, wait: bool = True) -> list[Path]:
        """Write the recorded calls whose copies are done (with wait, all: waits for them);
        returns the files written."""
        done, kept = [], []
        for entry in self._pending:
            path, manifest, arrays, event = entry
            if event is not None and not wait and not event.query():
                kept.append(entry)  # its call may wait for a peer this thread launches later
                continue
            if event is not None:
                event.synchronize()
            done.append(write_archive(path, manifest, self._to_host(arrays)))
        self._pending = kept
        self.written += done
        return done

    def _to_host(self, arrays: dict) -> dict:
        """The snapshots in host memory, copied on a stream of the recorder's own: `.cpu()` on
        the caller's stream would wait for everything queued there, e.g. a consumer spinning for
        a peer this thread launches later (measured: mhc_ar.ConcurrentRanks then trapped)."""
        devices = {t.device for t in arrays.values() if t.is_cuda}
        if not devices:
            return dict(arrays)
        device = devices.pop()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self._stream):
            return {name: t.to("cpu") for name, t in arrays.items()}

    def _folder_ready(self, rank: int, tp: int) -> bool:
        """A folder with this rank's files of an earlier capture would mix two runs' calls."""
        if rank in self._clean_ranks:
            return True
        old = sorted(self.directory.glob(f"call*-rank{rank}of{tp}{SUFFIX}")) if self.directory.is_dir() else []
        if old:
            self._say(f"folder{rank}", f"mhc_ar.capture: {self.directory} already holds rank {rank}'s bundles of an "
                      f"earlier capture ({old[0].name}, ...); nothing is recorded for it: use an empty folder")
            return False
        self._clean_ranks.add(rank)
        return True

    def _environment_of(self, device) -> dict:
        if self._environment is None:
            from .environment import collect_environment

            self._environment = collect_environment(device)
        return self._environment

    def _say(self, why: str, message: str) -> None:
        if why not in self._said:
            self._said.add(why)
            warnings.warn(message, stacklevel=4)


def _view_tensors(rank: int, contribution: dict, mix: tuple, results, mxfp8_out) -> dict:
    """Rank `rank`'s view as bundle array names -> the caller's tensors."""
    tensors = {f"inputs/rank{rank}.{name}": t for name, t in contribution.items()}
    tensors |= {f"inputs/mix.{name}": t for name, t in zip(MIX_FIELDS, mix) if t is not None}
    new_residual, layer_input = results
    outputs = {"new_residual": new_residual, "layer_input": layer_input}
    if mxfp8_out is not None:
        outputs["mxfp8_values"], outputs["mxfp8_scales"] = mxfp8_out
    tensors |= {f"kernel/rank{rank}.{name}": t for name, t in outputs.items() if t is not None}
    return tensors


def _view_bytes(view) -> int:
    return sum(t.numel() * t.element_size() for t in _view_tensors(0, *view).values())


def _snapshot(rank: int, *view):
    """Copies of the view's tensors, made on the current stream behind the call (device to
    device: no host synchronization, no pinned allocation, which can serialize the streams), and
    the event after them (None for CPU tensors)."""
    copies = {name: t.detach().clone() for name, t in _view_tensors(rank, *view).items()}
    event = None
    if any(t.is_cuda for t in copies.values()):
        event = torch.cuda.Event()
        event.record()
    return copies, event


# ----- reading ------------------------------------------------------------------------------------


@dataclass
class CapturedCall:
    """Every rank's view of one captured call, from its files."""

    case: Case
    call: int
    source: str
    eps: float
    tree: ReductionTree | None
    files: dict[int, Path]
    contributions: list[RankInputs]  # by rank
    mixes: dict[int, MixInputs]
    outputs: dict[int, dict[str, torch.Tensor]]  # rank -> output name -> tensor
    environment: dict = field(default_factory=dict)

    @property
    def mxfp8(self) -> bool:
        return self.case.variant is Variant.MXFP8


def load_call(path) -> CapturedCall:
    """The call a captured bundle belongs to, with the files of every rank (its siblings in the
    same folder); BundleError names what is missing or does not fit."""
    path = Path(path)
    manifest, _ = read_archive(path, arrays=False)
    if not is_captured(manifest):
        raise BundleError(f"{path}: not a captured call (no capture section); replay it with conformance.repro")
    section = manifest["capture"]
    call, tp = section["call"], section["tp"]
    files = {rank: path.parent / bundle_file(call, rank, tp) for rank in range(tp)}
    missing = [f.name for f in files.values() if not f.is_file()]
    if missing:
        raise BundleError(f"{path}: call {call} has {tp} ranks; missing beside it: {', '.join(missing)} "
                          "(copy every rank's files of the call into one folder)")
    contributions, mixes, outputs = [], {}, {}
    first_case = None
    for rank, file in files.items():
        sibling, tensors = read_archive(file)
        _check_sibling(path, file, manifest, sibling, rank)
        try:
            case = Case.from_dict(sibling["case"])
        except ValueError as error:
            raise BundleError(f"{file}: {error}") from None
        first_case = first_case or case
        fields = {name: tensors.get(f"inputs/rank{rank}.{name}") for name in RANK_FIELDS}
        contributions.append(RankInputs(**fields))
        mixes[rank] = MixInputs(**{name: tensors.get(f"inputs/mix.{name}") for name in MIX_FIELDS}, eps=sibling["eps"])
        outputs[rank] = {name: tensors[f"kernel/rank{rank}.{name}"] for name in OUTPUTS if f"kernel/rank{rank}.{name}" in tensors}
    tree = None if manifest["reduction_tree"] is None else ReductionTree(**manifest["reduction_tree"])
    captured = CapturedCall(first_case, call, section["source"], manifest["eps"], tree, files, contributions, mixes, outputs,
                            manifest.get("environment", {}))
    for rank in range(tp):
        try:
            validate_inputs(contributions, mixes[rank], tree=tree, mxfp8=captured.mxfp8)
        except ValueError as error:
            raise BundleError(f"{files[rank]}: the recorded inputs do not form a call: {error}") from None
        if "new_residual" not in outputs[rank]:
            raise BundleError(f"{files[rank]}: no recorded new_residual")
    return captured


def _check_sibling(path: Path, file: Path, manifest: dict, sibling: dict, rank: int) -> None:
    if not is_captured(sibling):
        raise BundleError(f"{file}: not a captured call's bundle")
    ours, theirs = manifest["capture"], sibling["capture"]
    if theirs["rank"] != rank or theirs["call"] != ours["call"] or theirs["tp"] != ours["tp"]:
        raise BundleError(f"{file}: records call {theirs['call']} rank {theirs['rank']} of {theirs['tp']}, not what its name says")
    keys = ("tp", "hidden", "hc", "m", "op", "variant", "top_k", "capacity")
    if any(sibling["case"][k] != manifest["case"][k] for k in keys) or sibling["eps"] != manifest["eps"]:
        raise BundleError(f"{file}: its case or eps differs from {path.name}'s (files of different captures in one folder?)")
    if sibling["reduction_tree"] != manifest["reduction_tree"]:
        raise BundleError(f"{file}: its consumer tiling differs from {path.name}'s")


# ----- replay -------------------------------------------------------------------------------------


def replay_call(captured: CapturedCall, *, reference_only: bool = False, out: TextIO | None = None, device=None) -> int:
    """Judge every rank's recorded outputs (and on a GPU a rerun of the kernels) against the
    reference; print what was compared and the first difference explained. 0: all equal."""
    from .repro import explain_first

    out = out or sys.stdout
    write: Callable[[str], None] = lambda line="": print(line, file=out)
    case, tp = captured.case, captured.case.tp
    write(f"captured call {captured.call} of {captured.source}: {case.id}")
    for rank, file in captured.files.items():
        write(f"  rank {rank}: {file}")
    gpu = (captured.environment.get("gpu") or {}).get("name")
    write(f"recorded on {gpu or 'an unnamed device'}")

    use_gpu = not reference_only and torch.cuda.is_available()
    device = torch.device(device or "cuda") if use_gpu else torch.device("cpu")
    contributions = [_to(rank_inputs, device) for rank_inputs in captured.contributions]
    mixes = {rank: _mix_to(mix, device) for rank, mix in captured.mixes.items()}
    judged: list[tuple[str, dict[int, dict]]] = [("recorded", captured.outputs)]
    if use_gpu:
        write(f"rerunning the kernels on {torch.cuda.get_device_name(device)} ({tp} virtual ranks, each with its own mix)")
        judged.append(("rerun", rerun(captured, contributions, mixes, device)))
    else:
        write(f"judging the recorded outputs with the reference on the CPU ({'--reference-only' if reference_only else 'no GPU'})")

    failures: list[tuple[str, Mismatch]] = []
    for rank in range(tp):
        reference = all_reduce_mhc(contributions, mixes[rank], tree=captured.tree, mxfp8=captured.mxfp8)
        expected = expected_outputs(reference)
        for label, outputs in judged:
            found = _compare_rank(expected, outputs[rank], rank)
            if label == "rerun" and captured.mxfp8:
                found += _against_flashinfer(outputs[rank], rank)
            failures += [(label, m) for m in found]
            names = ", ".join(n for n in OUTPUTS if outputs[rank].get(n) is not None)
            write(f"  rank {rank}, {label} ({names}): " + (f"{len(found)} outputs differ" if found else "equal to the reference bit for bit"))
    if not failures:
        write("no difference: every output of every rank matches the reference bit for bit")
        return 0
    write(f"{len(failures)} comparisons differ:")
    for label, m in failures:
        write(f"  {label}: {m.describe()}  [vs {m.oracle}]")
    label, first = failures[0]
    write(f"(the first is from the {label} outputs)")
    explain_first(write, first, case, contributions, mixes[first.rank], captured.tree, captured.mxfp8)
    return 1


def rerun(captured: CapturedCall, contributions: list[RankInputs], mixes: dict[int, MixInputs], device) -> dict[int, dict]:
    """The kernels again on the recorded inputs: EmulatedAllReduceMHC with every rank's own mix."""
    from mhc_ar import EmulatedAllReduceMHC, mxfp8_scale_bytes

    case, tp = captured.case, captured.case.tp
    op = EmulatedAllReduceMHC(
        tp_size=tp, hidden_size=case.hidden, hc_mult=case.hc, max_num_tokens=case.capacity, top_k=case.top_k, device=device,
        quantize_layer_input=captured.mxfp8, residual_only=case.variant is Variant.RESIDUAL_ONLY,
    )
    tree = ReductionTree(**op.consumer_tiling.reduction_tree_args())
    if captured.tree is not None and tree != captured.tree:
        raise BundleError(f"this build's consumer tiling {tree} differs from the recorded {captured.tree}: a rerun "
                          "would sum the RMSNorm in another order (judge with --reference-only)")
    mix = [[getattr(mixes[r], name) for r in range(tp)] for name in MIX_FIELDS]
    mx = None
    if captured.mxfp8:
        mx = [(torch.empty(case.m, case.hidden, dtype=torch.float8_e4m3fn, device=device),
               torch.empty(mxfp8_scale_bytes(case.m, case.hidden), dtype=torch.uint8, device=device)) for _ in range(tp)]
    eps = captured.eps
    if case.op is Contribution.FINALIZE:
        columns = [[getattr(c, name) for c in contributions] for name in RANK_FIELDS[1:]]
        results = op.finalize(*columns, *mix, eps, mxfp8_out=mx)
    else:
        results = op([c.x for c in contributions], *mix, eps, mxfp8_out=mx)
    torch.cuda.synchronize(device)
    outputs = {}
    for r, (new_residual, layer_input) in enumerate(results):
        outputs[r] = {"new_residual": new_residual, "layer_input": layer_input}
        if mx is not None:
            outputs[r]["mxfp8_values"], outputs[r]["mxfp8_scales"] = mx[r]
    return outputs


def _compare_rank(expected: dict, outputs: dict, rank: int) -> list[Mismatch]:
    found = []
    for name in OUTPUTS:
        want, got = expected[name], outputs.get(name)
        if want is not None and got is not None:
            got = got.to(want.device)  # recorded outputs are on the CPU; a GPU replay's reference is not
        mismatch = compare_output(want, got, name, rank)
        if mismatch:
            found.append(mismatch)
    return found


def _against_flashinfer(outputs: dict, rank: int) -> list[Mismatch]:
    return second_oracle_mismatches(flashinfer_mxfp8, outputs["layer_input"], outputs["mxfp8_values"], outputs["mxfp8_scales"],
                                    rank=rank)


def _to(rank_inputs: RankInputs, device) -> RankInputs:
    return RankInputs(**{name: None if getattr(rank_inputs, name) is None else getattr(rank_inputs, name).to(device)
                         for name in RANK_FIELDS})


def _mix_to(mix: MixInputs, device) -> MixInputs:
    moved = {name: None if getattr(mix, name) is None else getattr(mix, name).to(device) for name in MIX_FIELDS}
    return MixInputs(**moved, eps=mix.eps)


__all__ = ["CapturedCall", "Recorder", "bundle_file", "load_call", "replay_call", "rerun"]
