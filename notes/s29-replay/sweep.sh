set -e
for H in 7168 256 16392 2056 5120; do
 for hc in 5 6 7 8; do
  for v in full mxfp8 residual_only; do
   if [ $v = mxfp8 ] && [ $((H % 128)) -ne 0 ]; then continue; fi
   cl=$(python -c "import sys; sys.path[:0]=['/tmp/sim/stubs','/tmp/sim/main']; from mhc_ar.config import choose_consumer_tiling as c; print(c($H).cluster_size)")
   for cta in 0 $((cl-1)); do
    for c in call finalize; do
     python run_one.py main $H $hc $v $c $cta >/dev/null
     python run_one.py wide-occupancy $H $hc $v $c $cta >/dev/null
     python compare.py $H $hc $v $c $cta
    done
   done
  done
 done
done
