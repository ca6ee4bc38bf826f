"""Bit-exact PyTorch reference of the fused TP all-reduce + mHC post-mix, collapse, RMSNorm and
MXFP8 operation (SPEC.md, "The numerics contract").

One module per stage, named like the kernel's stages: contribution, scrub, reduce, post_mix,
collapse, rms_norm, mxfp8; `compose.all_reduce_mhc` chains them for a whole TP group. The
primitives they are built from live in `bits` (bf16 rounding on bit patterns), `exact` (fp32
fma/add/mul/div) and `rsqrt` (the hardware rsqrt.approx). `explain` prints every intermediate of
one element; `float64_model` is an independent sanity bound. Runs on CPU and CUDA tensors with
identical results; imports nothing from mhc_ar.
"""

from .bits import BF16_CANONICAL_NAN, F32_CANONICAL_NAN, bf16_rn, bf16_to_f32
from .collapse import collapse
from .compose import MixInputs, RankInputs, ReferenceOutputs, all_reduce_mhc, validate_inputs
from .contribution import contribution, finalize_contribution, invalid_routes, routed
from .exact import add_f32, div_f32, fma_f32, mul_f32
from .explain import Step, explain_element, format_steps
from .float64_model import Float64Report, StageCheck, check_against_float64
from .mxfp8 import e4m3_decode, e4m3_rn_satfinite, mxfp8_quantize, scale_layout_size, swizzle_offset
from .post_mix import post_mix
from .reduce import reduce
from .rms_norm import ReductionTree, rms_norm, sum_of_squares
from .rsqrt import (
    load_table,
    reference_rsqrt_table,
    rsqrt_approx_ftz,
    rsqrt_delta_from_measurement,
    write_table,
)
from .scrub import scrub

__all__ = [
    "BF16_CANONICAL_NAN",
    "F32_CANONICAL_NAN",
    "Float64Report",
    "MixInputs",
    "RankInputs",
    "ReductionTree",
    "ReferenceOutputs",
    "StageCheck",
    "Step",
    "add_f32",
    "all_reduce_mhc",
    "bf16_rn",
    "bf16_to_f32",
    "check_against_float64",
    "collapse",
    "contribution",
    "div_f32",
    "e4m3_decode",
    "e4m3_rn_satfinite",
    "explain_element",
    "finalize_contribution",
    "fma_f32",
    "format_steps",
    "invalid_routes",
    "load_table",
    "mul_f32",
    "mxfp8_quantize",
    "post_mix",
    "reduce",
    "routed",
    "reference_rsqrt_table",
    "rms_norm",
    "rsqrt_approx_ftz",
    "rsqrt_delta_from_measurement",
    "scale_layout_size",
    "scrub",
    "sum_of_squares",
    "swizzle_offset",
    "validate_inputs",
    "write_table",
]
