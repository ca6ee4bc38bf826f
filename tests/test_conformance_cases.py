"""The case matrix: preset sizes and coverage, filters, ids, id-derived seeds."""

from __future__ import annotations

import hashlib
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.cases import (
    CAPACITY,
    FAMILIES,
    FINALIZE_TOP_K,
    HC_VALUES,
    HIDDEN_SIZES,
    OPS,
    QUICK_HIDDEN_SIZES,
    TOKEN_COUNTS,
    TP_SIZES,
    VARIANTS,
    WIDE_FORM_TOKEN_COUNTS,
    Case,
    Family,
    Filters,
    Preset,
    assigned_family,
    cases_from_ids,
    parse_families,
    parse_list,
    preset_cases,
)
from mhc_ar.config import WIDE_FORM_MIN_TOKENS, Contribution, Variant

AXES = ("tp", "hidden", "hc", "m", "op", "variant")


def _combinations(cases, *axes):
    return {tuple(getattr(c, a) for a in axes) for c in cases}


def test_full_matrix_is_the_complete_cross_product_and_the_wide_form_edge():
    cases = preset_cases(Preset.FULL)
    assert len(cases) == 4 * 3 * 4 * 12 * 2 * 3 + 3 * 2 * 2 * 3 == 3492
    expected = set(itertools.product(TP_SIZES, HIDDEN_SIZES, HC_VALUES, TOKEN_COUNTS, OPS, VARIANTS))
    wide = set(itertools.product((1,), HIDDEN_SIZES, (8,), (1023, 1024), OPS, VARIANTS))
    assert WIDE_FORM_TOKEN_COUNTS == (WIDE_FORM_MIN_TOKENS - 1, WIDE_FORM_MIN_TOKENS) == (1023, 1024)
    assert _combinations(cases, *AXES) == expected | wide
    assert {c.capacity for c in cases if c.m > CAPACITY} == {WIDE_FORM_MIN_TOKENS}
    assert {c.capacity for c in cases if c.m <= CAPACITY} == {CAPACITY}
    edge = [c for c in cases if c.m == WIDE_FORM_MIN_TOKENS]
    assert {c.family for c in edge} == set(FAMILIES)
    assert Case.from_id(edge[0].id) == edge[0] and edge[0].id.endswith(f"-cap{WIDE_FORM_MIN_TOKENS}")


def test_the_wide_form_edge_follows_the_filters():
    assert not [c for c in preset_cases(Preset.FULL, Filters(tp=(2, 4))) if c.m > CAPACITY]
    assert not [c for c in preset_cases(Preset.FULL, Filters(hc=(1, 2, 4))) if c.m > CAPACITY]
    assert not [c for c in preset_cases(Preset.FULL, Filters(m=(1, 16))) if c.m > CAPACITY]
    assert not [c for c in preset_cases(Preset.QUICK) if c.m > CAPACITY]
    only = preset_cases(Preset.FULL, Filters(tp=(1,), hidden=(5120,), hc=(8,), variant=(Variant.MXFP8,)))
    assert {(c.m, c.op) for c in only if c.m > CAPACITY} == set(itertools.product((1023, 1024), OPS))


def test_default_preset_covers_every_tp_h_hc_op_variant_combination():
    cases = preset_cases(Preset.DEFAULT)
    assert len(cases) >= 1000
    assert _combinations(cases, "tp", "hidden", "hc", "op", "variant") == set(
        itertools.product(TP_SIZES, HIDDEN_SIZES, HC_VALUES, OPS, VARIANTS)
    )
    assert {c.m for c in cases} == set(TOKEN_COUNTS) | {WIDE_FORM_MIN_TOKENS}  # M values cycle through all of them
    assert len([c for c in cases if c.m == WIDE_FORM_MIN_TOKENS]) == 3 * 2 * 3  # tp 1, hc 8: every H, op, variant
    assert {c.family for c in cases} == set(FAMILIES)
    # A default case is a full-matrix case: same id, same seed.
    full_ids = {c.id for c in preset_cases(Preset.FULL)}
    assert {c.id for c in cases} <= full_ids


def test_quick_preset_is_small_and_covers_every_tp_op_variant():
    cases = preset_cases(Preset.QUICK)
    assert 40 <= len(cases) <= 80
    assert _combinations(cases, "tp", "op", "variant") == set(itertools.product(TP_SIZES, OPS, VARIANTS))
    assert {c.hidden for c in cases} == set(QUICK_HIDDEN_SIZES)
    assert {c.hc for c in cases} == set(HC_VALUES)
    assert {c.m for c in cases} == set(TOKEN_COUNTS)
    small = [c for c in cases if c.m <= 16]
    assert {c.family for c in small} == set(FAMILIES), "the CPU reference checks see every family"


@pytest.mark.parametrize("preset", list(Preset))
def test_every_family_meets_every_value_of_every_axis(preset):
    cases = preset_cases(preset)
    axes = AXES if preset is not Preset.QUICK else ("tp", "hidden", "hc", "op", "variant")
    for axis in axes:
        families_by_value = {}
        for c in cases:
            families_by_value.setdefault(getattr(c, axis), set()).add(c.family)
        for value, families in families_by_value.items():
            assert families == set(FAMILIES), f"{preset.value}: {axis}={value} misses {set(FAMILIES) - families}"


@pytest.mark.parametrize("preset", list(Preset))
def test_ids_are_unique_and_readable(preset):
    cases = preset_cases(preset)
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids))
    for case in cases[:50]:
        assert case.id == (
            f"tp{case.tp}-H{case.hidden}-hc{case.hc}-M{case.m}-{case.op.value}-{case.variant.value}-{case.family.value}"
        )


def test_case_fields():
    case = Case.from_id("tp4-H5120-hc4-M129-finalize-mxfp8-normal")
    assert (case.tp, case.hidden, case.hc, case.m) == (4, 5120, 4, 129)
    assert case.op is Contribution.FINALIZE and case.variant is Variant.MXFP8 and case.family is Family.NORMAL
    assert case.top_k == FINALIZE_TOP_K and case.capacity == CAPACITY
    assert Case.from_id("tp1-H128-hc1-M1-call-full-tiny").top_k == 0


def test_seed_is_derived_from_the_id_and_stable():
    case = Case.from_id("tp4-H5120-hc4-M129-finalize-mxfp8-normal")
    digest = hashlib.sha256(case.id.encode()).digest()
    assert case.seed == int.from_bytes(digest[:8], "big") % 2**63
    # Pinned: a change of the derivation would silently change every case's inputs.
    assert case.seed == Case.from_id(case.id).seed
    shifted = Case.from_id(case.id, seed_offset=7)
    assert shifted.seed == (case.seed + 7) % 2**63 and shifted.id == case.id
    seeds = [c.seed for c in preset_cases(Preset.FULL)]
    assert len(set(seeds)) == len(seeds)


@given(st.sampled_from(preset_cases(Preset.FULL)))
def test_id_round_trips(case):
    assert Case.from_id(case.id) == case
    assert Case.from_dict(case.to_dict()) == case


def test_repro_command_selects_exactly_that_case():
    case = preset_cases(Preset.DEFAULT)[123]
    command = case.repro_command
    assert command == f"python -m conformance run --case {case.id}"
    assert cases_from_ids([case.id]) == [case]
    # The filters of the case's own values also narrow the full matrix down to it.
    filters = Filters(
        tp=(case.tp,), hidden=(case.hidden,), hc=(case.hc,), m=(case.m,), op=(case.op,), variant=(case.variant,),
        family=(case.family,),
    )
    assert preset_cases(Preset.FULL, filters) == [case]


def test_filters_select_and_family_crosses():
    filters = Filters(tp=(2, 8), variant=(Variant.MXFP8,), op=(Contribution.CALL,))
    cases = preset_cases(Preset.DEFAULT, filters)
    assert cases and {c.tp for c in cases} == {2, 8}
    assert {c.variant for c in cases} == {Variant.MXFP8} and {c.op for c in cases} == {Contribution.CALL}
    crossed = preset_cases(Preset.DEFAULT, Filters(tp=(2,), family=FAMILIES))
    plain = preset_cases(Preset.DEFAULT, Filters(tp=(2,)))
    assert len(crossed) == len(FAMILIES) * len(plain)
    only_tiny = preset_cases(Preset.QUICK, Filters(family=(Family.TINY,)))
    assert len(only_tiny) == len(preset_cases(Preset.QUICK)) and {c.family for c in only_tiny} == {Family.TINY}
    # An axis given replaces the preset's: H=7168 is not a quick hidden size, and still runs.
    off_preset = preset_cases(Preset.QUICK, Filters(hidden=(7168,)))
    assert len(off_preset) == len(preset_cases(Preset.QUICK)) // 2 and {c.hidden for c in off_preset} == {7168}


def test_given_axes_replace_the_presets_and_keep_its_choices_elsewhere():
    """On-axis values select what the preset has (the same cases, ids and all); the M axis, or
    values off the preset's axes, are crossed with the preset's choices on the other axes."""
    default = preset_cases(Preset.DEFAULT)
    assert preset_cases(Preset.DEFAULT, Filters(tp=(2,))) == [c for c in default if c.tp == 2]
    crossed = preset_cases(Preset.DEFAULT, Filters(tp=(8,), hidden=(7168,), m=(1, 129)))
    combinations = {(c.hc, c.op, c.variant) for c in default if c.tp == 8 and c.hidden == 7168}
    assert len(crossed) == 2 * len(combinations) and {c.m for c in crossed} == {1, 129}
    odd = preset_cases(Preset.FULL, Filters(tp=(3,), hidden=(1000,)))
    assert {(c.tp, c.hidden) for c in odd} == {(3, 1000)} and {c.variant for c in odd} == {Variant.FULL, Variant.RESIDUAL_ONLY}
    assert len(odd) == len(HC_VALUES) * len(TOKEN_COUNTS) * 2 * 2


def test_command_line_lists():
    assert parse_list("1, 2,2,8", int, "tp") == (1, 2, 8)
    assert parse_families("all") == FAMILIES
    assert parse_families("tiny,normal") == (Family.TINY, Family.NORMAL)
    with pytest.raises(ValueError, match="--tp: invalid value 'x'"):
        parse_list("1,x", int, "tp")
    with pytest.raises(ValueError, match="--family"):
        parse_families("gaussian")


@pytest.mark.parametrize(
    "bad, message",
    [
        ("tp9-H128-hc1-M1-call-full-normal", "tp must be"),
        ("tp1-H130-hc1-M1-call-full-normal", "hidden must be"),
        ("tp1-H136-hc1-M1-call-mxfp8-normal", "mxfp8 variant needs"),
        ("tp1-H128-hc1-M257-call-full-normal", "m must be"),
        ("tp1-H128-hc1-M1-reduce-full-normal", "not a valid Contribution|reduce"),
        ("not-a-case", "not a case id"),
    ],
)
def test_invalid_ids_are_rejected_with_a_reason(bad, message):
    with pytest.raises(ValueError, match=message):
        Case.from_id(bad)


def test_assigned_family_is_a_function_of_the_shape():
    shape = (4, 5120, 4, 129, Contribution.FINALIZE, Variant.MXFP8)
    assert assigned_family(*shape) is assigned_family(*shape)
    assert Case.from_id("tp4-H5120-hc4-M129-finalize-mxfp8-normal").instance_key == (
        4, 5120, 4, CAPACITY, FINALIZE_TOP_K, Variant.MXFP8
    )
