# Session 29, call 3: the four packages' same-run cost, then bench-key of main and of pcs on the same machine.
set -u
FINAL=$OUT; O=/tmp/o; rm -rf $O; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee "$O/gpu.txt"
OUT=$O COST_PACKAGES=mhc_ar_before,mhc_ar,mhc_ar_pcs,mhc_ar_pnc \
  COST_ARGS="--tp 1 --shapes 7168x8,7168x4,5120x4 --m 1,16,128,1024,8192 --mxfp8" bash scripts/gpu_round.sh protocol-cost
cp -r mhc_ar /tmp/mhc_ar_paired
for p in mhc_ar_before mhc_ar_pcs; do
  rm -rf mhc_ar && cp -r .before/$p mhc_ar
  mkdir -p $O/$p && OUT=$O/$p bash scripts/gpu_round.sh bench-key
done
rm -rf mhc_ar && cp -r /tmp/mhc_ar_paired mhc_ar
cp $O/protocol-cost.log $FINAL/
cp $O/mhc_ar_before/bench-key.log $FINAL/bench-key-main.log
cp $O/mhc_ar_pcs/bench-key.log $FINAL/bench-key-pcs.log
cp $O/mhc_ar_before/bench/bench.json $FINAL/bench-main.json
cp $O/mhc_ar_pcs/bench/bench.json $FINAL/bench-pcs.json
tar -czf $FINAL/all.tgz -C $O .
ls $FINAL
