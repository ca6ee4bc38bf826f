# Session 29, call 4: the paired-token tree (no hints): its GPU tests, synccheck, racecheck, the TP=1 hc8 matrix, bench-key.
set -u
FINAL=$OUT; O=/tmp/o4; rm -rf $O; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee "$O/gpu.txt"
OUT=$O bash scripts/gpu_round.sh paired full-tp1-hc8 bench-key > $O/round4.log 2>&1
cp $O/round4.log $O/gpu.txt $FINAL/
cp $O/bench-key.log $FINAL/bench-key-paired.log
cp $O/bench/bench.json $FINAL/bench-paired.json
cp $O/full-tp1-hc8.log $FINAL/ 2>/dev/null
tar -czf $FINAL/all.tgz --exclude=bundles -C $O .
