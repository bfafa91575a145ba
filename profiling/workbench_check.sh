#!/usr/bin/env bash
# The workbench on a GPU machine, in one call: `bench --quick` (table, JSON, roofline PNG),
# `check --gpu` (every kernel against its reference), profile_decode.py (per-kernel tables of the
# synthetic decoder and of the models package's forward) and every notebook run headless; a
# one-screen summary last.
#
#   bash profiling/workbench_check.sh                         # results under $OUT or /tmp/cukern-workbench
#   CUKERN_WB_STEPS="bench check-gpu" bash profiling/workbench_check.sh
#
# Like device_check.sh it runs from the source tree (PYTHONPATH=.) and installs the wheels carried
# in .whl/ and .nbw/ into /tmp/site. Each step has its own time limit so that one slow step cannot eat the
# others: CUKERN_WB_LIMIT seconds (default 240), or CUKERN_WB_LIMIT_<step> (e.g.
# CUKERN_WB_LIMIT_check_gpu=150); bench and check --gpu print what finished when stopped. Written to the destination: bench.json,
# roofline.png, workbench.log (every step's full output), notebook-figures.tar and notebooks/ (each
# notebook as executed, with its outputs, when nbclient and ipykernel are there: .nbw/ carried).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cukern-kernel-cache}
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
PY=${PYTHON:-python3}
DEST=${OUT:-/tmp/cukern-workbench}
STEPS=${CUKERN_WB_STEPS:-bench check-gpu profile-decode profile-model notebooks}
LIMIT=${CUKERN_WB_LIMIT:-240}
mkdir -p "$DEST"
FIG=$(mktemp -d)
LOG=$DEST/workbench.log
: > "$LOG"

# .whl/: the project's wheels; .nbw/: nbclient, ipykernel and their dependencies (profiling/README.md)
WHEELS=$(ls .whl/*.whl .nbw/*.whl 2>/dev/null)
if [ -n "$WHEELS" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

declare -A STATUS
step() {  # step NAME CMD...: run under the time limit, append to the log, remember the exit code
    local name=$1; shift
    [[ " $STEPS " == *" $name "* ]] || return 0
    echo "=== $name: $*" | tee -a "$LOG"
    local t0=$SECONDS limit_var=CUKERN_WB_LIMIT_${name//-/_}
    timeout "${!limit_var:-$LIMIT}" "$@" 2>&1 | tee -a "$LOG"
    STATUS[$name]="rc=${PIPESTATUS[0]} ($((SECONDS - t0)) s)"
}

step bench $PY -m cukern bench --quick --json "$DEST/bench.json" --plot "$DEST/roofline.png"
step check-gpu $PY -m cukern check --gpu
step profile-decode $PY profiling/profile_decode.py --steps 32
# the models package's forward: the GGUF named by CUKERN_WB_MODEL, else a tiny random Gemma 3
step profile-model $PY profiling/profile_decode.py --steps 16 --prefill 128 \
    ${CUKERN_WB_MODEL:+--model "$CUKERN_WB_MODEL"} ${CUKERN_WB_MODEL:---tiny gemma3}
step notebooks $PY -m cukern notebooks --run --figures "$FIG" --write-to "$DEST/notebooks"
tar -C "$FIG" -cf "$DEST/notebook-figures.tar" . 2>/dev/null

{
    echo
    echo "============================ workbench summary ============================"
    for name in bench check-gpu profile-decode profile-model notebooks; do
        [ -n "${STATUS[$name]:-}" ] && printf '%-16s %s\n' "$name" "${STATUS[$name]}"
    done
    grep -E '^[0-9]+ tests, [0-9]+ cases' "$LOG" | tail -1
    grep -E '^decode step: ' "$LOG"
    sed -n '/^notebook  /,/^$/p' "$LOG"
} | tee -a "$LOG"
fail=0
for name in "${!STATUS[@]}"; do [[ ${STATUS[$name]} == rc=0* ]] || fail=1; done
echo "overall: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
