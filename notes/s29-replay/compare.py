# python compare.py [--a PREFIX] [--b PREFIX] H HC VARIANT OP CTA: run_one.py's outputs
# /tmp/sim/out_<PREFIX>_<H>_..._<CTA>.pkl, a (default main) against b (default wide-occupancy);
# regmain / regwide-occupancy are the REGPATH runs, mut is mut.sh's copy.
import sys, pickle
from collections import Counter
args = sys.argv[1:]
prefixes = {'--a': 'main', '--b': 'wide-occupancy'}
while args and args[0] in prefixes:
    prefixes[args[0]] = args[1]; args = args[2:]
a = pickle.load(open('/tmp/sim/out_%s_%s.pkl' % (prefixes['--a'], '_'.join(args)), 'rb'))
b = pickle.load(open('/tmp/sim/out_%s_%s.pkl' % (prefixes['--b'], '_'.join(args)), 'rb'))
ok = True
for tid in range(a['threads']):
    sa, sb = a['stores'][tid], b['stores'][tid]
    if set(sa) != set(sb):
        ok = False; print('tid', tid, 'store address sets differ', set(sa) ^ set(sb)); break
    for k in sa:
        if Counter(sa[k]) != Counter(sb[k]):
            ok = False; print('tid', tid, 'store differs at', k); break
    if not ok: break
    if a['sums'].get(tid) != b['sums'].get(tid):
        ok = False; print('tid', tid, 'sum_sq differs'); break
if a['uninit'] or b['uninit']:
    ok = False; print('UNINIT reached output', a['uninit'][:3], b['uninit'][:3])
# shared-memory event checks (wide)
offs = Counter(); v4 = Counter()
for tid, ev in b['events'].items():
    for kind, info in ev:
        if kind == 'sts' and not info[1]: offs[info[2]] += 1
        if kind == 'ldsv4': v4[info] += 1
nstores = sum(len(v) for v in b['stores'][0].values())
print('EQUAL' if ok else 'DIFF', args, 'frags', a['frags'], 'threads', a['threads'], 'region main', a['region'], 'wide', b['region'],
      '| wide predicated-off shared stores (in-region?):', dict(offs), '| distinct v4 read addrs', len(v4))
