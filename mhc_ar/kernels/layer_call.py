"""One host function that launches the publish and then the consumer on the same stream.

The kernels are exactly PublishKernel's and ConsumerKernel's (PDL-chained as before); only the
host side differs: an eager AllReduceMHC call is one TVM-FFI call instead of two, which halves
the per-call launch overhead the host pays at small M.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..config import ConsumerSpec, PublishSpec
from .consumer import ConsumerKernel
from .publish import PublishKernel


class PublishThenConsume:
    """Arguments: first what is fixed per rank (state, peer0..7, multicast, rank: see
    PublishKernel; mailbox: see ConsumerKernel), so the host can bind them once; then what
    changes per call (the contribution, the mix inputs and outputs, eps, num_tokens). `state` is
    this rank's protocol state, for both kernels."""

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
        stream,
    ):
        peers = (peer0, peer1, peer2, peer3, peer4, peer5, peer6, peer7)
        self.publish(source, gemm2, weights, routes, state, *peers, multicast, rank, num_tokens, stream)
        outputs = (new_residual, layer_input, mx_values, mx_scales)
        self.consumer(mailbox, state, residual, post, comb, pre, norm_weight, *outputs, eps, num_tokens, stream)
