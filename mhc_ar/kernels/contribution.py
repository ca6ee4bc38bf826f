"""Contract step 1, the rank's contribution of one 16-byte vector: x, or the MoE finalize sum.

Traced inline (plain Python) by the kernel that reads it: the publish at tp > 1, the consumer
itself at tp = 1 (ConsumerSpec.direct: nothing to exchange, so no mailbox and no publish).
"""

from __future__ import annotations

from cutlass import Float32, Int64, Uint32

from .. import ptx
from ..config import VECTOR_ELEMS
from ..protocol import BF16_BYTES, INT32_BYTES, INVALID_ROUTES, SKIPPED_ROUTE, STATE_WORD_BYTES

_WORDS_PER_VECTOR = 4


def load_x(source, element_offset, valid=None):
    """The four packed bf16x2 words of x [token, column .. column + 7]."""
    return ptx.ld_global_v4(source + element_offset * BF16_BYTES, valid)


def finalize_sum(hidden, top_k, shared, gemm2, weights, routes, gemm2_rows, token, vector, element_offset, counter_thread,
                 state_address, valid=None):
    """acc = +0; acc = fma(w_k, gemm2[idx_k], acc) over the routes in order, skipping every idx
    outside 0 .. gemm2_rows-1 (-1 by design; any other is an invalid index, never read, and
    counted once per entry by `counter_thread` in state[INVALID_ROUTES]); acc = acc + shared;
    one rounding to bf16. `valid` (None: always) predicates the vector's own loads."""
    acc = [Float32(0.0)] * VECTOR_ELEMS
    for k in range(top_k):
        route_offset = (Int64(token) * top_k + k) * INT32_BYTES  # of the route index and of its weight (fp32)
        row = ptx.ld_global_s32(routes + route_offset)
        taken = (row >= 0) & (row < gemm2_rows)
        invalid = ((row < 0) & (row != SKIPPED_ROUTE)) | (row >= gemm2_rows)
        ptx.red_add_u32(state_address + INVALID_ROUTES * STATE_WORD_BYTES, Uint32(1), counter_thread & invalid)
        weight = ptx.ld_global_f32(weights + route_offset)
        row_bytes = (Int64(row) * hidden + Int64(vector) * VECTOR_ELEMS) * BF16_BYTES
        expert = ptx.ld_global_v4(gemm2 + row_bytes, taken if valid is None else taken & valid)
        for w in range(_WORDS_PER_VECTOR):
            low, high = ptx.bf16x2_to_f32x2(expert[w])
            acc[2 * w] = ptx.fma_rn_if(taken, weight, low, acc[2 * w])
            acc[2 * w + 1] = ptx.fma_rn_if(taken, weight, high, acc[2 * w + 1])
    shared_words = ptx.ld_global_v4(shared + element_offset * BF16_BYTES, valid)
    out = []
    for w in range(_WORDS_PER_VECTOR):
        low, high = ptx.bf16x2_to_f32x2(shared_words[w])
        out.append(ptx.f32x2_to_bf16x2_rn(ptx.add_rn(acc[2 * w], low), ptx.add_rn(acc[2 * w + 1], high)))
    return out
