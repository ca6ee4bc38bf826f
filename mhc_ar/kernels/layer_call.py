"""One host function that launches the publish and then the consumer on the same stream.

The kernels are exactly PublishKernel's and ConsumerKernel's (PDL-chained as before; at tp = 1
the consumer alone, which reads the contribution itself: ConsumerSpec.direct); only the host
side differs: an eager AllReduceMHC call is one TVM-FFI call instead of two, which halves
the per-call launch overhead the host pays at small M. Two forms: PublishThenConsume takes
addresses (validated in Python), PublishThenConsumeTensors takes the tensors (checked by its
compiled TVM-FFI signature).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..config import ConsumerSpec, PublishSpec
from .consumer import ConsumerKernel
from .publish import PublishKernel


class PublishThenConsume:
    """Arguments: first what is fixed per rank (state, peer0..7, multicast, rank: see
    PublishKernel; mailbox: see ConsumerKernel), so the host can bind them once; then what
    changes per call (the contribution, the mix inputs and outputs, eps, num_tokens, the calls
    rejected since the last launch, and gemm2_permuted's row count). `state` is this rank's protocol state, for both
    kernels."""

    def __init__(self, publish: PublishSpec, consumer: ConsumerSpec):
        self.publish = PublishKernel(publish)
        self.consumer = ConsumerKernel(consumer)

    @cute.jit
    def __call__(
        self,
        state: cute.Tensor,
        peer0: Int64,
        peer1: Int64,
        peer2: Int64,
        peer3: Int64,
        peer4: Int64,
        peer5: Int64,
        peer6: Int64,
        peer7: Int64,
        multicast: Int64,
        rank: Int32,
        mailbox: Int64,
        source: Int64,
        gemm2: Int64,
        weights: Int64,
        routes: Int64,
        residual: Int64,
        post: Int64,
        comb: Int64,
        pre: Int64,
        norm_weight: Int64,
        new_residual: Int64,
        layer_input: Int64,
        mx_values: Int64,
        mx_scales: Int64,
        eps: Float32,
        num_tokens: Int32,
        rejected: Int32,
        gemm2_rows: Int32,
        stream,
    ):
        peers = (peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7)
        contribution = (source, gemm2, weights, routes)
        if cutlass.const_expr(not self.consumer.direct):
            self.publish(*contribution, post, state, *peers, multicast, rank, num_tokens, rejected, gemm2_rows, stream)
        mix = (residual, post, comb, pre, norm_weight)
        outputs = (new_residual, layer_input, mx_values, mx_scales)
        self.consumer(mailbox, state, *contribution, *mix, *outputs, eps, num_tokens, gemm2_rows, stream)


class PublishThenConsumeTensors:
    """The same two kernels, launched the same way, for an eager call without caller-given
    outputs (AllReduceMHC's common case), but the per-call arguments are the torch tensors
    themselves: TVM-FFI then checks in C, before anything launches, each tensor's dtype, rank and
    shape (one symbolic M for all, H and hc static), compact strides, 16-byte alignment and device
    (that of `state`, this rank's). What it cannot express (1 <= M <= capacity, eps, int32
    rather than uint32 routes) the caller checks. Arguments a variant does not use (call:
    gemm2, weights, routes; residual_only: pre, norm_weight, layer_input) are compiled as None."""

    def __init__(self, publish: PublishSpec, consumer: ConsumerSpec):
        self.publish = PublishKernel(publish)
        self.consumer = ConsumerKernel(consumer)

    @cute.jit
    def __call__(
        self,
        state: cute.Tensor,
        peer0: Int64,
        peer1: Int64,
        peer2: Int64,
        peer3: Int64,
        peer4: Int64,
        peer5: Int64,
        peer6: Int64,
        peer7: Int64,
        multicast: Int64,
        rank: Int32,
        mailbox: Int64,
        source: cute.Tensor,
        gemm2,
        weights,
        routes,
        residual: cute.Tensor,
        post: cute.Tensor,
        comb: cute.Tensor,
        pre,
        norm_weight,
        new_residual: cute.Tensor,
        layer_input,
        eps: Float32,
        rejected: Int32,
        stream,
    ):
        num_tokens = Int32(source.shape[0])
        peers = (peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7)
        contribution = (_address(source), _address(gemm2), _address(weights), _address(routes))
        gemm2_rows = Int32(0) if gemm2 is None else Int32(gemm2.shape[0])
        if cutlass.const_expr(not self.consumer.direct):
            self.publish(*contribution, _address(post), state, *peers, multicast, rank, num_tokens, rejected, gemm2_rows, stream)
        mix = (_address(residual), _address(post), _address(comb), _address(pre), _address(norm_weight))
        outputs = (_address(new_residual), _address(layer_input), Int64(0), Int64(0))
        self.consumer(mailbox, state, *contribution, *mix, *outputs, eps, num_tokens, gemm2_rows, stream)


def _address(tensor):
    """A tensor argument's device address, or 0 for an argument compiled as None."""
    return Int64(0) if tensor is None else tensor.iterator.toint()
