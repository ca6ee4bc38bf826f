import simstate
def _rec(name, addr, vals, pred):
    on = True if pred is None else bool(pred)
    simstate.log.setdefault(simstate.tls.tid, []).append((name, addr, tuple(vals), on))
def fma_rn(a, b, c): return ('fma', a, b, c)
def mul_rn(a, b): return ('mul', a, b)
def add_rn(a, b): return ('add', a, b)
def div_rn(a, b): return ('div', a, b)
def rsqrt_approx_ftz(x): return ('rsqrt', x)
def bf16x2_to_f32x2(w): return (('lo', w), ('hi', w))
def f32x2_to_bf16x2_rn(low, high): return ('pack', low, high)
def bf16x2_max_to_f32(w): return ('bmaxf', w)
def ue8m0_scale_and_inverse(x): return (('scale', x), ('inv', x))
def bf16x8_to_e4m3x8(*a): return ('e4m3',) + tuple(a)
def ld_global_v4(addr, pred=None):
    if pred is None or pred: return tuple(('g', addr, i) for i in range(4))
    return (0, 0, 0, 0)
def ld_global_u32(addr, pred=None):
    if pred is None or pred: return ('g32', addr)
    return 0
def ld_global_f32(addr): return ('g32', addr)
def st_global_v4(addr, w0, w1, w2, w3, pred=None): _rec('v4', addr, (w0, w1, w2, w3), pred)
def st_global_u64(addr, v, pred=None): _rec('u64', addr, (v,), pred)
def st_global_u8(addr, v, pred=None): _rec('u8', addr, (v,), pred)
def st_global_u32(addr, v, pred=None): _rec('u32', addr, (v,), pred)
def red_add_u32(addr, v, pred=None): _rec('red', addr, (v,), pred)
def _in_coef(addr, n):
    s, size = simstate.coef_region
    return s <= addr and addr + n <= s + size
def st_shared_u32_if(addr, v, pred):
    on = bool(pred)
    simstate.ev('sts', (addr, on, _in_coef(addr, 4)))
    if on:
        assert _in_coef(addr, 4), ('store out of region', addr, simstate.coef_region)
        assert addr % 4 == 0
        with _lock:
            assert addr not in simstate.shared or simstate.shared[addr] == v, ('conflicting store', addr)
            simstate.shared[addr] = v
import threading
_lock = threading.Lock()
def ld_shared_f32(addr):
    simstate.ev('lds', addr)
    assert _in_coef(addr, 4), ('ld.shared out of region', addr)
    return simstate.shared.get(addr, ('UNINIT', addr))
def ld_volatile_shared_v4_f32(addr):
    simstate.ev('ldsv4', addr)
    assert addr % 16 == 0, ('misaligned v4', addr)
    assert _in_coef(addr, 16), ('v4 out of region', addr, simstate.coef_region)
    return tuple(simstate.shared.get(addr + 4 * i, ('UNINIT', addr + 4 * i)) for i in range(4))
def mbarrier_init_expect_tx(*a): pass
