INV_FLOAT8_E4M3_MAX = 1.0 / 448.0
def bfloat2_max_abs_4(*a): return ('bmax4',) + tuple(a)
def reduce_max_4threads(x): return ('rmax4', x)
