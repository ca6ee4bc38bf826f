"""Ranks out of step, as a script (a trap ends the CUDA context, so each scenario is a process).

    python tests/out_of_step.py SCENARIO MODE TRANSPORT

Calls 0 (call) and 1 (finalize) are in step on every rank and checked before the rest: every
kernel is then loaded (CUDA loads kernels lazily, and a first load while a consumer spins can
wait for that spin). From call 2 (a call; they alternate with finalize), per SCENARIO: reject
(rank 1's call 2 is rejected, an alignment check only it fails; then three valid calls on every
rank), m_differs (call 2: rank 0 M=5, rank 1 M=7), skip (rank 1 never makes call 2),
op_differs (call 2: rank 0 calls, rank 1 finalizes).
MODE: check (the production consumer) or nocheck (the diagnostic build without the call-tag
comparison: what the protocol did before it).
TRANSPORT: streams (mhc_ar.concurrent: two virtual ranks on their own streams, one process) or
ipc (two processes sharing the GPU through CUDA IPC mailboxes; run it under CUDA MPS: without
it the processes time-slice, and the rank whose peer trapped was measured to hang).

Every rank launches all its calls with no host synchronization between them, each followed on
its stream by a copy of its outputs into pinned host memory, then waits. Each call whose copy
arrived is compared with the reference of the call that rank made, whether or not the CUDA
context failed later (so what is printed does not depend on when a trap comes); the first call
whose outputs never arrived is the one the error is reported at. Lines:
    rank R call K: ok | WRONG <first difference> | rejected: <ValueError>
    rank R ERROR at call K after S s: <CUDA error>   (S: when the host saw the error)
    rank R DONE
    rank R process exited at S s (exit code C) | rank R HUNG: ...   (ipc: the parent's view)
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conformance.cases import Case, Family  # noqa: E402
from conformance.compare import first_mismatch  # noqa: E402
from conformance.inputs import make_inputs  # noqa: E402
from conformance.runner import call_rank, poisoned_outputs  # noqa: E402
from mhc_ar.config import Contribution, Variant  # noqa: E402
from mhc_ar.transport import MULTICAST_OFF_ENV  # noqa: E402
from reference import ReductionTree, all_reduce_mhc  # noqa: E402

TP, HIDDEN, HC, TOP_K, CAPACITY, M = 2, 4096, 4, 4, 8, 3
SPIN_TIMEOUT_S = 2.0
CALLS = 6
IN_STEP = 2  # calls 0 (call) and 1 (finalize): every kernel launched once, checked, before the rest
# The first call at which the ranks' sequences differ, per scenario.
FIRST_OUT_OF_STEP = {"reject": IN_STEP, "m_differs": IN_STEP, "skip": IN_STEP, "op_differs": IN_STEP}
# CUDA objects of every call stay referenced until os._exit: after a trap, their destructors raise
# and would abort the process.
_KEEP = []
HANG_S = 15  # a process still running this long after its peer left is reported hung
UNWRITTEN = 0x7FA1  # bf16 bits the host copies start as (neither the poison nor a kernel NaN)


def case(k: int, m: int = M, op: Contribution = Contribution.CALL) -> Case:
    top_k = TOP_K if op is Contribution.FINALIZE else 0
    return Case(tp=TP, hidden=HIDDEN, hc=HC, m=m, op=op, variant=Variant.FULL, family=Family.NORMAL, top_k=top_k,
                capacity=CAPACITY, seed_offset=1000 * k)


def plan(scenario: str, rank: int) -> list[tuple[int, str, Case]]:
    """(call index, action, case) for this rank: action 'call' or 'reject'."""
    steps = []
    for k in range(CALLS):
        c = case(k, op=Contribution.FINALIZE if k % 2 else Contribution.CALL)
        action = "call"
        if k == IN_STEP and rank == 1:
            if scenario == "reject":
                action = "reject"
            elif scenario == "skip":
                continue
            elif scenario == "m_differs":
                c = case(k, m=7, op=c.op)
            elif scenario == "op_differs":
                c = case(k, op=Contribution.CALL if c.op is Contribution.FINALIZE else Contribution.FINALIZE)
        elif k == IN_STEP and rank == 0 and scenario == "m_differs":
            c = case(k, m=5, op=c.op)
        steps.append((k, action, c))
    return steps


def misaligned(tensor: torch.Tensor) -> torch.Tensor:
    """The same values at an address 2 bytes off 16-byte alignment (a check that can fail on one
    rank only)."""
    storage = torch.zeros(tensor.numel() + 8, dtype=tensor.dtype, device=tensor.device)
    view = storage[1 : 1 + tensor.numel()].view(tensor.shape)
    view.copy_(tensor)
    return view


def prepare(rank: int, steps, device, tree):
    """Inputs, poisoned outputs and reference of every call, made before any launch. Once the
    calls run, nothing may synchronize the device: not a host sync, and not the first launch of
    a kernel CUDA loads lazily (loading may synchronize the context, which would wait on a
    consumer spinning for a peer's call that comes later in the host's order)."""
    prepared = []
    for k, action, c in steps:
        inputs = make_inputs(c, device)
        ref = all_reduce_mhc(inputs.ranks, inputs.mix, tree=tree, mxfp8=False)
        # Compared on the CPU: after the launches, only copies reach the GPU (no kernel to load).
        ref = {"new_residual": ref.new_residual.cpu(), "layer_input": ref.layer_input.cpu()}
        if action == "reject":  # this rank's contribution at a misaligned address
            own = inputs.ranks[rank]
            if c.op is Contribution.CALL:
                own.x = misaligned(own.x)
            else:
                own.shared_output = misaligned(own.shared_output)
        host = {name: torch.full(want.shape, UNWRITTEN, dtype=torch.int16).view(torch.bfloat16).pin_memory() for name, want in ref.items()}
        prepared.append((k, action, c, inputs, poisoned_outputs(c, device), ref, host))
    return prepared


def launch_all(op, rank: int, prepared, stream_context, start: float):
    """Every call of this rank, no host sync between them. Returns what to check per call, and
    the launch failure (call, seconds, message) if a launch itself raised (a trap that surfaced
    there: the CUDA context is gone), else None."""
    launched = []
    for k, action, c, inputs, outputs, ref, host in prepared:
        with stream_context():
            if action == "reject":
                try:
                    call_rank(op, c, inputs, rank, outputs)
                except ValueError as error:
                    _say(f"rank {rank} call {k}: rejected: {error}")
                    continue
                raise AssertionError("the misaligned x was not rejected")
            try:
                call_rank(op, c, inputs, rank, outputs)
                for name, copy in host.items():  # queued behind the call on this rank's stream
                    copy.copy_(getattr(outputs, name)[rank], non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            except Exception as error:  # CUDA's error class differs by layer (torch, the DSL's runtime)
                return launched, (k, time.perf_counter() - start, "(launch) " + _first_line(error))
        launched.append((k, host, ref, done))
    return launched, None


def _say(line: str) -> None:
    """One line to stdout in one write(2): the two IPC rank processes (and their parent) share
    the pipe, and with unbuffered output (PYTHONUNBUFFERED) print's text and newline are two
    writes, so two ranks' lines were measured to interleave ("rank 0 call 1: okrank 1 call 1: ok")."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_all(rank: int, launched, start: float, last: bool = True, launch_failure=None) -> bool:
    """Wait for the calls, then compare every call whose outputs reached the host; False once
    the CUDA context has failed (seen while waiting, or at a launch: `launch_failure`)."""
    failure = None  # (seconds, message) when the host saw the context fail
    for _, _, _, done in launched:
        try:
            done.synchronize()
        except Exception as error:  # a trap: the CUDA context is gone
            failure = (time.perf_counter() - start, _first_line(error))
            break
    if failure is None and launch_failure is not None:
        failure = launch_failure[1:]
    for k, host, ref, _ in launched:
        if failure is not None and all(_unwritten(copy) for copy in host.values()):
            _say(f"rank {rank} ERROR at call {k} after {failure[0]:.2f} s: {failure[1]}")
            return False
        problem = None
        for name, want in ref.items():
            mismatch = first_mismatch(want, host[name], output=name, rank=rank)
            if mismatch is not None and problem is None:
                problem = mismatch.describe()
        _say(f"rank {rank} call {k}: " + ("ok" if problem is None else f"WRONG {problem}"))
    if launch_failure is not None:  # every launched call finished; the next launch raised
        _say(f"rank {rank} ERROR at call {launch_failure[0]} after {launch_failure[1]:.2f} s: {launch_failure[2]}")
        return False
    if failure is not None:  # every call of this rank had finished: a peer's call failed
        _say(f"rank {rank} ERROR after its last call, {failure[0]:.2f} s: {failure[1]}")
        return False
    if last:
        _say(f"rank {rank} DONE")
    return True


def _unwritten(copy: torch.Tensor) -> bool:
    return bool((copy.view(torch.int16) == UNWRITTEN).all())


def run_streams(scenario: str, mode: str) -> None:
    from mhc_ar.concurrent import ConcurrentRanks

    device = torch.device("cuda", 0)
    ranks = ConcurrentRanks(tp_size=TP, device=device)
    omit = {"step_check"} if mode == "nocheck" else set()
    ops = ranks.add(hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K, spin_timeout_s=SPIN_TIMEOUT_S,
                    diagnostic_omit=omit)
    tree = ReductionTree(**ops[0].consumer_tiling.reduction_tree_args())
    prepared = [prepare(r, plan(scenario, r), device, tree) for r in range(TP)]
    torch.cuda.synchronize(device)
    # The in-step calls first, launched call by call across the ranks and checked (so the first
    # launch of each kernel, which CUDA loads lazily and which may wait for the whole context,
    # never waits behind a consumer spinning for a rank not yet launched); then everything else
    # at once, rank by rank. A launch that raises stops the launches (the context is gone); what
    # was launched is still checked.
    in_step = [[prepared[r][k : k + 1] for r in range(TP)] for k in range(IN_STEP)]
    out_of_step = [[prepared[r][IN_STEP:] for r in range(TP)]]
    for part, groups in (("in step", in_step), ("out of step", out_of_step)):
        start = time.perf_counter()
        launched, failures = [[] for _ in range(TP)], [None] * TP
        for group in groups:
            for r in range(TP):
                calls, failures[r] = launch_all(ops[r], r, group[r], lambda r=r: ranks.on(r), start)
                launched[r] += calls
                if failures[r] is not None:
                    break
            if any(failures):
                break
        _KEEP.append(launched)
        for r in range(TP):
            if not check_all(r, launched[r], start, last=part == "out of step", launch_failure=failures[r]):
                return


def ipc_worker(rank: int, scenario: str, mode: str, mailboxes, barrier) -> None:
    """One rank's process. It leaves without tearing down CUDA, whatever happened: after a trap,
    freeing resources (the IPC mappings of the parent's mailboxes among them) is not worth
    waiting for."""
    import faulthandler

    faulthandler.dump_traceback_later(20, file=sys.stdout)  # where a hung rank waits, before the parent kills it
    try:
        _ipc_rank(rank, scenario, mode, mailboxes, barrier)
    except BaseException as error:  # printed, so the test shows it; the process still leaves
        _say(f"rank {rank} EXCEPTION {type(error).__name__}: {_first_line(error)}")
    sys.stdout.flush()
    os._exit(0)


def _ipc_rank(rank: int, scenario: str, mode: str, mailboxes, barrier) -> None:
    import contextlib

    os.environ.update(MULTICAST_OFF_ENV)
    from mhc_ar.allreduce_mhc import AllReduceMHC
    from mhc_ar.engine import Engine, Launches
    from mhc_ar.protocol import STATE_WORDS
    from mhc_ar.transport import RankEndpoint, _pad

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    engine = Engine(hidden_size=HIDDEN, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K, tp=TP, device=device,
                     variant=Variant.FULL, multicast=False, spin_timeout_s=SPIN_TIMEOUT_S, launches=Launches.ONE_CALL)
    if mode == "nocheck":
        engine.omit_for_diagnosis({"step_check"})
    endpoint = RankEndpoint(rank, TP, mailboxes[rank], torch.zeros(STATE_WORDS, dtype=torch.int32, device=device),
                            _pad([mailbox.data_ptr() for mailbox in mailboxes]))
    op = AllReduceMHC._for_endpoint(engine, endpoint)
    tree = ReductionTree(**op.consumer_tiling.reduction_tree_args())
    prepared = prepare(rank, plan(scenario, rank), device, tree)
    torch.cuda.synchronize(device)
    barrier.wait()
    for part in (slice(0, IN_STEP), slice(IN_STEP, None)):  # the in-step calls first, as run_streams does
        start = time.perf_counter()
        launched, failure = launch_all(op, rank, prepared[part], contextlib.nullcontext, start)
        _KEEP.append(launched)
        if not check_all(rank, launched, start, last=part.start == IN_STEP, launch_failure=failure):
            break


def run_ipc(scenario: str, mode: str) -> None:
    import torch.multiprocessing as mp

    from mhc_ar.protocol import SENTINEL_BF16, mailbox_shape

    ctx = mp.get_context("spawn")
    sentinel = SENTINEL_BF16 - (1 << 16)
    mailboxes = [
        torch.full(mailbox_shape(TP, CAPACITY, HIDDEN), sentinel, dtype=torch.int16, device="cuda").view(torch.bfloat16)
        for _ in range(TP)
    ]
    torch.cuda.synchronize()
    barrier = ctx.Barrier(TP)
    workers = [ctx.Process(target=ipc_worker, args=(r, scenario, mode, mailboxes, barrier)) for r in range(TP)]
    for w in workers:
        w.start()
    # When each process left (so a rank that hangs is seen hanging after its peer was gone).
    start, first_exit = time.perf_counter(), None
    running = dict(enumerate(workers))
    while running:
        for r, w in list(running.items()):
            if not w.is_alive():
                now = time.perf_counter() - start
                first_exit = now if first_exit is None else first_exit
                _say(f"rank {r} process exited at {now:.1f} s (exit code {w.exitcode})")
                del running[r]
        if first_exit is not None and time.perf_counter() - start > first_exit + HANG_S:
            for r, w in running.items():
                w.kill()
                _say(f"rank {r} HUNG: no exit {HANG_S} s after its peer's")
            break
        time.sleep(0.05)


if __name__ == "__main__":
    os.environ.update(MULTICAST_OFF_ENV)
    scenario, mode, transport = sys.argv[1:4]
    if scenario not in FIRST_OUT_OF_STEP or mode not in ("check", "nocheck") or transport not in ("streams", "ipc"):
        raise SystemExit(__doc__)
    (run_streams if transport == "streams" else run_ipc)(scenario, mode)
    # No teardown: after a trap, destructors of CUDA objects (events) raise and abort the process.
    sys.stdout.flush()
    os._exit(0)
