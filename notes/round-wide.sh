# The device round for notes/wide-occupancy-s29.patch (the TP = 1, hc > 4 consumer at 5 CTAs per SM).
# Set up here, in the project root on main (all under the ignored .before/):
#   rm -rf .before && mkdir .before && git archive HEAD mhc_ar | tar -x -C .before && mv .before/mhc_ar .before/mhc_ar_before
#   git apply notes/wide-occupancy-s29.patch
#   for n in 4 6; do cp -r mhc_ar .before/mhc_ar_w$n && find .before/mhc_ar_w$n -name __pycache__ -prune -exec rm -rf {} +
#     sed -i "s/^SHARED_COEFFICIENT_THREADS_PER_SM = .*/SHARED_COEFFICIENT_THREADS_PER_SM = $((n * 128))/" .before/mhc_ar_w$n/config.py; done
#   cp notes/round-wide.sh .before/round.sh
# Device: run 1 carries .devwheels/install.sh and part1 (bash .devwheels/install.sh); run 2 carries
# install.sh, part2 and .before:
#   bash .devwheels/install.sh >/tmp/inst.log 2>&1; export PYTHONPATH=$(cat /tmp/devsite/.ok); OUT=$OUT bash .before/round.sh
# Steps in order of need (the command limit may cut the tail): same-run cost, the GPU tests and
# sanitizers, full-a (TP 1 and 2, every hc), bench-7168x8. Logged under /tmp/ow; after every step
# the at most 8 files the device returns are refreshed in $OUT (the rest in $OUT/all.tgz).
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
FINAL=$OUT; O=/tmp/ow; rm -rf $O; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader > $O/gpu.txt
publish() {
    cp $O/gpu.txt $O/round.log $FINAL/ 2>/dev/null
    for f in protocol-cost.log full-a.log bench-7168x8.log; do [ -f $O/$f ] && cp $O/$f $FINAL/; done
    [ -f $O/bench-7168x8/bench.json ] && cp $O/bench-7168x8/bench.json $FINAL/bench-7168x8.json
    tar -czf $FINAL/all.tgz --exclude=bundles --exclude=reports -C $O . 2>/dev/null
}
# main, the patch at 5 CTAs per SM, and the patch at 4 and 6, in one process, same rounds
OUT=$O COST_PACKAGES=mhc_ar_before,mhc_ar,mhc_ar_w4,mhc_ar_w6 \
  COST_ARGS="--tp 1 --shapes 7168x8,5120x8 --m 1,16,128,1024,8192 --mxfp8" bash scripts/gpu_round.sh protocol-cost > $O/round.log 2>&1
publish
for step in shared-coefficients full-a bench-7168x8; do
    OUT=$O bash scripts/gpu_round.sh $step >> $O/round.log 2>&1; publish
done
grep -E "^===|PASS|FAIL|passed|failed|SUMMARY" $O/round.log
grep -E "^tp=1 H=7168 hc=8 (full|mxfp8) M=(16|1024):" $O/protocol-cost.log
grep -E "^\s+\[" $O/bench-7168x8.log
