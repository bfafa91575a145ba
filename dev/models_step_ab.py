"""A/B of the decode step's launch modes on a real GGUF model, in one process, in turns.

Configurations (attributes flipped on one loaded Transformer between runs): programmatic
dependent launch off/on for every dispatch of the step, the matvecs' f32 or int8 path. Each
row: decode b1 / b8 graph steady state (tok/s of the batch), prefill 128 / 1024 wall time.

    PYTHONPATH=. python dev/models_step_ab.py [--model PATH] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> int:
    import cupy

    from cukern.models import default_model_path
    from cukern.models.transformer import Transformer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=128)
    args = ap.parse_args()
    path = args.model or default_model_path()
    lm = Transformer.load(path, max_seqs=8, max_tokens=1024 + args.steps + 16, prefill_chunk=1024)
    c = lm.cfg
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, c.vocab_size, 128).tolist()
    long = rng.integers(0, c.vocab_size, 1024).tolist()
    sync = cupy.cuda.Device().synchronize
    logits = cupy.empty(c.vocab_size, cupy.float32)

    wg_min = lm.gemm.WG_MIN_N

    def set_mode(pdl: bool, int8: bool, wgr: bool = True):
        for d in (lm.ew, lm.attn, lm.tok, lm.mm):
            d.pdl = pdl
        lm.mm.int8 = int8
        lm.gemm.WG_MIN_N = wg_min if wgr else 1 << 30   # off: prefill GEMMs on gemm_f16 (mma.sync)

    def prefill_us(ids, reps=5):
        ts = []
        for _ in range(reps + 1):
            for s in lm.cache.alloc.active_slots():
                lm.cache.free(s)
            slot = lm.cache.add(0)
            sync()
            t0 = time.perf_counter()
            lm.prefill(ids, slot, logits)
            sync()
            ts.append((time.perf_counter() - t0) * 1e6)
        return float(np.median(ts[1:]))

    def decode(batch, **kw):
        lm.generate([prompt] * batch, 4, **kw)
        _, st = lm.generate([prompt] * batch, args.steps, **kw)
        return st.decode_tok_s

    modes = [(False, False, True), (True, False, True), (True, True, True), (True, False, False)]
    res = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes:
            set_mode(*m)
            row = (decode(1), decode(8), decode(1, temperature=0.8, top_k=64, top_p=0.95),
                   prefill_us(prompt), prefill_us(long))
            res[m].append(row)
            print(f"round {r} pdl={m[0]:d} int8={m[1]:d} wgr={m[2]:d}: b1 {row[0]:8.0f} tok/s  b8 {row[1]:8.0f} tok/s  "
                  f"b1 sampled {row[2]:8.0f}  pp128 {row[3]:8.1f} us  pp1024 {row[4]:8.1f} us", flush=True)
    print("\nmedian over rounds")
    print(f"{'pdl':>4} {'int8':>4} {'wgr':>4} {'b1 tok/s':>10} {'b8 tok/s':>10} {'b1 samp':>10} {'pp128 tok/s':>12} {'pp1024 tok/s':>13}")
    for m, rows in res.items():
        a = np.median(np.array(rows), axis=0)
        print(f"{m[0]:>4d} {m[1]:>4d} {m[2]:>4d} {a[0]:10.0f} {a[1]:10.0f} {a[2]:10.0f} {128 / a[3] * 1e6:12.0f} "
              f"{1024 / a[4] * 1e6:13.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
