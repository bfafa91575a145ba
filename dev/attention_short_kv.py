"""Decode attention at Gemma 3 270M's shape (B1, 4 query heads on 1 KV head, head_dim 256, f16 cache)
over short and medium KV: the time per call of every split count and merge place, against the plan's
own choice, in a pdl CUDA graph of 18 back-to-back calls (one per layer, as in a decode step).

    PYTHONPATH=. python dev/attention_short_kv.py [--lengths 128,512,...]
"""

from __future__ import annotations

import argparse

import cupy
import numpy as np

from cukern.attention import AttentionDispatch, PagedKVCache
from cukern.streams import capture_graph


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="64,128,256,384,512,1024,2048,4096,8192")
    ap.add_argument("--layers", type=int, default=18)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    h, kvh, d, page = 4, 1, 256, 16
    layers = args.layers
    cap = max(lengths)
    attn = AttentionDispatch(pdl=True)
    cache = PagedKVCache(layers, -(-cap // page), page, kvh, d, max_seqs=1, dtype="float16")
    rng = np.random.default_rng(0)
    for pool in cache.k_pools + cache.v_pools:
        pool[...] = cupy.asarray(rng.standard_normal(pool.shape).astype(np.float16))
    slot = cache.add(0)
    q = cupy.asarray(rng.standard_normal((1, h, d)).astype(np.float32))
    out = cupy.empty_like(q)
    stream = cupy.cuda.Stream(non_blocking=True)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def time_plan(plan, reps=30):
        fn = lambda s: [attn.flash_attn_decode(plan, i, q, out, stream=s) for i in range(layers)]  # noqa: E731
        fn(stream)
        g = capture_graph(fn, stream)
        ts = []
        for _ in range(reps):
            start.record(stream)
            g.replay(stream)
            end.record(stream)
            end.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / layers)
        return float(np.median(ts))

    length = 0
    print(f"{'keys':>6} {'default':>22} {'best':>22}   all (splits:apart us)")
    for L in lengths:
        cache.extend(slot, L - length, stream=stream)
        length = L
        stream.synchronize()
        attn._merge_apart = None
        dp = attn.plan_decode(cache, [slot], h)
        t_def = time_plan(dp)
        row = []
        for n in sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64}):
            if n > max(1, L // 32):
                continue
            for apart in (False, True):
                if apart and n == 1:
                    continue
                attn._merge_apart = apart
                p = attn.plan_decode(cache, [slot], h, n_splits=n)
                row.append((time_plan(p), n, apart, p.warps))
        attn._merge_apart = None
        best = min(row)
        print(f"{L:6d} {f's{dp.n_splits} a{int(dp.merge_apart)} w{dp.warps} {t_def:6.2f} us':>22} "
              f"{f's{best[1]} a{int(best[2])} w{best[3]} {best[0]:6.2f} us':>22}   "
              + " ".join(f"{n}:{int(a)} {t:.1f}" for t, n, a, _ in row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
