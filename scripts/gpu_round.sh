#!/usr/bin/env bash
# One GPU round on a device machine, every step logged under $OUT (default /tmp/mhc_out):
#   bash scripts/gpu_round.sh [smoke] [rsqrt] [routes] [tests] [concurrent] [out-of-step] [stress] [protocol-cost] [mps] [conformance] [full-a] [full-b] [full-tp1-hc8] [bench] [eager] [host-timing] ...
#   [eager-overhead] [capture] [impl-unfused] [impl-mhc_ar] [shared-coefficients] [bench-key] [bench-5120x4] [bench-7168x8] ...
#   [ncu-5120x4x1024] [ncu-7168x8x1-mxfp8] ... (Nsight Compute on one TP = 1 call of H x hc x M)
#   several GPUs: [topo] [tp-conformance] [tp-graph] [tp-bench] [missing-rank] (NGPU ranks; default all GPUs)
# Each step runs under `timeout`, so a hung kernel costs minutes, not the whole lease.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mhc_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(smoke rsqrt tests conformance bench)
status=0
run() {  # name, timeout seconds, command...
    local name=$1 limit=$2; shift 2
    echo "=== $name ($(date +%T))"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - start)) s"
    tail -n 25 "$OUT/$name.log"
    [ $rc -ne 0 ] && status=1
    return 0
}
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
for step in "${steps[@]}"; do
    case $step in
        smoke) run smoke 120 $PY scripts/smoke.py ;;
        rsqrt) run rsqrt 180 $PY -m conformance.rsqrt_measure --out "$OUT/rsqrt_delta_sm90.i8.zlib" \
                   --compare reference/data/rsqrt_delta_sm90.i8.zlib \
                   --compare tests/data/rsqrt_delta_h200_independent.i8.zlib ;;
        tests) run tests 540 $PY -m pytest -q -x -p no:cacheprovider -m gpu tests ;;
        tests-all) run tests-all 540 $PY -m pytest -q -p no:cacheprovider -m gpu tests ;;
        # The GPU tests that run TP = 1 (one kernel: ConsumerSpec.direct) beside other TP sizes.
        tests-tp1) run tests-tp1 400 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_kernels.py tests/test_gpu_unicast.py \
                       tests/test_gpu_routes.py tests/test_gpu_aliasing.py tests/test_gpu_capture.py -k "not ipc and not processes" ;;
        # Concurrent virtual ranks: the call tags, the co-residency bound, out-of-step ranks
        # (streams and CUDA IPC processes), one spin timeout per call, a small stress.
        concurrent) run concurrent 540 $PY -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu_concurrent.py tests/test_gpu_out_of_step.py ;;
        # The full concurrent stress: TP 2, 3, 4, 8; 10,000 calls per rank; 100 graph replays.
        stress) run stress 540 $PY -m conformance.stress ;;
        # The multi-process tests with CUDA MPS running, so the processes' kernels overlap for real.
        mps) run mps 300 bash -c 'ulimit -c 0; nvidia-cuda-mps-control -d && sleep 2 && python3 -m pytest -q -s -p no:cacheprovider -m gpu \
                 tests/test_gpu_out_of_step.py tests/test_gpu_unicast.py -k "ipc or processes"; rc=$?; echo quit | nvidia-cuda-mps-control; exit $rc' ;;
        # Same-run cost of the protocol change: this tree against the package before it, copied
        # as .before/mhc_ar_before (scripts/protocol_cost.py says how).
        protocol-cost) run protocol-cost 400 env PYTHONPATH=".before:${PYTHONPATH:-}" $PY scripts/protocol_cost.py \
                           --packages "${COST_PACKAGES:-mhc_ar_before,mhc_ar}" ${COST_ARGS:---publish} ;;
        # Eager host time of a call against an earlier copy of the package (capture off: its cost).
        eager-overhead) run eager-overhead 200 env PYTHONPATH=".before:${PYTHONPATH:-}" $PY scripts/eager_overhead.py \
                            --packages "${OVERHEAD_PACKAGES:-mhc_ar_precapture,mhc_ar}" ;;
        # Capture of real calls (issue 15): the toy two-layer loop, eager and in a graph, replayed.
        capture) run capture 300 $PY -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu_capture.py ;;
        # Another implementation through the gate (issue 14): the plain PyTorch chain, and ours by name.
        impl-unfused) run impl-unfused 560 $PY -m conformance run --impl torch-unfused --out "$OUT/reports" --run-id unfused-default \
                          --no-progress --skip-compile-checks --skip-reference-checks --max-bundles 3 ;;
        impl-mhc_ar) run impl-mhc_ar 560 $PY -m conformance run --impl mhc_ar --require-gpu --out "$OUT/reports" --run-id impl-mhc_ar-default \
                         --no-progress --skip-compile-checks --skip-reference-checks ;;
        # The bench at the issue's key points only (the whole sweep: the bench step).
        bench-key) run bench-key 560 $PY -m conformance.bench --shapes 5120x4,7168x4,7168x8 --m 1,16,128,1024,8192 --out "$OUT/bench" ;;
        conformance-quick) run conformance-quick 300 $PY -m conformance run --quick --require-gpu --out "$OUT/reports" ;;
        # The default matrix, and the full one in two halves (each well under the 10 min a device
        # command may run; session 11: 114 s and 147 s with the checks skipped).
        conformance) run conformance 560 $PY -m conformance run --require-gpu --out "$OUT/reports" --run-id default --no-progress ;;
        full-a) run full-a 560 $PY -m conformance run --full --tp 1,2 --require-gpu --out "$OUT/reports" --run-id full-tp1-2 \
                    --no-progress --skip-compile-checks --skip-reference-checks ;;
        # The TP = 1, hc = 8 part of the full matrix: the gate for a change to the consumer with its
        # coefficients in shared memory (ConsumerSpec.coefficients_in_shared) alone.
        full-tp1-hc8) run full-tp1-hc8 560 $PY -m conformance run --full --tp 1 --hc 8 --require-gpu --out "$OUT/reports" \
                          --run-id full-tp1-hc8 --no-progress --skip-compile-checks --skip-reference-checks ;;
        full-b) run full-b 560 $PY -m conformance run --full --tp 4,8 --require-gpu --out "$OUT/reports" --run-id full-tp4-8 \
                    --no-progress --skip-compile-checks --skip-reference-checks ;;
        # Out-of-step scenarios one by one, with their full output (the pytest file runs them all).
        # (Two processes run under MPS only: without it the rank whose peer trapped hangs; see
        # the mps step, and README "Ranks out of step".)
        out-of-step) for s in reject m_differs skip op_differs; do
                         run "oos-$s-check-streams" 60 $PY tests/out_of_step.py $s check streams
                         run "oos-$s-nocheck-streams" 60 $PY tests/out_of_step.py $s nocheck streams; done ;;
        # The TP = 1, hc > 4 consumer (coefficients in shared memory, narrow and wide form): the GPU
        # tests against the reference, then memcheck, synccheck and racecheck on
        # scripts/shared_coefficients_case.py's cases (racecheck reports the mbarrier init's known
        # warnings: notes/device-log.md, session 23).
        shared-coefficients) run shared-coefficients 300 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_kernels.py \
                                 -k "matches_reference or wide_form"
                for tool in memcheck synccheck racecheck; do
                    run "shared-coefficients-$tool" 200 compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 1 \
                        $PY scripts/shared_coefficients_case.py
                done ;;
        # Invalid route indices (issue 17): the GPU tests, and memcheck on one finalize with them.
        routes) run routes 300 $PY -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu_routes.py tests/test_gpu_aliasing.py
                run routes-memcheck 300 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 $PY scripts/bad_routes_case.py ;;
        bench) run bench 420 $PY -m conformance.bench --out "$OUT/bench" ;;
        # The eager table alone (with the H5120 rows it is reported beside), e.g. twice in a round.
        eager) run "eager-$SECONDS" 300 $PY -m conformance.bench --hidden 5120 --m 1,16,128 --tp "" --out "$OUT/bench-eager-$SECONDS" ;;
        eager-state) run eager-state 300 $PY scripts/eager_state.py ;;
        # Host-side parts of an eager call with the kernels replaced by a no-op (CUDA tensors).
        host-timing) run host-timing 120 $PY scripts/validation_timing.py --device cuda ;;
        # Several GPUs (one rank each, unicast transport; multicast stays off, exported above).
        topo) run topo 60 nvidia-smi topo -m ;;
        tp-conformance) run tp-conformance 560 torchrun --nproc-per-node "$NGPU" -m conformance run --tp "$NGPU" \
                            --out "$OUT/reports" --run-id "torchrun-tp$NGPU" --no-progress ;;
        tp-bench) run tp-bench 420 torchrun --nproc-per-node "$NGPU" -m conformance bench-tp --out "$OUT/bench-tp$NGPU" ;;
        tp-graph) run tp-graph 300 torchrun --nproc-per-node "$NGPU" scripts/tp_graph_replay.py --replays 100 ;;
        missing-rank) run missing-rank 120 torchrun --nproc-per-node "$NGPU" scripts/missing_rank.py --timeout 2 ;;
        # The whole sweep of one shape (the full bench may outlast one device command): bench-5120x4 ...
        bench-[0-9]*x[0-9]*) run "$step" 560 $PY -m conformance.bench --shapes "${step#bench-}" --out "$OUT/$step" ;;
        # Nsight Compute on one TP = 1 call (the consumer alone): ncu-5120x4x1024, ncu-7168x8x1-mxfp8 ...
        ncu-[0-9]*) spec=${step#ncu-}; shape=${spec%-mxfp8}; IFS=x read -r h c m <<<"$shape"
                    extra=(); [ "$spec" != "$shape" ] && extra=(--mxfp8)
                    run "$step" 300 bash -c 'ncu --clock-control none --kernel-name regex:ConsumerKernel --launch-skip 4 --launch-count 1 \
                        --set full -f -o "$0" "${@}" >/dev/null && ncu --import "$0.ncu-rep" --page details \
                        && ncu --import "$0.ncu-rep" --page source --print-source sass --csv >"$0.sass.csv"' \
                        "$OUT/$step" $PY scripts/ncu_consumer.py --hidden "$h" --hc "$c" --m "$m" "${extra[@]}" ;;
        *) echo "unknown step $step"; status=1 ;;
    esac
done
exit $status
