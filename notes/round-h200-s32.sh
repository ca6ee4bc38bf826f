# Session 32: on an H200 only, main vs notes/wide-occupancy-s29.patch (5 CTAs per SM) vs the patch at 6, TP = 1 hc 8, M >= 1024;
# then the H7168 hc8 bench on the patch. Run 2 of a fresh machine: carry install.sh, part2, .before.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
FINAL=$OUT; O=/tmp/oh; rm -rf $O; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $O/gpu.txt
grep -q H200 $O/gpu.txt || { echo "not an H200: nothing run"; cp $O/gpu.txt $FINAL/; exit 0; }
OUT=$O COST_PACKAGES=mhc_ar_before,mhc_ar,mhc_ar_w6 COST_ARGS="--tp 1 --shapes 7168x8,5120x8 --m 16,1024,8192 --mxfp8" \
  bash scripts/gpu_round.sh protocol-cost > $O/round.log 2>&1
cp $O/gpu.txt $O/round.log $O/protocol-cost.log $FINAL/ 2>/dev/null
OUT=$O bash scripts/gpu_round.sh bench-7168x8 >> $O/round.log 2>&1
cp $O/round.log $O/bench-7168x8.log $FINAL/ 2>/dev/null; [ -f $O/bench-7168x8/bench.json ] && cp $O/bench-7168x8/bench.json $FINAL/bench-7168x8.json
grep -E "^tp=1" $O/protocol-cost.log | sed -E 's/\[[^]]*\]//g'
grep -E "^\s+\[" $O/bench-7168x8.log
