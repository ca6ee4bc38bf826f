# GPU coverage owed since session 32 (any card): the steps named on the command line, through
# scripts/gpu_round.sh, logs under /tmp/oo, at most 8 files copied to $OUT (the device returns few).
#   OUT=$OUT bash notes/round-owed-s33.sh tests-all full-b     (about 320 + 150 s)
#   OUT=$OUT bash notes/round-owed-s33.sh conformance stress   (the README's main job, the stress)
set -u
FINAL=$OUT; O=/tmp/oo; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $FINAL/gpu-owed.txt
for step in "$@"; do
    OUT=$O bash scripts/gpu_round.sh $step >> $O/round-owed.log 2>&1
    cp $O/round-owed.log $FINAL/
    [ -f $O/$step.log ] && cp $O/$step.log $FINAL/
done
grep -E "^=== .* rc=|passed|failed|PASS|FAIL|ERROR" $O/round-owed.log | tail -30
