"""FlashAttention-style entry points (cukern/attention/flash_api.py): argument checks on the CPU; on the GPU
against the float64 references of tests/test_attention.py (K/V gathered back from the caller's pages) and,
where torch is installed, against torch SDPA. Tolerances are test_attention.py's: the decode and the SIMT
path (float32 queries) DECODE_TOL, tensor-core paths TC_TOL per dtype, LSE LSE_TOL.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from paged_inputs import make_paged, sdpa  # noqa: E402  (tests/ is on sys.path under pytest)
from attention_helpers import DECODE_TOL, LSE_TOL, TC_TOL, _store  # noqa: E402

from cukern.attention import flash_api, flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: E402
from cukern.attention import lse_to_log2, lse_to_natural  # noqa: E402
from cukern.reference import attention as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402


def _tol(q_kind: str) -> dict:
    return DECODE_TOL if q_kind == "float32" else TC_TOL[q_kind]


# ----------------------------------------------------------------------------- CPU

def test_window_size_maps_to_the_kernels_masks():
    w = flash_api._window
    assert w((-1, -1), False, 100) == (False, -1)
    assert w((-1, -1), True, 100) == (True, -1)
    assert w((7, 0), False, 100) == (True, 7)  # right = 0 is causal
    assert w((7, 5), True, 100) == (True, 7)  # causal sets right = 0
    assert w((7, -1), False, 100) == (False, 7)
    assert w((100, 100), False, 100) == (False, -1)  # sides that cover every key bound nothing
    with pytest.raises(ValueError, match="right"):
        w((3, 2), False, 100)
    with pytest.raises(TypeError, match="pair"):
        w(5, False, 100)
    with pytest.raises(TypeError, match="causal"):
        w((-1, -1), 1, 100)


def test_lse_conversions(rng):
    x = rng.standard_normal(7)
    x[3] = -np.inf
    y = lse_to_log2(x)
    np.testing.assert_allclose(np.exp2(np.delete(y, 3)), np.exp(np.delete(x, 3)), rtol=1e-12)
    assert y[3] == -np.inf
    np.testing.assert_allclose(lse_to_natural(y), x, rtol=1e-12)
    out = x.copy()
    assert lse_to_log2(out, out=out) is out and np.array_equal(out, y)


def _cache_case(rng, lengths=(5, 17), ps=4, hk=2, d=64, kind="float16"):
    p = make_paged(rng, list(lengths), page_size=ps, n_kv_heads=hk, head_dim=d, kind=kind)
    return p, cupy.asarray(p.block_table()), cupy.asarray(p.lengths.astype(np.int32))


def test_with_kvcache_routes_and_reuses(rng, host_if_no_gpu):
    """One query per sequence runs the split-KV decode, more the batched prefill; a second call of a shape
    makes no new split buffers; the LSE comes in FlashAttention's layout."""
    launches = host_if_no_gpu
    p, table, lens = _cache_case(rng)
    q = cupy.zeros((2, 1, 4, 64), cupy.float32)
    flash_attn_with_kvcache(q, p.k, p.v, cache_seqlens=lens, block_table=table)
    n_plans = len(flash_api._DECODE_PLANS)
    out, lse = flash_attn_with_kvcache(q, p.k, p.v, cache_seqlens=lens, block_table=table, return_lse=True)
    assert len(flash_api._DECODE_PLANS) == n_plans and out.shape == q.shape and lse.shape == (2, 4, 1)
    q3 = cupy.zeros((2, 3, 4, 64), cupy.float16)
    out, lse = flash_attn_with_kvcache(q3, p.k, p.v, cache_seqlens=lens, block_table=table, causal=True,
                                       return_lse=True)
    assert out.shape == q3.shape and out.dtype == np.float16 and lse.shape == (2, 4, 3)
    if launches is not None:
        assert any(k.startswith("decode") for k in launches) and launches["prefill<__half, 64, true>"] == 1
        launches.clear()
    flash_attn_with_kvcache(q.astype(cupy.float16), p.k, p.v, cache_seqlens=lens, block_table=table)
    if launches is not None:  # one query in the cache's dtype: the decode too
        assert any(k.startswith("decode") for k in launches) and not any(k.startswith("prefill") for k in launches)


def test_with_kvcache_rejects_bad_input_before_launch(rng, host_if_no_gpu):
    launches = host_if_no_gpu
    p, table, lens = _cache_case(rng)
    q = cupy.zeros((2, 1, 4, 64), cupy.float32)
    kw = dict(cache_seqlens=lens, block_table=table)
    cases = [
        (ValueError, "block_table must have shape", dict(kw, block_table=table[:1])),
        (TypeError, "block_table must have dtype", dict(kw, block_table=table.astype(cupy.int64))),
        (TypeError, "cache_seqlens must have dtype", dict(kw, cache_seqlens=lens.astype(cupy.int64))),
        (ValueError, "cache_seqlens must be", dict(kw, cache_seqlens=10_000)),
        (ValueError, "softmax_scale", dict(kw, softmax_scale=0.0)),
        (ValueError, "right", dict(kw, window_size=(4, 2))),
        (ValueError, "softcap", dict(kw, softcap=-1.0)),
        (ValueError, "max_seqlen_k", dict(kw, max_seqlen_k=0)),
        (ValueError, "out must have shape", dict(kw, out=cupy.zeros((2, 1, 4, 32), cupy.float32))),
    ]
    for err, match, args in cases:
        with pytest.raises(err, match=match):
            flash_attn_with_kvcache(q, p.k, p.v, **args)
    with pytest.raises(ValueError, match="C-contiguous"):  # HND-ordered pages: not the layout the kernels step
        flash_attn_with_kvcache(q, p.k.transpose(0, 2, 1, 3), p.v.transpose(0, 2, 1, 3), **kw)
    with pytest.raises(TypeError, match="v_cache must have k_cache's dtype"):
        flash_attn_with_kvcache(q, p.k, p.v.view(cupy.uint16), **kw)
    with pytest.raises(ValueError, match="head_dim"):
        flash_attn_with_kvcache(cupy.zeros((2, 1, 4, 32), cupy.float32), p.k, p.v, **kw)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        flash_attn_with_kvcache(cupy.zeros((2, 1, 3, 64), cupy.float32), p.k, p.v, **kw)
    with pytest.raises(ValueError, match="holds 2 sequences"):  # no block table: one cache row per sequence
        flash_attn_with_kvcache(cupy.zeros((3, 1, 4, 64), cupy.float32), p.k[:2], p.v[:2], cache_seqlens=3)
    odd = cupy.zeros((8, 4, 2, 80), cupy.float16)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        flash_attn_with_kvcache(cupy.zeros((2, 1, 4, 80), cupy.float32), odd, odd, **kw)
    with pytest.raises(TypeError, match="unexpected keyword"):  # FlashAttention's append of new K/V
        flash_attn_with_kvcache(q, p.k, p.v, k=q, v=q, **kw)
    if launches is not None:
        assert not launches


def test_varlen_rejects_bad_input_before_launch(host_if_no_gpu):
    launches = host_if_no_gpu
    q = cupy.zeros((10, 4, 64), cupy.float16)
    cu = cupy.asarray(np.array([0, 4, 10], np.int32))
    with pytest.raises(ValueError, match="max_seqlen_k"):
        flash_attn_varlen_func(q, q, q, cu, cu, 6, 0)
    with pytest.raises(ValueError, match="right"):
        flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, window_size=(2, 3))
    with pytest.raises(TypeError, match="q must be a cupy.ndarray"):
        flash_attn_varlen_func(q.get(), q, q, cu, cu, 6, 6)
    with pytest.raises(TypeError, match="k must"):
        flash_attn_varlen_func(q, q.astype(cupy.float32), q, cu, cu, 6, 6)
    if launches is not None:
        assert not launches
    out, lse = flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, window_size=(2, 6), return_lse=True)  # right covers all
    assert out.shape == q.shape and lse.shape == (4, 10)


# ----------------------------------------------------------------------------- GPU: varlen

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("d, h, hk", [(128, 8, 2), (64, 4, 4)])
@pytest.mark.parametrize("variant", ["noncausal", "causal", "window+softcap", "left_window"])
def test_varlen_func(rng, kind, d, h, hk, variant):
    q_lens, k_lens = [1, 130, 64, 7], [1, 130, 200, 19]
    fa, kw = dict(causal=False), dict(causal=False)
    if variant == "causal":
        fa, kw = dict(causal=True), dict(causal=True)
    elif variant == "window+softcap":
        fa = dict(causal=True, window_size=(20, -1), softcap=30.0, softmax_scale=0.2)
        kw = dict(causal=True, window_left=20, softcap=30.0, scale=0.2)
    elif variant == "left_window":
        fa, kw = dict(window_size=(15, -1)), dict(causal=False, window_left=15)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    q, k, v = (_store(rng.standard_normal((n, m, d)).astype(np.float32), kind)
               for n, m in ((cu_q[-1], h), (cu_k[-1], hk), (cu_k[-1], hk)))
    out = poison(cupy.empty(q.shape, q.dtype)) if variant != "causal" else None  # None: allocated
    got, lse = flash_attn_varlen_func(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), max(q_lens), max(k_lens),
                                      return_lse=True, out=out, **fa)
    assert out is None or got is out
    want_o, want_lse = ref.varlen(ref.as_float64(q, kind), ref.as_float64(k, kind), ref.as_float64(v, kind),
                                  cu_q, cu_k, **kw)
    assert_close(ref.as_float64(got, kind), want_o, **TC_TOL[kind])
    assert lse.shape == (h, cu_q[-1])
    assert_close(lse, want_lse.T, atol=LSE_TOL[kind], rtol=0, name="lse")


# ----------------------------------------------------------------------------- GPU: with_kvcache

# (cache kind, head_dim, n_heads, n_kv_heads, page_size, lengths, seqlen_q, q kind); every last page partly filled
# somewhere, lengths 1 and exact pages among them
KV_CASES = [
    ("float16", 128, 8, 2, 16, [1, 17, 300, 32], 1, "float32"),  # decode_tc, GQA 4
    ("bfloat16", 128, 8, 2, 16, [1, 17, 300, 32], 1, "bfloat16"),  # decode_tc with q/out in the cache's dtype
    ("bfloat16", 64, 4, 4, 1, [5, 129], 1, "float32"),  # page size 1, MHA
    ("float32", 96, 6, 2, 7, [13, 50], 1, "float32"),  # SIMT decode, odd page size, GQA 3
    ("float16", 64, 4, 2, 16, [40, 17, 100], 5, "float16"),  # tensor-core prefill, causal q_len > 1
    ("bfloat16", 128, 8, 1, 1, [9, 33], 3, "bfloat16"),  # page size 1, GQA 8
    ("float16", 64, 4, 2, 16, [20, 70], 4, "float32"),  # float32 queries: the SIMT batched path
]
KV_VARIANTS = {
    "causal": (dict(causal=True), dict(causal=True)),
    "window+softcap": (dict(window_size=(10, 0), softcap=20.0, softmax_scale=0.15),
                       dict(causal=True, window_left=10, softcap=20.0, scale=0.15)),
    "noncausal": (dict(), dict(causal=False)),
    "left_window": (dict(window_size=(12, -1)), dict(causal=False, window_left=12)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", KV_CASES, ids=lambda c: f"{c[0]}-d{c[1]}-h{c[2]}/{c[3]}-p{c[4]}-q{c[6]}{c[7][5:]}")
@pytest.mark.parametrize("variant", list(KV_VARIANTS))
def test_with_kvcache_paged(rng, case, variant):
    kind, d, h, hk, ps, lengths, sq, q_kind = case
    fa, kw = KV_VARIANTS[variant]
    p = make_paged(rng, lengths, page_size=ps, n_kv_heads=hk, head_dim=d, kind=kind)
    qf = rng.standard_normal((len(lengths), sq, h, d)).astype(np.float32)
    q = _store(qf, q_kind)
    out = poison(cupy.empty(q.shape, q.dtype))
    got, lse = flash_attn_with_kvcache(q, p.k, p.v, cache_seqlens=cupy.asarray(p.lengths.astype(np.int32)),
                                       block_table=cupy.asarray(p.block_table(pad=7)), return_lse=True, out=out,
                                       **fa)
    assert got is out
    want_o, want_lse = p.reference(ref.as_float64(q, q_kind).reshape(-1, h, d), [sq] * len(lengths), **kw)
    assert_close(ref.as_float64(out, q_kind).reshape(-1, h, d), want_o, **_tol(q_kind))
    assert lse.shape == (len(lengths), h, sq)
    assert_close(lse.transpose(0, 2, 1).reshape(-1, h), want_lse, atol=LSE_TOL[q_kind], rtol=0, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("q_kind, sq", [("float32", 1), ("float16", 6)])
def test_with_kvcache_contiguous_rows(rng, q_kind, sq):
    """No block table: row b of a [batch_cache, seqlen_cache, ...] cache (more rows than the batch, an int or
    per-sequence lengths), as FlashAttention's non-paged cache."""
    batch, h, hk, d, seqlen_cache = 3, 4, 2, 64, 77
    kf = rng.standard_normal((batch + 2, seqlen_cache, hk, d)).astype(np.float32)
    vf = rng.standard_normal((batch + 2, seqlen_cache, hk, d)).astype(np.float32)
    k, v = _store(kf, "float16"), _store(vf, "float16")
    qf = rng.standard_normal((batch, sq, h, d)).astype(np.float32)
    q = _store(qf, q_kind)
    for seqlens in (40, np.array([77, 6, 51], np.int32)):
        dev_lens = seqlens if isinstance(seqlens, int) else cupy.asarray(seqlens)
        out = flash_attn_with_kvcache(q, k, v, cache_seqlens=dev_lens, causal=True)
        lens = np.broadcast_to(seqlens, (batch,))
        table = np.arange(batch, dtype=np.int32)[:, None]
        want, _ = ref.paged_attention(ref.as_float64(q, q_kind).reshape(-1, h, d), ref.as_float64(k, "float16"),
                                      ref.as_float64(v, "float16"), table, lens, range(batch), [sq] * batch,
                                      seqlen_cache)
        assert_close(ref.as_float64(out, q_kind).reshape(-1, h, d), want, **_tol(q_kind))


@pytest.mark.gpu
def test_with_kvcache_decode_in_a_cuda_graph(rng):
    """The decode path captured after one call of its shape on the capture stream, replayed after the
    caller's lengths grew (the split buffers and index arrays are made by that first call)."""
    from cukern.streams import capture_graph
    p = make_paged(rng, [300, 45, 129], page_size=16, n_kv_heads=2, head_dim=128, kind="bfloat16", extra_pages=8)
    table = cupy.asarray(p.block_table())
    lens_host = p.lengths.astype(np.int32) - 3  # grown by 3 before the replay
    lens = cupy.asarray(lens_host)
    qf = rng.standard_normal((3, 1, 8, 128)).astype(np.float32)
    q = cupy.asarray(qf)
    out = poison(cupy.empty(q.shape, cupy.float32))
    st = cupy.cuda.Stream(non_blocking=True)
    kw = dict(cache_seqlens=lens, block_table=table, out=out, window_size=(200, 0), max_seqlen_k=512)
    cupy.cuda.Device().synchronize()  # the inputs, made on the current stream, before the capture stream reads them
    flash_attn_with_kvcache(q, p.k, p.v, stream=st, **kw)
    st.synchronize()
    graph = capture_graph(lambda s: flash_attn_with_kvcache(q, p.k, p.v, stream=s, **kw), stream=st)
    lens.set(p.lengths.astype(np.int32), stream=st)
    poison(out)
    cupy.cuda.Device().synchronize()
    graph.replay()
    st.synchronize()
    want, _ = p.reference(qf.reshape(3, 8, 128).astype(np.float64), [1, 1, 1], window_left=200)
    assert_close(out.reshape(3, 8, 128), want, **DECODE_TOL)


# ----------------------------------------------------------------------------- GPU: torch SDPA as the peer

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_varlen_func_matches_torch_sdpa(rng, kind):
    pytest.importorskip("torch")
    h, hk, d = 8, 2, 128
    q_lens, k_lens = [3, 130, 64], [3, 200, 64]
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    q, k, v = (_store(rng.standard_normal((n, m, d)).astype(np.float32), kind)
               for n, m in ((cu_q[-1], h), (cu_k[-1], hk), (cu_k[-1], hk)))
    out = flash_attn_varlen_func(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), max(q_lens), max(k_lens),
                                 causal=True, window_size=(50, 0))
    q64, k64, v64 = (ref.as_float64(a, kind) for a in (q, k, v))
    want = np.concatenate([sdpa(q64[cu_q[i]:cu_q[i + 1]], k64[cu_k[i]:cu_k[i + 1]], v64[cu_k[i]:cu_k[i + 1]],
                                 np.arange(k_lens[i] - q_lens[i], k_lens[i]), True, 50) for i in range(3)])
    assert_close(ref.as_float64(out, kind), want, **TC_TOL[kind])


@pytest.mark.gpu
@pytest.mark.parametrize("q_kind, sq", [("float32", 1), ("float16", 4)])
def test_with_kvcache_matches_torch_sdpa(rng, q_kind, sq):
    pytest.importorskip("torch")
    h, hk, d, ps = 8, 2, 64, 16
    p = make_paged(rng, [33, 300, 16], page_size=ps, n_kv_heads=hk, head_dim=d, kind="float16")
    q = _store(rng.standard_normal((3, sq, h, d)).astype(np.float32), q_kind)
    out = flash_attn_with_kvcache(q, p.k, p.v, cache_seqlens=cupy.asarray(p.lengths.astype(np.int32)),
                                  block_table=cupy.asarray(p.block_table()), causal=True)
    q64, table = ref.as_float64(q, q_kind), p.block_table()
    for b, n in enumerate(p.lengths):
        kb, vb = (ref.gather(pool, table[b], n, ps) for pool in (p.k64, p.v64))
        want = sdpa(q64[b], kb, vb, np.arange(n - sq, n), True)
        assert_close(ref.as_float64(out[b], q_kind), want, **_tol(q_kind), name=f"sequence {b}")
