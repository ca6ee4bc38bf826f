# The H200 round for the gated wide form (main since de796d0) against main before it.
# Set up in the project root (all under the ignored .before/):
#   rm -rf .before && mkdir .before && git archive 57f4bf0 mhc_ar | tar -x -C .before && mv .before/mhc_ar .before/mhc_ar_before
#   cp notes/round-h200-s32.sh .before/round-h200.sh
# Device: run 1 carries .devwheels/install.sh and part1 (bash .devwheels/install.sh); run 2 carries
# install.sh, part2 and .before:
#   bash .devwheels/install.sh >/tmp/inst.log 2>&1; export PYTHONPATH=$(cat /tmp/devsite/.ok); OUT=$OUT bash .before/round-h200.sh
# On any card but an H200 it runs nothing. Steps: same-run cost (H7168 hc8, M 16/1024/8192), bench-key
# (the issue 13 lines), full-a (TP 1-2, now with the wide form's 36 edge cases at M 1023/1024).
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
FINAL=$OUT; O=/tmp/oh; rm -rf $O; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $O/gpu.txt
grep -q H200 $O/gpu.txt || { echo "not an H200: nothing run"; cp $O/gpu.txt $FINAL/; exit 0; }
publish() {
    cp $O/gpu.txt $O/round.log $FINAL/ 2>/dev/null
    for f in protocol-cost.log bench-key.log full-a.log; do [ -f $O/$f ] && cp $O/$f $FINAL/; done
    [ -f $O/bench/bench.json ] && cp $O/bench/bench.json $FINAL/bench-key.json
}
OUT=$O COST_PACKAGES=mhc_ar_before,mhc_ar COST_ARGS="--tp 1 --shapes 7168x8 --m 16,1024,8192 --mxfp8" \
  bash scripts/gpu_round.sh protocol-cost > $O/round.log 2>&1
publish
for step in bench-key full-a; do OUT=$O bash scripts/gpu_round.sh $step >> $O/round.log 2>&1; publish; done
grep -E "^===|PASS|FAIL" $O/round.log
grep -E "^tp=1" $O/protocol-cost.log | sed -E 's/\[[^]]*\]//g'
grep -E "^\s+\[" $O/bench-key.log
