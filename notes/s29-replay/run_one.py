import sys, pickle, hashlib, threading
branch, H, hc, variant, contrib, cta = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6])
sys.path[:0] = ['/tmp/sim/stubs', f'/tmp/sim/{branch}']
sys.setrecursionlimit(100000)
import simstate
from mhc_ar.config import ConsumerSpec, choose_consumer_tiling, Variant, Contribution
from mhc_ar.kernels import consumer as C
import cutlass.memory as M

import os
if os.environ.get('REGPATH'):
    import mhc_ar.config as CF; CF.ConsumerSpec.coefficients_in_shared = property(lambda self: False)
tiling = choose_consumer_tiling(H)
spec = ConsumerSpec(tiling, hc=hc, tp=1, capacity=16, variant=Variant(variant), contribution=Contribution(contrib),
                    top_k=2 if contrib == 'finalize' else 0)
assert spec.coefficients_in_shared or os.environ.get('REGPATH')
K = C.ConsumerKernel(spec)
sums = {}
def fake_inv(self, sum_sq, eps, lane, warp, cta_, *a):
    sums[simstate.tls.tid] = sum_sq
    return ('invrms', 'opaque')
C.ConsumerKernel._inverse_rms = fake_inv

# record the coefficient region
orig_alloc = M.SmemAllocator.allocate_tensor
count_words = C._SharedCoefficients.count(hc)
def alloc(self, dtype, layout, byte_alignment=1):
    t = orig_alloc(self, dtype, layout, byte_alignment)
    if os.environ.get('REGPATH') and simstate.coef_region is None: simstate.coef_region = (0, 0)
    if layout == (count_words,) and dtype.size == 4 and simstate.coef_region in (None, (0, 0)):
        simstate.coef_region = self.last
    return t
M.SmemAllocator.allocate_tensor = alloc

class It:
    def toint(self): return 0x90000000
class St: iterator = It()
T = 10**12
token = 1
bid = token * tiling.cluster_size + cta
threads = tiling.threads_per_cta
simstate.barrier = threading.Barrier(threads)
errors = []
def body(tid):
    simstate.tls.tid, simstate.tls.bid = tid, bid
    try:
        K.kernel(0, St(), (1 * T, 11 * T, 12 * T, 13 * T), (2 * T, 3 * T, 4 * T, 5 * T, 6 * T), (7 * T, 8 * T, 9 * T, 10 * T),
                 ('eps',), 3, 40)
    except BaseException as e:
        import traceback
        errors.append((tid, traceback.format_exc()))
        simstate.barrier.abort()
ths = [threading.Thread(target=body, args=(t,)) for t in range(threads)]
for t in ths: t.start()
for t in ths: t.join()
if errors:
    print(errors[0][1]); sys.exit(1)

memo = {}
keep = []
def dig(e):
    k = id(e)
    if k in memo: return memo[k]
    keep.append(e)
    if isinstance(e, tuple):
        parts = [dig(x) for x in e]
        uninit = any(p[1] for p in parts) or (len(e) > 0 and e[0] == 'UNINIT')
        h = hashlib.sha1(('(' + ','.join(p[0] for p in parts) + ')').encode()).hexdigest()
        r = (h, uninit)
    else:
        r = (hashlib.sha1(repr(e).encode()).hexdigest(), False)
    memo[k] = r
    return r

out = {'stores': {}, 'sums': {}, 'events': {}, 'uninit': [], 'sample': None, 'threads': threads,
       'frags': tiling.fragments_per_thread, 'region': simstate.coef_region}
for tid in range(threads):
    recs = simstate.log.get(tid, [])
    ms = {}
    for name, addr, vals, on in recs:
        d = tuple(dig(v) for v in vals)
        if any(x[1] for x in d): out['uninit'].append((tid, name, addr))
        ms.setdefault((name, addr), []).append((tuple(x[0] for x in d), on))
    out['stores'][tid] = ms
    out['order'] = None
    if tid in sums:
        d = dig(sums[tid]); out['sums'][tid] = d[0]
        if d[1]: out['uninit'].append((tid, 'sum_sq'))
    ev = simstate.events.get(tid, [])
    out['events'][tid] = ev
# sample: tid 0, first new_residual store of target 0
for name, addr, vals, on in simstate.log.get(0, []):
    if name == 'v4' and addr == 7 * T + ((token * hc + 0) * H + (cta * tiling.vectors_per_cta) * 8) * 2:
        out['sample'] = vals[0]
        break
pickle.dump(out, open(f'/tmp/sim/out_{os.environ.get("REGPATH", "")}{branch}_{H}_{hc}_{variant}_{contrib}_{cta}.pkl', 'wb'))
print('ok', branch, H, hc, variant, contrib, cta, 'threads', threads, 'frags', tiling.fragments_per_thread,
      'region', simstate.coef_region, 'shared words written', len(simstate.shared))
