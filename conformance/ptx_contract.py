"""The PTX contract: what the compiled kernels must (and must not) contain.

The numerics contract (SPEC.md) fixes every floating-point instruction, and the protocol fixes
how memory is touched. Both are visible in the PTX, which CuTe DSL produces without a GPU, so
every kernel variant is compiled for every target arch and read here. Each check is named and
says what it found; a check fails on PTX that lacks (or has) the instruction in question, so
it also guards against a refactor that silently changes the code the DSL emits.
"""

from __future__ import annotations

import re
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from mhc_ar.config import ConsumerSpec, Contribution, PublishSpec, Variant
from mhc_ar.protocol import SENTINEL_HIGH_PTX as SENTINEL_HIGH, SENTINEL_LOW_PTX as SENTINEL_LOW

from .status import CheckStatus

_FLOAT_TYPES = (".f16", ".f16x2", ".bf16", ".bf16x2", ".f32", ".f64")


@dataclass(frozen=True)
class PtxCheck:
    name: str
    passed: bool
    message: str

    def to_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "message": self.message}


@dataclass(frozen=True)
class Instruction:
    line: int  # 1-based line in the PTX text
    opcode: str  # e.g. "fma.rn.f32" (predicate guard removed)
    operands: str
    text: str
    guarded: bool = False  # executed under a predicate (@p / @!p)


_GUARD = re.compile(r"^@!?%?\w+\s+")
_LABEL = re.compile(r"^([$%\w]+):$")


def _parse(ptx: str) -> tuple[list[Instruction], dict[str, int]]:
    """Instructions in text order, and each label's position (index of the next instruction)."""
    instructions: list[Instruction] = []
    labels: dict[str, int] = {}
    for number, raw in enumerate(ptx.splitlines(), start=1):
        line = raw.split("//", 1)[0]
        # Inline-asm blocks put several statements on one line: split at ';'.
        for statement in line.split(";"):
            text = statement.strip().strip("{}").strip()
            label = _LABEL.match(text)
            if label:
                labels[label.group(1)] = len(instructions)
                continue
            if not text or text.startswith("."):
                continue
            guard = _GUARD.match(text)
            text = _GUARD.sub("", text)
            opcode, _, operands = text.partition(" ")
            if not re.match(r"^[a-z]", opcode):
                continue
            instructions.append(Instruction(number, opcode, operands.strip(), text, guard is not None))
    return instructions, labels


def parse_instructions(ptx: str) -> list[Instruction]:
    """Every instruction of the PTX text in order (labels, directives, braces, comments skipped)."""
    return _parse(ptx)[0]


_BRANCHES = ("bra", "bra.uni")
_EXITS = ("ret", "exit", "trap")


def _is_branch(i: Instruction) -> bool:
    return i.opcode in _BRANCHES


class _Kernel:
    """The parsed PTX of one kernel, its basic blocks, and small queries over them."""

    def __init__(self, ptx: str):
        self.ptx = ptx
        self.instructions, self.labels = _parse(ptx)
        self._build_blocks()

    def _build_blocks(self) -> None:
        n = len(self.instructions)
        starts = {0, *self.labels.values()}
        starts |= {k + 1 for k, i in enumerate(self.instructions) if _is_branch(i) or i.opcode in _EXITS}
        self.block_starts = sorted(s for s in starts if s < n)
        self.block_of = {}
        for b, start in enumerate(self.block_starts):
            end = self.block_starts[b + 1] if b + 1 < len(self.block_starts) else n
            for k in range(start, end):
                self.block_of[k] = b
        self.successors: list[set[int]] = []
        for b, start in enumerate(self.block_starts):
            end = self.block_starts[b + 1] if b + 1 < len(self.block_starts) else n
            last = self.instructions[end - 1]
            following = {b + 1} if b + 1 < len(self.block_starts) else set()
            if _is_branch(last):
                target = self.labels.get(last.operands.strip())
                targets = {self.block_of[target]} if target is not None and target < n else set()
                self.successors.append(targets | (following if last.guarded else set()))
            elif last.opcode in _EXITS:
                self.successors.append(following if last.guarded else set())
            else:
                self.successors.append(following)

    def block_instructions(self, b: int) -> list[Instruction]:
        start = self.block_starts[b]
        end = self.block_starts[b + 1] if b + 1 < len(self.block_starts) else len(self.instructions)
        return self.instructions[start:end]

    def loop_of(self, b: int) -> set[int]:
        """The blocks on a cycle through block b (its strongly connected component), or an
        empty set if b is on no cycle."""
        def reach(start, edges):
            seen, todo = set(), [start]
            while todo:
                x = todo.pop()
                for y in edges[x]:
                    if y not in seen:
                        seen.add(y)
                        todo.append(y)
            return seen
        predecessors = [set() for _ in self.successors]
        for x, ys in enumerate(self.successors):
            for y in ys:
                predecessors[y].add(x)
        forward = reach(b, self.successors)
        if b not in forward:
            return set()
        return forward & (reach(b, predecessors) | {b})

    def count(self, opcode: str) -> int:
        return sum(1 for i in self.instructions if i.opcode == opcode)

    def matching(self, predicate: Callable[[Instruction], bool]) -> list[Instruction]:
        return [i for i in self.instructions if predicate(i)]

    def first_index(self, predicate: Callable[[Instruction], bool]) -> int | None:
        for k, i in enumerate(self.instructions):
            if predicate(i):
                return k
        return None


def _present(kernel: _Kernel, opcode: str, why: str) -> PtxCheck:
    n = kernel.count(opcode)
    return PtxCheck(f"has {opcode}", n > 0, f"{n} x {opcode} ({why})" if n else f"no {opcode} ({why})")


def _exactly(kernel: _Kernel, opcode: str, expected: int, why: str) -> PtxCheck:
    n = kernel.count(opcode)
    name = f"{expected} x {opcode}" if expected else f"no {opcode}"
    return PtxCheck(name, n == expected, f"found {n}, expected {expected} ({why})")


def _arithmetic(i: Instruction) -> bool:
    base = i.opcode.split(".", 1)[0]
    return base in ("fma", "add", "sub", "mul", "div", "mad") and any(i.opcode.endswith(t) for t in _FLOAT_TYPES)


def _no_ftz_arithmetic(kernel: _Kernel) -> PtxCheck:
    """Subnormals are part of the contract (the tiny family): only rsqrt.approx may flush."""
    bad = kernel.matching(lambda i: _arithmetic(i) and ".ftz" in i.opcode)
    message = "no .ftz on fma/add/sub/mul/div" if not bad else f"{len(bad)} flushing: line {bad[0].line}: {bad[0].text}"
    return PtxCheck("no .ftz on float arithmetic", not bad, message)


def _divisions_are_ieee(kernel: _Kernel) -> PtxCheck:
    bad = kernel.matching(lambda i: i.opcode.startswith("div.") and i.opcode.endswith(".f32") and i.opcode != "div.rn.f32")
    message = "every f32 division is div.rn.f32" if not bad else f"line {bad[0].line}: {bad[0].text} (contract: div.rn.f32)"
    return PtxCheck("f32 division is IEEE (div.rn)", not bad, message)


def _is_global_load(i: Instruction) -> bool:
    """Loads that can read global memory: ld/ldu/cp.async with .global, and generic-address
    ld (no state space), which may point at global memory too."""
    op = i.opcode
    if op.startswith(("ld.", "ldu.")) or op == "ld":
        spaces = (".param", ".shared", ".local", ".const")
        return ".global" in op or not any(s in op for s in spaces)
    return op.startswith("cp.async") and ".global" in op


def _reachable_before(kernel: _Kernel, wait: int, predicate: Callable[[Instruction], bool]) -> list[Instruction]:
    """Instructions matching `predicate` on some path from the kernel entry that does not pass
    the instruction at index `wait`."""
    wait_block = kernel.block_of[wait]
    early: list[Instruction] = []
    seen, todo = {0}, [0]
    while todo:
        b = todo.pop()
        body = kernel.block_instructions(b)
        if b == wait_block:
            start = kernel.block_starts[b]
            early += [i for i in kernel.instructions[start:wait] if predicate(i)]
            continue  # every path through this block passes the wait
        early += [i for i in body if predicate(i)]
        for nxt in kernel.successors[b]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return sorted(early, key=lambda i: i.line)


def _loads_before_wait(kernel: _Kernel, wait: int) -> list[Instruction]:
    """Global loads on some path from the kernel entry that does not pass the wait at `wait`."""
    return _reachable_before(kernel, wait, _is_global_load)


def _is_global_store(i: Instruction) -> bool:
    op = i.opcode
    if op.startswith("st.") or op.startswith("multimem.st"):
        return ".global" in op or not any(s in op for s in (".param", ".shared", ".local"))
    return False


def _zero_registers(kernel: _Kernel) -> set[str]:
    """Registers whose every definition is `mov.b32 %r, 0`."""
    defined: dict[str, set[str]] = {}
    for i in kernel.instructions:
        parts = [p.strip() for p in i.operands.split(",")]
        if parts and parts[0].startswith("%") and not i.opcode.startswith(("st.", "bra", "setp")):
            value = parts[1] if i.opcode.startswith("mov.") and len(parts) == 2 else None
            defined.setdefault(parts[0], set()).add(value if value is not None else "?")
    return {reg for reg, values in defined.items() if values == {"0"}}


def _consumer_stores_before_wait(kernel: _Kernel, variant: Variant, direct: bool = False) -> PtxCheck:
    """PDL: the consumer may store before griddepcontrol.wait only zeros into the MXFP8 padding
    scales (it starts after the publish passed its wait; see the kernel). Any other early
    store could race a kernel still reading last call's outputs. At tp = 1 (direct) no publish
    stands between it and the kernel before: no store at all before the wait."""
    name = "no global store before griddepcontrol.wait" if direct else "stores before griddepcontrol.wait: only MXFP8 padding zeros"
    wait = kernel.first_index(lambda i: i.opcode == "griddepcontrol.wait")
    if wait is None:
        return PtxCheck(name, False, "no griddepcontrol.wait")
    early = _reachable_before(kernel, wait, _is_global_store)
    if direct or variant is not Variant.MXFP8:
        if early:
            return PtxCheck(name, False, f"line {early[0].line}: {early[0].text} is reachable before the wait")
        return PtxCheck(name, True, "no global store before the wait")
    zeros = _zero_registers(kernel)
    for i in early:
        values = re.findall(r"%\w+", i.operands.split("]", 1)[-1])
        if not values or not all(v in zeros for v in values):
            return PtxCheck(name, False, f"line {i.line}: {i.text} stores a value other than zero before the wait")
    if not early:
        return PtxCheck(name, False, "no padding-scale stores before the wait (expected them to overlap the publish)")
    return PtxCheck(name, True, f"{len(early)} zero stores (padding scales) before the wait, nothing else")


def _dependents_after_wait(kernel: _Kernel) -> PtxCheck:
    """The publish triggers its dependent (the consumer) only after its own wait: so when the
    consumer starts, every kernel before the publish has finished (what the consumer's early
    padding-scale stores rely on)."""
    name = "griddepcontrol.launch_dependents after griddepcontrol.wait"
    wait = kernel.first_index(lambda i: i.opcode == "griddepcontrol.wait")
    if wait is None:
        return PtxCheck(name, False, "no griddepcontrol.wait")
    early = _reachable_before(kernel, wait, lambda i: i.opcode == "griddepcontrol.launch_dependents")
    if early:
        return PtxCheck(name, False, f"line {early[0].line}: launch_dependents is reachable before the wait")
    if kernel.count("griddepcontrol.launch_dependents") == 0:
        return PtxCheck(name, False, "no griddepcontrol.launch_dependents (the consumer would not overlap)")
    return PtxCheck(name, True, "every launch_dependents follows the wait")


def _griddepcontrol_first(kernel: _Kernel) -> PtxCheck:
    """PDL: nothing the previous kernel wrote may be loaded before griddepcontrol.wait. Checked
    in text order and on every control-flow path from the entry."""
    name = "griddepcontrol.wait before global loads"
    wait = kernel.first_index(lambda i: i.opcode == "griddepcontrol.wait")
    load = kernel.first_index(_is_global_load)
    if wait is None:
        return PtxCheck(name, False, "no griddepcontrol.wait")
    wait_line = kernel.instructions[wait].line
    if load is not None and load < wait:
        first = kernel.instructions[load]
        return PtxCheck(name, False, f"line {first.line}: {first.text} comes before griddepcontrol.wait (line {wait_line})")
    early = _loads_before_wait(kernel, wait)
    if early:
        return PtxCheck(name, False, f"line {early[0].line}: {early[0].text} is reachable without passing the wait (line {wait_line})")
    where = "no global load" if load is None else f"first global load at line {kernel.instructions[load].line}"
    return PtxCheck(name, True, f"wait at line {wait_line}, {where}; no path reaches a global load before it")


def _is_sentinel_compare(i: Instruction, constant: str) -> bool:
    return re.match(r"^setp\.eq(\.or|\.and)?\.(b32|u32|s32)$", i.opcode) is not None and constant in i.operands


def _is_float_compare(i: Instruction) -> bool:
    return i.opcode.startswith("setp.") and any(i.opcode.endswith(t) for t in _FLOAT_TYPES)


def _sentinel_compares(kernel: _Kernel, what: str) -> PtxCheck:
    """The sentinel test is an integer compare of each 16-bit lane with 0x8000 (a float compare
    would also match +0.0, and NaN never equals itself)."""
    low = kernel.matching(lambda i: _is_sentinel_compare(i, SENTINEL_LOW))
    high = kernel.matching(lambda i: _is_sentinel_compare(i, SENTINEL_HIGH))
    ok = bool(low) and bool(high)
    message = f"{len(low)} compares with {SENTINEL_LOW}, {len(high)} with {SENTINEL_HIGH} ({what})"
    return PtxCheck("sentinel compared as integer lanes", ok, message)


SPIN_LOAD = "ld.volatile.global.v4.b32"


def _spin_loops(kernel: _Kernel) -> list[set[int]]:
    """Every loop (set of basic blocks) that re-executes a spin load."""
    loops: list[set[int]] = []
    for k, i in enumerate(kernel.instructions):
        if i.opcode != SPIN_LOAD:
            continue
        loop = kernel.loop_of(kernel.block_of[k])
        if loop and loop not in loops:
            loops.append(loop)
    return loops


def _spin_compares_integer_lanes(kernel: _Kernel) -> PtxCheck:
    """Each spin loop (a cycle of basic blocks around a volatile 16-byte load) tests the sentinel
    with integer compares of both lanes and contains no floating-point compare."""
    name = "spin loops compare integer lanes only"
    loops = _spin_loops(kernel)
    if not loops:
        return PtxCheck(name, False, f"no loop around a spin load ({SPIN_LOAD})")
    for loop in loops:
        body = [i for b in sorted(loop) for i in kernel.block_instructions(b)]
        first = body[0].line
        floats = [i for i in body if _is_float_compare(i)]
        if floats:
            return PtxCheck(name, False, f"spin loop at line {first}: line {floats[0].line}: {floats[0].text}")
        for constant in (SENTINEL_LOW, SENTINEL_HIGH):
            if not any(_is_sentinel_compare(i, constant) for i in body):
                return PtxCheck(name, False, f"spin loop at line {first} has no integer compare with {constant}")
    return PtxCheck(name, True, f"{len(loops)} spin loops, each with integer sentinel compares and no float setp")


def _reads_globaltimer(i: Instruction) -> bool:
    return "%globaltimer" in i.operands


def _one_deadline(kernel: _Kernel) -> PtxCheck:
    """The spin timeout is one per call: the deadline is read from %globaltimer once, outside
    every spin loop, and each spin loop compares the clock with it and can trap (a deadline
    restarted per rank or fragment would let a stuck call wait tp x fragments x the timeout)."""
    name = "one spin deadline, every spin loop can trap"
    loops = _spin_loops(kernel)
    if not loops:
        return PtxCheck(name, False, f"no loop around a spin load ({SPIN_LOAD})")
    in_loops = set().union(*loops)
    reads = [k for k, i in enumerate(kernel.instructions) if _reads_globaltimer(i)]
    outside = [kernel.instructions[k] for k in reads if kernel.block_of[k] not in in_loops]
    if len(outside) != 1:
        lines = ", ".join(str(i.line) for i in outside) or "none"
        return PtxCheck(name, False, f"{len(outside)} %globaltimer reads outside the spin loops (lines {lines}), expected 1")
    for loop in loops:
        body = [i for b in sorted(loop) for i in kernel.block_instructions(b)]
        if not any(i.opcode == "trap" for i in body) or not any(_reads_globaltimer(i) for i in body):
            return PtxCheck(name, False, f"spin loop at line {body[0].line} reads no clock or has no trap")
    return PtxCheck(name, True, f"deadline at line {outside[0].line}; {len(loops)} spin loops, each reads the clock and can trap")


def _call_tags_compared(kernel: _Kernel) -> PtxCheck:
    """Out-of-step ranks trap: outside the spin loops, rank 0's call tag is broadcast in the warp
    (shfl.sync.idx) and a guarded trap follows (mhc_ar.protocol)."""
    name = "call tags compared, mismatch traps"
    in_loops = set().union(*_spin_loops(kernel)) if _spin_loops(kernel) else set()
    shuffles = kernel.matching(lambda i: i.opcode.startswith("shfl.sync.idx"))
    traps = [
        i for k, i in enumerate(kernel.instructions)
        if i.opcode == "trap" and i.guarded and kernel.block_of[k] not in in_loops
    ]
    if len(shuffles) < 4 or not traps:
        return PtxCheck(name, False, f"{len(shuffles)} shfl.sync.idx (4 tag words expected), {len(traps)} guarded traps outside spin loops")
    return PtxCheck(name, True, f"{len(shuffles)} shfl.sync.idx, guarded trap at line {traps[0].line}")


def _residual_before_spin(kernel: _Kernel, expected: int) -> PtxCheck:
    """ConsumerSpec.prefetch_residual: the residual's 16-byte loads are issued before the first
    spin load (their latency hides under the wait), or, where the registers do not allow it,
    none is."""
    name = f"{expected} residual loads before the spin"
    first_spin = kernel.first_index(lambda i: i.opcode == SPIN_LOAD)
    if first_spin is None:
        return PtxCheck(name, False, f"no spin load ({SPIN_LOAD})")
    early = [i for i in kernel.instructions[:first_spin] if i.opcode == "ld.global.v4.b32"]
    lines = ", ".join(str(i.line) for i in early[:8])
    return PtxCheck(name, len(early) == expected, f"found {len(early)} ld.global.v4.b32 before line {kernel.instructions[first_spin].line}" + (f" (lines {lines})" if early else ""))


def _no_mailbox(kernel: _Kernel) -> PtxCheck:
    """tp = 1 (direct): the contribution is read in place; no mailbox, spin, re-arm or call tag."""
    spins, clock = kernel.count(SPIN_LOAD), kernel.matching(_reads_globaltimer)
    return PtxCheck("no mailbox: no spin load, no deadline", spins == 0 and not clock,
                    f"{spins} x {SPIN_LOAD}, {len(clock)} globaltimer reads (tp = 1 reads its contribution directly)")


def _loads_before_arithmetic(kernel: _Kernel, expected: int) -> PtxCheck:
    """tp = 1, call: x and the residual streams of every fragment are all loaded before the
    first fma, so their latencies overlap instead of adding."""
    name = f"{expected} x and residual loads before the first fma"
    first = kernel.first_index(lambda i: i.opcode == "fma.rn.f32")
    if first is None:
        return PtxCheck(name, False, "no fma.rn.f32")
    early = [i for i in kernel.instructions[:first] if i.opcode == "ld.global.v4.b32"]
    return PtxCheck(name, len(early) == expected, f"found {len(early)} ld.global.v4.b32 before line {kernel.instructions[first].line}")


def _no_release_fence(kernel: _Kernel) -> PtxCheck:
    """No fence that waits for the thread's earlier global stores: the cross-CTA sums go by
    st.async on an mbarrier (mhc_ar.ptx). A `barrier.cluster.arrive` with release semantics (the
    default) compiles to MEMBAR.ALL.GPU; on the H200 that fence was the top stall of the consumer
    at M = 1024 (notes/device-log.md, session 16). `fence.mbarrier_init` is allowed: it is issued
    once, before any store."""
    def is_fence(i: Instruction) -> bool:
        if i.opcode.startswith("barrier.cluster.arrive"):
            return ".relaxed" not in i.opcode
        return i.opcode.startswith("membar") or (i.opcode.startswith("fence") and not i.opcode.startswith("fence.mbarrier_init"))

    found = kernel.matching(is_fence)
    return PtxCheck("no release fence", not found,
                    "; ".join(f"line {i.line}: {i.opcode}" for i in found[:3]) or "none (cross-CTA sums by st.async on an mbarrier)")


def check_consumer_ptx(ptx: str, variant: Variant, prefetched_loads: int | None = None, *, direct: Contribution | None = None,
                       top_k: int = 0, fragments: int = 1, predicated: bool = False) -> list[PtxCheck]:
    """The consumer's checks; `prefetched_loads` (hc x fragments per thread, or 0 where the
    residual is loaded after the spin) adds the check of where the residual loads go. `direct`:
    the consumer of tp = 1 that computes this contribution itself (ConsumerSpec.direct); then
    `prefetched_loads` counts the x and residual loads before the first fma (call), and a
    finalize is held to the publish's route-bound checks (`top_k` routes per fragment; with a
    `predicated` tiling its vector loads are guarded too)."""
    kernel = _Kernel(ptx)
    variant = Variant(variant)
    has_norm = variant is not Variant.RESIDUAL_ONLY
    checks = [
        _present(kernel, "fma.rn.f32", "post-mix, collapse, sum of squares"),
        _present(kernel, "mul.rn.f32", "y * post, p * inv * w"),
        _present(kernel, "add.rn.f32", "reduce in rank order, warp/CTA/cluster sums"),
        _no_ftz_arithmetic(kernel),
        _divisions_are_ieee(kernel),
    ]
    if direct is None:
        checks += [
            _present(kernel, SPIN_LOAD, "Lamport spin: 16-byte volatile loads"),
            _sentinel_compares(kernel, "spin"),
            _spin_compares_integer_lanes(kernel),
            _one_deadline(kernel),
            _call_tags_compared(kernel),
            _present(kernel, "st.global.v4.b32", "re-arm consumed slots and tags, bf16 outputs"),
        ]
    else:
        checks += [_no_mailbox(kernel), _present(kernel, "st.global.v4.b32", "bf16 outputs")]
    checks += [
        _griddepcontrol_first(kernel),
        _consumer_stores_before_wait(kernel, variant, direct is not None),
        _no_release_fence(kernel),
        _present(kernel, "cvt.rn.bf16x2.f32", "one rounding to bf16 per stage"),
    ]
    if direct is not None:
        checks.append(_dependents_after_wait(kernel))
        if Contribution(direct) is Contribution.FINALIZE:
            per_vector = 1 + _count_hc(prefetched_loads, fragments) + (1 if has_norm else 0)  # shared_output, residual, weight
            checks += _route_bounds(kernel, top_k, fragments, per_vector * fragments if predicated else 0)
        elif prefetched_loads is not None:
            checks.append(_loads_before_arithmetic(kernel, prefetched_loads))
    elif prefetched_loads is not None:
        checks.append(_residual_before_spin(kernel, prefetched_loads))
    if has_norm:
        checks += [
            _exactly(kernel, "div.rn.f32", 1, "ss / H, once per row"),
            _exactly(kernel, "rsqrt.approx.ftz.f32", 1, "inv = rsqrt(mean + eps), once per row"),
        ]
    else:
        checks += [
            _exactly(kernel, "div.rn.f32", 0, "residual_only computes no RMSNorm"),
            _exactly(kernel, "rsqrt.approx.ftz.f32", 0, "residual_only computes no RMSNorm"),
        ]
    if variant is Variant.MXFP8:
        checks += [
            _present(kernel, "cvt.rn.satfinite.e4m3x2.f32", "MXFP8 values, saturating"),
            _present(kernel, "st.global.b8", "one UE8M0 scale byte per block"),
        ]
    return checks


def _count_hc(prefetched_loads: int | None, fragments: int) -> int:
    """hc, from a direct consumer's `prefetched_loads` ((1 + hc) x fragments)."""
    return 0 if prefetched_loads is None else prefetched_loads // fragments - 1


def check_publish_ptx(ptx: str, contribution: Contribution, multicast: bool, tp: int, top_k: int = 0) -> list[PtxCheck]:
    kernel = _Kernel(ptx)
    stores = kernel.count("st.global.v4.b32")
    multimem = kernel.matching(lambda i: i.opcode.startswith("multimem."))
    multimem_stores = [i for i in multimem if i.opcode.startswith("multimem.st")]
    checks = [
        _griddepcontrol_first(kernel),
        _dependents_after_wait(kernel),
        _no_ftz_arithmetic(kernel),
        _sentinel_compares(kernel, "scrub: -0.0 lanes published as +0.0"),
    ]
    if multicast:
        checks += [
            PtxCheck(
                "one multimem.st per vector and per call tag",
                len(multimem_stores) == 2,
                f"found {len(multimem_stores)} multimem.st (one store of the data, one of the tag, reaches every rank)",
            ),
            PtxCheck(
                "no peer st.global.v4 loop",
                stores == 0,
                f"found {stores} st.global.v4.b32 (multicast publishes with multimem.st only)",
            ),
        ]
    else:
        checks += [
            PtxCheck(
                f"{tp} peer stores of data and {tp} of the call tag",
                stores == 2 * tp,
                f"found {stores} st.global.v4.b32, expected two per rank (tp={tp}): the vector and the token's tag",
            ),
            PtxCheck(
                "no multimem",
                not multimem,
                "no multimem instruction" if not multimem else f"line {multimem[0].line}: {multimem[0].text}",
            ),
        ]
    if Contribution(contribution) is Contribution.FINALIZE:
        checks += [
            _present(kernel, "fma.rn.f32", "acc = fma(w_k, gemm2[idx_k], acc)"),
            _present(kernel, "add.rn.f32", "acc + shared_output"),
            _present(kernel, "cvt.rn.bf16x2.f32", "one rounding of the contribution"),
            *_route_bounds(kernel, top_k),
        ]
    return checks


def _route_bounds(kernel: _Kernel, top_k: int, fragments: int = 1, other_guarded: int = 0) -> list[PtxCheck]:
    """gemm2_permuted is never read outside its rows (mhc_ar.routes): each route's row load is
    predicated, the index is compared with a register (the row count, not a constant), and each
    route may count itself invalid with one atomic add. `fragments`: vectors per thread (each
    sums its own routes); `other_guarded`: the thread's other predicated 16-byte loads (a tp = 1
    consumer whose tiling predicates its vectors also guards x, residual and weight loads)."""
    loads = kernel.matching(lambda i: i.opcode == "ld.global.v4.b32")
    guarded = [i for i in loads if i.guarded]
    routes = top_k * fragments
    # The route indices: the unpredicated 32-bit loads (the fingerprint's are predicated).
    indices = {_operands(i)[0] for i in kernel.matching(lambda i: i.opcode == "ld.global.b32" and not i.guarded)}
    upper = kernel.matching(lambda i: i.opcode in ("setp.lt.s32", "setp.ge.s32") and _operands(i)[1] in indices
                            and _operands(i)[2].startswith("%"))
    red = kernel.count("red.relaxed.gpu.global.add.u32")
    return [
        PtxCheck(f"{routes} predicated gemm2 row loads", len(guarded) == routes + other_guarded,
                 f"{len(guarded)} of {len(loads)} ld.global.v4.b32 guarded, expected one per route (top_k={top_k}) and "
                 f"vector ({fragments}), plus {other_guarded} predicated vector loads: an index outside 0 .. rows-1 reads nothing"),
        PtxCheck("route index compared with the row count", len(upper) >= top_k,
                 f"{len(upper)} setp.lt/ge.s32 of a loaded route index against a register, expected one per route "
                 "(idx < gemm2_rows)"),
        PtxCheck(f"{routes} x red.relaxed.gpu.global.add.u32", red == routes,
                 f"found {red}, expected one per route and vector (the invalid-route counter)"),
    ]


def _operands(instruction: Instruction) -> list[str]:
    """Comma-separated operands, padded to three ('' where absent)."""
    operands = [o.strip() for o in instruction.operands.rstrip(";").split(",")]
    return operands + [""] * (3 - len(operands))


def kernel_entries(ptx: str) -> list[str]:
    """Each kernel of a PTX module: its text from `.entry` to the closing brace."""
    return re.findall(r"\.entry \S+\(.*?\n\}\n", ptx, re.S)


# How the wide form of a consumer reads its coefficients (ConsumerKernel._mix_by_word); the narrow
# form never does.
WIDE_FORM_ROW_READ = "ld.volatile.shared.v4.f32"


def _launch_bound(entry: str) -> int:
    """An entry's `.minnctapersm` (0 without one)."""
    found = re.search(r"\.minnctapersm (\d+)", entry)
    return int(found.group(1)) if found else 0


def check_ptx(spec, ptx: str) -> list[PtxCheck]:
    """The contract checks of one compiled kernel (PublishSpec or ConsumerSpec). A consumer with
    a wide form (ConsumerSpec.has_wide_form) is one module of two kernels, told apart by how they
    read the coefficients, each with its own launch bound: each is held to the consumer checks,
    the wide form's named "wide form: ..."."""
    if isinstance(spec, PublishSpec):
        return check_publish_ptx(ptx, spec.contribution, spec.multicast, spec.tp, spec.top_k)
    if isinstance(spec, ConsumerSpec) and spec.has_wide_form:
        wide = replace(spec, wide=True)
        entries = kernel_entries(ptx)
        wide_entries = [e for e in entries if WIDE_FORM_ROW_READ in e]
        narrow_entries = [e for e in entries if WIDE_FORM_ROW_READ not in e]
        bounds = ([_launch_bound(e) for e in narrow_entries], [_launch_bound(e) for e in wide_entries])
        expected = ([spec.min_ctas_per_sm], [wide.min_ctas_per_sm])
        found = PtxCheck("a narrow and a wide form", bounds == expected,
                         f"{len(entries)} kernels; .minnctapersm of those without / with {WIDE_FORM_ROW_READ}: {bounds}, "
                         f"expected {expected}")
        if not found.passed:
            return [found]
        wide_checks = _check_consumer_spec(wide, wide_entries[0])
        return [found, *_check_consumer_spec(spec, narrow_entries[0]), *(replace(c, name=f"wide form: {c.name}") for c in wide_checks)]
    if isinstance(spec, ConsumerSpec):
        return _check_consumer_spec(spec, ptx)
    raise ValueError(f"spec must be a PublishSpec or ConsumerSpec, got {type(spec).__name__}")


def _check_consumer_spec(spec: ConsumerSpec, ptx: str) -> list[PtxCheck]:
    fragments = spec.tiling.fragments_per_thread
    if spec.direct:
        return check_consumer_ptx(ptx, spec.variant, (1 + spec.hc) * fragments, direct=spec.contribution, top_k=spec.top_k,
                                  fragments=fragments, predicated=spec.tiling.needs_predicate)
    prefetched = spec.hc * fragments if spec.prefetch_residual else 0
    return check_consumer_ptx(ptx, spec.variant, prefetched)


# ----- compile every variant for every arch ---------------------------------------------------


@dataclass
class KernelContract:
    """One kernel variant compiled for one arch, and its PTX checks."""

    arch: str
    kernel: str
    kind: str  # publish | consumer
    variant: str  # e.g. call-unicast, finalize-multicast, full, mxfp8, residual_only
    status: CheckStatus  # pass | fail | error
    compile_s: float
    checks: list[PtxCheck] = field(default_factory=list)
    error: str | None = None
    ptx_file: str | None = None  # relative to the report directory

    def to_dict(self) -> dict:
        return {
            "arch": self.arch,
            "kernel": self.kernel,
            "kind": self.kind,
            "variant": self.variant,
            "status": CheckStatus(self.status).value,
            "compile_s": round(self.compile_s, 4),
            "checks": [c.to_dict() for c in self.checks],
            "error": self.error,
            "ptx_file": self.ptx_file,
        }


def describe_spec(spec) -> tuple[str, str]:
    """(kind, variant label) of a kernel spec."""
    if isinstance(spec, PublishSpec):
        transport = "multicast" if spec.multicast else "unicast"
        return "publish", f"{spec.contribution.value}-{transport}"
    if spec.direct:
        return "consumer", f"{spec.variant.value}-{spec.contribution.value}-direct"
    return "consumer", spec.variant.value


def check_compiled_variants(
    archs: Iterable[str] | None = None,
    specs: Iterable | None = None,
    *,
    ptx_dir=None,
    on_result: Callable[[KernelContract], None] | None = None,
) -> list[KernelContract]:
    """Compile every kernel variant (mhc_ar.compile.kernel_variants()) for every arch (default
    mhc_ar.compile.TARGET_ARCHS) and check its PTX. A compile error is recorded, not raised.
    With ptx_dir, each PTX is written to ptx_dir/<arch>/<kernel>.ptx."""
    from pathlib import Path

    from mhc_ar.compile import TARGET_ARCHS, compile_spec, consumer_name, kernel_variants, publish_name

    archs = list(TARGET_ARCHS if archs is None else archs)
    specs = list(kernel_variants() if specs is None else specs)
    results = []
    for arch in archs:
        for spec in specs:
            kind, variant = describe_spec(spec)
            name = publish_name(spec) if kind == "publish" else consumer_name(spec)
            start = time.perf_counter()
            try:
                ptx = compile_spec(spec, arch, keep_ptx=True).ptx
                if not ptx:
                    raise RuntimeError("the compiler returned no PTX")
            except Exception:
                result = KernelContract(arch, name, kind, variant, CheckStatus.ERROR, time.perf_counter() - start,
                                        error=traceback.format_exc())
            else:
                elapsed = time.perf_counter() - start
                checks = check_ptx(spec, ptx)
                status = CheckStatus.PASS if all(c.passed for c in checks) else CheckStatus.FAIL
                result = KernelContract(arch, name, kind, variant, status, elapsed, checks)
                if ptx_dir is not None:
                    path = Path(ptx_dir) / arch / f"{name}.ptx"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(ptx)
                    result.ptx_file = f"{Path(ptx_dir).name}/{arch}/{name}.ptx"
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results


__all__ = [
    "Instruction",
    "KernelContract",
    "PtxCheck",
    "check_compiled_variants",
    "check_consumer_ptx",
    "check_ptx",
    "check_publish_ptx",
    "parse_instructions",
]
