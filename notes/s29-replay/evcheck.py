import pickle, glob, collections
for f in sorted(glob.glob('/tmp/sim/out_wide-occupancy_*.pkl')):
    o = pickle.load(open(f, 'rb'))
    H, hc, var, con, cta = f[:-4].split('out_wide-occupancy_')[1].replace('residual_only', 'residualonly').split('_')
    hc = int(hc)
    region = o['region']
    bad = []
    written = collections.Counter()
    reads = collections.Counter()
    for tid, ev in o['events'].items():
        kinds = [k for k, _ in ev]
        b = kinds.index('bar')
        if any(k == 'sts' for k in kinds[b:]) or any(k in ('ldsv4', 'lds') for k in kinds[:b]): bad.append(tid)
        for k, info in ev:
            if k == 'sts' and info[1]: written[(info[0] - region[0]) // 4] += 1
            if k == 'ldsv4': reads[(info - region[0]) // 4] += 1
    nreads = sum(1 for k, _ in o['events'][0] if k == 'ldsv4')
    rows = hc + 1 + (var != 'residualonly')
    words = sorted(written)
    print(H, hc, var, cta, 'order-bad', bad[:3], 'words written', len(words), 'dup', [w for w, c in written.items() if c > 1][:3],
          'v4 reads/thread', nreads, '=4*frags*rows*2:', nreads == 4 * o['frags'] * rows * 2,
          'read word starts', sorted(reads)[:12], 'max read word+3', max(reads) + 3, '< count', region[1] // 4)
