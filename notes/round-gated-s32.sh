# Session 32: the gated wide form (branch wide-form; the working tree) against main (.before/mhc_ar_before).
# Run 2 of a fresh machine: carry install.sh, part2, .before. Steps in order of need; files refreshed in $OUT after each.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
FINAL=$OUT; O=/tmp/og; rm -rf $O; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $O/gpu.txt
publish() {
    cp $O/gpu.txt $O/round.log $FINAL/ 2>/dev/null
    for f in protocol-cost.log shared-coefficients.log bench-key.log bench-7168x8.log full-a.log; do [ -f $O/$f ] && cp $O/$f $FINAL/; done
    tar -czf $FINAL/all.tgz --exclude=bundles --exclude=reports -C $O . 2>/dev/null
}
OUT=$O COST_PACKAGES=mhc_ar_before,mhc_ar COST_ARGS="--tp 1 --shapes 7168x8,5120x8 --m 1,16,128,1024,8192 --mxfp8" \
  bash scripts/gpu_round.sh protocol-cost > $O/round.log 2>&1
publish
bench=bench-7168x8; grep -q H200 $O/gpu.txt && bench=bench-key
for step in shared-coefficients $bench full-a; do
    OUT=$O bash scripts/gpu_round.sh $step >> $O/round.log 2>&1; publish
done
for f in $O/bench-*/bench.json; do [ -f $f ] && cp $f $FINAL/$(basename $(dirname $f)).json; done
grep -E "^===|PASS|FAIL|passed|failed|SUMMARY" $O/round.log
grep -E "^tp=1" $O/protocol-cost.log | sed -E 's/\[[^]]*\]//g'
grep -hE "^\s+\[" $O/bench-*.log
