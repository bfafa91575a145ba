"""Decode attention with q and out in the cache's 16-bit dtype (AttentionDispatch.flash_attn_decode; the f32
q/out paths are tests/test_attention_decode.py, whose cache helpers, tests/attention_helpers.py, these tests share).

q is drawn in f32 and rounded to the cache dtype (bf16 as uint16 bits); the float64 reference takes the rounded
q and the stored K/V, so what is left is the kernel's f32 arithmetic (the decode tolerance, 1e-4) and the one
rounding of out: f16 1e-3 abs + 2e-3 rel, bf16 1e-2 abs + 1.6e-2 rel (cukern.testing.TOLERANCES); the LSE
stays f32 (1e-4). Outputs NaN-poisoned first; ragged lengths (1, a page plus one), odd page sizes, GQA with
padded head blocks, head_dim 512 (SIMT kernel), split-KV merged in the last block and apart.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from attention_helpers import _host, _make_cache, _store  # noqa: E402  (tests/ is on sys.path under pytest)

from cukern.attention import AttentionDispatch, DecodeOverrides, PagedKVCache  # noqa: E402
from cukern.reference import attention as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402

_STORAGE = {"float16": cupy.float16, "bfloat16": cupy.uint16}


@pytest.mark.gpu
@pytest.mark.parametrize("kind, d, h, hk, ps, lengths", [
    ("float16", 128, 8, 2, 16, [1, 17, 300]),      # decode_tc, GQA 4
    ("bfloat16", 64, 10, 2, 5, [63, 64, 65]),      # GQA 5: padded rows of the head block, odd page size
    ("float16", 256, 4, 1, 16, [9000]),            # Gemma 3's shape: split, merged apart by the plan's choice
    ("bfloat16", 160, 32, 2, 7, [600, 1]),         # GQA 16: two head blocks
    ("float16", 512, 4, 1, 16, [3, 90]),           # head_dim 512: the SIMT kernel
    ("bfloat16", 512, 2, 2, 3, [40]),
])
@pytest.mark.parametrize("variant", ["plain", "window+sinks", "softcap+split7", "apart+split5"])
def test_decode_half_q_out(rng, kind, d, h, hk, ps, lengths, variant):
    attn = AttentionDispatch()
    cache, slots = _make_cache(rng, lengths, n_kv_heads=hk, head_dim=d, page_size=ps, kind=kind, attn=attn)
    kw, n_splits, ov = {}, None, None
    if variant == "window+sinks":
        kw = dict(window_left=9, sinks=rng.standard_normal(h).astype(np.float32) * 2)
    elif variant == "softcap+split7":
        kw, n_splits = dict(softcap=5.0, scale=0.3), 7
    elif variant == "apart+split5":
        n_splits, ov = 5, DecodeOverrides(merge_apart=True)
    qx = (rng.standard_normal((len(slots), h, d)) * 2.0).astype(np.float32)
    q = _store(qx, kind)
    qv = ref.as_float64(q, kind)  # the rounded q the kernel sees
    plan = attn.plan_decode(cache, slots, h, n_splits=n_splits, window_left=kw.get("window_left", -1), overrides=ov)
    out = poison(cupy.empty((len(slots), h, d), _STORAGE[kind]))
    lse = poison(cupy.empty((len(slots), h), cupy.float32))
    dev_kw = dict(kw, sinks=cupy.asarray(kw["sinks"])) if "sinks" in kw else kw
    attn.flash_attn_decode(plan, 0, q, out, lse=lse, **dev_kw)
    kp, vp, pt, lens = _host(cache)
    want_o, want_lse = ref.paged_attention(qv, kp, vp, pt, lens, slots, [1] * len(slots), ps, **kw)
    assert_close(ref.as_float64(out, kind), want_o, dtype=kind, name=f"out {kind}")
    assert_close(lse, want_lse, atol=1e-4, rtol=0, name="lse")


@pytest.mark.parametrize("kind, d, force, want", [
    ("float16", 128, None, {"decode_tc<__half, 128, 8, __half>"}),
    ("float16", 256, None, {"decode_tc<__half, 256, 4, __half>", "merge_states<__half>"}),  # apart: Gemma 3
    ("bfloat16", 64, True, {"decode_tc<__nv_bfloat16, 64, 8, __nv_bfloat16>", "merge_states<__nv_bfloat16>"}),
    ("bfloat16", 512, None, {"decode<__nv_bfloat16, 512, 4, __nv_bfloat16>"}),
])
def test_decode_half_q_launches_host(monkeypatch, kind, d, force, want):
    """On CPU (tests/host_dispatch.py): a q / out of the cache's dtype launches the kernels of the q16 unit (the
    launcher raises on a name the unit does not hold), the merge apart writing that dtype too."""
    from host_dispatch import patch
    launches = patch(monkeypatch)
    attn = AttentionDispatch()
    h = 4 if d >= 256 else 32
    cache = PagedKVCache(1, 8192 // 16 + 1, 16, 1 if d >= 256 else 8, d, max_seqs=1, dtype=kind)
    slot = cache.add(8192)
    plan = attn.plan_decode(cache, [slot], h, overrides=DecodeOverrides(merge_apart=force))
    q, out = cupy.empty((1, h, d), _STORAGE[kind]), cupy.empty((1, h, d), _STORAGE[kind])
    attn.flash_attn_decode(plan, 0, q, out, lse=cupy.empty((1, h)))
    assert set(launches) == want


def test_decode_half_q_rejects_mixed_dtypes(monkeypatch):
    from host_dispatch import patch
    launches = patch(monkeypatch)
    attn = AttentionDispatch()
    for kind, q_dtype, out_dtype, match in [
            ("bfloat16", cupy.float16, cupy.float16, "q must be float32 or bfloat16"),   # f16 q, bf16 cache
            ("float32", cupy.float16, cupy.float16, "q must be float32 \\("),             # f32 cache: f32 q only
            ("float16", cupy.float16, cupy.float32, "out must have dtype float16"),      # out not q's dtype
            ("float16", cupy.float32, cupy.float16, "out must have dtype float32")]:
        cache = PagedKVCache(1, 4, 16, 2, 64, max_seqs=1, dtype=kind)
        plan = attn.plan_decode(cache, [cache.add(10)], 4)
        with pytest.raises(TypeError, match=match):
            attn.flash_attn_decode(plan, 0, cupy.empty((1, 4, 64), q_dtype), cupy.empty((1, 4, 64), out_dtype))
    assert not launches
