"""Attention prefill: batched, varlen and long causal prefill on mma.sync and Hopper wgmma, against
their float64 references (cukern/reference/attention.py).

Every paged kernel is checked against the reference computed on K/V gathered back from the pages;
tolerances: attention_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.reference import attention as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402
from attention_helpers import DECODE_TOL, LSE_TOL, TC_TOL, _host, _make_cache, _q, _store  # noqa: E402


# ----------------------------------------------------------------------------- batched prefill

# (kind, head_dim, n_heads, n_kv_heads, page_size, lengths, q_lens)
BATCHED_CASES = [
    ("float16", 128, 4, 1, 16, [200, 17, 1], [200, 5, 1]),      # fresh prefill, extend (seq_start 12), length 1
    ("bfloat16", 64, 4, 2, 1, [130, 64], [70, 64]),              # page size 1, exactly one tile
    ("float16", 256, 2, 2, 32, [97, 32], [97, 31]),              # head_dim 256 (4 warps, Q from shared memory)
    ("float16", 96, 3, 1, 8, [33, 150], [33, 129]),              # odd head_dim, GQA 3
    ("bfloat16", 224, 2, 1, 16, [65], [65]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", BATCHED_CASES, ids=lambda c: f"{c[0]}-d{c[1]}-h{c[2]}/{c[3]}-p{c[4]}")
@pytest.mark.parametrize("variant", ["causal", "window+sinks", "softcap", "noncausal"])
def test_batched_tensor_cores(attn, rng, case, variant):
    kind, d, h, hk, ps, lengths, q_lens = case
    cache, slots = _make_cache(rng, lengths, n_kv_heads=hk, head_dim=d, page_size=ps, kind=kind, attn=attn)
    kw, causal = {}, True
    if variant == "window+sinks":
        kw = dict(window_left=20, sinks=rng.standard_normal(h).astype(np.float32))
    elif variant == "softcap":
        kw = dict(softcap=4.0, scale=0.25)
    elif variant == "noncausal":
        causal = False
    n_q = sum(q_lens)
    qf = rng.standard_normal((n_q, h, d)).astype(np.float32)
    q = _store(qf, kind)
    qh = ref.as_float64(q, kind)
    plan = attn.plan_batched(cache, slots, q_lens)
    out = poison(cupy.empty(q.shape, q.dtype))  # NaN in f16; 0xFFFF, a NaN, in bf16 bits
    lse = poison(cupy.empty((n_q, h), cupy.float32))
    dev_kw = dict(kw)
    if "sinks" in kw:
        dev_kw["sinks"] = cupy.asarray(kw["sinks"])
    attn.flash_attn_batched(plan, 0, q, out, causal=causal, lse=lse, **dev_kw)
    kp, vp, pt, lens = _host(cache)
    want_o, want_lse = ref.paged_attention(qh, kp, vp, pt, lens, slots, q_lens, ps, causal=causal, **kw)
    assert_close(ref.as_float64(out, kind), want_o, **TC_TOL[kind])
    assert_close(lse, want_lse, atol=LSE_TOL[kind], rtol=0, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("kind,d", [("float32", 64), ("float16", 512), ("bfloat16", 128)])
@pytest.mark.parametrize("causal", [True, False])
def test_batched_f32_queries_simt(attn, rng, kind, d, causal):
    cache, slots = _make_cache(rng, [40, 3], n_kv_heads=1, head_dim=d, page_size=16, kind=kind, attn=attn)
    q_lens = [7, 3]
    qh, q = _q(rng, (10, 4, d))
    plan = attn.plan_batched(cache, slots, q_lens)
    out = poison(cupy.empty((10, 4, d), cupy.float32))
    lse = poison(cupy.empty((10, 4), cupy.float32))
    attn.flash_attn_batched(plan, 0, q, out, causal=causal, window_left=30, lse=lse)
    kp, vp, pt, lens = _host(cache)
    want_o, want_lse = ref.paged_attention(qh, kp, vp, pt, lens, slots, q_lens, 16, causal=causal, window_left=30)
    assert_close(out, want_o, **DECODE_TOL)
    assert_close(lse, want_lse, atol=1e-4, rtol=0, name="lse")


def test_batched_rejects_bad_input(attn, rng, host_if_no_gpu):
    cache, slots = _make_cache(rng, [10], n_kv_heads=1, head_dim=64, attn=attn)
    with pytest.raises(ValueError, match="q_len"):
        attn.plan_batched(cache, slots, [11])
    plan = attn.plan_batched(cache, slots, [10])
    q = cupy.zeros((10, 2, 64), cupy.uint16)  # bfloat16 queries against a float16 cache
    with pytest.raises(TypeError, match="cache dtype"):
        attn.flash_attn_batched(plan, 0, q, q)


# ----------------------------------------------------------------------------- varlen

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d,h,hk", [(128, 4, 2), (64, 2, 2), (192, 2, 1)])
def test_varlen(attn, rng, kind, causal, d, h, hk):
    q_lens, k_lens = [1, 130, 64, 7], [1, 130, 200, 3]
    if causal:
        k_lens[3] = 9  # causal needs k_len >= q_len for every query to see a key
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    qf = rng.standard_normal((cu_q[-1], h, d)).astype(np.float32)
    kf = rng.standard_normal((cu_k[-1], hk, d)).astype(np.float32)
    vf = rng.standard_normal((cu_k[-1], hk, d)).astype(np.float32)
    q, k, v = _store(qf, kind), _store(kf, kind), _store(vf, kind)
    out = poison(cupy.empty(q.shape, q.dtype))
    lse = poison(cupy.empty((cu_q[-1], h), cupy.float32))
    attn.flash_attn_varlen(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), out, max_seqlen_q=max(q_lens),
                           causal=causal, lse=lse)
    want_o, want_lse = ref.varlen(ref.as_float64(q, kind), ref.as_float64(k, kind), ref.as_float64(v, kind),
                                  cu_q, cu_k, causal=causal)
    assert_close(ref.as_float64(out, kind), want_o, **TC_TOL[kind])
    assert_close(lse, want_lse, atol=LSE_TOL[kind], rtol=0, name="lse")


@pytest.mark.gpu
@pytest.mark.slow
def test_prefill_long_causal(attn, rng):
    """A 2k-token causal prefill through many K/V tiles (online-softmax rescaling across tiles)."""
    n, h, d = 2048, 2, 128
    cache, slots = _make_cache(rng, [n], n_kv_heads=1, head_dim=d, page_size=64, attn=attn)
    qf = rng.standard_normal((n, h, d)).astype(np.float32)
    q = _store(qf, "float16")
    plan = attn.plan_batched(cache, slots, [n])
    out = poison(cupy.empty(q.shape, q.dtype))
    attn.flash_attn_batched(plan, 0, q, out)
    kp, vp, pt, lens = _host(cache)
    want, _ = ref.paged_attention(ref.as_float64(q, "float16"), kp, vp, pt, lens, slots, [n], 64)
    assert_close(out, want, **TC_TOL["float16"])


def _hopper() -> bool:
    return int(cupy.cuda.Device().compute_capability) == 90


# (kind, head_dim, n_heads, n_kv_heads, page_size, lengths, q_lens): K/V tiles (128 keys; 64 at head_dim 256)
# across pages (64, 32), inside one page (256), through the division path (48: not a power of two); ragged
# around the 128-row query tiles and the key tiles
WG_CASES = [
    ("float16", 128, 4, 2, 64, [700, 129, 1, 128], [700, 40, 1, 128]),
    ("bfloat16", 128, 6, 2, 256, [300, 513], [257, 2]),
    ("float16", 128, 2, 1, 48, [385, 127], [385, 127]),
    ("float16", 256, 4, 1, 32, [700, 65, 1, 64], [700, 65, 1, 63]),
    ("bfloat16", 256, 4, 2, 256, [300, 513], [129, 3]),
    ("float16", 256, 2, 2, 48, [385, 127], [385, 127]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", WG_CASES, ids=lambda c: f"{c[0]}-d{c[1]}-h{c[2]}/{c[3]}-p{c[4]}")
@pytest.mark.parametrize("variant", ["causal", "window+sinks", "softcap", "noncausal"])
def test_prefill_wgmma_matches_mma_sync(attn, rng, case, variant):
    """Hopper: prefill_wg (wgmma) and prefill (mma.sync) on the same paged batch, each against the
    reference; the two kernels round P the same way, so they also agree with each other closely."""
    if not _hopper():
        pytest.skip("prefill_wg needs sm_90")
    kind, d, h, hk, ps, lengths, q_lens = case
    cache, slots = _make_cache(rng, lengths, n_kv_heads=hk, head_dim=d, page_size=ps, kind=kind, attn=attn)
    kw, causal = {}, variant != "noncausal"
    if variant == "window+sinks":
        kw = dict(window_left=150, sinks=rng.standard_normal(h).astype(np.float32))
    elif variant == "softcap":
        kw = dict(softcap=4.0, scale=0.25)
    n_q = sum(q_lens)
    q = _store(rng.standard_normal((n_q, h, d)).astype(np.float32), kind)
    plan = attn.plan_batched(cache, slots, q_lens)
    dev_kw = dict(kw, sinks=cupy.asarray(kw["sinks"])) if "sinks" in kw else kw
    kp, vp, pt, lens = _host(cache)
    want_o, want_lse = ref.paged_attention(ref.as_float64(q, kind), kp, vp, pt, lens, slots, q_lens, ps,
                                           causal=causal, **kw)
    got = {}
    for wg in (True, False):
        out = poison(cupy.empty(q.shape, q.dtype))
        lse = poison(cupy.empty((n_q, h), cupy.float32))
        attn.flash_attn_batched(plan, 0, q, out, causal=causal, lse=lse, wgmma=wg, **dev_kw)
        got[wg] = ref.as_float64(out, kind)
        assert_close(got[wg], want_o, **TC_TOL[kind], name=f"out (wgmma={wg})")
        assert_close(lse, want_lse, atol=LSE_TOL[kind], rtol=0, name=f"lse (wgmma={wg})")
    assert_close(got[True], got[False], **TC_TOL[kind], name="wgmma vs mma.sync")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_varlen_wgmma_matches_mma_sync(attn, rng, kind, d):
    """Hopper: the varlen path (contiguous K/V, GQA, ragged q and k lengths, causal) through both kernels."""
    if not _hopper():
        pytest.skip("prefill_wg needs sm_90")
    q_lens, k_lens = [1, 127, 128, 129, 300, 64], [1, 127, 200, 129, 300, 700]
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    h, hk = 4, 2
    q, k, v = (_store(rng.standard_normal((n, hh, d)).astype(np.float32), kind)
               for n, hh in ((cu_q[-1], h), (cu_k[-1], hk), (cu_k[-1], hk)))
    want_o, want_lse = ref.varlen(ref.as_float64(q, kind), ref.as_float64(k, kind), ref.as_float64(v, kind),
                                  cu_q, cu_k, causal=True)
    for wg in (True, False):
        out = poison(cupy.empty(q.shape, q.dtype))
        lse = poison(cupy.empty((cu_q[-1], h), cupy.float32))
        attn.flash_attn_varlen(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), out, max_seqlen_q=max(q_lens),
                               causal=True, lse=lse, wgmma=wg)
        assert_close(ref.as_float64(out, kind), want_o, **TC_TOL[kind], name=f"out (wgmma={wg})")
        assert_close(lse, want_lse, atol=LSE_TOL[kind], rtol=0, name=f"lse (wgmma={wg})")


def test_prefill_wgmma_rejects_what_it_cannot_run(attn, rng, host_if_no_gpu):
    cache, slots = _make_cache(rng, [10], n_kv_heads=1, head_dim=64, attn=attn)
    plan = attn.plan_batched(cache, slots, [10])
    q = cupy.zeros((10, 2, 64), cupy.float16)
    with pytest.raises(ValueError, match="wgmma=True"):  # head_dim 64 (and any non-Hopper device)
        attn.flash_attn_batched(plan, 0, q, q.copy(), wgmma=True)
    with pytest.raises(TypeError, match="wgmma"):
        attn.flash_attn_batched(plan, 0, q, q.copy(), wgmma=1)
