"""Every validation error of the API, on the CPU: a ValueError naming the argument, raised before
anything is launched (CallValidator is pure; the GPU test checks that state is unchanged)."""

from __future__ import annotations

import pytest
import torch

from mhc_ar.allreduce_mhc import _per_rank
from mhc_ar.call_check import CallValidator
from mhc_ar.engine import variant_of
from mhc_ar.config import Variant, mxfp8_scale_bytes
from mhc_ar.transport import make_transport
from mhc_ar.validation import check_eps

M, H, HC, K = 4, 256, 2, 3
CPU = torch.device("cpu")


def validator(variant=Variant.FULL, top_k=K):
    return CallValidator(hidden_size=H, hc_mult=HC, max_num_tokens=8, top_k=top_k, variant=variant, device=CPU)


def aligned(shape, dtype):
    """A 16-byte aligned contiguous tensor (torch's CPU allocator aligns to 64 bytes)."""
    return torch.zeros(shape, dtype=dtype)


def mix(**overrides):
    values = dict(
        residual=aligned((M, HC, H), torch.bfloat16),
        post=aligned((M, HC), torch.float32),
        comb=aligned((M, HC, HC), torch.float32),
        pre=aligned((M, HC), torch.float32),
        norm_weight=aligned((H,), torch.bfloat16),
    )
    values.update(overrides)
    return tuple(values[k] for k in ("residual", "post", "comb", "pre", "norm_weight"))


def test_valid_call_passes_and_allocates_outputs():
    launch = validator().check_call(aligned((M, H), torch.bfloat16), mix(), 1e-6, None, None)
    new_residual, layer_input = launch.results
    assert new_residual.shape == (M, HC, H) and layer_input.shape == (M, H)
    post3 = aligned((M, HC, 1), torch.float32)
    validator().check_call(aligned((M, H), torch.bfloat16), mix(post=post3), 1e-6, None, None)


X = aligned((M, H), torch.bfloat16)


@pytest.mark.parametrize(
    "args,match",
    [
        (dict(x=aligned((M, H), torch.float16)), "x must have dtype"),
        (dict(x=aligned((M, H + 8), torch.bfloat16)), "x must have shape"),
        (dict(x=aligned((0, H), torch.bfloat16)), "x has 0 tokens"),
        (dict(x=aligned((9, H), torch.bfloat16)), "x has 9 tokens"),
        (dict(x=aligned((M, 2 * H), torch.bfloat16)[:, ::2]), "x must have shape|x must be contiguous"),
        (dict(x=aligned((M * H + 1,), torch.bfloat16)[1:].view(M, H)), "x must be 16-byte aligned"),
        (dict(x=[1, 2]), "x must be a torch.Tensor"),
        (dict(x=torch.zeros((), dtype=torch.bfloat16)), "x must have a leading token dimension"),
        (dict(mix=mix(residual=aligned((M, HC + 1, H), torch.bfloat16))), "residual must have shape"),
        (dict(mix=mix(post=aligned((M, HC), torch.float64))), "post must have dtype"),
        (dict(mix=mix(comb=aligned((M, HC, HC), torch.float32).transpose(1, 2))), "comb must be contiguous"),
        (dict(mix=mix(pre=None)), "pre must be a torch.Tensor"),
        (dict(mix=mix(norm_weight=aligned((H,), torch.float32))), "norm_weight must have dtype"),
        (dict(eps=float("nan")), "eps must be finite"),
        (dict(eps=-1.0), "eps must be finite"),
        (dict(eps="1e-6"), "eps must be a float"),
        (dict(mxfp8_out=(X, X)), "mxfp8_out given"),
        (dict(out=(aligned((M, HC, H), torch.float32), X)), "new_residual"),
        (dict(out=(aligned((M, HC, H), torch.bfloat16), None)), "layer_input"),
        (dict(out=X), "out must be a"),
    ],
)
def test_call_rejections_name_the_argument(args, match):
    kwargs = dict(x=X, mix=mix(), eps=1e-6, mxfp8_out=None, out=None)
    kwargs.update(args)
    with pytest.raises(ValueError, match=match):
        validator().check_call(kwargs["x"], kwargs["mix"], kwargs["eps"], kwargs["mxfp8_out"], kwargs["out"])


def test_outputs_must_not_alias_inputs():
    inputs = mix()
    with pytest.raises(ValueError, match="new_residual.* overlaps residual"):
        validator().check_call(X, inputs, 1e-6, None, (inputs[0], aligned((M, H), torch.bfloat16)))
    # layer_input inside the norm weight's storage (same dtype, same element count per row).
    weight = aligned((M * H,), torch.bfloat16)
    with pytest.raises(ValueError, match="layer_input.* overlaps norm_weight"):
        validator().check_call(X, mix(norm_weight=weight[:H]), 1e-6, None, (aligned((M, HC, H), torch.bfloat16), weight.view(M, H)))


def test_outputs_must_not_alias_what_the_publish_reads():
    """x (call) and shared_output, gemm2_permuted, expert_weights, the routes (finalize) are
    inputs too: an output sharing their memory is refused, not left to PDL ordering."""
    storage = aligned((M * H,), torch.bfloat16)
    x = storage.view(M, H)
    with pytest.raises(ValueError, match=r"out\[1\] \(layer_input\) overlaps x: outputs must not alias inputs"):
        validator().check_call(x, mix(), 1e-6, None, (aligned((M, HC, H), torch.bfloat16), storage.view(M, H)))
    raw = aligned((M * H * 2,), torch.uint8)  # x's bytes, the e4m3 values inside them
    x, values = raw.view(torch.bfloat16).view(M, H), raw[: M * H].view(torch.float8_e4m3fn).view(M, H)
    with pytest.raises(ValueError, match=r"mxfp8_out\[0\] \(values\) overlaps x"):
        validator(Variant.MXFP8).check_call(x, mix(), 1e-6, (values, aligned((mxfp8_scale_bytes(M, H),), torch.uint8)), None)
    shared = aligned((M, H), torch.bfloat16)
    out = (aligned((M, HC, H), torch.bfloat16), shared)
    with pytest.raises(ValueError, match=r"out\[1\] \(layer_input\) overlaps shared_output"):
        validator(top_k=K).check_finalize(aligned((4, H), torch.bfloat16), aligned((M, K), torch.float32),
                                          aligned((M, K), torch.int32), shared, mix(), 1e-6, None, out)


def test_outputs_must_not_alias_each_other():
    storage = aligned((M * HC * H,), torch.bfloat16)
    out = (storage.view(M, HC, H), storage[: M * H].view(M, H))
    with pytest.raises(ValueError, match="new_residual.* overlaps out\\[1\\] \\(layer_input\\)"):
        validator().check_call(X, mix(), 1e-6, None, out)
    v = validator(Variant.MXFP8)
    scale_bytes = mxfp8_scale_bytes(M, H)
    raw = aligned((M * H + scale_bytes,), torch.uint8)
    values = raw[: M * H].view(torch.float8_e4m3fn).view(M, H)
    with pytest.raises(ValueError, match="values.* overlaps .*scales"):
        v.check_call(X, mix(), 1e-6, (values, raw[:scale_bytes]), None)


def test_mxfp8_scales_must_not_alias_what_the_publish_reads():
    """The scales' padding rows are zeroed while the publish may still read its sources."""
    v = validator(Variant.MXFP8)
    values = aligned((M, H), torch.float8_e4m3fn)
    scale_bytes = mxfp8_scale_bytes(M, H)
    x_storage = aligned((max(M * H * 2, scale_bytes),), torch.uint8)
    x = x_storage[: M * H * 2].view(torch.bfloat16).view(M, H)
    with pytest.raises(ValueError, match="scales.* overlaps x"):
        v.check_call(x, mix(), 1e-6, (values, x_storage[:scale_bytes]), None)
    storage = aligned((max(scale_bytes // 4, M * K),), torch.int32)
    routes, scales = storage[: M * K].view(M, K), storage.view(torch.uint8)[:scale_bytes]
    gemm2, weights = aligned((M * K, H), torch.bfloat16), aligned((M, K), torch.float32)
    with pytest.raises(ValueError, match="scales.* overlaps expanded_idx_to_permuted_idx"):
        v.check_finalize(gemm2, weights, routes, X, mix(), 1e-6, (values, scales), None)


def _variant_arguments(variant, given_out):
    """A valid (mix, mxfp8_out, out) for the variant; out given or None."""
    inputs = mix(pre=None, norm_weight=None) if variant is Variant.RESIDUAL_ONLY else mix()
    mx = None
    if variant is Variant.MXFP8:
        mx = (aligned((M, H), torch.float8_e4m3fn), aligned((mxfp8_scale_bytes(M, H),), torch.uint8))
    out = None
    if given_out:
        out = (aligned((M, HC, H), torch.bfloat16), None if variant is Variant.RESIDUAL_ONLY else aligned((M, H), torch.bfloat16))
    return inputs, mx, out


def _expected_launch(inputs, mx, out):
    """The addresses a valid call must launch with: (mix, outputs[2:], outputs or None)."""
    residual, post, comb, pre, norm_weight = inputs
    mix_addresses = tuple(0 if t is None else t.data_ptr() for t in (residual, post, comb, pre, norm_weight))
    mx_addresses = (0, 0) if mx is None else (mx[0].data_ptr(), mx[1].data_ptr())
    out_addresses = None if out is None else (out[0].data_ptr(), 0 if out[1] is None else out[1].data_ptr())
    return mix_addresses, mx_addresses, out_addresses


def _check_outputs(launch, variant, mx_addresses, out, out_addresses):
    assert launch.outputs[2:] == mx_addresses
    if out is not None:
        assert launch.outputs[:2] == out_addresses
        assert all(a is b for a, b in zip(launch.results, out))
        return
    new_residual, layer_input = launch.results
    assert new_residual.shape == (M, HC, H) and new_residual.dtype == torch.bfloat16 and new_residual.is_contiguous()
    assert launch.outputs[0] == new_residual.data_ptr()
    if variant is Variant.RESIDUAL_ONLY:
        assert layer_input is None and launch.outputs[1] == 0
    else:
        assert layer_input.shape == (M, H) and layer_input.dtype == torch.bfloat16 and layer_input.is_contiguous()
        assert launch.outputs[1] == layer_input.data_ptr()
        assert layer_input.untyped_storage().data_ptr() != new_residual.untyped_storage().data_ptr()


@pytest.mark.parametrize("variant", list(Variant))
@pytest.mark.parametrize("given_out", [False, True])
def test_call_launches_the_arguments_addresses(variant, given_out):
    """A valid call launches with exactly its tensors' addresses (0 for what the variant lacks),
    and fresh outputs are contiguous with layer_input right after new_residual."""
    inputs, mx, out = _variant_arguments(variant, given_out)
    mix_addresses, mx_addresses, out_addresses = _expected_launch(inputs, mx, out)
    launch = validator(variant).check_call(X, inputs, 1e-6, mx, out)
    assert launch.contribution == (X.data_ptr(), 0, 0, 0)
    assert launch.mix == mix_addresses
    _check_outputs(launch, variant, mx_addresses, out, out_addresses)


@pytest.mark.parametrize(
    "args",
    [
        dict(eps=1),  # an int eps
        dict(mix=mix(post=aligned((M, HC, 1), torch.float32))),  # post as [M, hc, 1]
    ],
)
def test_unusual_but_valid_calls_are_accepted(args):
    kwargs = dict(x=X, mix=mix(), eps=1e-6)
    kwargs.update(args)
    launch = validator().check_call(kwargs["x"], kwargs["mix"], kwargs["eps"], None, None)
    assert launch.mix[1] == kwargs["mix"][1].data_ptr()


def test_mxfp8_outputs():
    v = validator(Variant.MXFP8)
    values = aligned((M, H), torch.float8_e4m3fn)
    scales = aligned((mxfp8_scale_bytes(M, H),), torch.uint8)
    v.check_call(X, mix(), 1e-6, (values, scales), None)
    with pytest.raises(ValueError, match="required"):
        v.check_call(X, mix(), 1e-6, None, None)
    with pytest.raises(ValueError, match="scales"):
        v.check_call(X, mix(), 1e-6, (values, scales[:-1]), None)
    with pytest.raises(ValueError, match="values"):
        v.check_call(X, mix(), 1e-6, (values.view(torch.uint8), scales), None)


def test_residual_only_takes_no_pre_or_weight():
    v = validator(Variant.RESIDUAL_ONLY)
    launch = v.check_call(X, mix(pre=None, norm_weight=None), 1e-6, None, None)
    assert launch.results[1] is None
    with pytest.raises(ValueError, match="pre must be None"):
        v.check_call(X, mix(norm_weight=None), 1e-6, None, None)


@pytest.mark.parametrize("variant", list(Variant))
@pytest.mark.parametrize("given_out", [False, True])
def test_finalize_launches_the_arguments_addresses(variant, given_out):
    inputs, mx, out = _variant_arguments(variant, given_out)
    gemm2, weights, routes = aligned((M * K, H), torch.bfloat16), aligned((M, K), torch.float32), aligned((M, K), torch.int32)
    mix_addresses, mx_addresses, out_addresses = _expected_launch(inputs, mx, out)
    launch = validator(variant).check_finalize(gemm2, weights, routes, X, inputs, 1e-6, mx, out)
    assert launch.contribution == (X.data_ptr(), gemm2.data_ptr(), weights.data_ptr(), routes.data_ptr())
    assert launch.mix == mix_addresses
    _check_outputs(launch, variant, mx_addresses, out, out_addresses)


@pytest.mark.parametrize(
    "what, match",
    [
        ("gemm2 1-D", "gemm2_permuted must be a 2-D"),
        ("gemm2 0-D", "gemm2_permuted must be a 2-D"),
        ("routes int64", "expanded_idx_to_permuted_idx must have dtype"),
        ("weights shape", "expert_weights must have shape"),
        ("shared on the wrong device", "shared_output must be on"),
    ],
)
def test_finalize_rejects_each_contribution_argument(what, match):
    gemm2, weights, routes, shared = aligned((M * K, H), torch.bfloat16), aligned((M, K), torch.float32), aligned((M, K), torch.int32), X
    if what == "gemm2 1-D":
        gemm2 = aligned((M * K * H,), torch.bfloat16)
    elif what == "gemm2 0-D":
        gemm2 = torch.zeros((), dtype=torch.bfloat16)
    elif what == "routes int64":
        routes = routes.long()
    elif what == "weights shape":
        weights = aligned((M, K + 1), torch.float32)
    else:
        shared = torch.empty((M, H), dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=match):
        validator().check_finalize(gemm2, weights, routes, shared, mix(), 1e-6, None, None)


def test_finalize_rejections():
    v = validator()
    gemm2 = aligned((M * K, H), torch.bfloat16)
    weights = aligned((M, K), torch.float32)
    routes = aligned((M, K), torch.int32)
    v.check_finalize(gemm2, weights, routes, X, mix(), 1e-6, None, None)
    with pytest.raises(ValueError, match="expanded_idx_to_permuted_idx must have dtype"):
        v.check_finalize(gemm2, weights, routes.long(), X, mix(), 1e-6, None, None)
    with pytest.raises(ValueError, match="expert_weights must have shape"):
        v.check_finalize(gemm2, weights[:, :2].contiguous(), routes, X, mix(), 1e-6, None, None)
    with pytest.raises(ValueError, match="gemm2_permuted"):
        v.check_finalize(aligned((M * K, H + 8), torch.bfloat16), weights, routes, X, mix(), 1e-6, None, None)
    with pytest.raises(ValueError, match="top_k >= 1"):
        validator(top_k=0).check_finalize(gemm2, weights, routes, X, mix(), 1e-6, None, None)


def test_construction_arguments():
    with pytest.raises(ValueError, match="hidden_size must be an int"):
        CallValidator(hidden_size=4096.0, hc_mult=4, max_num_tokens=8, top_k=0, variant=Variant.FULL, device=CPU)
    with pytest.raises(ValueError, match="top_k"):
        CallValidator(hidden_size=4096, hc_mult=4, max_num_tokens=8, top_k=-1, variant=Variant.FULL, device=CPU)
    with pytest.raises(ValueError, match="exclude each other"):
        variant_of(True, True)
    with pytest.raises(ValueError, match="transport must be one of"):
        make_transport("nvlink")
    with pytest.raises(ValueError, match="one entry per rank"):
        _per_rank([X], "x", 2)
    assert check_eps(0) == 0.0
