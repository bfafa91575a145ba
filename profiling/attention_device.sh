#!/usr/bin/env bash
# One GPU call for the attention family alone (device_check.sh also compiles every other family):
# GPU tests, a compute-sanitizer memcheck subset, the benchmark; logs under $OUT.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD CUPY_CACHE_DIR=/tmp/cukern-kernel-cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/attn-out}; mkdir -p "$OUT"
T0=$SECONDS
timeout ${ATTN_TEST_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider ${ATTN_TESTS:-tests/test_attention.py} \
    > "$OUT/tests.log" 2>&1; echo "tests rc=$? ($((SECONDS - T0)) s)"
grep -E "passed|failed" "$OUT/tests.log" | tail -1
T1=$SECONDS
if [ -n "${ATTN_SANITIZE_K:-}" ]; then
  CUKERN_NO_POOL=1 timeout ${ATTN_SAN_S:-120} compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
      python3 -m pytest -q -x -m "gpu and not slow" -p no:cacheprovider tests/test_attention.py -k "$ATTN_SANITIZE_K" \
      > "$OUT/sanitizer.log" 2>&1; echo "sanitizer rc=$? ($((SECONDS - T1)) s)"
  grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer.log" | tail -2
fi
T2=$SECONDS
if [ -n "${ATTN_BENCH:-1}" ]; then
  timeout ${ATTN_BENCH_S:-200} python3 profiling/bench_attention.py ${ATTN_BENCH_ARGS:---quick} --json "$OUT/bench.json" \
      > "$OUT/bench.log" 2>&1; echo "bench rc=$? ($((SECONDS - T2)) s)"
  if grep -q "^device:" "$OUT/bench.log"; then sed -n '/^device:/,$p' "$OUT/bench.log"; else grep "^row" "$OUT/bench.log"; fi
  grep -E "^note|Error" "$OUT/bench.log" | head -5
fi
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -40
