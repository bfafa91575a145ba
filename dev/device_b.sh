#!/usr/bin/env bash
set -u
export PYTHONPATH=$PWD:/tmp/site:/tmp/cukern-model-site CUPY_CACHE_DIR=/tmp/cukern-kernel-cache PYTHONUNBUFFERED=1
L=${OUT:-/tmp}/b; mkdir -p $L
t0=$SECONDS
timeout 200 python -m pytest -q -m gpu -n 16 tests/test_dmmv.py -k "split or normed" > $L/tests.log 2>&1; echo "tests rc=$? $((SECONDS-t0))s"; grep -E "^FAILED|passed|failed" $L/tests.log | tail -8
timeout 170 python profiling/bench_dmmv.py --quick --json $L/bench_dmmv.json > $L/bench.log 2>&1; echo "bench rc=$? $((SECONDS-t0))s"; grep -E "lm head|norm \+ glu|copy" $L/bench.log | head -20
