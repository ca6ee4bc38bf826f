"""One rank's call checked against an instance's static configuration, before anything runs.

CallValidator raises ValueError naming the argument and the rule, before it allocates or
launches anything (so a rejected call leaves every state usable); a call that passes becomes a
Launch: the validated addresses the kernels take, and the outputs the caller gets back (fresh
ones, allocated last, where the caller gave none).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import validation as check
from .config import Variant, mxfp8_scale_bytes

INT32_MAX = 2**31 - 1


class Launch(NamedTuple):
    """Validated addresses of one rank's call, ready to launch (a tuple: cheap to build)."""

    contribution: tuple[int, int, int, int]  # source, gemm2, weights, routes
    mix: tuple[int, int, int, int, int]  # residual, post, comb, pre, norm_weight
    outputs: tuple[int, int, int, int]  # new_residual, layer_input, mx_values, mx_scales
    results: tuple  # what the caller gets back
    gemm2_rows: int = 0  # gemm2_permuted's row count (finalize): the publish reads no row past it


class CallValidator:
    """Checks one rank's call against the static configuration: raises ValueError naming the
    argument before it allocates or launches anything (so a rejected call leaves everything
    usable); a call that passes is returned as a Launch, with fresh outputs allocated (last)
    where the caller gave none."""

    def __init__(self, *, hidden_size, hc_mult, max_num_tokens, top_k, variant, device):
        for name, value in (("hidden_size", hidden_size), ("hc_mult", hc_mult), ("max_num_tokens", max_num_tokens), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {type(value).__name__}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        self.hidden_size, self.hc, self.capacity, self.top_k = hidden_size, hc_mult, max_num_tokens, top_k
        self.variant = variant
        self.device = device

    # ---- validation (raises ValueError before anything is allocated or launched) -------------

    def check_call(self, x, mix, eps, mxfp8_out, out, tokens=None) -> Launch:
        m = check.check_tokens(x, "x", self.capacity) if tokens is None else tokens
        address = check.check_tensor(x, "x", shape=(m, self.hidden_size), dtype=torch.bfloat16, device=self.device)
        return self._check_mix((address, 0, 0, 0), (("x", x),), m, mix, eps, mxfp8_out, out)

    def fresh_outputs(self, m: int):
        """(new_residual [M, hc, H], layer_input [M, H] or None) for a call without out=.
        Two torch.empty calls: on the H200's host, one allocation cut in two by as_strided took
        8.8 us against 4.8 (`scripts/validation_timing.py --device cuda`)."""
        h, hc, bf16, device = self.hidden_size, self.hc, torch.bfloat16, self.device
        new_residual = torch.empty(m, hc, h, dtype=bf16, device=device)
        if self.variant is Variant.RESIDUAL_ONLY:
            return new_residual, None
        return new_residual, torch.empty(m, h, dtype=bf16, device=device)

    def check_finalize(self, gemm2, weights, routes, shared, mix, eps, mxfp8_out, out) -> Launch:
        if self.top_k < 1:
            raise ValueError("finalize needs an instance built with top_k >= 1")
        m = check.check_tokens(shared, "shared_output", self.capacity)
        h, k, dev = self.hidden_size, self.top_k, self.device
        if not isinstance(gemm2, torch.Tensor) or gemm2.dim() != 2:
            raise ValueError("gemm2_permuted must be a 2-D [rows, hidden_size] tensor")
        if gemm2.shape[0] > INT32_MAX:
            raise ValueError(f"gemm2_permuted has {gemm2.shape[0]} rows; at most {INT32_MAX} (int32 route indices)")
        contribution = (
            check.check_tensor(shared, "shared_output", shape=(m, h), dtype=torch.bfloat16, device=dev),
            check.check_tensor(gemm2, "gemm2_permuted", shape=(gemm2.shape[0], h), dtype=torch.bfloat16, device=dev),
            check.check_tensor(weights, "expert_weights", shape=(m, k), dtype=torch.float32, device=dev),
            check.check_tensor(routes, "expanded_idx_to_permuted_idx", shape=(m, k), dtype=torch.int32, device=dev),
        )
        launch = self._check_mix(contribution, _finalize_sources(gemm2, weights, routes, shared), m, mix, eps, mxfp8_out, out)
        return launch._replace(gemm2_rows=gemm2.shape[0])

    def _check_mix(self, contribution, sources, m, mix, eps, mxfp8_out, out) -> Launch:
        residual, post, comb, pre, norm_weight = mix
        h, hc, dev = self.hidden_size, self.hc, self.device
        f32, bf16 = torch.float32, torch.bfloat16
        inputs = [("residual", check.check_tensor(residual, "residual", shape=(m, hc, h), dtype=bf16, device=dev), m * hc * h * 2)]
        post_shape = (m, hc, 1) if isinstance(post, torch.Tensor) and post.dim() == 3 else (m, hc)
        inputs.append(("post", check.check_tensor(post, "post", shape=post_shape, dtype=f32, device=dev), m * hc * 4))
        inputs.append(("comb", check.check_tensor(comb, "comb", shape=(m, hc, hc), dtype=f32, device=dev), m * hc * hc * 4))
        check.check_eps(eps)
        residual_only = self.variant is Variant.RESIDUAL_ONLY
        if residual_only:
            for name, value in (("pre", pre), ("norm_weight", norm_weight)):
                if value is not None:
                    raise ValueError(f"{name} must be None for a residual_only instance (no layer input is computed)")
            pre_address = weight_address = 0
        else:
            pre_address = check.check_tensor(pre, "pre", shape=(m, hc), dtype=f32, device=dev)
            weight_address = check.check_tensor(norm_weight, "norm_weight", shape=(h,), dtype=bf16, device=dev)
            inputs += [("pre", pre_address, m * hc * 4), ("norm_weight", weight_address, h * 2)]

        outputs = []
        mx_values = mx_scales = 0
        if self.variant is Variant.MXFP8:
            if not isinstance(mxfp8_out, (tuple, list)) or len(mxfp8_out) != 2:
                raise ValueError("mxfp8_out=(values, scales) is required by a quantize_layer_input instance")
            values, scales = mxfp8_out
            scale_bytes = mxfp8_scale_bytes(m, h)
            mx_values = check.check_tensor(values, "mxfp8_out[0] (values)", shape=(m, h), dtype=torch.float8_e4m3fn, device=dev)
            mx_scales = check.check_tensor(scales, "mxfp8_out[1] (scales)", shape=(scale_bytes,), dtype=torch.uint8, device=dev)
            outputs += [("mxfp8_out[0] (values)", mx_values, m * h), ("mxfp8_out[1] (scales)", mx_scales, scale_bytes)]
            _check_early_scales(mx_scales, scale_bytes, sources)
        elif mxfp8_out is not None:
            raise ValueError("mxfp8_out given, but this instance was built with quantize_layer_input=False")

        if out is None:
            check.check_no_overlap(outputs, inputs + _spans(sources))
            check.check_disjoint(outputs)
            new_residual, layer_input = self.fresh_outputs(m)
        else:
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise ValueError("out must be a (new_residual, layer_input) pair")
            new_residual, layer_input = out
            address = check.check_tensor(new_residual, "out[0] (new_residual)", shape=(m, hc, h), dtype=bf16, device=dev)
            outputs.append(("out[0] (new_residual)", address, m * hc * h * 2))
            if residual_only:
                if layer_input is not None:
                    raise ValueError("out[1] must be None for a residual_only instance")
            else:
                address = check.check_tensor(layer_input, "out[1] (layer_input)", shape=(m, h), dtype=bf16, device=dev)
                outputs.append(("out[1] (layer_input)", address, m * h * 2))
            # The publish's sources too (x, or shared_output and the expert tensors): one rule for
            # every input, as README states it, rather than a PDL-ordering argument per output.
            check.check_no_overlap(outputs, inputs + _spans(sources))
            check.check_disjoint(outputs)

        return Launch(
            contribution,
            (inputs[0][1], inputs[1][1], inputs[2][1], pre_address, weight_address),
            (new_residual.data_ptr(), 0 if layer_input is None else layer_input.data_ptr(), mx_values, mx_scales),
            (new_residual, layer_input),
        )


def _finalize_sources(gemm2, weights, routes, shared):
    return (("shared_output", shared), ("gemm2_permuted", gemm2), ("expert_weights", weights), ("expanded_idx_to_permuted_idx", routes))


def _spans(sources):
    """(name, address, nbytes) of the publish's sources (validated tensors)."""
    return [(name, tensor.data_ptr(), tensor.numel() * tensor.element_size()) for name, tensor in sources]


def _check_early_scales(address: int, nbytes: int, sources) -> None:
    """The consumer zeroes the MXFP8 padding scales before its PDL wait, while the publish may
    still read its sources: the scales must not share memory with them (checked first, so the
    message says why)."""
    check.check_no_overlap([("mxfp8_out[1] (scales)", address, nbytes)], _spans(sources))
