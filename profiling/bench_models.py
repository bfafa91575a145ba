"""Models benchmark: Gemma 3 270M Q4_K_M end to end on cukern, against Hugging Face transformers
loading the same GGUF on the same GPU in the same run.

Rows (``us``: wall time per prompt, or per decode step of the whole batch; every row synchronises
before and after, so host launch overhead counts, as it does for a user):

* ``prefill N``: one prompt of N = 128 / 1024 tokens (chunked prefill: tiled GEMM projections,
  fused norm + RoPE + KV write, batched attention over the paged cache) to the last logits;
  peer: transformers' forward over the same ids (bfloat16, and float32 in ``extra``);
* ``decode bB graph``: greedy decode of B = 1 / 8 sequences, steady state of the CUDA graph
  replays (embed, 18 layers, LM head, on-device sampling, position advance per replay);
  GB/s counts the weights read once per step (the matvecs' bytes) against the copy ceiling;
  peer: transformers' eager greedy ``generate`` (float32, the faster of its two dtypes here);
* ``decode b1 eager``: the same step launched from Python kernel by kernel (no graph);
* ``decode b1 sampled``: the graph step with temperature 0.8, top-k 64, top-p 0.95 (its ratio to
  the greedy step in ``extra``);
* ``eager dispatch``: host time per launch of back-to-back eager calls (a 1 x d_model RMS norm
  with programmatic dependent launch, as the model makes them), where the GPU work is shorter.

llama.cpp is the end-to-end peer a user would pick instead: with ``--llama-bench PATH`` (or
``CUKERN_LLAMA_BENCH``) its ``llama-bench`` runs on the same GGUF in the same process run
(``-ngl 99 -fa on -p 128,1024 -n 128``), and its pp128 / pp1024 / tg128 rates stand beside the
prefill and decode b1 rows (the ``x llama.cpp`` ratio in ``extra``); without it those columns
are left out with a note.

``--synthetic gpt-oss-20b,qwen3-30b-a3b`` adds rows for full-size random-weight MoE files
(:mod:`cukern.models.synthetic`, written under ``SYNTHETIC_DIR`` once and reused): prefill 1024 and
decode b1 / b8 graph over random token ids, llama-bench's pp1024 / tg128 on the same file beside
them; GB/s counts the bytes a step reads (:func:`active_weight_bytes`: the dense matrices, and
of the expert tensors the share of experts B tokens route to, :func:`expected_experts`).

Run: PYTHONPATH=. python profiling/bench_models.py [--quick] [--json out.json] [--no-peer]
     [--llama-bench PATH] [--synthetic NAMES]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from cukern import traffic
from cukern.benchmark import Row, measure_ceilings, script_main

_TEXT = ("The history of computing is a story of machines that grew faster, smaller and cheaper. "
         "Early computers filled rooms; today a phone holds more power than the machines that sent people "
         "to the moon. Graphics processors began as chips that drew triangles, and became the engines of "
         "modern machine learning, because the same arithmetic that shades pixels multiplies matrices. ")


PREFILL = (128, 1024)  # prompt lengths
SYNTHETIC_PREFILL = 1024
SYNTHETIC_DIR = "/tmp/cukern-synthetic"   # where --synthetic writes its files (once; reused)
SAMPLED = dict(temperature=0.8, top_k=64, top_p=0.95)
DECODE = [(1, True, {}), (1, False, {}), (8, True, {}), (1, True, SAMPLED)]  # (batch, CUDA graph?, sampling)


def _prompt_ids(tok, n: int) -> list[int]:
    ids = tok.encode(_TEXT * (n // 40 + 2))
    return ids[:n]


def _wall(fn, sync, repeat: int) -> float:
    """Median wall time of fn() in us, synchronising before and after each call."""
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(times))


class _HF:
    """transformers' Gemma 3 loaded from the same GGUF (dequantized by transformers), on the GPU."""

    def __init__(self, path: str | None, dtype: str, *, like: "_HF | None" = None):
        import copy

        import torch
        self.torch = torch
        if like is not None:   # a copy in another dtype: transformers dequantizes the GGUF only once
            self.model = copy.deepcopy(like.model).to(getattr(torch, dtype)).eval()
            return
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                          dtype=getattr(torch, dtype)).to("cuda").eval()

    def sync(self):
        self.torch.cuda.synchronize()

    def prefill_us(self, ids: list[int], repeat: int) -> float:
        x = self.torch.tensor([ids], device="cuda")
        with self.torch.no_grad():
            self.model(x)
            return _wall(lambda: self.model(x, use_cache=False), self.sync, repeat)

    def decode_us(self, ids: list[int], batch: int, n_new: int) -> float:
        """Per generate step (all sequences), greedy, from the time of n_new tokens minus a 1-token run."""
        x = self.torch.tensor([ids] * batch, device="cuda")
        kw = dict(do_sample=False, pad_token_id=0)
        with self.torch.no_grad():
            self.model.generate(x, max_new_tokens=4, min_new_tokens=4, **kw)
            one = _wall(lambda: self.model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw), self.sync, 2)
            full = _wall(lambda: self.model.generate(x, max_new_tokens=n_new, min_new_tokens=n_new, **kw),
                         self.sync, 1)
        return (full - one) / (n_new - 1)

    def close(self):
        del self.model
        self.torch.cuda.empty_cache()


def llama_bench(binary: str | None, model: str, repeat: int, prompts: str = "128,1024") -> dict[str, float]:
    """llama.cpp's tokens/s on ``model``: {"pp128": ..., "pp1024": ..., "tg128": ...} (a ``pp`` per length in
    ``prompts``), or {} with a note on stderr when no binary is given or it fails."""
    if not binary:
        print("bench_models: no llama-bench (--llama-bench PATH or CUKERN_LLAMA_BENCH): llama.cpp column left out",
              file=sys.stderr)
        return {}
    cmd = [binary, "-m", model, "-ngl", "99", "-fa", "on", "-p", prompts, "-n", "128", "-r", str(repeat),
           "-o", "json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
        runs = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        print(f"bench_models: llama-bench failed ({type(e).__name__}: {e}): llama.cpp column left out",
              file=sys.stderr)
        return {}
    rates = {}
    for r in runs:
        name = f"pp{r['n_prompt']}" if r.get("n_gen", 0) == 0 else f"tg{r['n_gen']}"
        rates[name] = float(r["avg_ts"])
    return rates


def bench(quick: bool = False, *, peer: bool = True, llama: str | None = None,
          synthetic: tuple = ()) -> tuple[list, object]:
    ceil = measure_ceilings()
    rows: list[Row] = []
    _gemma_rows(rows, ceil, quick, peer, llama)
    for name in synthetic:
        rows += synthetic_rows(name, ceil, quick, llama)
    return rows, ceil


def _gemma_rows(rows: list, ceil, quick: bool, peer: bool, llama: str | None) -> None:
    import cupy

    from cukern.models import default_model_path
    from cukern.models.gguf_loader import load_gguf
    from cukern.models.tokenizer import Tokenizer
    from cukern.models.transformer import Transformer

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        print(f"bench_models: {e}", file=sys.stderr)
        return
    m = load_gguf(path)
    tok = Tokenizer.from_gguf(m)
    m.upload(progress=False)
    n_new = 64 if quick else 256
    lm = Transformer(m, max_seqs=8, max_tokens=1024 + n_new + 8, prefill_chunk=1024)
    name = "gemma3-270m Q4_K_M"
    sync = cupy.cuda.Device().synchronize
    weight_bytes = traffic.decode_step([w.nbytes for L in lm.layers for w in (L.wq, L.wk, L.wv, L.wo, L.wg, L.wu, L.wd)]
                                       + [lm.head.nbytes])

    llama_rates = llama_bench(llama, path, 3 if quick else 5)
    hf = {}
    if peer:
        try:
            hf["float32"] = _HF(path, "float32")
            hf["bfloat16"] = _HF(None, "bfloat16", like=hf["float32"])
        except Exception as e:  # a missing transformers/accelerate is reported, the cukern rows still run
            print(f"bench_models: transformers peer unavailable: {type(e).__name__}: {e}", file=sys.stderr)

    # ---- prefill
    for n in PREFILL:
        ids = _prompt_ids(tok, n)
        us = _prefill_us(lm, ids, 3 if quick else 7)
        peers = {}
        for dtype, h in hf.items():
            peers[f"transformers {dtype}"] = h.prefill_us(ids, 3 if quick else 5)
        bf = peers.pop("transformers bfloat16", None)
        extra = {"tok_s": n / us * 1e6, "peers": peers}
        _add_llama(extra, llama_rates, f"pp{n}", n, us)
        rows.append(Row("models", f"prefill {n}: {n / us * 1e6:,.0f} tok/s", name, us,
                        peer="transformers bf16" if bf else "", peer_us=bf, extra=extra))

    # ---- decode
    prompt = _prompt_ids(tok, 128)
    greedy_us = None
    for batch, graph, kw in DECODE:
        steps = n_new if graph else min(n_new, 64)
        us, tok_s = _decode_us(lm, [prompt] * batch, steps, graph, kw)
        peers = {}
        if graph and not kw:
            for dtype, h in hf.items():
                peers[f"transformers {dtype} eager"] = h.decode_us(prompt, batch, 32 if quick else 64)
        f32 = peers.pop("transformers float32 eager", None)
        gbs = weight_bytes / us / 1e3
        extra = {"tok_s": tok_s, "peers": peers}
        if batch == 1 and graph and not kw:
            greedy_us = us
            _add_llama(extra, llama_rates, "tg128", 1, us)
        mode = "sampled" if kw else "graph" if graph else "eager"
        if kw and greedy_us:
            extra["x greedy step"] = us / greedy_us
        rows.append(Row("models", f"decode b{batch} {mode}: {tok_s:,.0f} tok/s", name, us,
                        gbs=gbs, pct_ceiling=gbs / ceil.copy_gbs, peer="transformers f32 eager" if f32 else "",
                        peer_us=f32, extra=extra))
        print(f"  decode b{batch} {mode}: {us:.1f} us per step, {tok_s:,.0f} tok/s, {gbs:,.0f} GB/s of weights"
              + (f", {extra['x llama.cpp']:.2f}x llama.cpp tg128" if "x llama.cpp" in extra else "")
              + (f", {extra['x greedy step']:.3f}x the greedy step" if "x greedy step" in extra else ""),
              file=sys.stderr)
    # ---- host cost of one eager dispatch (a notebook's call): a 1 x d_model RMS norm, as the model launches it
    x = cupy.random.standard_normal((1, m.config.d_model), dtype=cupy.float32)
    y = cupy.empty_like(x)
    w = lm.output_norm

    def norms(n=2000):
        for _ in range(n):
            lm.ew.rms_norm(x, w, y, eps=1e-6)

    norms(50)
    us = _wall(norms, sync, 3) / 2000
    rows.append(Row("models", f"eager dispatch: {us:.1f} us host per launch", "rms_norm 1 x "
                    f"{m.config.d_model}, pdl", us, extra={"launch_us": us}))
    for h in hf.values():
        h.close()


def expected_experts(n_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a layer reads for ``batch`` tokens each routed to ``top_k`` of ``n_experts``
    uniformly at random: E (1 - (1 - k/E)^B). E.g. gpt-oss-20b (E 32, k 4) at B 8: 32 (1 - 0.875^8) = 21.0."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** batch)


def active_weight_bytes(lm, batch: int) -> int:
    """GGUF bytes one decode step of ``batch`` sequences reads from a MoE model: the attention projections,
    routers and LM head once, and of every expert tensor (weights and bias matrices) the share of the
    experts :func:`expected_experts` touches."""
    c = lm.cfg
    share = expected_experts(c.n_experts, c.n_experts_used, batch) / c.n_experts
    dense = [lm.head.nbytes]
    experts = []
    for L in lm.layers:
        dense += [w.nbytes for w in (L.wq, L.wk, L.wv, L.wo)] + [L.moe.router.nbytes]
        experts += [w.nbytes for w in (L.moe.gate, L.moe.up, L.moe.down, L.moe.gate_bias, L.moe.up_bias,
                                       L.moe.down_bias) if w is not None]
    return traffic.decode_step(dense) + round(share * traffic.decode_step(experts))


def synthetic_file(name: str, folder: str = SYNTHETIC_DIR) -> str:
    """``folder/name.gguf``, written by :mod:`cukern.models.synthetic` unless it is there already (the
    writer renames a complete file into place, so an interrupted write is not reused)."""
    from cukern.models.synthetic import file_bytes, preset, write_synthetic_gguf
    path = os.path.join(folder, f"{name}.gguf")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        print(f"bench_models: writing {path} ({file_bytes(preset(name)) / 1e9:.1f} GB)", file=sys.stderr)
        t0 = time.perf_counter()
        write_synthetic_gguf(path, name, progress=True)
        print(f"bench_models: wrote {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return path


def synthetic_rows(name: str, ceil, quick: bool, llama: str | None) -> list[Row]:
    """Prefill 1024 and decode b1 / b8 graph rows of a synthetic full-size MoE file (random token ids),
    with llama-bench's pp1024 / tg128 on the same file; GB/s from :func:`active_weight_bytes`."""
    from cukern.benchmark import free_device_memory
    from cukern.models.gguf_loader import load_gguf
    from cukern.models.transformer import Transformer

    path = synthetic_file(name)
    llama_rates = llama_bench(llama, path, 2 if quick else 4, prompts=str(SYNTHETIC_PREFILL))
    m = load_gguf(path)
    m.upload(progress=False)
    n_new = 64 if quick else 256
    lm = Transformer(m, max_seqs=8, max_tokens=SYNTHETIC_PREFILL + n_new + 8, prefill_chunk=1024)
    label = f"{name} synthetic ({m.n_bytes / 1e9:.1f} GB)"
    rng = np.random.default_rng(0)
    rows = []
    n = SYNTHETIC_PREFILL
    us = _prefill_us(lm, rng.integers(0, m.config.vocab_size, n).tolist(), 3 if quick else 5)
    extra = {"tok_s": n / us * 1e6}
    _add_llama(extra, llama_rates, f"pp{n}", n, us)
    rows.append(Row("models", f"prefill {n}: {n / us * 1e6:,.0f} tok/s", label, us, extra=extra))
    prompt = rng.integers(0, m.config.vocab_size, 128).tolist()
    for batch in (1, 8):
        us, tok_s = _decode_us(lm, [prompt] * batch, n_new, True, {})
        nbytes = active_weight_bytes(lm, batch)
        gbs = nbytes / us / 1e3
        extra = {"tok_s": tok_s, "weight_bytes": nbytes}
        if batch == 1:
            _add_llama(extra, llama_rates, "tg128", 1, us)
        rows.append(Row("models", f"decode b{batch} graph: {tok_s:,.0f} tok/s", label, us, gbs=gbs,
                        pct_ceiling=gbs / ceil.copy_gbs, extra=extra))
        print(f"  {name} decode b{batch}: {us:.1f} us per step, {tok_s:,.0f} tok/s, {gbs:,.0f} GB/s of the "
              f"{nbytes / 1e9:.2f} GB read" + (f", {extra['x llama.cpp']:.2f}x llama.cpp tg128"
                                               if "x llama.cpp" in extra else ""), file=sys.stderr)
    del lm, m
    free_device_memory()
    return rows


def _prefill_us(lm, ids: list[int], repeat: int) -> float:
    """Median wall time (us) of one prompt's prefill to its last logits, from an empty cache."""
    import cupy
    logits = cupy.empty(lm.cfg.vocab_size, cupy.float32)

    def run():
        for s in lm.cache.alloc.active_slots():
            lm.cache.free(s)
        lm.prefill(ids, lm.cache.add(0), logits)

    run()
    return _wall(run, cupy.cuda.Device().synchronize, repeat)


def _decode_us(lm, prompts: list, steps: int, graph: bool, kw: dict) -> tuple[float, float]:
    """(us per decode step of the whole batch, tokens/s) of ``steps`` steps, after an 8-step warm-up
    (compile, first graph capture)."""
    lm.generate(prompts, 8, use_graph=graph, **kw)
    _, stats = lm.generate(prompts, steps, use_graph=graph, **kw)
    return stats.decode_s / (stats.decode_tokens / len(prompts)) * 1e6, stats.decode_tok_s


def _add_llama(extra: dict, rates: dict, test: str, tokens: int, us: float) -> None:
    """Put llama.cpp's tokens/s for the same work (llama-bench's ``test``: pp128, tg128, ...) and cukern's ratio
    to it into a row's extra, and its time for the row's tokens among the row's peers (a line of the table)."""
    rate = rates.get(test)
    if rate:
        extra["llama.cpp tok_s"] = rate
        extra["x llama.cpp"] = tokens / us * 1e6 / rate
        extra.setdefault("peers", {})[f"llama.cpp {test}"] = tokens / rate * 1e6


TITLE = 'models (us: per prompt, or per decode step of the batch; x peer > 1: cukern faster)'


def main(argv=None) -> int:
    return script_main(bench, __doc__, title=TITLE,
                       quick_help='fewer decode steps and repeats', argv=argv,
                       add_args=_add_args,
                       bench_kwargs=lambda args: {"peer": not args.no_peer, "llama": args.llama_bench,
                                                  "synthetic": _names(args.synthetic)})


def _names(value: str | None) -> tuple:
    from cukern.models.synthetic import preset
    names = tuple(n for n in (value or "").split(",") if n)
    for n in names:
        preset(n)   # a bad name fails before anything runs
    return names


def _add_args(ap) -> None:
    ap.add_argument("--no-peer", action="store_true", help="skip transformers")
    ap.add_argument("--llama-bench", metavar="PATH", default=os.environ.get("CUKERN_LLAMA_BENCH"),
                    help="llama.cpp's llama-bench binary (default: $CUKERN_LLAMA_BENCH): the end-to-end peer")
    ap.add_argument("--synthetic", metavar="NAMES", help="also full-size random-weight MoE files, comma-separated "
                    "cukern.models.synthetic presets (gpt-oss-20b,qwen3-30b-a3b), written once under "
                    f"{SYNTHETIC_DIR}")


if __name__ == "__main__":
    sys.exit(main())
