#!/usr/bin/env bash
# One call on a GPU machine: versions, CPU compile check, GPU tests, benchmarks, the
# tests under compute-sanitizer memcheck; a one-screen summary last.
#
#   bash profiling/device_check.sh                 # everything
#   CUKERN_TESTS="tests/test_params.py" CUKERN_BENCH="" bash profiling/device_check.sh
#   CUKERN_CHECK_ARGS="--arch sm_90 --unit attention" ...   # narrow the compile check (default: all, sm_90 + sm_80;
#                                                  # --family attention: every attention unit)
#   CUKERN_CHECK_ARGS=skip ...                     # no compile check (CI runs it)
#   CUKERN_JOBS=8 ...                              # pytest-xdist workers for the GPU tests
#   CUKERN_BENCH_ARGS=--quick ...                  # arguments of every benchmark
#   CUKERN_STEP_TIMEOUT=240 ...                    # seconds each step may take (default: no limit)
#   CUKERN_SANITIZE="tests/test_dmmv_q8.py tests/test_dmmv_moe.py" ...          # narrow the sanitizer pass
#   CUKERN_SANITIZE_JOBS=8 ...                     # compute-sanitizer processes side by side (default 6)
#   CUKERN_RACECHECK_K="test_decode_tc_warps" ...  # the racecheck pass's -k (default: the shared-memory-heavy
#                                                  # kernels below, ~3 min on an H100); "skip": none
#
# The benchmarks run before the sanitizer pass, the slowest step, so that a time limit on the
# whole call cuts the sanitizer rather than the numbers.
#
# Runs from the source tree (PYTHONPATH=.), as on the lent GPU machine, which has
# CuPy but no package registry: wheels it lacks (gguf, nvtx) are carried in .whl/
# and installed into /tmp/site. Kernel cache and logs go under /tmp, never into
# carried folders. When $OUT is set, $OUT/logs.tar.gz holds the logs of every finished step (one
# file, refreshed after each step, so a call cut off by its time limit still returns them).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
LOG=/tmp/cukern-check; rm -rf "$LOG"; mkdir -p "$LOG"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cukern-kernel-cache}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
TESTS=${CUKERN_TESTS:-tests}
SANITIZE=${CUKERN_SANITIZE:-$TESTS}
BENCH=${CUKERN_BENCH-$(ls profiling/bench_*.py 2>/dev/null)}
BENCH_ARGS=${CUKERN_BENCH_ARGS:-}
XDIST=${CUKERN_JOBS:+-n $CUKERN_JOBS}
STEP_TIMEOUT=${CUKERN_STEP_TIMEOUT:-0}
# every xdist worker draws the same data: one seed for the run, printed in the header
export CUKERN_TEST_SEED=${CUKERN_TEST_SEED:-$RANDOM$RANDOM}
echo "CUKERN_TEST_SEED=$CUKERN_TEST_SEED"

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

declare -A STATUS
step() {  # step NAME CMD...: run, log to $LOG/NAME.log, remember the exit code
    local name=$1; shift
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout "$STEP_TIMEOUT" "$@" 2>&1 | tee "$LOG/$name.log"
    STATUS[$name]="rc=${PIPESTATUS[0]} ($((SECONDS - t0)) s)"
    if [ -n "${OUT:-}" ]; then tar -czf "$OUT/logs.tar.gz" -C "$LOG" .; fi
}

step info $PY -m cukern info
if [ "${CUKERN_CHECK_ARGS:-}" != skip ]; then
    # shellcheck disable=SC2086
    step check $PY -m cukern check ${CUKERN_CHECK_ARGS:---arch sm_90 --arch sm_80}
fi
# every unit compiled once, in parallel, before the xdist workers would each compile it again
step warm $PY profiling/warm_cache.py
# shellcheck disable=SC2086
step gpu-tests $PY -m pytest -q -m gpu $XDIST $TESTS
for b in $BENCH; do
    name=bench-$(basename "$b" .py | sed 's/^bench_//')
    # shellcheck disable=SC2086
    step "$name" $PY "$b" $BENCH_ARGS --json "$LOG/$name.json"
done
# memcheck sees out-of-bounds accesses only at allocation granularity: CUKERN_NO_POOL makes
# the tests allocate every array with its own cudaMalloc instead of carving CuPy's pool.
# compute-sanitizer wraps one pytest process (xdist workers under it make no progress), so the
# pass runs CUKERN_SANITIZE_JOBS such processes side by side (default 6), test files dealt out in turn.
sanitize() {
    local jobs=${CUKERN_SANITIZE_JOBS:-6} files=() i rc=0
    for f in $SANITIZE; do if [ -d "$f" ]; then files+=("$f"/test_*.py); else files+=("$f"); fi; done
    for ((i = 0; i < jobs; i++)); do
        local part=()
        for ((j = i; j < ${#files[@]}; j += jobs)); do part+=("${files[j]}"); done
        [ ${#part[@]} -gt 0 ] || continue
        CUKERN_NO_POOL=1 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
            $PY -m pytest -q -m "gpu and not slow" -p no:xdist -p no:cacheprovider \
            ${CUKERN_SANITIZE_K:+-k "$CUKERN_SANITIZE_K"} "${part[@]}" > "$LOG/sanitizer.$i.log" 2>&1 &
    done
    for job in $(jobs -p); do wait "$job" || rc=1; done
    for ((i = 0; i < jobs; i++)); do
        [ -f "$LOG/sanitizer.$i.log" ] || continue
        echo "--- part $i: $(grep -E '^(=+ )?[0-9]+ (passed|failed)|no tests ran' "$LOG/sanitizer.$i.log" | tail -1)"
        grep -E 'ERROR SUMMARY|FAILED|Error|error' "$LOG/sanitizer.$i.log" | grep -v '^=* *[0-9]* passed' | tail -25
    done
    return $rc
}
export SANITIZE PY LOG
export -f sanitize
step sanitizer bash -c sanitize
# shared-memory races (racecheck) in the kernels that stage through shared memory: decode_tc and its split
# merge, merge_states, the mma.sync and wgmma prefills, the int8 matvec rings, the wgmma and int8 GEMMs,
# the varlen backward's dK/dV kernel (dS through shared memory)
RACE_K=${CUKERN_RACECHECK_K:-"(test_decode and softcap and (d128 or d256)) or test_decode_tc_warps or test_merge_states \
or (test_prefill_wgmma_matches_mma_sync and (causal-float16-d128-h4 or causal-float16-d256-h4 or window)) \
or test_varlen_wgmma_matches_mma_sync \
or row_tail or (test_gemm_wg and Q4_K) or (test_gemm_q8 and Q6_K) \
or (test_varlen_backward and float16 and (causal or softcap) and 128-4-2)"}
if [ "$RACE_K" != skip ]; then
    CUKERN_NO_POOL=1 step racecheck compute-sanitizer --tool racecheck --error-exitcode 99 --print-limit 20 \
        $PY -m pytest -q -m gpu -p no:xdist -k "$RACE_K" \
        tests/test_attention.py tests/test_attention_decode.py tests/test_attention_prefill.py tests/test_dmmv.py \
        tests/test_dmmv_fused.py tests/test_dmmv_q8.py tests/test_dmmv_moe.py tests/test_matmul.py tests/test_matmul_wgr.py \
        tests/test_matmul_int8.py tests/test_attention_backward.py
fi


echo
echo "================================ summary ================================"
$PY -m cukern info 2>/dev/null | grep -E '^(gpu|cupy|nvrtc|cuda driver)'
for name in check warm gpu-tests sanitizer racecheck; do
    [ -f "$LOG/$name.log" ] || continue
    line=$(grep -E '([0-9]+ (passed|failed|errors?))|kernel rows|^warm_cache' "$LOG/$name.log" | tail -1)
    printf '%-10s %-16s %s\n' "$name" "${STATUS[$name]}" "$line"
done
cat "$LOG"/sanitizer.*.log 2>/dev/null | grep -E "ERROR SUMMARY" | sort | uniq -c
grep -E "RACECHECK SUMMARY" "$LOG/racecheck.log" 2>/dev/null | tail -1
for b in $BENCH; do
    name=bench-$(basename "$b" .py | sed 's/^bench_//')
    echo "--- $name ${STATUS[$name]}"
    sed -n '/^device:/,$p' "$LOG/$name.log"
done
fail=0
for name in "${!STATUS[@]}"; do [[ ${STATUS[$name]} == rc=0* ]] || fail=1; done
echo "overall: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
