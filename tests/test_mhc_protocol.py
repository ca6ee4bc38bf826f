"""The protocol's host-side arithmetic on the CPU: call-tag encoding, fingerprint, mailbox layout,
and the co-residency bound of concurrent virtual ranks (mhc_ar.residency)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mhc_ar.protocol import (
    MAX_CAPACITY,
    ROW_PAD_ELEMS,
    SENTINEL_BF16,
    SENTINEL_HIGH_PTX,
    SENTINEL_LOW_PTX,
    TAG_FIELD_MASK,
    TAG_RANK_MASK,
    call_tag,
    fingerprint,
    layout_id,
    mailbox_shape,
    pack_tag_field,
    row_elems,
    slot_byte_offset,
    tag_byte_offset,
    unpack_tag_field,
)
from mhc_ar.residency import CoResidency, InstanceGrid

words32 = st.integers(min_value=0, max_value=2**32 - 1)


def test_the_sentinel_as_ptx_immediates_is_one_lane_of_a_word():
    assert int(SENTINEL_LOW_PTX, 16) == SENTINEL_BF16 and int(SENTINEL_HIGH_PTX, 16) == SENTINEL_BF16 << 16
    assert (SENTINEL_LOW_PTX, SENTINEL_HIGH_PTX) == ("0x00008000", "0x80000000")  # 8 hex digits: a b32 immediate


@given(st.integers(min_value=0, max_value=2**40))
def test_a_tag_field_never_holds_the_sentinel_and_keeps_30_bits(value):
    word = pack_tag_field(value)
    assert word & 0xFFFF != SENTINEL_BF16 and word >> 16 != SENTINEL_BF16
    assert word & 0x80008000 == 0  # each lane's top bit is clear
    assert unpack_tag_field(word) == value & TAG_FIELD_MASK


@given(st.lists(words32, min_size=2, max_size=72), st.data())
def test_changing_any_one_coefficient_word_changes_the_fingerprint(words, data):
    index = data.draw(st.integers(min_value=0, max_value=len(words) - 1))
    other = data.draw(words32.filter(lambda w: w != words[index]))
    changed = list(words)
    changed[index] = other
    # Sum of word_i * odd multiplier_i mod 2^32: a one-word change moves the sum; the fold of
    # the top two bits into the bottom two keeps a sign-bit-only change visible too.
    assert fingerprint(words) != fingerprint(changed)


def test_sign_and_exponent_flips_of_a_coefficient_change_the_fingerprint():
    one, minus_one = 0x3F800000, 0xBF800000  # 1.0f, -1.0f
    assert fingerprint([one, one, one]) != fingerprint([one, minus_one, one])
    assert fingerprint([one, one]) != fingerprint([one ^ 0x40000000, one])


def test_call_tag_fields():
    tag = call_tag(sequence=7, tokens=129, fingerprint_value=12345, finalize=True, rank=5, layout=999)
    assert [unpack_tag_field(w) for w in tag[:3]] == [7, 129, 12345]
    word3 = unpack_tag_field(tag[3])
    assert word3 & 1 == 1 and (tag[3] & TAG_RANK_MASK) >> 1 == 5 and word3 >> 4 == 999
    # Two ranks' tags of the same call differ only in the rank field.
    other = call_tag(7, 129, 12345, True, 2, 999)
    assert other[:3] == tag[:3] and other[3] & ~TAG_RANK_MASK == tag[3] & ~TAG_RANK_MASK


def test_layout_id_separates_configurations_and_fits_its_field():
    ids = {layout_id(h, tp, cap, hc) for h in (4096, 5120, 7168) for tp in (1, 2, 8) for cap in (64, 256) for hc in (1, 4, 8)}
    assert len(ids) == 3 * 3 * 2 * 3
    assert all(0 <= i < 2**26 for i in ids)


def test_mailbox_rows_keep_128_byte_lines_and_hold_the_tag_after_the_values():
    assert mailbox_shape(8, 256, 5120) == (3, 8, 256, 5120 + ROW_PAD_ELEMS)
    assert (row_elems(5120) * 2) % 128 == 0
    assert tag_byte_offset(5120) == 5120 * 2
    assert slot_byte_offset(1, 2, 3, 5120, 8, 256) == ((1 * 8 + 2) * 256 + 3) * row_elems(5120) * 2
    assert MAX_CAPACITY == 2**30 - 1


# The H200 figures the bound is built from are the driver's; here fixed numbers check the formula.
H5120 = InstanceGrid(cluster_size=5, publish_vectors_per_token=640, publish_threads_per_cta=128)
H4096 = InstanceGrid(cluster_size=4, publish_vectors_per_token=512, publish_threads_per_cta=128)


def test_co_residency_bound_counts_two_kernels_per_rank():
    bound = CoResidency(tp=8, sms=132, ctas_per_sm=8, max_active_clusters=200)
    # Per rank a consumer (5 CTAs per token) and a publish (5 per token): 8 x 10 M <= 1056.
    assert bound.in_flight_ctas([(H5120, 13)]) == 8 * (65 + 65)
    assert bound.fits([(H5120, 13)]) and not bound.fits([(H5120, 14)])
    assert bound.max_tokens(H5120) == 13
    # Beside it, a smaller instance counts with the largest grids of either: 8 x (64 + 64) <= 1056
    # at 16 tokens of H=4096 (4 CTAs per token each), 8 x (68 + 68) > 1056 at 17.
    assert bound.max_tokens(H4096, [(H5120, 13)]) == 16
    assert bound.max_tokens(H5120, [(H4096, 16)]) == 13


def test_co_residency_bound_also_needs_every_cluster_at_once():
    bound = CoResidency(tp=2, sms=132, ctas_per_sm=8, max_active_clusters=40)
    assert bound.max_tokens(H5120) == 20  # 2 x M clusters <= 40, though the CTAs would allow 52
    assert "40" in bound.describe([(H5120, 20)])


def test_no_token_fits_a_tiny_gpu():
    assert CoResidency(tp=8, sms=1, ctas_per_sm=8, max_active_clusters=1).max_tokens(H5120) == 0


@pytest.mark.parametrize("tokens", [1, 127, 128, 129])
def test_publish_grid_rounds_up(tokens):
    assert H5120.publish_ctas(tokens) == -(-tokens * 640 // 128)
