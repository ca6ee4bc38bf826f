"""`python -m conformance bench`: the fused path against the unfused PyTorch chain, on one GPU.

The TP=1 sweep runs M = 1, 2, 4, ..., 8192 (M_SWEEP) at each (hidden, hc) shape, by default
(5120, 4), (7168, 4) and (7168, 8) (SHAPES). Everything a ratio compares is measured in the same
run, the same way: each side is captured in a CUDA graph of CALLS_PER_GRAPH calls (cycling
through enough input sets that one graph replay touches more memory than L2 holds when the
problem is large), the graph is replayed REPEATS times between CUDA events, and the per-call
median is reported; the fused sides of a TP=1 row (full, MXFP8, full + quantize) and the two
sides of a TP row are timed that way ROUNDS times, in turn, and report the median of their
rounds (interleaved_times_us). Also measured in the same run: device copy bandwidth (4 GiB copies three
ways, COPY_METHODS, the best of each; bytes read + written; the best is the copy ceiling), the publish kernel alone,
the consumer per rank at emulated TP sizes (by default TP=8 at M = 1, 16, 1024, H=5120, hc=4:
(all ranks - publishes) / tp, its bytes and their rate over the copy ceiling), and, at H=5120
hc=4 (DETAIL_SHAPE) when that shape is swept, the MXFP8 variant's cost stage by stage and the
eager per-call latency of the Python API (host overhead: argument checks, output allocation, one
TVM-FFI call launching both kernels), with its parts.

The unfused chain is what the fusion replaces: rank sum to bf16, post-mix, collapse, RMSNorm in
straightforward PyTorch, plus FlashInfer's cute-dsl mxfp8_quantize for the MXFP8 variant; the
same chain through torch.compile (Inductor) is what a user wanting speed without bit-exactness
would pick instead, so it is timed beside it (`--no-compiled` leaves it out).
"""

from __future__ import annotations

import argparse
from html import escape as html_escape
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

CALLS_PER_GRAPH = 20
REPEATS = 15
ROUNDS = 5  # interleaved_times_us: rounds of the sides a target's ratio compares
L2_SPILL_BYTES = 256 << 20  # cycle input sets until one replay touches this much memory
MAX_INPUT_SETS = 8
M_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SHAPES = ((5120, 4), (7168, 4), (7168, 8))  # (hidden, hc) of the TP=1 sweep
CROSSED_HC = (4,)  # --hidden without --hc sweeps these hc
DETAIL_SHAPE = (5120, 4)  # (hidden, hc) of the eager table, the MXFP8 diagnosis and the TP rows
TP_SWEEP = (8,)  # emulated TP sizes, beside TP=1
TP_M_SWEEP = (1, 16, 1024)
SMALL_M = 16  # the small-M targets hold for M <= SMALL_M (here and in bench_tp)
SMALL_M_FUSED_US = 8.0  # the earlier issue's small-M target (here and in bench_tp)
SMALL_M_TP1_FUSED_US = 3.0  # issue 13's, at TP = 1


def graph_time_us(calls, *, calls_per_graph: int = CALLS_PER_GRAPH, repeats: int = REPEATS, before_each_replay=None) -> float:
    """Median time per call (us) of `calls[i % len(calls)]()` captured calls_per_graph times.
    `before_each_replay` runs (untimed) before each timed replay, e.g. a barrier across ranks."""
    for call in calls:  # warm-up: compilation, allocator, lazy init outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls_per_graph):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if before_each_replay is not None:
            before_each_replay()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000.0 / calls_per_graph)
    del graph
    return statistics.median(times)


def interleaved_times_us(measures: dict, rounds: int = ROUNDS) -> dict:
    """name -> every round's figure: each of `measures` (name -> a call returning us, e.g. a
    graph_time_us) in turn, `rounds` times. The sides of a ratio are timed alternately over the
    same stretch of time, so a drift of the GPU's state falls on all of them: one figure each,
    back to back, put the MXFP8 variant 9.1% over the full one at H7168 hc8 M16 in one run where
    five alternating rounds put them within 0.3% in three (notes/device-log.md, session 23)."""
    times = {name: [] for name in measures}
    for _ in range(rounds):
        for name, measure in measures.items():
            times[name].append(measure())
    return times


COPY_CEILING_BYTES = 4 << 30  # per buffer: a copy this large is not bound by its launch or tail
COPY_CEILING_TRIALS = 5


COPY_METHODS = ("copy_ in a graph", "copy_ on the stream", "x * 1 kernel in a graph")


def copy_bandwidth_gbs(nbytes: int = COPY_CEILING_BYTES, trials: int = COPY_CEILING_TRIALS) -> float:
    """Device copy bandwidth, bytes read + written per second (GB/s): the best over
    COPY_METHODS of the best of `trials` copies of `nbytes` (the ceiling the fused kernels are
    held to). Several ways, because they differ: on the H200 (session 14) torch's copy_ captured
    in a CUDA graph moved 2771 GB/s, less than the fused call itself, while a device-to-device
    copy_ timed on a stream has been seen near 4.3 TB/s (KINDS.md); a graph's memcpy node may
    take another path than the stream's copy. copy_methods_gbs gives each method's figure."""
    return max(copy_methods_gbs(nbytes, trials).values())


def copy_methods_gbs(nbytes: int = COPY_CEILING_BYTES, trials: int = COPY_CEILING_TRIALS) -> dict:
    """Each of COPY_METHODS: read + write GB/s of its best of `trials` copies of `nbytes`."""
    best = _best_copy_us(nbytes, trials)
    torch.cuda.empty_cache()  # the 2 x nbytes of buffers are gone with _best_copy_us's frame
    return {method: _gbs(2 * nbytes, us) for method, us in best.items()}


def _best_copy_us(nbytes: int, trials: int) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    words_in, words_out = src.view(torch.int32), dst.view(torch.int32)
    best = {}
    best[COPY_METHODS[0]] = min(graph_time_us([lambda: dst.copy_(src)], calls_per_graph=2, repeats=5) for _ in range(trials))
    best[COPY_METHODS[1]] = min(_stream_time_us(lambda: dst.copy_(src)) for _ in range(trials))
    best[COPY_METHODS[2]] = min(graph_time_us([lambda: _word_copy(words_in, words_out)], calls_per_graph=2, repeats=5)
                                for _ in range(trials))
    return best


def same_bytes_copy_us(nbytes: int, pairs: int, device: str = "cuda") -> float:
    """The x * 1 kernel of COPY_METHODS (_word_copy), graph-timed like the fused call, reading
    nbytes // 2 and writing as many, cycling `pairs` buffer pairs (pass the number of input sets
    the fused row cycled, so both sides find as much of their data in L2): what a kernel doing
    nothing but move a fused row's bytes takes at that size, launch and memory latency included.
    At TP = 1 (full variant) the fused call reads x and the residual and writes new_residual and
    layer_input: M*H*2*(1 + hc) bytes each way, fused_bytes // 2."""
    words = nbytes // 2 // 4
    buffers = [(torch.empty(words, dtype=torch.int32, device=device).random_(0, 1 << 30), torch.empty(words, dtype=torch.int32, device=device))
               for _ in range(pairs)]
    return graph_time_us([lambda src=src, dst=dst: _word_copy(src, dst) for src, dst in buffers])


def _word_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    """COPY_METHODS' x * 1 kernel: an SM kernel that reads and writes every int32 word (the same bits)."""
    torch.mul(src, 1, out=dst)


def _stream_time_us(call, repeats: int = 5) -> float:
    """Median of `repeats` event-timed calls launched on the stream (no graph)."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000.0)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# The two sides
# ---------------------------------------------------------------------------------------------


@dataclass
class Inputs:
    xs: list  # per rank [M, H] bf16
    residual: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    pre: torch.Tensor
    norm_weight: torch.Tensor
    eps: float = 1e-6


def make_inputs(tp: int, m: int, hidden: int, hc: int, seed: int) -> Inputs:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    return Inputs(
        xs=[normal(m, hidden) for _ in range(tp)],
        residual=normal(m, hc, hidden),
        post=torch.rand(m, hc, generator=g, device="cuda") + 0.5,
        comb=torch.rand(m, hc, hc, generator=g, device="cuda") / hc,
        pre=(torch.rand(m, hc, generator=g, device="cuda") + 0.5) / hc,
        norm_weight=(1 + 0.1 * torch.randn(hidden, generator=g, device="cuda")).to(torch.bfloat16),
    )


def chain_math(xs, residual, post, comb, pre, norm_weight, eps: float):
    """The straightforward PyTorch chain computing the same outputs (not bit-exact: a baseline):
    rank sum to bf16, post-mix, collapse, RMSNorm. Eager, or through torch.compile."""
    total = xs[0].float()
    for x in xs[1:]:
        total = total + x.float()
    y = total.to(torch.bfloat16).float()
    mixed = y[:, None, :] * post[:, :, None] + torch.einsum("msh,mst->mth", residual.float(), comb)
    new_residual = mixed.to(torch.bfloat16)
    p = (new_residual.float() * pre[:, :, None]).sum(dim=1).to(torch.bfloat16).float()
    inv = torch.rsqrt(p.pow(2).mean(dim=-1, keepdim=True) + eps)
    layer_input = (p * inv * norm_weight.float()).to(torch.bfloat16)
    return new_residual, layer_input


_COMPILED = {}


def compiled_math():
    """chain_math through torch.compile (Inductor, its own fusion and rounding), M dynamic so
    one compile serves every M of a shape."""
    if "chain" not in _COMPILED:
        _COMPILED["chain"] = torch.compile(chain_math, dynamic=True)
    return _COMPILED["chain"]


def unfused_chain(inputs: Inputs, mxfp8: bool, compiled: bool = False):
    """One call of the chain (eager, or compiled), plus FlashInfer's cute-dsl mxfp8_quantize for
    the MXFP8 variant (not compiled: a custom kernel either way)."""
    from flashinfer import mxfp8_quantize

    math_ = compiled_math() if compiled else chain_math

    def call():
        new_residual, layer_input = math_(inputs.xs, inputs.residual, inputs.post, inputs.comb, inputs.pre,
                                          inputs.norm_weight, inputs.eps)
        if mxfp8:
            mxfp8_quantize(layer_input, True, backend="cute-dsl")
        return new_residual, layer_input

    return call


class FusedSide:
    """An EmulatedAllReduceMHC with preallocated outputs, and its launches split for timing."""

    def __init__(self, op, inputs: Inputs, mxfp8: bool):
        from mhc_ar import mxfp8_scale_bytes

        self.op, self.inputs = op, inputs
        m, hc, hidden = inputs.residual.shape
        tp = op.tp_size
        self.out = [
            (torch.empty(m, hc, hidden, dtype=torch.bfloat16, device="cuda"), torch.empty(m, hidden, dtype=torch.bfloat16, device="cuda"))
            for _ in range(tp)
        ]
        self.mx = None
        if mxfp8:
            self.mx = [
                (torch.empty(m, hidden, dtype=torch.float8_e4m3fn, device="cuda"), torch.empty(mxfp8_scale_bytes(m, hidden), dtype=torch.uint8, device="cuda"))
                for _ in range(tp)
            ]
        i = inputs
        self.parts = op.parts
        self.launches = [
            self.parts.validator.check_call(i.xs[r], (i.residual, i.post, i.comb, i.pre, i.norm_weight), i.eps, None if self.mx is None else self.mx[r], self.out[r])
            for r in range(tp)
        ]
        self.tokens = m

    def call(self):
        i = self.inputs
        self.op(i.xs, i.residual, i.post, i.comb, i.pre, i.norm_weight, i.eps, out=self.out, mxfp8_out=self.mx)

    def publish_only(self):
        for rank, launch in zip(self.parts.ranks, self.launches):
            self.parts.publish(rank, launch, self.tokens)


FUSED_BYTES_FORMULA = (
    "per rank: x read M*H*2 + mailbox writes tp*M*H*2 (publish) + mailbox reads tp*M*H*2 + re-arm tp*M*H*2"
    " + residual read M*hc*H*2 + new_residual write M*hc*H*2 + layer_input write M*H*2"
    " (+ MXFP8 values M*H + scales M*H/32); the mix coefficients, norm weight and tags are left out."
    " At TP = 1 (one kernel, no mailbox): x read M*H*2 + residual read + new_residual write + layer_input write (+ MXFP8)"
)


def fused_bytes(tp: int, m: int, hidden: int, hc: int, mxfp8: bool) -> int:
    """The fewest bytes one rank's whole fused call must move (FUSED_BYTES_FORMULA): its
    publish (x in, its vector to every rank's mailbox) and its consumer (consumer_bytes); at
    TP = 1 the consumer alone (it reads x in place: mhc_ar.config.ConsumerSpec.direct)."""
    if tp == 1:
        return consumer_bytes(1, m, hidden, hc, mxfp8)
    return m * hidden * 2 + tp * m * hidden * 2 + consumer_bytes(tp, m, hidden, hc, mxfp8)


def consumer_bytes(tp: int, m: int, hidden: int, hc: int, mxfp8: bool) -> int:
    """The fewest bytes one rank's consumer must move: mailbox read + re-arm (at TP = 1: x read
    in place), residual in and out, layer_input out (+ MXFP8 values and scales)."""
    exchanged = 2 * tp * m * hidden * 2 if tp > 1 else m * hidden * 2
    moved = exchanged + 2 * m * hc * hidden * 2 + m * hidden * 2
    if mxfp8:
        moved += m * hidden + m * hidden // 32
    return moved


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One M of one shape: a TP=1 row (measure_tp1: every side) or an emulated TP row
    (measure_tp: all ranks' calls, their publishes, the consumer per rank)."""

    hidden: int
    hc: int
    m: int
    tp: int
    fused_us: float  # TP rows: all tp ranks' calls, one after the other
    fused_mxfp8_us: float | None = None
    publish_us: float | None = None  # TP rows: all tp publishes
    unfused_us: float | None = None
    unfused_mxfp8_us: float | None = None
    compiled_us: float | None = None  # the chain through torch.compile
    compiled_mxfp8_us: float | None = None
    full_plus_quant_us: float | None = None
    consumer_bytes: int = 0  # consumer_bytes(): one rank's consumer
    consumer_gbs: float | None = None  # TP=1 rows: consumer_bytes / fused time
    fused_bytes: int = 0  # FUSED_BYTES_FORMULA
    fused_ceiling_fraction: float | None = None  # fused_bytes / fused time, over the copy ceiling
    same_bytes_copy_us: float | None = None  # TP=1 rows: same_bytes_copy_us(fused_bytes)
    consumer_us: float | None = None  # TP rows: the consumer per rank, (fused - publish) / tp
    consumer_ceiling_fraction: float | None = None  # TP rows: consumer_bytes / consumer_us, over the copy ceiling
    # Every round of the sides timed by interleaved_times_us, by side ("fused", "mxfp8",
    # "full+quant"; TP rows: "all ranks", "publishes"); their figures above are the medians.
    rounds_us: dict = field(default_factory=dict)


@dataclass
class BenchResult:
    device: str
    copy_gbs: float
    copy_methods_gbs: dict = field(default_factory=dict)  # COPY_METHODS -> GB/s; copy_gbs is the best
    rows: list[Row] = field(default_factory=list)
    tp_rows: list[Row] = field(default_factory=list)
    eager_us: dict = field(default_factory=dict)
    eager_api: str = ""
    mxfp8_diagnosis: list = field(default_factory=list)
    seconds: float = 0.0


def _input_sets(tp, m, hidden, hc, seed):
    per_call = consumer_bytes(tp, m, hidden, hc, False) + tp * m * hidden * 2
    count = max(1, min(MAX_INPUT_SETS, math.ceil(L2_SPILL_BYTES / per_call)))
    return [make_inputs(tp, m, hidden, hc, seed + s) for s in range(count)]


def tp1_ops(hidden: int, hc: int, capacity: int) -> dict:
    """The two TP=1 instances measure_tp1 times: "full" and "mxfp8"."""
    from mhc_ar import EmulatedAllReduceMHC

    return {
        "full": EmulatedAllReduceMHC(tp_size=1, hidden_size=hidden, hc_mult=hc, max_num_tokens=capacity),
        "mxfp8": EmulatedAllReduceMHC(tp_size=1, hidden_size=hidden, hc_mult=hc, max_num_tokens=capacity, quantize_layer_input=True),
    }


def measure_tp1(hidden: int, hc: int, ms, ops, compiled: bool = True, copy_ceiling_gbs: float = float("inf")) -> list[Row]:
    from flashinfer import mxfp8_quantize

    rows = []
    for m in ms:
        sets = _input_sets(1, m, hidden, hc, seed=m)
        full = [FusedSide(ops["full"], s, mxfp8=False) for s in sets]
        quant = [FusedSide(ops["mxfp8"], s, mxfp8=True) for s in sets]

        def full_then_quantize(side):
            side.call()
            mxfp8_quantize(side.out[0][1], True, backend="cute-dsl")

        # The sides of the MXFP8 targets (over full, against full + quantize), in turn.
        rounds = interleaved_times_us({
            "fused": lambda: graph_time_us([f.call for f in full]),
            "mxfp8": lambda: graph_time_us([f.call for f in quant]),
            "full+quant": lambda: graph_time_us([lambda side=side: full_then_quantize(side) for side in full]),
        })
        row = Row(hidden=hidden, hc=hc, m=m, tp=1, fused_us=statistics.median(rounds["fused"]), rounds_us=rounds)
        row.fused_mxfp8_us = statistics.median(rounds["mxfp8"])
        row.full_plus_quant_us = statistics.median(rounds["full+quant"])
        # At TP = 1 the call is one kernel (no publish: mhc_ar.config.ConsumerSpec.direct).
        row.publish_us = None if ops["full"].parts.one_kernel else graph_time_us([f.publish_only for f in full])
        row.unfused_us = graph_time_us([unfused_chain(s, mxfp8=False) for s in sets])
        row.unfused_mxfp8_us = graph_time_us([unfused_chain(s, mxfp8=True) for s in sets])
        if compiled:
            row.compiled_us = graph_time_us([unfused_chain(s, mxfp8=False, compiled=True) for s in sets])
            row.compiled_mxfp8_us = graph_time_us([unfused_chain(s, mxfp8=True, compiled=True) for s in sets])
        row.consumer_bytes = consumer_bytes(1, m, hidden, hc, False)
        # Conservative: the consumer's bytes over the whole fused call (publish included). The
        # difference fused - publish is no consumer time: under PDL the two kernels overlap.
        row.consumer_gbs = _gbs(row.consumer_bytes, row.fused_us)
        row.fused_bytes = fused_bytes(1, m, hidden, hc, False)
        row.fused_ceiling_fraction = _gbs(row.fused_bytes, row.fused_us) / copy_ceiling_gbs
        row.same_bytes_copy_us = same_bytes_copy_us(row.fused_bytes, pairs=len(sets))
        rows.append(row)
        print(_format_row(row), flush=True)
        # Gone before the next M's are made: at M=8192, H=7168, hc=8 one residual is 940 MB, and
        # the sets and both sides' outputs hold several.
        del sets, full, quant
    return rows


DIAGNOSIS_M = (1, 4, 16, 128)
HOST_PROBE = "host probe: torch.empty(0) on the CPU"
EAGER_M = (1, 16, 128)  # eager host time per call, at these M (those within the sweep's capacity)
DIAGNOSIS_BUILDS = {  # name -> consumer stages left out (mhc_ar.config.DIAGNOSTIC_STAGES)
    "mxfp8": (),
    "mxfp8 without padding-scale zeroing": ("padding_scales",),
    "mxfp8 without block quantization": ("mxfp8_block",),
    "mxfp8 without either": ("padding_scales", "mxfp8_block"),
}


def measure_mxfp8_diagnosis(hidden: int, hc: int, ms, capacity: int, full_op) -> list[dict]:
    """What the MXFP8 variant's extra time is made of: the same graph timing for builds that
    leave a stage out (their outputs break the contract; they exist only here)."""
    from mhc_ar import EmulatedAllReduceMHC

    ops = {}
    for name, omit in DIAGNOSIS_BUILDS.items():
        ops[name] = EmulatedAllReduceMHC(tp_size=1, hidden_size=hidden, hc_mult=hc, max_num_tokens=capacity, quantize_layer_input=True)
        if omit:
            ops[name].parts.omit_for_diagnosis(omit)
    rows = []
    for m in ms:
        sets = _input_sets(1, m, hidden, hc, seed=m)
        row = {"hidden": hidden, "hc": hc, "m": m, "full": graph_time_us([FusedSide(full_op, s, mxfp8=False).call for s in sets])}
        for name, op in ops.items():
            row[name] = graph_time_us([FusedSide(op, s, mxfp8=True).call for s in sets])
        rows.append(row)
        print(f"diagnosis H{hidden} hc{hc} M{m}: " + ", ".join(f"{k} {v:.2f} us" for k, v in row.items() if k not in ("hidden", "hc", "m")), flush=True)
    return rows


def measure_tp(tp: int, hidden: int, hc: int, ms, copy_ceiling_gbs: float = float("inf")) -> list[Row]:
    """Emulated TP (one process, all tp ranks' calls in turn): per M, all ranks' calls and their
    publishes alone, as tp_row's figures."""
    from mhc_ar import EmulatedAllReduceMHC

    op = EmulatedAllReduceMHC(tp_size=tp, hidden_size=hidden, hc_mult=hc, max_num_tokens=max(ms))
    rows = []
    for m in ms:
        sets = _input_sets(tp, m, hidden, hc, seed=tp * 10_000 + m)
        sides = [FusedSide(op, s, mxfp8=False) for s in sets]
        rounds = interleaved_times_us({"all ranks": lambda: graph_time_us([s.call for s in sides]),
                                       "publishes": lambda: graph_time_us([s.publish_only for s in sides])})
        row = tp_row(tp, hidden, hc, m, fused_us=statistics.median(rounds["all ranks"]),
                     publish_us=statistics.median(rounds["publishes"]), copy_ceiling_gbs=copy_ceiling_gbs)
        row.rounds_us = rounds
        rows.append(row)
        print(_format_tp_row(row), flush=True)
        del sets, sides
    del op
    return rows


def tp_row(tp: int, hidden: int, hc: int, m: int, *, fused_us: float, publish_us: float, copy_ceiling_gbs: float) -> Row:
    """An emulated TP row from its two times: all tp ranks' calls (fused_us) and their publishes
    alone (publish_us). All tp publishes run, then all tp consumers, so (all - publishes) / tp
    estimates one rank's consumer (PDL overlaps the last publish with the first consumer: an
    underestimate of the consumer's time, so an overestimate of its rate). Its rate is
    consumer_bytes over that time, as a fraction of the copy ceiling; None where the difference
    is not positive (noise where the consumers take next to no time)."""
    row = Row(hidden=hidden, hc=hc, m=m, tp=tp, fused_us=fused_us, publish_us=publish_us)
    row.consumer_us = (fused_us - publish_us) / tp
    row.consumer_bytes = consumer_bytes(tp, m, hidden, hc, False)
    if row.consumer_us > 0:
        row.consumer_ceiling_fraction = _gbs(row.consumer_bytes, row.consumer_us) / copy_ceiling_gbs
    return row


def _gbs(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9


def _per_call_us(fn, calls: int = 2000, batches: int = 5) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls // batches):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6 / (calls // batches))
    return statistics.median(times)


def _cpu_placement() -> str:
    """The CPUs this process may run on and the one it ran on last (Linux), for the log."""
    try:
        with open("/proc/self/stat") as f:
            last = f.read().rsplit(")", 1)[1].split()[36]
        return f"{len(os.sched_getaffinity(0))} CPUs allowed, last on CPU {last}"
    except (OSError, AttributeError, IndexError):
        return "CPU placement unknown"


def single_rank_op(hidden: int, hc: int, capacity: int):
    """AllReduceMHC over a one-process group (the unicast transport, symmetric memory), or None
    with the reason if torch.distributed or symmetric memory is unavailable here."""
    import socket

    import torch.distributed as dist

    from mhc_ar import AllReduceMHC

    try:
        if not dist.is_initialized():
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        return AllReduceMHC(hidden_size=hidden, hc_mult=hc, max_num_tokens=capacity, device="cuda"), ""
    except Exception as error:  # report, fall back to the emulated object
        return None, f"{type(error).__name__}: {error}"


def eager_breakdown_us(op, inputs: Inputs, *, emulated: bool) -> dict:
    """Host wall time per eager call (host-bound at small M), and its parts, each timed alone:
    the call without outputs given (AllReduceMHC: the tensor launcher, argument checks in C) and
    with out= (CallValidator, then the address launcher); CallValidator with the output
    allocation; the allocation; each launcher with its arguments prepared (each launches all
    the call's kernels with one host call); the kernels launched by a host call each (at TP = 1
    the call is one kernel: mhc_ar.config.ConsumerSpec.direct)."""
    i = inputs
    x = i.xs if emulated else i.xs[0]
    mix = (i.residual, i.post, i.comb, i.pre, i.norm_weight)
    kernels = op.parts
    rank = kernels.ranks[0]
    validator = kernels.validator
    launch = validator.check_call(i.xs[0], mix, i.eps, None, None)
    tokens = i.xs[0].shape[0]
    m, hc, hidden = i.residual.shape
    out = (torch.empty(m, hc, hidden, dtype=torch.bfloat16, device="cuda"), torch.empty(m, hidden, dtype=torch.bfloat16, device="cuda"))
    out_arg = [out] if emulated else out

    def kernel_by_kernel():
        kernels.publish(rank, launch, tokens)
        kernels.consume(rank, launch, i.eps, tokens)

    parts = {
        "call": _per_call_us(lambda: op(x, *mix, i.eps)),
        "call with out=": _per_call_us(lambda: op(x, *mix, i.eps, out=out_arg)),
        "validation + allocation": _per_call_us(lambda: validator.check_call(i.xs[0], mix, i.eps, None, None)),
        "allocation": _per_call_us(lambda: validator.fresh_outputs(tokens)),
    }
    addresses, tensors = kernels.launcher(rank), kernels.tensor_launcher(rank)
    if addresses is not None:  # AllReduceMHC
        parts["address launcher"] = _per_call_us(lambda: addresses(*launch.contribution, *launch.mix, *launch.outputs, i.eps, tokens, 0, 0))
        parts["tensor launcher"] = _per_call_us(lambda: tensors(i.xs[0], None, None, None, *mix, *out, i.eps, 0))
    # Same run, for comparison: each kernel by its own host call (what one call replaces).
    parts["one host launch call per kernel"] = _per_call_us(kernel_by_kernel)
    # The host's Python speed varies between machines and runs (the same code measured 22 and
    # 39 us per call): a fixed CPU-only operation to compare runs by.
    parts[HOST_PROBE] = _per_call_us(lambda: torch.empty(0))
    return parts


def _us(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _format_row(row: Row) -> str:
    f = _us
    ratio = row.unfused_us / row.fused_us if row.unfused_us else float("nan")
    return (
        f"H{row.hidden} hc{row.hc} M{row.m}: fused {f(row.fused_us)} us, mxfp8 {f(row.fused_mxfp8_us)} us, publish {f(row.publish_us)} us, "
        f"unfused {f(row.unfused_us)} us (x{ratio:.1f}), unfused+quant {f(row.unfused_mxfp8_us)} us, "
        f"compiled {f(row.compiled_us)} us, compiled+quant {f(row.compiled_mxfp8_us)} us, "
        f"full+quant {f(row.full_plus_quant_us)} us, consumer {f(row.consumer_gbs)} GB/s, "
        f"fused bytes {row.fused_bytes} at {_percent(row.fused_ceiling_fraction)} of the copy ceiling, "
        f"a copy of the same bytes {f(row.same_bytes_copy_us)} us{_rounds_note(row, 'fused', 'mxfp8')}"
    )


def _format_tp_row(row: Row) -> str:
    return (
        f"tp{row.tp} H{row.hidden} hc{row.hc} M{row.m}: all ranks {row.fused_us:.2f} us, publishes {row.publish_us:.2f} us, "
        f"consumer/rank {_us(row.consumer_us)} us, {row.consumer_bytes} bytes at {_percent(row.consumer_ceiling_fraction)} of the copy ceiling"
        f"{_rounds_note(row, 'all ranks', 'publishes')}"
    )


def _spread(row: Row, side: str) -> str:
    """min-max of a side's rounds (us); - where the row has none (a bench.json from before them)."""
    times = row.rounds_us.get(side)
    return "-" if not times else f"{min(times):.2f}-{max(times):.2f}"


def _rounds_note(row: Row, *sides: str) -> str:
    if not row.rounds_us:
        return ""
    return f"; {len(row.rounds_us[sides[0]])} rounds, " + ", ".join(f"{side} {_spread(row, side)}" for side in sides) + " us"


def _percent(fraction) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def _row_name(row: Row) -> str:
    """The row a target's figure comes from, as the log and the tables name it."""
    return ("" if row.tp == 1 else f"tp{row.tp} ") + f"H{row.hidden} hc{row.hc} M{row.m}"


def format_shapes(shapes) -> str:
    return ",".join(f"{hidden}x{hc}" for hidden, hc in shapes)


def _positive_int(text: str) -> int:
    value = int(text, 10)
    if value <= 0:
        raise ValueError(text)
    return value


def _shape(text: str) -> tuple[int, int]:
    """'7168x8' -> (7168, 8): HIDDENxHC, both positive."""
    hidden, sep, hc = text.lower().partition("x")
    if not sep:
        raise ValueError(text)
    return _positive_int(hidden), _positive_int(hc)


def parse_shapes(shapes: str | None = None, hidden: str | None = None, hc: str | None = None) -> tuple[tuple[int, int], ...]:
    """The TP=1 sweep's (hidden, hc) shapes from the command line: --shapes as HIDDENxHC items;
    or --hidden crossed with --hc, where the one not given is the hidden sizes of SHAPES or
    CROSSED_HC; or SHAPES. ValueError naming the option for a malformed or non-positive item,
    or for --shapes given with --hidden or --hc."""
    from .cases import parse_list

    if shapes is not None:
        if hidden is not None or hc is not None:
            raise ValueError("--shapes: give either --shapes or --hidden/--hc, not both")
        return parse_list(shapes, _shape, "shapes")
    if hidden is None and hc is None:
        return SHAPES
    hiddens = parse_list(hidden, _positive_int, "hidden") if hidden is not None else tuple(dict.fromkeys(h for h, _ in SHAPES))
    hcs = parse_list(hc, _positive_int, "hc") if hc is not None else CROSSED_HC
    return tuple((h, c) for h in hiddens for c in hcs)


def run(shapes=SHAPES, ms=M_SWEEP, tps=TP_SWEEP, tp_ms=TP_M_SWEEP, compiled: bool = True) -> BenchResult:
    """The TP=1 sweep over `ms` at each (hidden, hc) of `shapes` (the eager table and the MXFP8
    diagnosis at DETAIL_SHAPE, if it is one of them), then emulated TP at each of `tps` over
    `tp_ms` at DETAIL_SHAPE."""
    start = time.time()
    # The eager figures depend on the host's speed: its CPU-only probe before any GPU work, to
    # compare with the probe beside the eager table.
    print(f"host probe at start: torch.empty(0) on the CPU {_per_call_us(lambda: torch.empty(0)):.2f} us, {_cpu_placement()}", flush=True)
    methods = copy_methods_gbs()
    result = BenchResult(device=torch.cuda.get_device_name(), copy_gbs=max(methods.values()), copy_methods_gbs=methods)
    print(f"device copy bandwidth: {result.copy_gbs:.0f} GB/s (read + write; the best of "
          + ", ".join(f"{m} {v:.0f}" for m, v in methods.items()) + f"); the fused call's bytes: {FUSED_BYTES_FORMULA}", flush=True)
    capacity = max(ms)
    for hidden, hc in shapes:
        ops = tp1_ops(hidden, hc, capacity)
        result.rows += measure_tp1(hidden, hc, ms, ops, compiled=compiled, copy_ceiling_gbs=result.copy_gbs)
        if (hidden, hc) == DETAIL_SHAPE:
            _measure_details(result, hidden, hc, capacity, ops["full"])
        # One shape's instances (workspaces sized for `capacity` tokens) and cached blocks go
        # before the next shape's are made.
        del ops
        torch.cuda.empty_cache()
    for tp in tps:
        result.tp_rows += measure_tp(tp, *DETAIL_SHAPE, tp_ms, copy_ceiling_gbs=result.copy_gbs)
        torch.cuda.empty_cache()
    result.seconds = time.time() - start
    return result


def _measure_details(result: BenchResult, hidden: int, hc: int, capacity: int, full_op) -> None:
    """The eager table and the MXFP8 diagnosis, into `result` (their objects die with this frame)."""
    capacity_ms = lambda ms: [m for m in ms if m <= capacity]  # noqa: E731
    real, why = single_rank_op(hidden, hc, capacity)
    op, emulated = (real, False) if real is not None else (full_op, True)
    result.eager_api = "AllReduceMHC (1-rank group, unicast)" if real is not None else f"EmulatedAllReduceMHC tp=1 ({why})"
    for m in capacity_ms(EAGER_M):
        parts = eager_breakdown_us(op, make_inputs(1, m, hidden, hc, seed=1), emulated=emulated)
        result.eager_us[str(m)] = parts["call"]
        result.eager_us[f"{m} parts"] = parts
        print(f"eager {result.eager_api} H{hidden} hc{hc} M{m}: " + ", ".join(f"{k} {v:.2f} us" for k, v in parts.items()) + f"; {_cpu_placement()}", flush=True)
    result.mxfp8_diagnosis = measure_mxfp8_diagnosis(hidden, hc, capacity_ms(DIAGNOSIS_M), capacity, full_op)


MXFP8_OVER_FULL = 0.08  # the MXFP8 variant's time over the full variant's, at most
TP_CONSUMER_TP, TP_CONSUMER_M, TP_CONSUMER_CEILING = 8, 1024, 0.80  # the emulated TP consumer target


def targets(result: BenchResult) -> list[tuple[str, bool | None, str]]:
    """The targets, each (name, met?, measured figures naming the row that decides it): issue
    13's first, then the earlier ones."""
    return _issue13_targets(result) + _earlier_targets(result)


def _issue13_targets(result: BenchResult) -> list[tuple[str, bool, str]]:
    checks = []
    large = [r for r in result.rows if r.m >= 1024 and r.fused_ceiling_fraction is not None]
    if large:
        low = min(large, key=lambda r: r.fused_ceiling_fraction)
        checks.append(("TP=1, M>=1024: fused bytes / fused time >= 85% of the copy ceiling", low.fused_ceiling_fraction >= 0.85,
                       f"min {_percent(low.fused_ceiling_fraction)} ({_row_name(low)}: {low.fused_bytes} bytes in {low.fused_us:.2f} us)"))
    compiled = [r for r in result.rows if r.compiled_us is not None]
    if compiled:  # against what a user would pick instead
        slowest = max(compiled, key=lambda r: r.fused_us / r.compiled_us)
        checks.append(("TP=1: fused not slower than the torch.compile chain at any M", slowest.fused_us <= slowest.compiled_us,
                       f"worst {_row_name(slowest)}: fused {slowest.fused_us:.2f} us, compiled {slowest.compiled_us:.2f} us"))
        tiny = [r for r in compiled if r.m <= SMALL_M]
        if tiny:  # two conditions, each decided by its own row
            longest = max(tiny, key=lambda r: r.fused_us)
            worst = max(tiny, key=lambda r: r.fused_us / r.compiled_us)
            ok = longest.fused_us <= SMALL_M_TP1_FUSED_US and worst.fused_us <= 0.5 * worst.compiled_us
            floor = ""
            if longest.same_bytes_copy_us is not None:  # why it takes what it takes: the bytes alone
                floor = f" (a copy of the same {longest.fused_bytes} bytes: {longest.same_bytes_copy_us:.2f} us)"
            checks.append((f"TP=1, M<={SMALL_M}: fused <= {SMALL_M_TP1_FUSED_US:.1f} us and <= 0.5x compiled", ok,
                           f"slowest {_row_name(longest)}: {longest.fused_us:.2f} us{floor}; "
                           f"worst ratio {_row_name(worst)}: x{worst.fused_us / worst.compiled_us:.2f} of compiled"))
    if result.rows:
        worst = max(result.rows, key=lambda r: r.fused_mxfp8_us / r.fused_us)
        over = worst.fused_mxfp8_us / worst.fused_us - 1
        checks.append((f"MXFP8 variant <= {100 * MXFP8_OVER_FULL:.0f}% over full at every M", over <= MXFP8_OVER_FULL,
                       f"max +{100 * over:.1f}% ({_row_name(worst)}: {worst.fused_mxfp8_us:.2f} us vs {worst.fused_us:.2f} us)"))
    tp_rows = [r for r in result.tp_rows if r.tp == TP_CONSUMER_TP and r.m == TP_CONSUMER_M]
    if tp_rows:
        name = (f"emulated TP={TP_CONSUMER_TP}, M={TP_CONSUMER_M}: consumer bytes / consumer time >= "
                f"{100 * TP_CONSUMER_CEILING:.0f}% of the copy ceiling")
        unmeasured = [r for r in tp_rows if r.consumer_ceiling_fraction is None]
        if unmeasured:
            r = unmeasured[0]
            checks.append((name, False, f"{_row_name(r)}: all ranks {r.fused_us:.2f} us - publishes {r.publish_us:.2f} us leave no consumer time"))
        else:
            low = min(tp_rows, key=lambda r: r.consumer_ceiling_fraction)
            checks.append((name, low.consumer_ceiling_fraction >= TP_CONSUMER_CEILING,
                           f"{_percent(low.consumer_ceiling_fraction)} ({_row_name(low)}: {low.consumer_bytes} bytes in "
                           f"{low.consumer_us:.2f} us per rank, {_gbs(low.consumer_bytes, low.consumer_us):.0f} of {result.copy_gbs:.0f} GB/s)"))
    return checks


def _earlier_targets(result: BenchResult) -> list[tuple[str, bool | None, str]]:
    checks = []
    small = [r for r in result.rows if r.hidden == 5120 and r.m <= SMALL_M]
    if small:
        worst = max(r.fused_us for r in small)
        ratio = min(r.unfused_us / r.fused_us for r in small)
        checks.append((f"M<={SMALL_M}, H=5120: fused <= {SMALL_M_FUSED_US:g} us", worst <= SMALL_M_FUSED_US, f"max {worst:.2f} us"))
        checks.append((f"M<={SMALL_M}, H=5120: >= 4x unfused", ratio >= 4.0, f"min x{ratio:.1f}"))
    big = [r for r in result.rows if r.m == 1024]
    if big:
        ratio = min(r.unfused_us / r.fused_us for r in big)
        frac = min((r.consumer_gbs or 0) / result.copy_gbs for r in big)
        checks.append(("M=1024: >= 10x unfused", ratio >= 10.0, f"min x{ratio:.1f}"))
        checks.append(("M=1024: consumer bytes / fused time >= 75% of copy bandwidth", frac >= 0.75, f"min {100 * frac:.0f}%"))
    if result.rows:
        beats = all(r.fused_mxfp8_us < r.full_plus_quant_us for r in result.rows)
        checks.append(("MXFP8 variant beats full + separate quantize", beats, "all rows" if beats else "not all rows"))
    if "1" in result.eager_us:
        measured = f"{result.eager_us['1']:.2f} us"
        probe = result.eager_us.get("1 parts", {}).get(HOST_PROBE)
        if probe is not None:  # the host's speed, to read the figure by (README, Benchmark)
            measured += f" (host probe {probe:.2f} us)"
        checks.append(("eager call overhead < 20 us at M=1", result.eager_us["1"] < 20.0, measured))
    return checks


def _eager_table(eager_us: dict) -> str:
    """One row per M, one column per measured part (the keys of eager_breakdown_us)."""
    parts = {m.removesuffix(" parts"): v for m, v in eager_us.items() if m.endswith(" parts")}
    if not parts:
        return "<p>not measured</p>"
    columns = list(next(iter(parts.values())))
    head = "".join(f"<th>{html_escape(c)}</th>" for c in columns)
    rows = "".join(
        f"<tr><td>{html_escape(m)}</td>" + "".join(f"<td>{values.get(c, float('nan')):.2f}</td>" for c in columns) + "</tr>"
        for m, values in parts.items()
    )
    return f"<table><tr><th>M</th>{head}</tr>{rows}</table>"


def load_result(path: Path) -> BenchResult:
    """A BenchResult from a bench.json that write_report wrote (its saved target verdicts are
    dropped: rendering decides them again from the figures). Fields added since are left at
    their defaults (e.g. same_bytes_copy_us: None, shown as not measured)."""
    saved = json.loads(Path(path).read_text())
    saved.pop("targets", None)
    saved["rows"] = [Row(**r) for r in saved.get("rows", [])]
    saved["tp_rows"] = [Row(**r) for r in saved.get("tp_rows", [])]
    return BenchResult(**saved)


def write_report(result: BenchResult, out: Path, *, rendered_from: Path | None = None) -> None:
    """bench.json (the figures and the target verdicts) and bench.html into `out`; with
    `rendered_from` (a saved bench.json re-rendered without a GPU) only bench.html, saying so."""
    out.mkdir(parents=True, exist_ok=True)
    if rendered_from is None:
        (out / "bench.json").write_text(json.dumps(asdict(result) | {"targets": targets(result)}, indent=1))
    (out / "bench.html").write_text(_html(result, rendered_from))


def _html(result: BenchResult, rendered_from: Path | None) -> str:
    from .plots import line_plot_svg

    series = {}
    for r in result.rows:  # one fused, eager unfused and torch.compile series per (H, hc)
        shape = f"H{r.hidden} hc{r.hc}"
        series.setdefault(f"fused {shape}", []).append((r.m, r.fused_us))
        series.setdefault(f"eager unfused {shape}", []).append((r.m, r.unfused_us))
        if r.compiled_us is not None:
            series.setdefault(f"torch.compile {shape}", []).append((r.m, r.compiled_us))
        if r.same_bytes_copy_us is not None:
            series.setdefault(f"same-bytes copy {shape}", []).append((r.m, r.same_bytes_copy_us))
    svg = line_plot_svg(series, x_label="M (tokens)", y_label="us per call", log_x=True, log_y=True)
    rows = "".join(
        f"<tr><td>{r.hidden}</td><td>{r.hc}</td><td>{r.m}</td><td>{r.fused_us:.2f}</td><td>{r.fused_mxfp8_us:.2f}</td><td>{_us(r.publish_us)}</td>"
        f"<td>{r.unfused_us:.2f}</td><td>{r.unfused_mxfp8_us:.2f}</td><td>{_us(r.compiled_us)}</td><td>{_us(r.compiled_mxfp8_us)}</td>"
        f"<td>{r.full_plus_quant_us:.2f}</td>"
        f"<td>{r.unfused_us / r.fused_us:.1f}</td><td>{'' if r.consumer_gbs is None else f'{r.consumer_gbs:.0f}'}</td>"
        f"<td>{_percent(r.fused_ceiling_fraction)}</td><td>{_us(r.same_bytes_copy_us)}</td>"
        f"<td>{'-' if r.same_bytes_copy_us is None else f'{r.fused_us / r.same_bytes_copy_us:.2f}'}</td>"
        f"<td>{_spread(r, 'fused')}</td><td>{_spread(r, 'mxfp8')}</td></tr>"
        for r in result.rows
    )
    tp_rows = "".join(
        f"<tr><td>{r.tp}</td><td>{r.hidden}</td><td>{r.hc}</td><td>{r.m}</td><td>{r.fused_us:.2f}</td><td>{r.publish_us:.2f}</td>"
        f"<td>{_us(r.consumer_us)}</td><td>{r.consumer_bytes}</td><td>{_percent(r.consumer_ceiling_fraction)}</td>"
        f"<td>{_spread(r, 'all ranks')}</td><td>{_spread(r, 'publishes')}</td></tr>"
        for r in result.tp_rows
    )
    builds = ["full", *DIAGNOSIS_BUILDS]
    diagnosis_rows = "".join(
        f"<tr><td>{d['hidden']}</td><td>{d['hc']}</td><td>{d['m']}</td>" + "".join(f"<td>{d[b]:.2f}</td>" for b in builds) + "</tr>"
        for d in result.mxfp8_diagnosis
    )
    target_rows = "".join(
        f"<tr class='{'pass' if ok else 'fail'}'><td>{html_escape(name)}</td><td>{'met' if ok else 'missed'}</td><td>{html_escape(figure)}</td></tr>"
        for name, ok, figure in targets(result)
    )
    detail_hidden, detail_hc = DETAIL_SHAPE
    html = f"""<!doctype html><html><head><meta charset="utf-8"><title>mhc-ar bench</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}
tr.pass td{{background:#dfd}}tr.fail td{{background:#fdd}}</style></head><body>
<h1>mhc-ar benchmark</h1>{_rendered_note(rendered_from)}<p>{result.device}; device copy bandwidth {result.copy_gbs:.0f} GB/s (read + write, the best of {COPY_CEILING_TRIALS} copies of {COPY_CEILING_BYTES >> 30} GiB each way: {html_escape(", ".join(f"{m} {v:.0f}" for m, v in result.copy_methods_gbs.items()))});
every time is the median per call of {REPEATS} replays of a CUDA graph of {CALLS_PER_GRAPH} calls{_rounds_text(result)}; total {result.seconds:.0f} s.</p>
<h2>Targets</h2><table><tr><th>target</th><th>result</th><th>measured</th></tr>{target_rows}</table>
<h2>Latency vs M (TP=1, each (H, hc))</h2>{svg}
<table><tr><th>H</th><th>hc</th><th>M</th><th>fused us</th><th>fused MXFP8 us</th><th>publish us</th><th>unfused us</th><th>unfused+quant us</th>
<th>compiled us</th><th>compiled+quant us</th>
<th>fused full + quantize us</th><th>speed-up</th><th>consumer bytes / fused time, GB/s</th><th>fused bytes / fused time, of the copy ceiling</th>
<th>copy of the same bytes us</th><th>fused / copy of the same bytes</th><th>fused rounds, min-max us</th>
<th>fused MXFP8 rounds, min-max us</th></tr>{rows}</table>
<p>A copy of the same bytes: an x * 1 kernel in a graph, timed like the fused call, reading half the fused bytes and writing
as many (at TP=1 the full variant reads x and the residual and writes new_residual and layer_input: M*H*2*(1 + hc) bytes each
way). What moving those bytes alone takes at that size, launch and memory latency included: at small M the floor under the fused
time.</p>
<h2>MXFP8 cost, stage by stage (us per call; builds that leave a stage out break the contract: diagnosis only)</h2>
<table><tr><th>H</th><th>hc</th><th>M</th>{"".join(f"<th>{html_escape(b)}</th>" for b in builds)}</tr>{diagnosis_rows}</table>
<h2>Emulated TP (consumer per rank = (all ranks - publishes) / tp; its bytes per consumer_bytes)</h2>
<table><tr><th>tp</th><th>H</th><th>hc</th><th>M</th><th>all ranks us</th><th>publishes us</th><th>consumer/rank us</th><th>consumer bytes</th>
<th>consumer bytes / consumer time, of the copy ceiling</th><th>all ranks rounds, min-max us</th><th>publishes rounds, min-max us</th></tr>{tp_rows}</table>
<h2>Eager __call__ latency (H={detail_hidden}, hc={detail_hc}, TP=1, host wall time per call, us)</h2>
<p>{html_escape(result.eager_api)}</p>{_eager_table(result.eager_us)}</body></html>"""
    return html


def _rounds_text(result: BenchResult) -> str:
    rounds = next((len(times) for r in result.rows + result.tp_rows for times in r.rounds_us.values()), 0)
    if not rounds:  # a bench.json from before the rounds
        return ""
    return (f"; the fused, fused MXFP8 and full + quantize times of a TP=1 row and both times of a TP row are the median of "
            f"{rounds} such figures, the sides timed in turn (their spread in the last columns)")


def _rendered_note(rendered_from: Path | None) -> str:
    if rendered_from is None:
        return ""
    return (f"<p><b>Re-rendered from {html_escape(str(rendered_from))}</b> by this version of the bench, without a GPU: the "
            "figures are that run's; the targets are judged again from them; columns it did not measure show -.</p>")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="report folder (default reports/bench-<time>)")
    parser.add_argument("--shapes", default=None,
                        help=f"TP=1 shapes, HIDDENxHC comma list (default {format_shapes(SHAPES)}); not with --hidden/--hc")
    parser.add_argument("--hidden", default=None,
                        help="hidden sizes, comma list, crossed with --hc (without --hc: hc "
                             f"{','.join(map(str, CROSSED_HC))}, e.g. --hidden 5120 is --shapes 5120x{CROSSED_HC[0]})")
    parser.add_argument("--hc", default=None,
                        help="hc values, comma list, crossed with --hidden (without --hidden: the hidden sizes of the default shapes)")
    parser.add_argument("--m", default=",".join(map(str, M_SWEEP)), help="the TP=1 sweep's M (the instances' capacity is the largest)")
    parser.add_argument("--tp", default=",".join(map(str, TP_SWEEP)),
                        help=f"emulated TP sizes for the consumer sweep at M {','.join(map(str, TP_M_SWEEP))}, "
                             f"H={DETAIL_SHAPE[0]}, hc={DETAIL_SHAPE[1]} ('' for none)")
    parser.add_argument("--no-compiled", action="store_true", help="leave the torch.compile chain out (it compiles once per shape)")
    parser.add_argument("--render", default=None, metavar="BENCH_JSON",
                        help="measure nothing: write bench.html from a saved bench.json into --out (no GPU needed)")
    args = parser.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes, args.hidden, args.hc)
    except ValueError as error:
        parser.error(str(error))
    if args.render is not None:
        return _render(Path(args.render), Path(args.out) if args.out else Path("reports") / time.strftime("bench-render-%Y%m%d-%H%M%S"))
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU", file=sys.stderr)
        return 2
    from mhc_ar.transport import disable_multicast_env

    disable_multicast_env()
    ints = lambda text: tuple(int(v) for v in text.split(",") if v)  # noqa: E731
    result = run(shapes=shapes, ms=ints(args.m), tps=ints(args.tp), compiled=not args.no_compiled)
    out = Path(args.out) if args.out else Path("reports") / time.strftime("bench-%Y%m%d-%H%M%S")
    write_report(result, out)
    print(f"\nbench: {len(result.rows)} TP=1 rows ({format_shapes(shapes)}), {len(result.tp_rows)} TP rows in {result.seconds:.0f} s -> {out}/bench.html")
    for name, ok, figure in targets(result):
        print(f"  [{'met' if ok else 'MISSED'}] {name}: {figure}")
    return 0


def _render(source: Path, out: Path) -> int:
    try:
        result = load_result(source)
    except (OSError, ValueError, TypeError, AttributeError) as error:  # missing, not JSON, or not a bench.json
        print(f"--render: cannot read a bench result from {source}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    write_report(result, out, rendered_from=source)
    print(f"bench: {source} re-rendered -> {out}/bench.html")
    for name, ok, figure in targets(result):
        print(f"  [{'met' if ok else 'MISSED'}] {name}: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
