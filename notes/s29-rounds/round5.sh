# Session 29, call 5: main's whole bench sweep, each shape in its own process.
set -u
FINAL=$OUT; O=/tmp/o5; rm -rf $O; mkdir -p $O
rm -rf mhc_ar && cp -r .before/mhc_ar_before mhc_ar
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader > $O/gpu.txt
OUT=$O bash scripts/gpu_round.sh bench-7168x8 bench-5120x4 bench-7168x4 > $O/round5.log 2>&1
for s in 7168x8 5120x4 7168x4; do cp $O/bench-$s.log $FINAL/; cp $O/bench-$s/bench.json $FINAL/bench-$s.json; done
cp $O/round5.log $FINAL/
tar -czf $FINAL/all.tgz -C $O .
