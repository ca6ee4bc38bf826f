import simstate
class _Iter:
    def __init__(self, addr, esize): self.addr, self.esize = addr, esize
    def toint(self): return self.addr
    def __add__(self, k): return _Iter(self.addr + k * self.esize, self.esize)
class _T:
    def __init__(self, it): self.iterator = it
class SmemAllocator:
    BASE = 1024 * 3   # dynamic smem base, 1024-aligned (get_dyn_smem alignment=1024)
    def __init__(self): self.off = self.BASE
    def allocate_tensor(self, dtype, layout, byte_alignment=1):
        n = 1
        for s in layout: n *= s
        self.off = -(-self.off // byte_alignment) * byte_alignment
        t = _T(_Iter(self.off, dtype.size))
        self.last = (self.off, n * dtype.size)
        self.off += n * dtype.size
        return t
