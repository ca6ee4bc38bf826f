"""Host-side builds on the CPU (sm_90a, fake tensors): the one-call launcher AllReduceMHC uses
holds exactly the kernels compiled on their own, and diagnostic builds leave out only what they
name."""

from __future__ import annotations

import dataclasses
import re

import pytest

from conformance.ptx_contract import parse_instructions
from mhc_ar.compile import compile_consumer, compile_publish, compile_publish_then_consume, consumer_name
from mhc_ar.config import ConsumerSpec, Contribution, PublishSpec, Variant, choose_consumer_tiling

H, HC, TP, CAPACITY, TOP_K = 5120, 4, 4, 64, 6


def _entries(ptx: str) -> list[str]:
    """Each kernel's PTX text with its own names (entry, parameters, labels) made neutral."""
    bodies = re.findall(r"\.entry \S+\(.*?\n\}\n", ptx, re.S)
    return [
        re.sub(r"\$L__BB\d+_", "$L_", re.sub(r"\w+_param_(\d+)", r"param_\1", re.sub(r"\.entry \S+\(", ".entry K(", b)))
        for b in bodies
    ]


def _publish(contribution: Contribution) -> PublishSpec:
    top_k = TOP_K if contribution is Contribution.FINALIZE else 0
    return PublishSpec(hidden_size=H, tp=TP, capacity=CAPACITY, contribution=contribution, top_k=top_k, multicast=False)


def _consumer(variant: Variant) -> ConsumerSpec:
    return ConsumerSpec(choose_consumer_tiling(H), hc=HC, tp=TP, capacity=CAPACITY, variant=variant)


@pytest.mark.parametrize("contribution", list(Contribution))
@pytest.mark.parametrize("variant", list(Variant))
def test_one_call_launcher_holds_the_same_two_kernels(contribution, variant):
    publish, consumer = _publish(contribution), _consumer(variant)
    both = _entries(compile_publish_then_consume(publish, consumer, "sm_90a", keep_ptx=True).ptx)
    alone = _entries(compile_publish(publish, "sm_90a", keep_ptx=True).ptx) + _entries(
        compile_consumer(consumer, "sm_90a", keep_ptx=True).ptx
    )
    assert len(both) == 2 and len(alone) == 2
    assert both == alone, "the one-call launcher compiled different kernel code"


def _stores(ptx: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for i in parse_instructions(ptx):
        if i.opcode.startswith("st.global"):
            counts[i.opcode] = counts.get(i.opcode, 0) + 1
    return counts


def test_diagnostic_builds_leave_out_only_their_stage():
    spec = _consumer(Variant.MXFP8)
    full = _stores(compile_consumer(spec, "sm_90a", keep_ptx=True).ptx)
    no_padding = dataclasses.replace(spec, omit=frozenset({"padding_scales"}))
    no_block = dataclasses.replace(spec, omit=frozenset({"mxfp8_block"}))
    assert consumer_name(no_padding).endswith("-no_padding_scales")
    padding = _stores(compile_consumer(no_padding, "sm_90a", keep_ptx=True).ptx)
    block = _stores(compile_consumer(no_block, "sm_90a", keep_ptx=True).ptx)
    # The zeroing: one 16-byte store per all-padding chunk and three 4-byte stores for mixed ones.
    assert full["st.global.b32"] - padding.get("st.global.b32", 0) == 3
    assert full["st.global.v4.b32"] - padding["st.global.v4.b32"] == 1
    # The block: the e4m3 values (8 bytes per thread and fragment) and the scale byte.
    assert "st.global.b64" in full and "st.global.b64" not in block
    assert "st.global.b8" in full and "st.global.b8" not in block
    assert block["st.global.v4.b32"] == full["st.global.v4.b32"]
    with pytest.raises(ValueError, match="omit must be a subset"):
        dataclasses.replace(spec, omit=frozenset({"rms_norm"}))


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
def test_one_call_launcher_compiles_for_blackwell(arch):
    publish, consumer = _publish(Contribution.FINALIZE), _consumer(Variant.MXFP8)
    both = _entries(compile_publish_then_consume(publish, consumer, arch, keep_ptx=True).ptx)
    alone = _entries(compile_publish(publish, arch, keep_ptx=True).ptx) + _entries(compile_consumer(consumer, arch, keep_ptx=True).ptx)
    assert len(both) == 2 and both == alone
