#!/usr/bin/env bash
# the closing run's first call (merged tree): warm cache, full GPU suite, memcheck + racecheck subsets, bench_dmmv
set -u
bash profiling/models_device.sh >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site CUPY_CACHE_DIR=/tmp/cukern-kernel-cache PYTHONUNBUFFERED=1
L=${OUT:-/tmp}/f; mkdir -p $L
t0=$SECONDS
python profiling/warm_cache.py > $L/warm.log 2>&1; echo "warm rc=$? $((SECONDS-t0))s"; tail -1 $L/warm.log
timeout 240 python -m pytest -q -m gpu -n 16 tests > $L/tests.log 2>&1; echo "gpu suite rc=$? $((SECONDS-t0))s"; grep -E "^FAILED|^ERROR|passed|failed" $L/tests.log | tail -12
CUKERN_NO_POOL=1 timeout 200 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 python -m pytest -q -x -m "gpu and not slow" -p no:xdist tests/test_dmmv.py tests/test_models.py tests/test_attention.py -k "split or normed or three or (forward_matches and gemma3) or decode" > $L/memcheck.log 2>&1; echo "memcheck rc=$? $((SECONDS-t0))s"; grep -E "passed|failed|ERROR SUMMARY" $L/memcheck.log | tail -3
timeout 150 compute-sanitizer --tool racecheck --error-exitcode 99 --print-limit 10 python -m pytest -q -x -m gpu -p no:xdist tests/test_dmmv.py tests/test_attention.py -k "(normed and (Q5_0 or Q4_K or F32)) or (three and (Q5_0 or Q4_K)) or test_merge_states or test_decode_tc_warps" > $L/racecheck.log 2>&1; echo "racecheck rc=$? $((SECONDS-t0))s"; grep -E "passed|failed|RACECHECK SUMMARY" $L/racecheck.log | tail -3
timeout 120 python profiling/bench_dmmv.py --quick --json $L/bench_dmmv.json > $L/bench.log 2>&1; echo "bench rc=$? $((SECONDS-t0))s"; grep -E "lm head|norm \+ glu|copy" $L/bench.log | head -12
