# Session 29, prepared for an H200 that did not come (not run; notes/round-wide.sh is the round to run next): main against the paired tree, same run; then the paired tree's hc8 sweep.
# Set up here: git archive HEAD mhc_ar | tar -x -C /tmp && mkdir -p .before && mv /tmp/mhc_ar .before/mhc_ar_before;
#   git apply notes/paired-tokens-s27.patch; cp notes/s29-rounds/round6.sh .before/
# Device, after install.sh with part1 then part2 (carry .before with part2):
#   export PYTHONPATH=$(cat /tmp/devsite/.ok); OUT=$OUT bash .before/round6.sh   (about 110 s)
set -u
FINAL=$OUT; O=/tmp/o6; rm -rf $O; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $FINAL/gpu.txt
OUT=$O COST_PACKAGES=mhc_ar_before,mhc_ar COST_ARGS="--tp 1 --shapes 7168x8 --m 16,1024 --mxfp8" \
  bash scripts/gpu_round.sh protocol-cost > $O/round6.log 2>&1
cp $O/protocol-cost.log $FINAL/protocol-cost-h200.log
OUT=$O timeout 150 bash scripts/gpu_round.sh bench-7168x8 >> $O/round6.log 2>&1
cp $O/bench-7168x8.log $FINAL/bench-7168x8-paired.log; cp $O/bench-7168x8/bench.json $FINAL/bench-7168x8-paired.json
cp $O/round6.log $FINAL/
