"""Deliberately wrong implementations of the operation, for the gate's adapter tests: each is the
reference with one stage done the way a plausible rewrite might do it (tests/test_conformance_impl.py).
Importable as MODULE:FACTORY for `run --impl` (tests/ on sys.path)."""

from __future__ import annotations

from conformance.impl import ReferenceImplementation
from reference import bf16_rn, bf16_to_f32, collapse, contribution, finalize_contribution, post_mix, reduce, rms_norm, scrub
from reference.exact import add_f32, fma_f32
from reference.mxfp8 import mxfp8_quantize


class _Staged(ReferenceImplementation):
    """The reference's stages in order, each overridable."""

    def contributions(self, ranks):
        out = []
        for rank in ranks:
            if rank.is_finalize:
                out.append(finalize_contribution(rank.gemm2_permuted, rank.expert_weights, rank.expanded_idx_to_permuted_idx, rank.shared_output))
            else:
                out.append(contribution(rank.x))
        return [scrub(c) for c in out]

    def reduce(self, contributions):
        return reduce(contributions)

    def collapse(self, new_residual, pre):
        return collapse(new_residual, pre)

    def compute(self, ranks, mix):
        y = self.reduce(self.contributions(ranks))
        new_residual = post_mix(y, mix.residual, mix.post, mix.comb)
        if mix.residual_only:
            return new_residual, None, None, None
        layer_input = rms_norm(self.collapse(new_residual, mix.pre), mix.norm_weight, mix.eps, self.reduction_tree)
        values = scales = None
        if self.mxfp8:
            values, scales = mxfp8_quantize(layer_input)
        return new_residual, layer_input, values, scales


class ReverseRankSum(_Staged):
    """Sums the ranks from the last to the first."""

    def reduce(self, contributions):
        return reduce(contributions[::-1])


class NoScrub(_Staged):
    """Publishes -0.0 as it is and starts the sum from rank 0's value, as a plain one-shot
    all-reduce does: where every rank holds -0.0, y is -0.0 instead of +0.0."""

    def contributions(self, ranks):
        return [contribution(r.x) if not r.is_finalize else
                finalize_contribution(r.gemm2_permuted, r.expert_weights, r.expanded_idx_to_permuted_idx, r.shared_output)
                for r in ranks]

    def reduce(self, contributions):
        s = bf16_to_f32(contributions[0])
        for c in contributions[1:]:
            s = add_f32(s, bf16_to_f32(c))
        return bf16_rn(s)


class RoutesReversed(_Staged):
    """Takes a finalize's routes from the last to the first."""

    def contributions(self, ranks):
        if not ranks[0].is_finalize:
            return super().contributions(ranks)
        out = []
        for r in ranks:
            flip = lambda t: t.flip(1).contiguous()  # noqa: E731
            out.append(scrub(finalize_contribution(r.gemm2_permuted, flip(r.expert_weights), flip(r.expanded_idx_to_permuted_idx),
                                                   r.shared_output)))
        return out


class CollapseRoundedTwice(_Staged):
    """Rounds the collapse accumulator to bf16 after every fma, not only at the end."""

    def collapse(self, new_residual, pre):
        streams = bf16_to_f32(new_residual)
        c = streams[:, 0] * 0.0
        for t in range(new_residual.shape[1]):
            c = bf16_to_f32(bf16_rn(fma_f32(streams[:, t], pre[:, t : t + 1], c)))
        return bf16_rn(c)


class NoFinalize(ReferenceImplementation):
    """An incomplete adapter: no finalize."""

    finalize = None


def reverse_rank_sum(**kwargs):
    return ReverseRankSum(**kwargs)


def no_scrub(**kwargs):
    return NoScrub(**kwargs)


def routes_reversed(**kwargs):
    return RoutesReversed(**kwargs)


def collapse_rounded_twice(**kwargs):
    return CollapseRoundedTwice(**kwargs)


def no_finalize(**kwargs):
    return NoFinalize(**kwargs)


def wrong_arguments(hidden):  # takes none of the adapter's keyword arguments
    return ReferenceImplementation
