def load_x(source, element_offset, valid):
    if valid is None or valid: return tuple(('x', element_offset, i) for i in range(4))
    return (0, 0, 0, 0)
def finalize_sum(hidden, top_k, source, gemm2, weights, routes, gemm2_rows, row, vector, element_offset, first, state_address, valid):
    if valid is None or valid: return tuple(('fin', element_offset, i) for i in range(4))
    return (0, 0, 0, 0)
