"""Where an implementation first diverges from the reference, from its outputs alone.

An implementation shows three stage outputs: new_residual (after post_mix), layer_input (after
rms_norm) and the MXFP8 bytes. The stages before each are told apart by asking which
explanation reproduces the first differing element exactly, with the reference's
intermediates (reference.all_reduce_mhc(..., intermediates=True)), on the CPU:

* new_residual differs at column (m, h): post_mix run on another y reproduces all hc targets of
  the column? y from the unscrubbed contributions -> contribution (the -0.0 scrub); for a
  finalize, y from route sums in another order (reversed, or the shared output first) ->
  contribution; y from the contributions summed in another rank order -> reduce; any y near the
  reference's (a few bf16 ulps, either zero) -> reduce (y itself differs: the reduce, or a
  contribution before it); none -> post_mix.
* else layer_input differs in row m: rms_norm of the reference's p with another inverse RMS
  (a few hundred fp32 ulps around it) reproduces the row -> rms_norm (the sum of squares, its
  order, the mean or the rsqrt); otherwise p itself differs -> collapse.
* else the MXFP8 bytes differ -> mxfp8.

Also the distance of every differing element, in units in the last place of its own format
(bf16, e4m3 codes, UE8M0 scale steps), binned per output.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from reference import all_reduce_mhc, bf16_rn, bf16_to_f32, post_mix, reduce, scrub
from reference.exact import add_f32, fma_f32, mul_f32

from .compare import integer_view
from .runner import KernelOutputs

STAGES = ("contribution", "reduce", "post_mix", "collapse", "rms_norm", "mxfp8")
ULP_BINS = ("1", "2-3", "4-15", "16-255", ">=256", "sign/NaN/Inf")
_Y_NEIGHBORS = 4  # bf16 ulps either side of the reference's y
_INV_NEIGHBORS = 256  # fp32 ulps either side of the reference's inverse RMS
_MAX_ORDERS = 24  # rank orders tried (every permutation up to tp = 4)


@dataclass
class Divergence:
    stage: str | None  # None: no output differs
    detail: str
    ulps: dict[str, dict[str, int]] = field(default_factory=dict)  # output -> bin -> elements

    def to_dict(self) -> dict:
        return {"stage": self.stage, "detail": self.detail, "ulps": self.ulps}


def first_divergence(case, inputs, tree, outputs: KernelOutputs, rank: int = 0) -> Divergence:
    """The first stage whose value differs on `rank` (see the module docstring)."""
    mxfp8 = outputs.mxfp8_values[rank] is not None
    ref = all_reduce_mhc(_cpu_ranks(inputs), _cpu_mix(inputs), tree=tree, mxfp8=mxfp8, intermediates=True)
    got = {name: None if t is None else t.cpu() for name, t in
           (("new_residual", outputs.new_residual[rank]), ("layer_input", outputs.layer_input[rank]),
            ("mxfp8_values", outputs.mxfp8_values[rank]), ("mxfp8_scales", outputs.mxfp8_scales[rank]))}
    want = {"new_residual": ref.new_residual, "layer_input": ref.layer_input,
            "mxfp8_values": None if ref.mxfp8_values is None else ref.mxfp8_values.view(torch.float8_e4m3fn),
            "mxfp8_scales": ref.mxfp8_scales}
    ulps = {name: ulp_bins(want[name], got[name], name) for name in want if want[name] is not None and got[name] is not None}
    ulps = {name: bins for name, bins in ulps.items() if any(bins.values())}
    mix = _cpu_mix(inputs)
    record = ref.intermediates
    if _differs(want["new_residual"], got["new_residual"]):
        stage, detail = _upstream_of_post_mix(record, mix, got["new_residual"], _cpu_ranks(inputs))
    elif want["layer_input"] is not None and _differs(want["layer_input"], got["layer_input"]):
        stage, detail = _collapse_or_rms_norm(record, mix, tree, got["layer_input"])
    elif any(n in ulps for n in ("mxfp8_values", "mxfp8_scales")):
        stage, detail = "mxfp8", "new_residual and layer_input equal the reference; the MXFP8 bytes differ"
    else:
        return Divergence(None, "every output equals the reference", ulps)
    return Divergence(stage, detail, ulps)


def _cpu_ranks(inputs):
    from reference import RankInputs

    def cpu(t):
        return None if t is None else t.cpu()

    return [RankInputs(x=cpu(r.x), gemm2_permuted=cpu(r.gemm2_permuted), expert_weights=cpu(r.expert_weights),
                       expanded_idx_to_permuted_idx=cpu(r.expanded_idx_to_permuted_idx), shared_output=cpu(r.shared_output))
            for r in inputs.ranks]


def _cpu_mix(inputs):
    from reference import MixInputs

    m = inputs.mix
    return MixInputs(m.residual.cpu(), m.post.cpu(), m.comb.cpu(), None if m.pre is None else m.pre.cpu(),
                     None if m.norm_weight is None else m.norm_weight.cpu(), m.eps)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return integer_view(t.contiguous())


def _differs(want, got) -> bool:
    return got is not None and bool((_bits(want) != _bits(got)).any())


def _upstream_of_post_mix(record, mix, got_new_residual, ranks):
    diff = (_bits(record["new_residual"]) != _bits(got_new_residual)).any(dim=1)  # [M, H]: a column differs
    m, h = (int(i) for i in diff.nonzero()[0])
    column = got_new_residual[m : m + 1, :, h : h + 1]

    def reproduces(y_value: torch.Tensor) -> bool:
        y = y_value.reshape(1, 1)
        mixed = post_mix(y, mix.residual[m : m + 1, :, h : h + 1], mix.post[m : m + 1], mix.comb[m : m + 1])
        return bool((_bits(mixed) == _bits(column)).all())

    where = f"token {m}, column {h}"
    y_ref = record["y"][m, h]
    if reproduces(y_ref):  # this column's y is right: post_mix itself differs
        return "post_mix", f"{where}: post_mix of the reference's y does not give the implementation's streams"
    contributions = record["contribution"][:, m, h]  # scrubbed, bf16 [tp]
    raw = [r.x[m, h] for r in ranks] if ranks[0].x is not None else None
    if raw is not None and reproduces(_sum_from_first(raw)):
        return "contribution", (f"{where}: the streams follow from the contributions without the -0.0 scrub "
                                "(summed from rank 0's value, as a plain all-reduce does)")
    if raw is None:  # finalize: the weighted route sum in another order
        for name, order in _FINALIZE_ORDERS.items():
            candidates = [scrub(_finalize_element(r, m, h, order).reshape(1)) for r in ranks]
            if reproduces(reduce(candidates)[0]):
                return "contribution", f"{where}: the streams follow from each rank's finalize sum with {name}"
    for order in itertools.islice(itertools.permutations(range(len(contributions))), 1, _MAX_ORDERS):
        if reproduces(reduce([contributions[r].reshape(1) for r in order])[0]):
            return "reduce", f"{where}: the streams follow from the ranks summed in the order {list(order)}"
    for candidate in _bf16_neighbors(y_ref, _Y_NEIGHBORS):
        if reproduces(candidate):
            return "reduce", (f"{where}: y = {float(candidate)!r} (0x{int(_bits(candidate.reshape(1))[0]) & 0xFFFF:04x}) "
                              f"instead of {float(y_ref)!r} explains the streams (the reduce, or a contribution before it)")
    return "post_mix", f"{where}: no y near the reference's gives the implementation's streams"


def _collapse_or_rms_norm(record, mix, tree, got_layer_input):
    rows = (_bits(record["layer_input"]) != _bits(got_layer_input)).any(dim=1)
    m = int(rows.nonzero()[0, 0])
    p = record["p"][m : m + 1]
    weight = bf16_to_f32(mix.norm_weight)[None, :]
    inv = record["inv"][m]
    target = _bits(got_layer_input[m : m + 1])
    for candidate in _f32_neighbors(inv, _INV_NEIGHBORS):
        out = bf16_rn(mul_f32(mul_f32(bf16_to_f32(p), candidate.reshape(1, 1)), weight))
        if bool((_bits(out) == target).all()):
            return "rms_norm", (f"token {m}: the reference's p with inverse RMS {float(candidate)!r} instead of "
                                f"{float(inv)!r} gives the row (the sum of squares, its order, the mean or the rsqrt)")
    return "collapse", f"token {m}: no inverse RMS gives the row from the reference's p: p itself differs"


# Other orders of a finalize contribution a rewrite might use: (route order, shared first?).
_FINALIZE_ORDERS = {"the routes in reverse order": ("reverse", False), "the shared output added first": ("forward", True)}


def _finalize_element(rank, m: int, h: int, order) -> torch.Tensor:
    """One element of a rank's finalize contribution, the routes taken `order[0]` and the shared
    output added first when `order[1]` (the reference: forward, last)."""
    direction, shared_first = order
    routes = range(rank.expert_weights.shape[1])
    if direction == "reverse":
        routes = reversed(routes)
    shared = bf16_to_f32(rank.shared_output[m, h].reshape(1))
    acc = shared if shared_first else torch.zeros(1, dtype=torch.float32)
    for k in routes:
        row = int(rank.expanded_idx_to_permuted_idx[m, k])
        if row >= 0:
            acc = fma_f32(rank.expert_weights[m, k].reshape(1), bf16_to_f32(rank.gemm2_permuted[row, h].reshape(1)), acc)
    if not shared_first:
        acc = add_f32(acc, shared)
    return bf16_rn(acc)[0]


def _sum_from_first(values) -> torch.Tensor:
    """fp32 sum starting from the first value (not from +0.0), rounded to bf16: where every
    value is -0.0 it stays -0.0, which the scrub exists to prevent."""
    s = bf16_to_f32(values[0].reshape(1))
    for v in values[1:]:
        s = add_f32(s, bf16_to_f32(v.reshape(1)))
    return bf16_rn(s)[0]


def _bf16_neighbors(value: torch.Tensor, k: int):
    """bf16 values within k ulps (through zero, both signs), nearest first."""
    ordinal = _bf16_ordinal(value.reshape(1))[0]
    for step in range(1, k + 1):
        for sign in (1, -1):
            yield _bf16_from_ordinal(ordinal + sign * step)
    zero = torch.zeros(1, dtype=torch.bfloat16)
    yield zero[0]
    yield (-zero)[0]


def _bf16_ordinal(t: torch.Tensor) -> torch.Tensor:
    bits = _bits(t).to(torch.int32) & 0xFFFF
    return torch.where(bits & 0x8000 != 0, -(bits & 0x7FFF), bits)


def _bf16_from_ordinal(o: torch.Tensor) -> torch.Tensor:
    o = int(o)
    bits = o if o >= 0 else (0x8000 | (-o))
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)[0]


def _f32_neighbors(value: torch.Tensor, k: int):
    bits = int(value.reshape(1).view(torch.int32)[0])
    for step in range(1, k + 1):
        for sign in (1, -1):
            yield torch.tensor([bits + sign * step], dtype=torch.int32).view(torch.float32)[0]


def ulp_bins(want: torch.Tensor, got: torch.Tensor, output: str) -> dict[str, int]:
    """Differing elements binned by their distance in units of the format's last place."""
    bins = dict.fromkeys(ULP_BINS, 0)
    a, b = _bits(want).reshape(-1).to(torch.int64), _bits(got).reshape(-1).to(torch.int64)
    differs = a != b
    if not bool(differs.any()):
        return bins
    a, b = a[differs], b[differs]
    if output == "mxfp8_scales":  # one UE8M0 step is a factor of two
        distance, special = (a - b).abs(), (a == 0xFF) | (b == 0xFF)
    else:
        width = 8 * want.element_size()
        sign_bit, magnitude = 1 << (width - 1), (1 << (width - 1)) - 1
        a, b = a & ((1 << width) - 1), b & ((1 << width) - 1)
        ordinal = lambda v: torch.where(v & sign_bit != 0, -(v & magnitude), v & magnitude)  # noqa: E731
        distance = (ordinal(a) - ordinal(b)).abs()
        exponent_all_ones = _nonfinite(a, output) | _nonfinite(b, output)
        special = exponent_all_ones | ((a ^ b) & sign_bit != 0)
    for name, lo, hi in (("1", 1, 1), ("2-3", 2, 3), ("4-15", 4, 15), ("16-255", 16, 255), (">=256", 256, None)):
        inside = (distance >= lo) & (~special) if hi is None else (distance >= lo) & (distance <= hi) & (~special)
        bins[name] = int(inside.sum())
    bins["sign/NaN/Inf"] = int(special.sum())
    return bins


def _nonfinite(bits: torch.Tensor, output: str) -> torch.Tensor:
    if output == "mxfp8_values":  # e4m3: only S.1111.111 is NaN, no Inf
        return (bits & 0x7F) == 0x7F
    return (bits & 0x7F80) == 0x7F80  # bf16


__all__ = ["Divergence", "STAGES", "ULP_BINS", "first_divergence", "ulp_bins"]
