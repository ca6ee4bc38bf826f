m=$1; sedexpr=$2
rm -rf /tmp/sim/mut; cp -r /tmp/sim/wide-occupancy /tmp/sim/mut
sed -i "$sedexpr" /tmp/sim/mut/mhc_ar/kernels/consumer.py
cd /tmp/sim/mut && git diff --no-index --stat /tmp/sim/wide-occupancy/mhc_ar/kernels/consumer.py mhc_ar/kernels/consumer.py | tail -1
cd /tmp/sim
for args in "7168 8 full call 0" "256 5 mxfp8 call 0" "16392 6 residual_only call 7"; do
  python run_one.py mut $args > /dev/null 2>/tmp/sim/err || { echo "$m: run error: $(tail -1 /tmp/sim/err)"; continue; }
  python compare.py --b mut $args | cut -c1-200
done
