# Session 28's device round, never run (no H200 came). Copy to .before/round.sh and build .before as notes/device-log.md "Session 28" says.
#   bash .before/round.sh cost   main, paired, and .cs / .nc-hinted copies, same run; the fastest at
#                                H7168 hc8 M1024 full is kept in /tmp/chosen; its GPU tests and bench-key
#   bash .before/round.sh gate   the chosen package's GPU tests, synccheck, racecheck and matrix, on the same warm machine
#   bash .before/round.sh all    both in one call
set -u
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "$1" != gate ]; then
  OUT=$OUT COST_PACKAGES=mhc_ar_before,mhc_ar,mhc_ar_pcs,mhc_ar_pnc \
    COST_ARGS="--tp 1 --shapes 7168x8,5120x4 --m 16,1024,8192 --mxfp8" bash scripts/gpu_round.sh protocol-cost
  python3 - "$OUT/protocol-cost.log" > /tmp/chosen <<'PY'
import re, sys
line = next(l for l in open(sys.argv[1]) if "H=7168 hc=8 full M=1024:" in l)
times = {name: float(us) for name, us in re.findall(r"(mhc_ar\w*) ([\d.]+) us", line)}
print(min(times, key=times.get))
PY
fi
[ -n "${FORCE:-}" ] && echo "$FORCE" > /tmp/chosen
best=$(cat /tmp/chosen); echo "chosen: $best" | tee "$OUT/chosen.txt"
if [ "$best" = mhc_ar_before ]; then echo "main is fastest: stop"; exit 0; fi
if [ "$best" != mhc_ar ]; then rm -rf mhc_ar && cp -r ".before/$best" mhc_ar; fi
if [ "$1" != gate ]; then
  OUT=$OUT bash scripts/gpu_round.sh bench-key
fi
if [ "$1" != cost ]; then
  # The patch's `paired` step: GPU tests against the reference, synccheck and racecheck.
  case $best in
    mhc_ar) OUT=$OUT bash scripts/gpu_round.sh paired full-tp1-hc8 ;;
    *) OUT=$OUT bash scripts/gpu_round.sh paired full-a full-b ;;
  esac
fi
