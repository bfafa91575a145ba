"""Attention family benchmark: decode GB/s against the copy ceiling, prefill / varlen TFLOP/s against
torch SDPA's flash and cuDNN backends, all measured in the same run.

Counted work:
* decode: bytes of K and V read (every cached token of every KV head once) + Q read + O written;
  % is of the device-to-device copy bandwidth measured in this run; the peer is
  ``torch.nn.functional.scaled_dot_product_attention`` (its default backend choice, contiguous
  f16 K/V, ``enable_gqa``), both timed through CUDA graphs of back-to-back calls, as a decode loop
  runs them; K/V rotate over enough layers to exceed the 50 MB L2 several times. "pdl" rows:
  the same plan launched by ``AttentionDispatch(pdl=True)`` (each call overlaps the previous one's
  tail);
* prefill / varlen: causal FLOPs 2 * B * H * L^2 * D (QK^T and PV over the lower triangle), or
  4 * B * H * L^2 * D non-causal; % is of the fastest torch SDPA backend in this run (flash =
  FlashAttention-2, cuDNN), "x peer" is the ratio to the flash backend. Ours and the peers are
  timed in alternating rounds (the minimum of each over the rounds), so a clock drift during the
  run reaches every side alike.

Run: PYTHONPATH=. python profiling/bench_attention.py [--quick] [--only decode|prefill] [--json out.json]
(``--only prefill``: the prefill and varlen rows)
"""

from __future__ import annotations

import math
import sys

import cupy
import numpy as np

from cukern import traffic
from cukern.attention import AttentionDispatch, PagedKVCache
from cukern.benchmark import Row, measure_ceilings, script_main, time_graph_us, time_us

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # the peer is optional; rows then show no ratio
    torch = None

_L2_BYTES = 50 << 20


def _fill_pools(cache: PagedKVCache, rng) -> None:
    for pool in (*cache.k_pools, *cache.v_pools):
        pool[...] = rng.standard_normal(pool.shape, dtype=cupy.float32).astype(pool.dtype)


def _decode_rows(attn, ceil, rng, b, kv_len, h, hk, d, n_splits=None, label="", attn_pdl=None):
    """Rows of one decode shape: ``attn`` (and ``attn_pdl``, an AttentionDispatch(pdl=True), beside it
    on the same plan) timed through CUDA graphs of back-to-back calls over rotating layers, with torch
    SDPA at the same shape as the peer of both (none for labelled sweep rows); with the peer, the three
    are timed in _ROUNDS alternating rounds and each row takes its best."""
    kv_bytes = traffic.kv_cache(b, kv_len, hk, d)
    n_layers = max(1, min(16, math.ceil(4 * _L2_BYTES / kv_bytes)))
    page = 16
    pages = b * -(-kv_len // page)
    cache = PagedKVCache(n_layers, pages, page, hk, d, max_seqs=b)
    _fill_pools(cache, rng)
    slots = [cache.add(kv_len) for _ in range(b)]
    plan = attn.plan_decode(cache, slots, h, n_splits=n_splits)
    q = rng.standard_normal((b, h, d), dtype=cupy.float32)
    out = cupy.empty_like(q)
    nbytes = traffic.attention_decode(b, kv_len, h, hk, d)

    def timed(a):
        k = {"i": 0}

        def step():
            layer = k["i"] % n_layers
            k["i"] += 1
            a.flash_attn_decode(plan, layer, q, out)
        return lambda: time_graph_us(step, n_inner=max(8, 2 * n_layers))
    timers = {"": timed(attn)}
    if attn_pdl is not None:
        timers["pdl"] = timed(attn_pdl)
    if torch is not None and not label:
        tq = torch.randn(b, h, 1, d, device="cuda", dtype=torch.float16)
        tkv = [(torch.randn(b, hk, kv_len, d, device="cuda", dtype=torch.float16),
                torch.randn(b, hk, kv_len, d, device="cuda", dtype=torch.float16)) for _ in range(n_layers)]
        j = {"i": 0}

        def peer():
            kk, vv = tkv[j["i"] % n_layers]
            j["i"] += 1
            F.scaled_dot_product_attention(tq, kk, vv, enable_gqa=hk != h)
        timers["peer"] = lambda: _torch_graph_us(peer, max(8, 2 * n_layers))
    times = {}
    for _ in range(_ROUNDS if "peer" in timers else 1):  # ours and the peer in alternating rounds, the best of each
        for name, timer in timers.items():
            t = timer()
            times[name] = min(times.get(name, t), t)
    peer_us = times.pop("peer", None)
    tkv = None
    del cache
    rows = []
    for mode, us in times.items():
        gbs = nbytes / (us * 1e-6) / 1e9
        name = "decode" + "".join(f" {x}" for x in (label, mode) if x) + " (graph)"
        rows.append(Row("attention", name, f"B{b} KV{kv_len} {h}/{hk} D{d} s{plan.n_splits} w{plan.warps}", us,
                        gbs=gbs, pct_ceiling=gbs / ceil.copy_gbs, peer="torch SDPA (default)" if peer_us else "",
                        peer_us=peer_us))
    return rows


def _torch_graph_us(fn, n_inner):
    from cukern.benchmark import time_torch_graph_us
    try:
        return time_torch_graph_us(fn, n_inner=n_inner)
    except Exception as e:  # a backend that cannot be captured: time eagerly
        print(f"note: torch graph capture failed ({type(e).__name__}); peer timed eagerly")
        return time_us(fn)


_ROUNDS = 3  # alternating timing rounds of ours and the peers (decode, prefill, varlen)


def _sdpa_fns(b, h, hk, L, d, causal) -> dict:
    """{'flash': fn, 'cudnn': fn} running torch SDPA at this shape with that backend; a backend that is
    unavailable is left out (with a note)."""
    if torch is None:
        return {}
    q = torch.randn(b, h, L, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, hk, L, d, device="cuda", dtype=torch.float16)
    v = torch.randn(b, hk, L, d, device="cuda", dtype=torch.float16)
    fns = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def fn(backend=backend):
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hk != h)
        try:
            fn()
            torch.cuda.synchronize()
            fns[name] = fn
        except Exception as e:
            print(f"note: torch SDPA backend {backend} unavailable at B{b} H{h} L{L} D{d}: {type(e).__name__}")
    return fns


def _rounds_us(fns: dict) -> dict:
    """Each function timed in _ROUNDS alternating rounds; the minimum per function (us)."""
    best = {}
    for _ in range(_ROUNDS):
        for name, fn in fns.items():
            t = time_us(fn, n_warmup=3, n_repeat=10)
            best[name] = min(best.get(name, t), t)
    return best


def _prefill_fn(attn, rng, b, L, h, hk, d, causal=True):
    """A paged batched prefill of b sequences of L tokens (page size 64), ready to time."""
    page = 64
    cache = PagedKVCache(1, b * -(-L // page), page, hk, d, max_seqs=b)
    _fill_pools(cache, rng)
    slots = [cache.add(L) for _ in range(b)]
    plan = attn.plan_batched(cache, slots, [L] * b)
    q = rng.standard_normal((b * L, h, d), dtype=cupy.float32).astype(cupy.float16)
    out = cupy.empty_like(q)
    return lambda: attn.flash_attn_batched(plan, 0, q, out, causal=causal)


def _varlen_fn(attn, rng, b, L, h, hk, d, causal=True):
    """A varlen forward (with LSE) of b packed sequences of L tokens, ready to time."""
    q = rng.standard_normal((b * L, h, d), dtype=cupy.float32).astype(cupy.float16)
    k = rng.standard_normal((b * L, hk, d), dtype=cupy.float32).astype(cupy.float16)
    v = rng.standard_normal((b * L, hk, d), dtype=cupy.float32).astype(cupy.float16)
    cu = cupy.asarray(np.arange(b + 1, dtype=np.int32) * L)
    out = cupy.empty_like(q)
    lse = cupy.empty((b * L, h), cupy.float32)
    return lambda: attn.flash_attn_varlen(q, k, v, cu, cu, out, max_seqlen_q=L, causal=causal, lse=lse)


def _tc_rows(kernel, fn, b, L, h, hk, d, causal):
    """Our kernel and torch SDPA's backends at one shape, timed in alternating rounds."""
    t = _rounds_us({"ours": fn, **_sdpa_fns(b, h, hk, L, d, causal)})
    return _tc_row(kernel, b, L, h, hk, d, causal, t["ours"], (t.get("flash"), t.get("cudnn")))


def _tc_row(kernel, b, L, h, hk, d, causal, us, peers):
    flash, cudnn = peers
    best = min([t for t in (flash, cudnn) if t is not None], default=None)
    tf = traffic.attention_prefill_flops(b, h, L, d, causal) / (us * 1e-6) / 1e12
    extra = {"cudnn_us": cudnn, "flash_us": flash}
    pct = best / us if best else None  # = our TFLOP/s / the fastest SDPA backend's
    return Row("attention", kernel, f"B{b} L{L} {h}/{hk} D{d}{' causal' if causal else ''}", us, tflops=tf,
               pct_ceiling=pct, peer="SDPA flash" + (f" (cuDNN {cudnn:.0f}us)" if cudnn else ""), peer_us=flash,
               extra=extra)


class _Rows(list):
    """Rows that print themselves as they come (a run cut short still shows what it measured)."""

    def append(self, r: Row) -> None:
        super().append(r)
        extra = f" peer {r.peer_us:.2f} us" if r.peer_us else ""
        rate = f"{r.gbs:,.0f} GB/s" if r.gbs else f"{r.tflops:.1f} TFLOP/s"
        print(f"row: {r.kernel} {r.shape}: {r.us:.2f} us {rate}{extra}", flush=True)

    def extend(self, rs) -> None:
        for r in rs:
            self.append(r)


def bench(quick: bool = False, only: str | None = None) -> tuple[list, object]:
    attn = AttentionDispatch()
    ceil = measure_ceilings()
    rng = cupy.random.default_rng(0)
    rows = _Rows()
    if only != "prefill":
        _decode_bench(attn, ceil, rng, rows, quick)
    if only != "decode":
        _prefill_bench(attn, rng, rows, quick)
    if torch is None:
        print("note: torch is not installed here: the peer columns are empty")
    return list(rows), ceil


def _decode_bench(attn, ceil, rng, rows, quick: bool) -> None:
    decode = [(1, 8192, 32, 8, 128), (1, 32768, 32, 8, 128), (1, 131072, 32, 8, 128), (32, 4096, 32, 8, 128),
              (1, 8192, 8, 1, 256), (1, 8192, 4, 1, 256), (1, 512, 4, 1, 256)]  # the last: Gemma 3 270M's
    if not quick:                                                                # decode step at short KV
        decode = [(1, 1024, 32, 8, 128)] + decode[:3] + [(8, 4096, 32, 8, 128)] + decode[3:4] + \
            [(64, 4096, 32, 8, 128), (1, 32768, 8, 1, 256)] + decode[4:] + [(32, 4096, 4, 1, 256)]
    attn_pdl = AttentionDispatch(pdl=True)  # "pdl" rows: each launch overlaps the previous one's tail
    for b, L, h, hk, d in decode:
        rows.extend(_decode_rows(attn, ceil, rng, b, L, h, hk, d, attn_pdl=attn_pdl))
    for s in (16, 48, 64):  # split-count sweep at the headline shape (the default is the row above)
        rows.extend(_decode_rows(attn, ceil, rng, 1, 8192, 32, 8, 128, n_splits=s, label=f"splits={s}"))


def _prefill_bench(attn, rng, rows, quick: bool) -> None:
    """Prefill over the paged cache and varlen rows."""
    prefill = [(4, 4096, 32, 32, 128), (1, 1024, 32, 32, 128), (4, 4096, 16, 16, 256)]
    if not quick:
        prefill = [(16, 512, 32, 32, 128), (8, 1024, 32, 32, 128), (4, 2048, 32, 32, 128), (4, 4096, 32, 32, 128),
                   (2, 8192, 32, 32, 128), (1, 16384, 32, 32, 128), (8, 1024, 16, 16, 256), (4, 4096, 16, 16, 256),
                   (1, 16384, 16, 16, 256)]
    for b, L, h, hk, d in prefill:
        rows.append(_tc_rows("prefill paged f16", _prefill_fn(attn, rng, b, L, h, hk, d), b, L, h, hk, d, True))
    for b, L, h, hk, d, causal in [(4, 4096, 32, 32, 128, True)] + ([] if quick else [(4, 4096, 32, 8, 128, False)]):
        rows.append(_tc_rows("varlen f16 (+lse)", _varlen_fn(attn, rng, b, L, h, hk, d, causal), b, L, h, hk, d,
                             causal))


TITLE = 'attention (decode: % of copy bandwidth; prefill/varlen: % of the fastest torch SDPA)'


def main(argv=None) -> int:
    return script_main(bench, __doc__, title=TITLE, quick_help='a few shapes only', argv=argv,
                       add_args=lambda ap: ap.add_argument("--only", choices=("decode", "prefill"),
                                                           help="only the decode rows, or the prefill and varlen rows"),
                       bench_kwargs=lambda args: {"only": args.only})


if __name__ == "__main__":
    sys.exit(main())
