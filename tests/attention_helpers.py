"""Shared helpers of the attention tests (test_attention*.py): tolerances, paged caches, queries.

Every paged kernel is checked against the reference computed on K/V gathered back from the
pages (FlashInfer's way). Tolerances, |out - ref| <= atol + rtol * |ref|:

* decode and the float32 (SIMT) batched path write f32 computed in f32 from the stored K/V:
  atol 1e-4, rtol 1e-4 (the reference uses the same stored K/V values, so only f32 rounding
  and exp2 approximation remain); LSE atol 1e-4;
* tensor-core prefill / varlen round P and O to the element type: f16 atol 1e-3 + rtol 2e-3,
  bf16 atol 1e-2 + rtol 1.6e-2 (cukern.testing defaults); LSE atol 2e-3 (f16) / 1e-2 (bf16).
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.attention import AttentionDispatch, PagedKVCache  # noqa: E402
from cukern.reference import attention as ref  # noqa: E402


DECODE_TOL = dict(atol=1e-4, rtol=1e-4)
LSE_TOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-4}
TC_TOL = {"float16": dict(atol=1e-3, rtol=2e-3), "bfloat16": dict(atol=1e-2, rtol=1.6e-2)}


def _store(x: np.ndarray, kind: str):
    """Host float array -> device array of `kind` (bf16 as uint16 bits)."""
    if kind == "bfloat16":
        return cupy.asarray(ref.bf16_bits(x))
    return cupy.asarray(x.astype(kind))


def _make_cache(rng, lengths, *, n_kv_heads=2, head_dim=64, page_size=16, kind="float16", n_layers=1,
                extra_pages=3, src_f32=True, attn=None, scatter=False):
    """A cache holding random K/V for sequences of the given lengths, written through write_kv_run; with
    ``scatter`` every sequence grows a page at a time beside a filler sequence that takes every other page, so
    that no page-table row is a run of consecutive pages."""
    n_pages = sum(-(-n // page_size) for n in lengths) * (2 if scatter else 1) + extra_pages
    cache = PagedKVCache(n_layers, n_pages, page_size, n_kv_heads, head_dim,
                         max_seqs=len(lengths) + 2 + int(scatter), dtype=kind)
    attn = attn or AttentionDispatch()
    filler = cache.add(0) if scatter else None
    slots = []
    for n in lengths:
        s = cache.add(0)
        if scatter:
            for t in range(0, n, page_size):
                cache.extend(s, min(n - t, page_size))
                cache.extend(filler, page_size)
        else:
            cache.extend(s, n)
        for layer in range(n_layers):
            k = rng.standard_normal((n, n_kv_heads, head_dim)).astype(np.float32)
            v = rng.standard_normal((n, n_kv_heads, head_dim)).astype(np.float32)
            if src_f32:
                kd, vd = cupy.asarray(k), cupy.asarray(v)
            else:
                kd, vd = _store(k, kind), _store(v, kind)
            attn.write_kv_run(cache, layer, kd, vd, s, 0)
        slots.append(s)
    return cache, slots


def _host(cache, layer=0):
    k = ref.as_float64(cache.k_pools[layer], cache.kind)
    v = ref.as_float64(cache.v_pools[layer], cache.kind)
    return k, v, cache.page_table.get(), cache.lengths.get()


def _q(rng, shape, kind="float32", scale=1.0):
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    return x, _store(x, kind)
