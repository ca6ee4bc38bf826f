"""Input families: every tensor of a case, drawn deterministically from the case's seed.

Everything is drawn with a torch.Generator on the target device (a GPU run builds its inputs
on the GPU; the same seed on the CPU gives other numbers, which is fine: a failing case's
inputs are saved in its bundle). Replicated inputs (residual, post, comb, pre, norm_weight)
are one set of tensors shared by every rank; each rank has its own contribution (x, or the
finalize tensors).

Families (conformance.cases.Family):
  normal           x, residual ~ N(0,1); post ~ U(0.5,1.5); comb positive, rows and columns
                   summing to about 1 (Sinkhorn-like); pre ~ U(0.5,1.5)/hc; weight ~ N(1,0.1)
  wide_range       magnitudes 2^-60 .. 2^60 in activations, powers of two 2^-8 .. 2^8 in the mix
  signed_zeros     half of every tensor exact +-0.0; a whole rank of -0.0 (the mailbox sentinel:
                   the publish must scrub it or the consumer would wait forever)
  nan_inf          NaN (random payloads and signs) and +-Inf in x, residual, comb, post, on even
                   rows only (odd rows stay finite, so both paths are checked in one case)
  order_sensitive  2^24, 1, -2^24 in chosen columns of the rank contributions, the post-mix and
                   the collapse (and the finalize routes): fp32 in contract order gives 0, any
                   other order gives 1
  tiny             activations ~2^-128 (bf16 and fp32 subnormals), layer input ~2^-118, so MXFP8
                   block maxima lie around 2.6e-36 .. 5.3e-36 (scale bytes next to the fp32
                   normal/subnormal boundary)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mhc_ar.config import Contribution, Variant
from mhc_ar.protocol import SKIPPED_ROUTE
from reference import MixInputs, RankInputs

from .cases import FAMILIES, Case, Family

EPS = 1e-6
SKIPPED_ROUTE_FRACTION = 0.25
# order_sensitive: columns j with j % ORDER_PERIOD equal to one of these carry the pattern of
# one stage; spread over every thread and CTA of the consumer.
ORDER_PERIOD = 16
ORDER_REDUCE_COLUMN, ORDER_POST_MIX_COLUMN, ORDER_COLLAPSE_COLUMN, ORDER_FINALIZE_COLUMN = 1, 5, 9, 13
TWO_24 = float(2**24)  # 2^24 + 1 rounds back to 2^24 in fp32
# tiny: 2^-128 activations are fp32 subnormals (below 2^-126); after RMSNorm (inv ~ rsqrt(eps)
# ~ 2^10 since the sum of squares underflows) the layer input is ~2^-118 ~ 3e-36.
TINY_SCALE = 2.0**-128
# Measured: with this weight scale about half of the block maxima fall in 2.6e-36 .. 5.3e-36
# (a block maximum of 32 values spreads over about a factor 2 either way, so no fixed scale
# puts them all there).
TINY_WEIGHT = 0.4
WIDE_EXPONENT = 60
WIDE_EXPONENT_ODD_ROWS = 15
MIX_EXPONENT = 8
SPECIAL_FRACTION = 0.01  # nan_inf: share of elements of a dirty row that become NaN or Inf


@dataclass
class CaseInputs:
    """What the kernel and the reference both receive for one case."""

    ranks: list[RankInputs]
    mix: MixInputs

    @property
    def device(self) -> torch.device:
        return self.mix.residual.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by a stable name (rank{r}.x, rank{r}.gemm2_permuted, ..., mix.residual, ...)."""
        out = {}
        for r, rank in enumerate(self.ranks):
            for name in RANK_FIELDS:
                value = getattr(rank, name)
                if value is not None:
                    out[f"rank{r}.{name}"] = value
        for name in MIX_FIELDS:
            value = getattr(self.mix, name)
            if value is not None:
                out[f"mix.{name}"] = value
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], *, tp: int, eps: float) -> "CaseInputs":
        """Inverse of tensors(); raises ValueError naming a missing tensor."""
        if "mix.residual" not in tensors:
            raise ValueError("inputs: mix.residual is missing")
        ranks = []
        for r in range(tp):
            fields = {name: tensors.get(f"rank{r}.{name}") for name in RANK_FIELDS}
            if fields["x"] is None and fields["shared_output"] is None:
                raise ValueError(f"inputs: rank{r} has neither x nor the finalize tensors")
            ranks.append(RankInputs(**fields))
        mix = MixInputs(**{name: tensors.get(f"mix.{name}") for name in MIX_FIELDS}, eps=eps)
        return cls(ranks, mix)

    def to(self, device) -> "CaseInputs":
        return CaseInputs.from_tensors(
            {name: t.to(device) for name, t in self.tensors().items()}, tp=len(self.ranks), eps=self.mix.eps
        )


RANK_FIELDS = ("x", "gemm2_permuted", "expert_weights", "expanded_idx_to_permuted_idx", "shared_output")
MIX_FIELDS = ("residual", "post", "comb", "pre", "norm_weight")


def make_inputs(case: Case, device="cpu") -> CaseInputs:
    """All inputs of `case` on `device`, drawn from case.seed; the same call gives the same bits."""
    draw = _Draw(case.seed, torch.device(device))
    values = _normal(case, draw)
    if case.family not in _FAMILY_TRANSFORMS:
        raise ValueError(f"case {case.id}: {case.family.value} inputs are recorded, not drawn (conformance.capture)")
    _FAMILY_TRANSFORMS[case.family](case, draw, values)
    return values.build(case)


# ----- drawing --------------------------------------------------------------------------------


class _Draw:
    """A seeded generator on the target device and the few distributions the families use."""

    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def normal(self, *shape, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
        values = torch.randn(shape, generator=self.generator, device=self.device)
        return values * std + mean

    def uniform(self, *shape, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, device=self.device) * (high - low) + low

    def chance(self, *shape, p: float) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, device=self.device) < p

    def integers(self, low: int, high: int, *shape) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.generator, device=self.device)

    def sign(self, *shape) -> torch.Tensor:
        return torch.where(self.chance(*shape, p=0.5), -1.0, 1.0)

    def permutation(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.generator, device=self.device)


@dataclass
class _Values:
    """The case's tensors while a family shapes them: activations and the mix in fp32 (rounded
    to bf16 at build()), routes as int64."""

    activations: list[torch.Tensor]  # call: x [M, H]; finalize: shared_output [M, H], per rank
    gemm2: list[torch.Tensor] | None  # finalize: [M * top_k, H] per rank
    weights: list[torch.Tensor] | None  # finalize: [M, top_k] per rank
    routes: list[torch.Tensor] | None  # finalize: [M, top_k] per rank, -1 = skipped
    residual: torch.Tensor  # [M, hc, H]
    post: torch.Tensor  # [M, hc]
    comb: torch.Tensor  # [M, hc, hc] [source, target]
    pre: torch.Tensor  # [M, hc]
    norm_weight: torch.Tensor  # [H]

    def contribution_tensors(self) -> list[list[torch.Tensor]]:
        """The bf16-bound activation tensors of each rank (x, or shared_output and gemm2)."""
        if self.gemm2 is None:
            return [[a] for a in self.activations]
        return [[a, g] for a, g in zip(self.activations, self.gemm2)]

    def build(self, case: Case) -> CaseInputs:
        ranks = []
        for r in range(case.tp):
            if case.op is Contribution.CALL:
                ranks.append(RankInputs(x=_to_bf16(self.activations[r])))
            else:
                ranks.append(
                    RankInputs(
                        gemm2_permuted=_to_bf16(self.gemm2[r]),
                        expert_weights=self.weights[r].float().contiguous(),
                        expanded_idx_to_permuted_idx=self.routes[r].to(torch.int32),
                        shared_output=_to_bf16(self.activations[r]),
                    )
                )
        residual_only = case.variant is Variant.RESIDUAL_ONLY
        mix = MixInputs(
            residual=_to_bf16(self.residual),
            post=self.post.float().contiguous(),
            comb=self.comb.float().contiguous(),
            pre=None if residual_only else self.pre.float().contiguous(),
            norm_weight=None if residual_only else _to_bf16(self.norm_weight),
            eps=EPS,
        )
        return CaseInputs(ranks, mix)


def _to_bf16(values: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 with torch's rounding, except that a NaN keeps its sign and top payload bits
    (torch's cast makes every NaN 0x7FC0; the nan_inf family wants other payloads too)."""
    values = values.float().contiguous()
    rounded = values.to(torch.bfloat16)
    upper_half = (values.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isnan(values), upper_half, rounded).contiguous()


def _sinkhorn_comb(draw: _Draw, m: int, hc: int, iterations: int = 3) -> torch.Tensor:
    """Positive [M, hc, hc] with rows and columns summing to about 1 (entries around 1/hc)."""
    comb = draw.uniform(m, hc, hc, low=0.5, high=1.5)
    for _ in range(iterations):
        comb = comb / comb.sum(dim=2, keepdim=True)
        comb = comb / comb.sum(dim=1, keepdim=True)
    return comb


def _normal(case: Case, draw: _Draw) -> _Values:
    m, h, hc, tp = case.m, case.hidden, case.hc, case.tp
    gemm2 = weights = routes = None
    if case.op is Contribution.FINALIZE:
        k = case.top_k
        gemm2, weights, routes = [], [], []
        for _ in range(tp):
            gemm2.append(draw.normal(m * k, h))
            weights.append(draw.uniform(m, k) / k)
            permuted = draw.permutation(m * k).reshape(m, k)
            routes.append(torch.where(draw.chance(m, k, p=SKIPPED_ROUTE_FRACTION), SKIPPED_ROUTE, permuted))
    return _Values(
        activations=[draw.normal(m, h) for _ in range(tp)],
        gemm2=gemm2,
        weights=weights,
        routes=routes,
        residual=draw.normal(m, hc, h),
        post=draw.uniform(m, hc, low=0.5, high=1.5),
        comb=_sinkhorn_comb(draw, m, hc),
        pre=draw.uniform(m, hc, low=0.5, high=1.5) / hc,
        norm_weight=draw.normal(h, mean=1.0, std=0.1),
    )


# ----- families ---------------------------------------------------------------------------------


def _keep_normal(case: Case, draw: _Draw, v: _Values) -> None:
    pass


def _wide(draw: _Draw, like: torch.Tensor, exponent: int) -> torch.Tensor:
    """sign * (1 + u) * 2^e with e uniform in [-exponent, exponent]: exactly representable scales."""
    e = draw.integers(-exponent, exponent + 1, *like.shape).float()
    return draw.sign(*like.shape) * draw.uniform(*like.shape, low=1.0, high=2.0) * torch.exp2(e)


def _wide_rows(draw: _Draw, like: torch.Tensor) -> torch.Tensor:
    """_wide with exponents up to WIDE_EXPONENT on even rows (their sum of squares overflows
    fp32, so the contract's inv is 0) and up to WIDE_EXPONENT_ODD_ROWS on odd rows (finite)."""
    return torch.where(_even_rows(like), _wide(draw, like, WIDE_EXPONENT), _wide(draw, like, WIDE_EXPONENT_ODD_ROWS))


def _wide_range(case: Case, draw: _Draw, v: _Values) -> None:
    for tensors in v.contribution_tensors():
        for t in tensors:
            t.copy_(_wide_rows(draw, t))
    v.residual = _wide_rows(draw, v.residual)
    # Mix coefficients keep their sign but get power-of-two scales.
    for name in ("post", "comb", "pre"):
        t = getattr(v, name)
        setattr(v, name, t * torch.exp2(draw.integers(-MIX_EXPONENT, MIX_EXPONENT + 1, *t.shape).float()))
    v.norm_weight = _wide(draw, v.norm_weight, MIX_EXPONENT)
    if v.weights is not None:
        v.weights = [w * torch.exp2(draw.integers(-MIX_EXPONENT, MIX_EXPONENT + 1, *w.shape).float()) for w in v.weights]


def _signed_zeros_in(draw: _Draw, t: torch.Tensor, p: float) -> torch.Tensor:
    """t with a fraction p of its elements replaced by +0.0 or -0.0 (random sign)."""
    zero = draw.sign(*t.shape) * 0.0
    return torch.where(draw.chance(*t.shape, p=p), zero, t)


def _signed_zeros(case: Case, draw: _Draw, v: _Values) -> None:
    for tensors in v.contribution_tensors():
        for t in tensors:
            t.copy_(_signed_zeros_in(draw, t, 0.5))
    # A whole rank of -0.0: every lane of its contribution is the sentinel's bit pattern.
    # With tp == 1 the even rows of the only rank play that part.
    negative_zero = torch.tensor(-0.0, device=draw.device)
    if case.tp > 1:
        for t in v.contribution_tensors()[case.tp - 1]:
            t.copy_(negative_zero.expand_as(t))
    else:
        for t in v.contribution_tensors()[0]:
            t[::2] = negative_zero
    v.residual = _signed_zeros_in(draw, v.residual, 0.5)
    v.residual[:, 0] = -0.0  # whole streams of -0.0
    for name in ("post", "comb", "pre", "norm_weight"):
        setattr(v, name, _signed_zeros_in(draw, getattr(v, name), 0.25))
    if v.weights is not None:
        v.weights = [_signed_zeros_in(draw, w, 0.25) for w in v.weights]


def _special_values(draw: _Draw, like: torch.Tensor, bf16: bool) -> torch.Tensor:
    """NaN with random payloads and signs, and +-Inf, as fp32 values that keep their bits when
    rounded to bf16 (bf16 payloads live in the top 7 mantissa bits)."""
    shape = like.shape
    payload_bits = 7 if bf16 else 23
    shift = 23 - payload_bits
    payload = draw.integers(1, 2**payload_bits, *shape) << shift  # never 0: NaN, not Inf
    nan_bits = (0x7F800000 | payload) | torch.where(draw.chance(*shape, p=0.5), 0x80000000, 0)
    inf_bits = torch.where(draw.chance(*shape, p=0.5), 0xFF800000, 0x7F800000)
    bits = torch.where(draw.chance(*shape, p=0.5), nan_bits, inf_bits)
    signed = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return signed.view(torch.float32)


def _even_rows(t: torch.Tensor) -> torch.Tensor:
    return (torch.arange(t.shape[0], device=t.device) % 2 == 0).view(-1, *([1] * (t.dim() - 1)))


def _sprinkle(draw: _Draw, t: torch.Tensor, bf16: bool, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Specials in a fraction of the elements of the chosen rows (default: the even rows of
    dim 0), at least one per tensor (in its first chosen row)."""
    rows = _even_rows(t) if rows is None else rows.view(-1, *([1] * (t.dim() - 1)))
    dirty = draw.chance(*t.shape, p=SPECIAL_FRACTION)
    first = int(rows.reshape(-1).nonzero()[0, 0]) if bool(rows.any()) else 0
    dirty.view(dirty.shape[0], -1)[first, 0] = True
    return torch.where(dirty & rows, _special_values(draw, t, bf16), t)


def _nan_inf(case: Case, draw: _Draw, v: _Values) -> None:
    for r, tensors in enumerate(v.contribution_tensors()):
        tensors[0].copy_(_sprinkle(draw, tensors[0], bf16=True))
        if v.gemm2 is not None:
            # Only the expert rows that even tokens route to: odd tokens stay finite.
            even_token_rows = torch.zeros(v.gemm2[r].shape[0], dtype=torch.bool, device=draw.device)
            routes = v.routes[r][::2]
            even_token_rows[routes[routes != SKIPPED_ROUTE]] = True
            tensors[1].copy_(_sprinkle(draw, tensors[1], bf16=True, rows=even_token_rows))
    v.residual = _sprinkle(draw, v.residual, bf16=True)
    v.comb = _sprinkle(draw, v.comb, bf16=False)
    v.post = _sprinkle(draw, v.post, bf16=False)


def _order_columns(hidden: int, residue: int, device) -> torch.Tensor:
    return torch.arange(residue, hidden, ORDER_PERIOD, device=device)


def _order_sensitive(case: Case, draw: _Draw, v: _Values) -> None:
    """2^24, 1, -2^24 summed in contract order give 0, in any other order 1.

    reduce columns: three ranks (which ones varies by column) contribute the three, in rank order;
    post-mix columns: y = 2^24 (one rank), streams 0 and 1 hold 1 and -2^24, comb all ones on
    even rows; collapse columns: streams 0, 1, 2 hold the three, comb is the identity on odd
    rows, pre = 1; finalize columns: routes 0, 1, 2 carry the three with weight 1.
    """
    h, tp, hc, m = case.hidden, case.tp, case.hc, case.m
    device = draw.device
    pattern = (TWO_24, 1.0, -TWO_24)
    reduce_cols = _order_columns(h, ORDER_REDUCE_COLUMN, device)
    post_cols = _order_columns(h, ORDER_POST_MIX_COLUMN, device)
    collapse_cols = _order_columns(h, ORDER_COLLAPSE_COLUMN, device)
    finalize_cols = _order_columns(h, ORDER_FINALIZE_COLUMN, device)
    stage_cols = torch.cat([reduce_cols, post_cols, collapse_cols, finalize_cols])

    # Which ranks carry the pattern rotates with the column; they get it in ascending rank
    # order, so the contract's rank-order sum always cancels to 0.
    first_rank = (reduce_cols // ORDER_PERIOD) % tp
    carriers = torch.stack([(first_rank + i) % tp for i in range(min(tp, len(pattern)))]).sort(dim=0).values
    post_rank = (post_cols // ORDER_PERIOD) % tp
    for r, tensors in enumerate(v.contribution_tensors()):
        activation = tensors[0]
        activation[:, stage_cols] = 0.0
        for i in range(carriers.shape[0]):
            activation[:, reduce_cols[carriers[i] == r]] = pattern[i]
        activation[:, post_cols[post_rank == r]] = TWO_24
    if v.gemm2 is not None:
        for r in range(tp):
            v.gemm2[r][:, stage_cols] = 0.0
            routes, weights = v.routes[r], v.weights[r]
            k_used = min(len(pattern), case.top_k)
            # The first routes of every token are taken, with weight exactly 1.
            ordered = draw.permutation(m * case.top_k).reshape(m, case.top_k)
            routes.copy_(torch.where(draw.chance(m, case.top_k, p=SKIPPED_ROUTE_FRACTION), SKIPPED_ROUTE, ordered))
            routes[:, :k_used] = ordered[:, :k_used]
            weights[:, :k_used] = 1.0
            for k in range(k_used):
                rows = routes[:, k]
                v.gemm2[r][rows[:, None], finalize_cols[None, :]] = pattern[k]

    v.post = torch.ones_like(v.post)
    v.pre = torch.ones_like(v.pre)
    ones = torch.ones(hc, hc, device=device)
    identity = torch.eye(hc, device=device)
    even = (torch.arange(m, device=device) % 2 == 0).view(m, 1, 1)
    v.comb = torch.where(even, ones, identity).expand(m, hc, hc).clone()
    v.residual[:, :, stage_cols] = 0.0
    if hc >= 2:
        v.residual[:, 0, post_cols] = 1.0
        v.residual[:, 1, post_cols] = -TWO_24
    for t, value in enumerate(pattern[: min(hc, len(pattern))]):
        v.residual[:, t, collapse_cols] = value


def _tiny(case: Case, draw: _Draw, v: _Values) -> None:
    # Scaled by 1/sqrt(tp) so that the reduced y has the same spread at every TP size.
    scale = TINY_SCALE / math.sqrt(case.tp)
    for tensors in v.contribution_tensors():
        for t in tensors:
            t.mul_(scale)
    v.residual = v.residual * TINY_SCALE
    v.norm_weight = draw.uniform(case.hidden, low=0.7, high=1.4) * TINY_WEIGHT


_FAMILY_TRANSFORMS = {
    Family.NORMAL: _keep_normal,
    Family.WIDE_RANGE: _wide_range,
    Family.SIGNED_ZEROS: _signed_zeros,
    Family.NAN_INF: _nan_inf,
    Family.ORDER_SENSITIVE: _order_sensitive,
    Family.TINY: _tiny,
}
assert set(_FAMILY_TRANSFORMS) == set(FAMILIES), "every drawn family needs a transform"
