"""Launch configuration (mhc_ar.config) on the CPU: tilings cover every column once, validate."""

from __future__ import annotations

import pytest

from mhc_ar.config import (
    MAX_CLUSTER_SIZE,
    ConsumerSpec,
    ConsumerTiling,
    Contribution,
    PublishSpec,
    Variant,
    choose_consumer_tiling,
    mxfp8_scale_bytes,
)

HIDDEN_SIZES = [8, 16, 24, 64, 128, 136, 1000, 1024, 1032, 4096, 4104, 5120, 7168, 8192, 8200, 16384, 65536]


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_tiling_covers_every_vector_exactly_once(hidden):
    t = choose_consumer_tiling(hidden)
    owners = {}
    for cta in range(t.cluster_size):
        for thread in range(t.threads_per_cta):
            for fragment in range(t.fragments_per_thread):
                local = thread + fragment * t.threads_per_cta
                vector = cta * t.vectors_per_cta + local
                if local < t.vectors_per_cta and vector < t.num_vectors:
                    assert vector not in owners, f"vector {vector} owned twice"
                    owners[vector] = (cta, thread, fragment)
    assert sorted(owners) == list(range(hidden // 8))
    assert 1 <= t.cluster_size <= MAX_CLUSTER_SIZE
    assert t.vectors_per_cta % 4 == 0  # an MXFP8 block never straddles CTAs
    # needs_predicate is exactly "some (thread, fragment) owns nothing"
    slots = t.cluster_size * t.threads_per_cta * t.fragments_per_thread
    assert t.needs_predicate == (slots != len(owners))


def test_model_hidden_sizes_use_one_vector_per_thread():
    for hidden, cluster in ((4096, 4), (5120, 5), (7168, 7)):
        t = choose_consumer_tiling(hidden)
        assert (t.cluster_size, t.threads_per_cta, t.vectors_per_cta, t.fragments_per_thread) == (cluster, 128, 128, 1)
        assert not t.needs_predicate


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(hidden_size=12, cluster_size=1, threads_per_cta=32, vectors_per_cta=4), "multiple of 8"),
        (dict(hidden_size=4096, cluster_size=9, threads_per_cta=128, vectors_per_cta=64), "cluster_size"),
        (dict(hidden_size=4096, cluster_size=4, threads_per_cta=100, vectors_per_cta=128), "threads_per_cta"),
        (dict(hidden_size=4096, cluster_size=4, threads_per_cta=128, vectors_per_cta=126), "vectors_per_cta"),
        (dict(hidden_size=4096, cluster_size=2, threads_per_cta=128, vectors_per_cta=128), "covers"),
        (dict(hidden_size=4096, cluster_size=8, threads_per_cta=128, vectors_per_cta=128), "last CTA"),
    ],
)
def test_tiling_rejects_bad_configurations(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ConsumerTiling(**kwargs)


def test_specs_reject_bad_sizes():
    tiling = choose_consumer_tiling(4104)
    with pytest.raises(ValueError, match="hc_mult"):
        ConsumerSpec(tiling, hc=9, tp=2, capacity=8, variant=Variant.FULL)
    with pytest.raises(ValueError, match="tp"):
        ConsumerSpec(tiling, hc=4, tp=9, capacity=8, variant=Variant.FULL)
    with pytest.raises(ValueError, match="multiple of 128"):
        ConsumerSpec(tiling, hc=4, tp=2, capacity=8, variant=Variant.MXFP8)
    with pytest.raises(ValueError, match="top_k"):
        PublishSpec(hidden_size=4096, tp=2, capacity=8, contribution=Contribution.FINALIZE, top_k=0, multicast=False, hc=4)
    with pytest.raises(ValueError, match="max_num_tokens"):
        PublishSpec(hidden_size=4096, tp=2, capacity=0, contribution=Contribution.CALL, top_k=0, multicast=False, hc=4)
    with pytest.raises(ValueError, match="max_num_tokens"):  # M travels in a 30-bit call-tag field
        PublishSpec(hidden_size=8, tp=2, capacity=2**30, contribution=Contribution.CALL, top_k=0, multicast=False, hc=4)
    with pytest.raises(ValueError, match="hc_mult"):  # the call tag's fingerprint reads hc coefficients
        PublishSpec(hidden_size=4096, tp=2, capacity=8, contribution=Contribution.CALL, top_k=0, multicast=False, hc=0)


def test_reduction_tree_args_round_trip_into_the_reference():
    from reference import ReductionTree

    t = choose_consumer_tiling(7168)
    tree = ReductionTree(**t.reduction_tree_args())
    assert (tree.cluster_size, tree.threads_per_cta, tree.vectors_per_cta) == (7, 128, 128)


@pytest.mark.parametrize("m,hidden,expected", [(1, 4096, 128 * 128), (128, 4096, 128 * 128), (129, 7168, 256 * 224), (5, 160, 128 * 8)])
def test_scale_bytes(m, hidden, expected):
    assert mxfp8_scale_bytes(m, hidden) == expected
