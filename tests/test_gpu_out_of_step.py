"""Ranks out of step: a rank whose call sequence differs from its peers' never gets silently
wrong outputs. Each scenario runs tests/out_of_step.py in its own process (a trap ends the CUDA
context): two ranks, on their own streams in one process or as two processes sharing the GPU
through CUDA IPC mailboxes, every rank launching all its calls with no host sync between them.

* With the diagnostic consumer that leaves the call-tag comparison out (the protocol before the
  tags), each scenario returns outputs that differ from the reference of the call the rank made,
  with no error: the hazard is real.
* With the production consumer, no rank ever reads a wrong output: the CUDA context fails at or
  before the first out-of-step call, well before the spin timeout (the tag comparison traps, not
  the timeout).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from out_of_step import FIRST_OUT_OF_STEP, SPIN_TIMEOUT_S  # noqa: E402

SCENARIOS = sorted(FIRST_OUT_OF_STEP)


def _mps_running() -> bool:
    """Whether a CUDA MPS control daemon serves this machine (its pipe directory has the control
    pipe), so that two processes' kernels run at the same time instead of in time slices."""
    pipes = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipes, "control"))


# Measured on the H200 (session 12, notes/device-log.md): under MPS both processes trap within
# 0.06 s of the out-of-step call. Without MPS the processes only time-slice, and after one
# process's consumer trapped, the other's kernels never ran again (not even to their spin
# timeout): it was still running 15 s after its peer had exited. Not explained; so the IPC
# variant runs under MPS only (scripts/gpu_round.sh mps starts the daemon).
NEEDS_MPS = pytest.mark.skipif(not _mps_running(), reason="two processes on one GPU need CUDA MPS here: without it, "
                               "the rank whose peer trapped hangs (measured; see the comment above)")


def _run(scenario: str, mode: str, transport: str) -> list[str]:
    try:
        result = subprocess.run([sys.executable, os.path.join(HERE, "out_of_step.py"), scenario, mode, transport],
                                capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as expired:
        printed = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        raise AssertionError(f"{scenario} {mode} {transport}: no end within 90 s; printed so far:\n{printed}") from None
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    print(f"{scenario} {mode} {transport}:\n  " + "\n  ".join(lines))
    assert lines, f"the scenario printed nothing (rc {result.returncode}):\n{result.stdout}\n{result.stderr[-3000:]}"
    return lines


def _errors(lines):
    """(rank, call, seconds) of each ERROR line."""
    found = []
    for line in lines:
        if " ERROR at call " in line:
            words = line.split()
            found.append((int(words[1]), int(words[5]), float(words[7])))
    return found


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_without_the_tag_comparison_out_of_step_ranks_are_silently_wrong(scenario):
    lines = _run(scenario, "nocheck", "streams")
    wrong = [n for n, line in enumerate(lines) if "WRONG" in line]
    assert wrong, f"{scenario}: expected a silently wrong output without the tag comparison:\n" + "\n".join(lines)
    errors = [n for n, line in enumerate(lines) if " ERROR " in line]
    assert not errors or errors[0] > wrong[0], "the wrong output was not silent: an error came first"


@pytest.mark.parametrize("transport", ["streams", pytest.param("ipc", marks=NEEDS_MPS)])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_out_of_step_ranks_fail_loudly(scenario, transport):
    lines = _run(scenario, "check", transport)
    assert not [line for line in lines if "WRONG" in line], "\n".join(lines)
    errors = _errors(lines)
    # One process: the trap ends the context of both virtual ranks. Two processes: each rank's
    # own consumer traps on the other's tag.
    ranks_failing = {rank for rank, _, _ in errors}
    assert ranks_failing == ({0, 1} if transport == "ipc" else {0}), "\n".join(lines)
    for rank, call, seconds in errors:
        assert call <= FIRST_OUT_OF_STEP[scenario] + 1, f"rank {rank} failed only at call {call}"
        assert seconds < SPIN_TIMEOUT_S / 2, f"rank {rank} failed after {seconds} s: the timeout, not the tag check"
    for k in range(FIRST_OUT_OF_STEP[scenario]):
        assert f"rank 0 call {k}: ok" in lines, f"the in-step call {k} before must be right:\n" + "\n".join(lines)
