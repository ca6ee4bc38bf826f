def const_expr(x): return x
def range_constexpr(*a): return range(*a)
def _num(x):
    if isinstance(x, bool): return x
    if isinstance(x, (int, float)): return ('const', float(x))
    return x
class _Meta(type):
    def __call__(cls, x):
        return cls.conv(x)
class Float32(metaclass=_Meta):
    size = 4
    @staticmethod
    def conv(x):
        if isinstance(x, bool): return ('const', float(x))
        if isinstance(x, (int, float)): return ('const', float(x))
        return x
class _Int(metaclass=_Meta):
    @staticmethod
    def conv(x): return x
class Int32(_Int): size = 4
class Int64(_Int): size = 8
class Uint32(_Int): size = 4
class Uint64(_Int): size = 8
class Boolean(_Int): size = 1
