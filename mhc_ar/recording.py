"""Capture real calls as reproducer bundles: ``with mhc_ar.capture(dir, every=N, limit=K): ...``.

A numerical mismatch seen in a model run becomes a reproducer without rebuilding its inputs by
hand: while capture is on, every N-th call of any AllReduceMHC or EmulatedAllReduceMHC (the
first call after capture starts included) is recorded, per rank, as a bundle in `dir` with its
inputs, its outputs, the rank, the consumer tiling and the environment; `mhc-ar-conformance repro
FILE` replays it (conformance.capture says how the files fit together and how a replay judges
them).

The same from the environment, for a process whose code cannot be changed: ``MHC_AR_CAPTURE=DIR``
(and optionally ``MHC_AR_CAPTURE_EVERY``, ``MHC_AR_CAPTURE_LIMIT``, ``MHC_AR_CAPTURE_MAX_BYTES``)
turns capture on for the whole process when mhc_ar is imported.

Costs: with capture off, one module-global read per call and nothing else (no copy). With it on,
a recorded call enqueues device copies of its inputs and outputs behind the call on its stream
(no host synchronization; device memory up to max_bytes per rank), and the file is written at a
later call once they are done, or when capture ends (and at exit). Recording is bounded per rank
by `limit` calls and `max_bytes` of arrays; inside a CUDA graph capture nothing can be copied, so
nothing is recorded (a warning says so once). Every rank of a TP group must capture with the
same settings, so that the ranks record the same calls (the files of one call share its number).

The recorder and the bundle format live in conformance.capture (the judge's side); this module
only holds the switch, so that mhc_ar imports nothing from conformance while capture is off.
"""

from __future__ import annotations

import atexit
import contextlib
import os

ENV_DIR = "MHC_AR_CAPTURE"
ENV_EVERY = "MHC_AR_CAPTURE_EVERY"
ENV_LIMIT = "MHC_AR_CAPTURE_LIMIT"
ENV_MAX_BYTES = "MHC_AR_CAPTURE_MAX_BYTES"
DEFAULT_EVERY = 1
DEFAULT_LIMIT = 16
DEFAULT_MAX_BYTES = 1 << 30

# The active recorder (conformance.capture.Recorder), or None: the only thing a call reads.
recorder = None


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def start(directory, *, every: int = DEFAULT_EVERY, limit: int = DEFAULT_LIMIT, max_bytes: int = DEFAULT_MAX_BYTES):
    """Turn capture on (replacing any active recorder) and return the recorder."""
    global recorder
    every = _positive_int(every, "every")
    limit = _positive_int(limit, "limit")
    max_bytes = _positive_int(max_bytes, "max_bytes")
    from conformance.capture import Recorder  # only now: the bundle writer is the judge's

    stop()
    recorder = Recorder(directory, every=every, limit=limit, max_bytes=max_bytes)
    return recorder


def stop() -> None:
    """Capture off; the calls recorded so far are written first."""
    global recorder
    active, recorder = recorder, None
    if active is not None:
        active.flush()


@atexit.register
def _flush_at_exit() -> None:
    if recorder is not None:
        recorder.flush()


@contextlib.contextmanager
def capture(directory, *, every: int = DEFAULT_EVERY, limit: int = DEFAULT_LIMIT, max_bytes: int = DEFAULT_MAX_BYTES):
    """Record every `every`-th call (the first one included), at most `limit` calls and
    `max_bytes` of arrays, as bundles in `directory`; yields the recorder (its `.written` lists
    the files). Restores the previous recorder (or none) on exit."""
    global recorder
    previous = recorder
    recorder = None  # start() would flush and drop it; it resumes after the block
    active = start(directory, every=every, limit=limit, max_bytes=max_bytes)
    try:
        yield active
    finally:
        active.flush()
        recorder = previous


def start_from_environment(environ=os.environ):
    """Capture on for the whole process if MHC_AR_CAPTURE names a folder (at import of mhc_ar)."""
    directory = environ.get(ENV_DIR)
    if not directory:
        return None

    def number(name, default):
        text = environ.get(name)
        if text is None or text == "":
            return default
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name} must be a positive int, got {text!r}") from None

    global recorder
    settings = dict(
        every=_positive_int(number(ENV_EVERY, DEFAULT_EVERY), ENV_EVERY),
        limit=_positive_int(number(ENV_LIMIT, DEFAULT_LIMIT), ENV_LIMIT),
        max_bytes=_positive_int(number(ENV_MAX_BYTES, DEFAULT_MAX_BYTES), ENV_MAX_BYTES),
    )
    recorder = _StartOnFirstCall(directory, settings)
    return recorder


class _StartOnFirstCall:
    """Capture turned on by the environment while mhc_ar is being imported, when conformance
    (which imports mhc_ar) cannot be imported yet: the recorder is made at the first call."""

    def __init__(self, directory, settings: dict):
        self.directory, self.settings = directory, settings
        self.started = None  # the recorder made at the first call

    def record(self, **call) -> None:
        self.started = start(self.directory, **self.settings)
        self.started.record(**call)

    def flush(self) -> list:
        return [] if self.started is None else self.started.flush()


__all__ = ["capture", "start", "start_from_environment", "stop"]
