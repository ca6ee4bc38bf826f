# Session 32: on an H200 only: the gated wide form (the working tree, main since de796d0) against
# main before it (.before/mhc_ar_before), then bench-key. Run 2: carry install.sh, part2, .before.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
FINAL=$OUT; O=/tmp/oh; rm -rf $O; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $O/gpu.txt
grep -q H200 $O/gpu.txt || { echo "not an H200: nothing run"; cp $O/gpu.txt $FINAL/; exit 0; }
OUT=$O COST_PACKAGES=mhc_ar_before,mhc_ar COST_ARGS="--tp 1 --shapes 7168x8 --m 16,1024,8192 --mxfp8" \
  bash scripts/gpu_round.sh protocol-cost > $O/round.log 2>&1
cp $O/gpu.txt $O/round.log $O/protocol-cost.log $FINAL/ 2>/dev/null
OUT=$O bash scripts/gpu_round.sh bench-key >> $O/round.log 2>&1
cp $O/round.log $O/bench-key.log $FINAL/ 2>/dev/null; [ -f $O/bench/bench.json ] && cp $O/bench/bench.json $FINAL/bench-key.json
grep -E "^tp=1" $O/protocol-cost.log | sed -E 's/\[[^]]*\]//g'
grep -E "^\s+\[" $O/bench-key.log
