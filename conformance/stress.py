"""Concurrent ranks under stress: every virtual rank on its own CUDA stream (mhc_ar.concurrent),
launching its own calls with no host synchronization between them, skewed by random delays.

    python -m conformance.stress [--tp 2,3,4,8] [--calls 10000] [--replays 100] [--seed 0]

Per TP size, two instances on the same ranks (H=5120 hc=4 full and H=4096 hc=2 MXFP8, each with
its max_num_tokens at the co-residency bound, at most MAX_TOKENS), calls and finalizes
interleaved at random, M random in 1..capacity, inputs drawn from three families:

* eager: `calls` calls per rank back to back in batches of BATCH (the host waits only between
  batches, to compare), each rank delayed by 0..MAX_SKEW_US before each call, every output
  NaN-poisoned before the batch; every byte of every rank's every output of every call is
  compared with the reference.
* graphs: GRAPH_CALLS calls captured per rank stream (delays included) into one CUDA graph per
  rank, replayed `replays` times with new inputs copied into the captured buffers before each
  replay (ALTERNATIVES sets per call, same shapes); outputs re-poisoned and every byte compared.

Prints one summary line per TP size and part; `run` returns the figures.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field

import torch

from mhc_ar.config import Contribution, Variant
from reference import ReductionTree, all_reduce_mhc

from .cases import Case, Family
from .inputs import CaseInputs, make_inputs
from .compare import first_mismatch
from .runner import call_rank, poison, poisoned_outputs

INSTANCES = (
    dict(hidden=5120, hc=4, top_k=8, variant=Variant.FULL),
    dict(hidden=4096, hc=2, top_k=4, variant=Variant.MXFP8),
)
MAX_TOKENS = 16
FAMILIES = (Family.NORMAL, Family.SIGNED_ZEROS, Family.NAN_INF)
SETS_PER_INSTANCE = 8
MAX_SKEW_US = 50.0
BATCH = 500
GRAPH_CALLS = 24
ALTERNATIVES = 4


@dataclass
class InputSet:
    """One call's inputs for every rank and the reference's bytes (the same for every rank)."""

    instance: int
    case: Case
    inputs: CaseInputs
    expected: dict  # output name -> reference tensor viewed as integers


@dataclass
class Tally:
    calls_per_rank: int = 0
    ops: dict = field(default_factory=dict)  # "call"/"finalize" -> count
    tokens: set = field(default_factory=set)
    bytes_checked: int = 0
    mismatches: int = 0
    first_mismatch: str | None = None
    seconds: float = 0.0


def _as_int(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({1: torch.uint8, 2: torch.int16}[tensor.element_size()])


class Stress:
    def __init__(self, tp: int, *, seed: int = 0, device="cuda"):
        from mhc_ar.concurrent import ConcurrentRanks

        self.tp, self.device = tp, torch.device(device)
        self.rng = random.Random(seed * 1000 + tp)
        self.ranks = ConcurrentRanks(tp_size=tp, device=self.device)
        self.instances = []  # (arguments, per-rank ops, capacity, reduction tree)
        for arguments in INSTANCES:
            variant = arguments["variant"]
            kwargs = dict(hidden_size=arguments["hidden"], hc_mult=arguments["hc"], top_k=arguments["top_k"],
                          quantize_layer_input=variant is Variant.MXFP8, residual_only=variant is Variant.RESIDUAL_ONLY)
            capacity = min(MAX_TOKENS, self.ranks.max_tokens(**kwargs))
            if capacity < 1:
                raise ValueError(f"tp={tp}: no M fits the co-residency bound for {arguments}")
            ops = self.ranks.add(max_num_tokens=capacity, **kwargs)
            tree = ReductionTree(**ops[0].consumer_tiling.reduction_tree_args())
            self.instances.append((arguments, ops, capacity, tree))

    def warm_up(self) -> None:
        """One in-step call and finalize per instance, then a sync: every kernel is loaded before
        the stress (CUDA may load a kernel lazily at its first launch, and loading can
        synchronize the context while a consumer waits for a peer the host has yet to launch)."""
        for instance, (_, _, capacity, _) in enumerate(self.instances):
            for op in (Contribution.CALL, Contribution.FINALIZE):
                item = self.input_set(instance, capacity, op, Family.NORMAL, 0)
                outputs = poisoned_outputs(item.case, self.device)
                torch.cuda.synchronize(self.device)
                self.launch([item], [outputs], [[0.0] * self.tp])
                self.ranks.synchronize()
                tally = Tally()
                self.compare([item], [outputs], tally, "warm-up")
                if tally.mismatches:
                    raise AssertionError(tally.first_mismatch)

    def describe_instances(self) -> str:
        return ", ".join(f"H{a['hidden']} hc{a['hc']} {a['variant'].value} cap {c}" for a, _, c, _ in self.instances)

    # ---- inputs ---------------------------------------------------------------------------

    def input_set(self, instance: int, m: int, op: Contribution, family: Family, seed_offset: int) -> InputSet:
        arguments, _, capacity, tree = self.instances[instance]
        case = Case(tp=self.tp, hidden=arguments["hidden"], hc=arguments["hc"], m=m, op=op, variant=arguments["variant"],
                    family=family, top_k=arguments["top_k"] if op is Contribution.FINALIZE else 0, capacity=capacity,
                    seed_offset=seed_offset)
        inputs = make_inputs(case, self.device)
        ref = all_reduce_mhc(inputs.ranks, inputs.mix, tree=tree, mxfp8=case.variant is Variant.MXFP8)
        expected = {"new_residual": _as_int(ref.new_residual)}
        if ref.layer_input is not None:
            expected["layer_input"] = _as_int(ref.layer_input)
        if case.variant is Variant.MXFP8:
            expected["mxfp8_values"] = ref.mxfp8_values.view(torch.uint8)
            expected["mxfp8_scales"] = ref.mxfp8_scales.view(torch.uint8)
        return InputSet(instance, case, inputs, expected)

    def random_sets(self) -> list[InputSet]:
        sets = []
        for instance, (_, _, capacity, _) in enumerate(self.instances):
            sizes = [1, capacity] + [self.rng.randint(1, capacity) for _ in range(SETS_PER_INSTANCE - 2)]
            for k, m in enumerate(sizes):
                op = (Contribution.CALL, Contribution.FINALIZE)[k % 2]
                sets.append(self.input_set(instance, m, op, FAMILIES[k % len(FAMILIES)], self.rng.randrange(1 << 20)))
        return sets

    # ---- calls ----------------------------------------------------------------------------

    def launch(self, plan, outputs, skews) -> None:
        """Every rank's calls of `plan` on its own stream; ranks are visited in a rotating order
        per call and each is delayed by its skew first. No host synchronization."""
        for k, item in enumerate(plan):
            ops = self.instances[item.instance][1]
            for i in range(self.tp):
                r = (k + i) % self.tp
                self.ranks.delay(r, skews[k][r])
                with self.ranks.on(r):
                    call_rank(ops[r], item.case, item.inputs, r, outputs[k])

    def skews(self, count: int):
        return [[self.rng.uniform(0.0, MAX_SKEW_US) for _ in range(self.tp)] for _ in range(count)]

    def compare(self, plan, outputs, tally: Tally, where: str) -> None:
        """Every byte of every rank's outputs against the reference (on the GPU, one host read)."""
        counts, labels = [], []
        for k, item in enumerate(plan):
            for r in range(self.tp):
                for name, want in item.expected.items():
                    got = getattr(outputs[k], name)[r]
                    counts.append((got.view(want.dtype) != want).sum())
                    labels.append((k, r, name))
                    tally.bytes_checked += got.numel() * got.element_size()
        totals = torch.stack(counts).cpu().tolist()
        tally.mismatches += sum(totals)
        if any(totals) and tally.first_mismatch is None:
            index = next(i for i, t in enumerate(totals) if t)
            k, r, name = labels[index]
            got, want = getattr(outputs[k], name)[r], plan[k].expected[name]
            mismatch = first_mismatch(want, got.view(want.dtype), output=name, rank=r)
            detail = mismatch.describe() if mismatch is not None else f"{totals[index]} elements differ"
            tally.first_mismatch = f"{where}, call {k} ({plan[k].case.id}), rank {r}: {detail}"

    def eager(self, calls: int) -> Tally:
        sets = self.random_sets()
        tally = Tally()
        start = time.perf_counter()
        for first in range(0, calls, BATCH):
            plan = [sets[self.rng.randrange(len(sets))] for _ in range(min(BATCH, calls - first))]
            outputs = [poisoned_outputs(item.case, self.device) for item in plan]
            torch.cuda.synchronize(self.device)
            self.launch(plan, outputs, self.skews(len(plan)))
            self.ranks.synchronize()
            self.compare(plan, outputs, tally, f"eager batch {first // BATCH}")
            self._count(plan, tally)
        tally.seconds = time.perf_counter() - start
        return tally

    def graphs(self, replays: int) -> Tally:
        """GRAPH_CALLS calls captured per rank, replayed with new inputs each time."""
        shapes = []
        for k in range(GRAPH_CALLS):
            instance = k % len(self.instances)
            capacity = self.instances[instance][2]
            shapes.append((instance, self.rng.randint(1, capacity), (Contribution.CALL, Contribution.FINALIZE)[(k // 2) % 2]))
        alternatives = [
            [self.input_set(i, m, op, FAMILIES[(k + a) % len(FAMILIES)], self.rng.randrange(1 << 20)) for a in range(ALTERNATIVES)]
            for k, (i, m, op) in enumerate(shapes)
        ]
        static = [_clone_set(choices[0]) for choices in alternatives]
        outputs = [poisoned_outputs(item.case, self.device) for item in static]
        skews = self.skews(GRAPH_CALLS)
        torch.cuda.synchronize(self.device)
        graphs = []
        for r in range(self.tp):
            ops_of = [self.instances[item.instance][1][r] for item in static]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.ranks.streams[r]):
                for k, item in enumerate(static):
                    self.ranks.delay(r, skews[k][r])
                    call_rank(ops_of[k], item.case, item.inputs, r, outputs[k])
            graphs.append(graph)
        tally = Tally()
        start = time.perf_counter()
        for replay in range(replays):
            chosen = [choices[replay % ALTERNATIVES] for choices in alternatives]
            for target, source in zip(static, chosen):
                for name, tensor in target.inputs.tensors().items():
                    tensor.copy_(source.inputs.tensors()[name])
            for buffers in outputs:
                poison(buffers)
            torch.cuda.synchronize(self.device)
            for i in range(self.tp):
                r = (replay + i) % self.tp
                with self.ranks.on(r):
                    graphs[r].replay()
            self.ranks.synchronize()
            self.compare(chosen, outputs, tally, f"graph replay {replay}")
            self._count(chosen, tally)
        tally.seconds = time.perf_counter() - start
        return tally

    def _count(self, plan, tally: Tally) -> None:
        tally.calls_per_rank += len(plan)
        for item in plan:
            tally.ops[item.case.op.value] = tally.ops.get(item.case.op.value, 0) + 1
            tally.tokens.add(item.case.m)


def _clone_set(item: InputSet) -> InputSet:
    tensors = {name: t.clone() for name, t in item.inputs.tensors().items()}
    inputs = CaseInputs.from_tensors(tensors, tp=item.case.tp, eps=item.inputs.mix.eps)
    return InputSet(item.instance, item.case, inputs, item.expected)


def _summary(tp: int, part: str, stress: Stress, tally: Tally, extra: str) -> str:
    tokens = f"M {min(tally.tokens)}..{max(tally.tokens)}" if tally.tokens else "M -"
    ops = ", ".join(f"{n} {k}" for k, n in sorted(tally.ops.items()))
    line = (f"tp={tp} {part}: {tally.calls_per_rank} calls per rank ({ops}) on {stress.describe_instances()}; {tokens}; "
            f"{extra}; {tally.bytes_checked} bytes checked, {tally.mismatches} mismatching elements, {tally.seconds:.1f} s")
    if tally.first_mismatch:
        line += f"; first: {tally.first_mismatch}"
    return line


def run(tps=(2, 3, 4, 8), calls: int = 10_000, replays: int = 100, seed: int = 0, report=print) -> list[dict]:
    results = []
    for tp in tps:
        stress = Stress(tp, seed=seed)
        stress.warm_up()
        eager = stress.eager(calls)
        report(_summary(tp, "eager", stress, eager, f"skews 0-{MAX_SKEW_US:g} us per rank and call, batches of {BATCH}"))
        graphs = stress.graphs(replays)
        report(_summary(tp, "graphs", stress, graphs, f"{GRAPH_CALLS} calls per rank graph x {replays} replays, new inputs each"))
        results.append(dict(tp=tp, eager=eager, graphs=graphs, instances=stress.describe_instances()))
        del stress
        torch.cuda.empty_cache()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.stress", description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="2,3,4,8", help="TP sizes, comma-separated (default 2,3,4,8)")
    parser.add_argument("--calls", type=int, default=10_000, help="eager calls per rank (default 10000)")
    parser.add_argument("--replays", type=int, default=100, help="graph replays (default 100)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = run([int(t) for t in args.tp.split(",") if t], args.calls, args.replays, args.seed)
    bad = sum(r["eager"].mismatches + r["graphs"].mismatches for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
