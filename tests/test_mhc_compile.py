"""Host-side builds on the CPU (sm_90a, fake tensors): the one-call launcher AllReduceMHC uses
holds exactly the kernels compiled on their own, and diagnostic builds leave out only what they
name."""

from __future__ import annotations

import dataclasses
import re

import pytest

from conformance.ptx_contract import kernel_entries, parse_instructions
from mhc_ar.compile import (
    compile_consumer,
    compile_publish,
    compile_publish_then_consume,
    compile_tensor_launcher,
    consumer_name,
)
from mhc_ar.config import ConsumerSpec, Contribution, PublishSpec, Variant, choose_consumer_tiling

H, HC, TP, CAPACITY, TOP_K = 5120, 4, 4, 64, 6


def _entries(ptx: str) -> list[str]:
    """Each kernel's PTX text with its own names (entry, parameters, labels) made neutral."""
    return [
        re.sub(r"\$L__BB\d+_", "$L_", re.sub(r"\w+_param_(\d+)", r"param_\1", re.sub(r"\.entry \S+\(", ".entry K(", b)))
        for b in kernel_entries(ptx)
    ]


def _publish(contribution: Contribution) -> PublishSpec:
    top_k = TOP_K if contribution is Contribution.FINALIZE else 0
    return PublishSpec(hidden_size=H, tp=TP, capacity=CAPACITY, contribution=contribution, top_k=top_k, multicast=False, hc=HC)


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


# The tensor launcher: AllReduceMHC's eager path for calls without caller-given outputs.

_TENSOR_VARIANTS = [Variant.FULL, Variant.RESIDUAL_ONLY]


@pytest.mark.parametrize("contribution", list(Contribution))
@pytest.mark.parametrize("variant", _TENSOR_VARIANTS)
def test_tensor_launcher_holds_the_same_two_kernels(contribution, variant):
    publish, consumer = _publish(contribution), _consumer(variant)
    tensors = _entries(compile_tensor_launcher(publish, consumer, "sm_90a", keep_ptx=True).ptx)
    addresses = _entries(compile_publish_then_consume(publish, consumer, "sm_90a", keep_ptx=True).ptx)
    assert len(tensors) == 2 and tensors == addresses, "the tensor launcher compiled different kernel code"


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
def test_tensor_launcher_compiles_for_blackwell(arch):
    publish, consumer = _publish(Contribution.FINALIZE), _consumer(Variant.FULL)
    tensors = _entries(compile_tensor_launcher(publish, consumer, arch, keep_ptx=True).ptx)
    assert len(tensors) == 2 and tensors == _entries(compile_publish_then_consume(publish, consumer, arch, keep_ptx=True).ptx)


def test_tensor_launcher_is_not_built_for_mxfp8():
    with pytest.raises(ValueError, match="mxfp8_out"):
        compile_tensor_launcher(_publish(Contribution.CALL), _consumer(Variant.MXFP8), "sm_90a")


def _host_messages(contribution, variant) -> set[str]:
    """The error messages the launcher's host code can raise (TVM-FFI's argument checks)."""
    module = str(compile_tensor_launcher(_publish(contribution), _consumer(variant), "sm_90a").function.ir_module)
    return {m.replace("\\00", "") for m in re.findall(r'"([^"]*)"', module)}


@pytest.mark.parametrize("contribution", list(Contribution))
@pytest.mark.parametrize("variant", _TENSOR_VARIANTS)
def test_tensor_launcher_checks_every_tensor_before_launching(contribution, variant):
    """What CallValidator checks in Python, the compiled signature must check in C: dtype, rank,
    shape (M shared with the contribution, the rest static), compact strides, 16-byte alignment,
    the device of this rank's state; and None exactly where the variant takes nothing."""
    messages = _host_messages(contribution, variant)
    finalize = contribution is Contribution.FINALIZE
    layer_input = variant is not Variant.RESIDUAL_ONLY
    tensors = ["source", "residual", "post", "comb", "new_residual"]
    tensors += ["gemm2", "weights", "routes"] if finalize else []
    tensors += ["pre", "norm_weight", "layer_input"] if layer_input else []
    for name in tensors:
        assert f"{name}.strides" in messages, f"{name}: strides not checked"
    rules = ["expected data alignment=16 bytes", "expected to match state.device.index", "expected to match source.shape[0]",
             "expected device_type=cuda", "expected dtype=bfloat16", "expected dtype=float32"]
    rules += ["expected dtype=int32"] if finalize else []
    rules += ["expected None"] if not (finalize and layer_input) else []
    for rule in rules:
        assert any(m.endswith(rule) for m in messages), f"missing check: {rule!r}"
    signature = next(m for m in messages if "when calling: `__call__(" in m)
    m, rows = "n0", "n1"
    wanted = {
        "source": f"Tensor([{m}, {H}], bfloat16)",
        "residual": f"Tensor([{m}, {HC}, {H}], bfloat16)",
        "post": f"Tensor([{m}, {HC}], float32)",
        "comb": f"Tensor([{m}, {HC}, {HC}], float32)",
        "new_residual": f"Tensor([{m}, {HC}, {H}], bfloat16)",
        "gemm2": f"Tensor([{rows}, {H}], bfloat16)" if finalize else "None",
        "weights": f"Tensor([{m}, {TOP_K}], float32)" if finalize else "None",
        "routes": f"Tensor([{m}, {TOP_K}], int32)" if finalize else "None",
        "pre": f"Tensor([{m}, {HC}], float32)" if layer_input else "None",
        "norm_weight": f"Tensor([{H}], bfloat16)" if layer_input else "None",
        "layer_input": f"Tensor([{m}, {H}], bfloat16)" if layer_input else "None",
    }
    for name, declared in wanted.items():
        assert f"{name}: {declared}" in signature, f"{name}: expected {declared} in {signature}"


# ---- tp = 1: one kernel, the consumer reading the contribution in place (ConsumerSpec.direct) ----


def _direct(variant: Variant, contribution: Contribution) -> tuple[PublishSpec, ConsumerSpec]:
    from mhc_ar.compile import consumer_specs

    top_k = TOP_K if contribution is Contribution.FINALIZE else 0
    publish = PublishSpec(hidden_size=H, tp=1, capacity=CAPACITY, contribution=contribution, top_k=top_k, multicast=False, hc=HC)
    base = ConsumerSpec(choose_consumer_tiling(H), hc=HC, tp=1, capacity=CAPACITY, variant=variant)
    return publish, consumer_specs(base, TOP_K)[contribution is Contribution.FINALIZE]


@pytest.mark.parametrize("contribution", list(Contribution))
@pytest.mark.parametrize("variant", list(Variant))
def test_at_tp1_the_one_call_launcher_holds_the_consumer_alone(contribution, variant):
    publish, consumer = _direct(variant, contribution)
    assert consumer.direct and consumer.contribution is contribution
    both = _entries(compile_publish_then_consume(publish, consumer, "sm_90a", keep_ptx=True).ptx)
    alone = _entries(compile_consumer(consumer, "sm_90a", keep_ptx=True).ptx)
    assert len(both) == 1 and both == alone, "at tp = 1 the launcher must launch the consumer alone"
    if variant is not Variant.MXFP8:
        tensors = _entries(compile_tensor_launcher(publish, consumer, "sm_90a", keep_ptx=True).ptx)
        assert tensors == alone


def test_tp1_consumers_follow_the_contribution_and_tp_above_one_share_one():
    from mhc_ar.compile import consumer_specs, kernel_variants

    base = ConsumerSpec(choose_consumer_tiling(H), hc=HC, tp=1, capacity=CAPACITY, variant=Variant.FULL)
    specs = consumer_specs(base, TOP_K)
    assert (specs[False].contribution, specs[False].top_k) == (Contribution.CALL, 0)
    assert (specs[True].contribution, specs[True].top_k) == (Contribution.FINALIZE, TOP_K)
    assert consumer_name(specs[True]).endswith(f"-tp1-finalize-k{TOP_K}")
    shared = consumer_specs(dataclasses.replace(base, tp=2), TOP_K)
    assert shared[False] is shared[True] and not shared[False].direct
    tp1 = kernel_variants(hidden_size=H, hc=HC, tp=1, top_k=TOP_K)
    assert all(isinstance(s, ConsumerSpec) and s.direct for s in tp1) and len(tp1) == 2 * len(Variant)
    with pytest.raises(ValueError, match="tp > 1"):
        dataclasses.replace(base, tp=2, contribution=Contribution.FINALIZE, top_k=TOP_K)
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(base, contribution=Contribution.FINALIZE, top_k=0)


def test_direct_and_mailbox_consumers_fail_each_others_contract():
    """The contract tells the two apart: a tp = 1 consumer has no spin and stores nothing before
    its wait; held to the mailbox rules it fails them, and the reverse."""
    from conformance.ptx_contract import check_consumer_ptx, check_ptx

    _, direct = _direct(Variant.MXFP8, Contribution.CALL)
    mailbox = _consumer(Variant.MXFP8)
    direct_ptx = compile_consumer(direct, "sm_90a", keep_ptx=True).ptx
    mailbox_ptx = compile_consumer(mailbox, "sm_90a", keep_ptx=True).ptx
    assert all(c.passed for c in check_ptx(direct, direct_ptx))
    assert all(c.passed for c in check_ptx(mailbox, mailbox_ptx))
    as_mailbox = {c.name for c in check_consumer_ptx(direct_ptx, Variant.MXFP8, 0) if not c.passed}
    assert "has ld.volatile.global.v4.b32" in as_mailbox and "call tags compared, mismatch traps" in as_mailbox
    as_direct = {c.name for c in check_consumer_ptx(mailbox_ptx, Variant.MXFP8, 1 + HC, direct=Contribution.CALL) if not c.passed}
    assert {"no mailbox: no spin load, no deadline", "no global store before griddepcontrol.wait"} <= as_direct


def test_direct_finalize_consumer_holds_the_route_bounds():
    from conformance.ptx_contract import check_ptx

    _, consumer = _direct(Variant.FULL, Contribution.FINALIZE)
    checks = {c.name: c for c in check_ptx(consumer, compile_consumer(consumer, "sm_90a", keep_ptx=True).ptx)}
    assert checks[f"{TOP_K} predicated gemm2 row loads"].passed and checks[f"{TOP_K} x red.relaxed.gpu.global.add.u32"].passed
    assert all(c.passed for c in checks.values()), [c for c in checks.values() if not c.passed]


def test_kernel_signatures_follow_the_declared_argument_lists():
    """Each kernel's arguments are named once (mhc_ar.protocol); the signatures the DSL compiles
    must list exactly those names in that order (the fake compile arguments and each rank's
    bound prefix are built from the lists)."""
    import inspect

    from mhc_ar import protocol
    from mhc_ar.kernels.consumer import ConsumerKernel
    from mhc_ar.kernels.layer_call import PublishThenConsume, PublishThenConsumeTensors
    from mhc_ar.kernels.publish import PublishKernel

    cases = [
        (PublishKernel.__call__, protocol.PUBLISH_ARGUMENTS, True),
        (PublishKernel.kernel, protocol.PUBLISH_KERNEL_ARGUMENTS, False),
        (ConsumerKernel.__call__, protocol.CONSUMER_ARGUMENTS, True),
        (ConsumerKernel.kernel, protocol.CONSUMER_KERNEL_ARGUMENTS, False),
        (PublishThenConsume.__call__, protocol.LAYER_CALL_ARGUMENTS, True),
        (PublishThenConsumeTensors.__call__, protocol.TENSOR_LAUNCHER_ARGUMENTS, True),
    ]
    for function, names, launches in cases:
        parameters = list(inspect.signature(inspect.unwrap(function)).parameters)
        assert parameters == ["self", *names, *(["stream"] if launches else [])], function.__qualname__
    assert protocol.RANK_ARGUMENTS == protocol.LAYER_CALL_ARGUMENTS[: len(protocol.RANK_ARGUMENTS)]
    assert protocol.flat_arguments(protocol.PUBLISH_KERNEL_ARGUMENTS) == protocol.PUBLISH_ARGUMENTS
    assert protocol.flat_arguments(protocol.CONSUMER_KERNEL_ARGUMENTS) == protocol.CONSUMER_ARGUMENTS


def test_a_rank_binds_its_arguments_in_the_declared_order():
    import torch

    from mhc_ar.protocol import RANK_ARGUMENTS
    from mhc_ar.transport import RankEndpoint

    state = torch.zeros(4, dtype=torch.int32)
    endpoint = RankEndpoint(3, 4, torch.empty(0, dtype=torch.bfloat16), state, (11, 12, 13, 14, 0, 0, 0, 0), multicast_address=99)
    bound = dict(zip(RANK_ARGUMENTS, endpoint.rank_arguments))
    assert bound["state"] is state and bound["rank"] == 3 and bound["multicast"] == 99
    assert [bound[f"peer{r}"] for r in range(8)] == [11, 12, 13, 14, 0, 0, 0, 0]


@pytest.mark.parametrize("hc, variant", [(8, Variant.FULL), (5, Variant.MXFP8), (6, Variant.RESIDUAL_ONLY)])
def test_tp1_above_hc4_reads_the_coefficients_from_shared_memory_in_two_forms(hc, variant):
    """hc > 4 at tp = 1 (ConsumerSpec.coefficients_in_shared): the hc * (hc + 2) coefficients are
    staged in shared memory; the mailbox consumer (tp > 1) keeps them in registers. The module
    holds two kernels. The narrow form reads each coefficient where used (one volatile
    ld.shared.f32 each) under a bound of 4 CTAs per SM (SHARED_COEFFICIENT_CTAS_PER_SM); the wide
    form, for calls of WIDE_FORM_MIN_TOKENS or more, re-reads every row for each word of the
    fragment as volatile vectors (rows padded to whole 16-byte vectors) under a bound of 640
    threads per SM (WIDE_FORM_THREADS_PER_SM: 5 CTAs of 128 threads, 2 of 256 at H > 8192)."""
    from conformance.ptx_contract import check_ptx

    direct = ConsumerSpec(choose_consumer_tiling(7168), hc=hc, tp=1, capacity=CAPACITY, variant=variant)
    mailbox = dataclasses.replace(direct, tp=2)
    wide = dataclasses.replace(direct, wide=True)
    assert direct.coefficients_in_shared and direct.has_wide_form and direct.min_ctas_per_sm == 4
    assert wide.min_ctas_per_sm == 5 and not wide.has_wide_form
    big = ConsumerSpec(choose_consumer_tiling(16392), hc=hc, tp=1, capacity=CAPACITY, variant=Variant.FULL)
    assert big.tiling.threads_per_cta == 256 and big.min_ctas_per_sm == 4 and dataclasses.replace(big, wide=True).min_ctas_per_sm == 2
    assert not mailbox.coefficients_in_shared and not mailbox.has_wide_form and mailbox.min_ctas_per_sm == 0
    with pytest.raises(ValueError, match="wide form"):
        dataclasses.replace(mailbox, wide=True)
    with pytest.raises(ValueError, match="wide form"):
        dataclasses.replace(direct, hc=4, wide=True)
    direct_ptx = compile_consumer(direct, "sm_90a", keep_ptx=True).ptx
    mailbox_ptx = compile_consumer(mailbox, "sm_90a", keep_ptx=True).ptx
    entries = kernel_entries(direct_ptx)
    assert len(entries) == 2 and len(kernel_entries(mailbox_ptx)) == 1
    [narrow_ptx] = [e for e in entries if "ConsumerKernel" in e.split("(", 1)[0]]
    [wide_ptx] = [e for e in entries if "WideFormKernel" in e.split("(", 1)[0]]
    rows = hc + 1 + (variant is not Variant.RESIDUAL_ONLY)  # post, the hc comb rows, pre (with a norm)
    narrow_reads = [i for i in parse_instructions(narrow_ptx) if i.opcode == "ld.shared.f32"]
    assert len(narrow_reads) >= rows * hc and ".minnctapersm 4" in narrow_ptx
    assert not [i for i in parse_instructions(narrow_ptx) if i.opcode == "ld.volatile.shared.v4.f32"]
    row_reads = [i for i in parse_instructions(wide_ptx) if i.opcode == "ld.volatile.shared.v4.f32"]
    assert len(row_reads) == 4 * rows * -(-hc // 4)  # per word of the fragment, each row in ceil(hc / 4) vectors
    assert ".minnctapersm 5" in wide_ptx and ".minnctapersm" not in mailbox_ptx
    assert not [i for i in parse_instructions(mailbox_ptx) if i.opcode == "st.shared.b32"]
    checks = check_ptx(direct, direct_ptx)
    assert all(c.passed for c in checks) and sum(c.name.startswith("wide form: ") for c in checks) >= 10
    # Either kernel alone is not the consumer the spec describes.
    for alone in (narrow_ptx, wide_ptx):
        [found] = check_ptx(direct, alone)
        assert found.name == "a narrow and a wide form" and not found.passed
