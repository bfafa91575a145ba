"""FlashInfer-style wrappers (cukern/attention/flashinfer_api.py): plan()'s checks and tables and run()'s
reading of the caller's cache on the CPU; on the GPU against the float64 references of tests/test_attention.py
(pages gathered back), in a CUDA graph across plans, and against torch SDPA where torch is installed. The LSE
is compared in FlashInfer's base 2 (the reference's natural log times log2(e)) and in natural log.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from paged_inputs import make_paged, sdpa  # noqa: E402  (tests/ is on sys.path under pytest)
from attention_helpers import DECODE_TOL, LSE_TOL, TC_TOL, _store  # noqa: E402

from cukern.attention import (AttentionDispatch, BatchDecodeWithPagedKVCacheWrapper,  # noqa: E402
                              BatchPrefillWithPagedKVCacheWrapper)
from cukern.reference import attention as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402

LOG2E = 1.0 / math.log(2.0)


def _plan_decode(w, p, h, **kw):
    w.plan(*p.csr(), h, p.k.shape[2], p.k.shape[3], p.page_size, kv_data_type=p.kind, **kw)


# ----------------------------------------------------------------------------- CPU

def test_plan_builds_page_tables_from_csr(rng, host_if_no_gpu):
    p = make_paged(rng, [5, 12, 1], page_size=4, n_kv_heads=2, head_dim=64, kind="float16")
    w = BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    _plan_decode(w, p, 4)
    table = p.block_table(pad=-1)
    got = w._bufs["pages"].get()
    assert np.array_equal(got[:3, :table.shape[1]], table) and (got[3:] == -1).all()
    assert np.array_equal(w._bufs["pages2"].get()[:3, :table.shape[1]], np.where(table >= 0, 2 * table, -1))
    assert list(w._bufs["lengths"].get()[:3]) == [5, 12, 1]
    assert w._plan.batch == 3 and w._plan.n_heads == 4


def test_plan_keeps_buffers_for_a_fitting_schedule(rng, host_if_no_gpu):
    """Same batch and schedule: the tables and split buffers are the previous plan's (a captured run stays
    valid); a larger batch makes new ones."""
    w = BatchDecodeWithPagedKVCacheWrapper()
    p = make_paged(rng, [40, 100], page_size=16, n_kv_heads=2, head_dim=128, kind="bfloat16")
    _plan_decode(w, p, 8, n_splits=3, max_kv_len=256)
    first, pages = w._plan, w._bufs["pages"]
    p2 = make_paged(rng, [7, 130], page_size=16, n_kv_heads=2, head_dim=128, kind="bfloat16")
    _plan_decode(w, p2, 8, n_splits=3, max_kv_len=256)
    assert w._bufs["pages"] is pages and w._plan.counters is first.counters and w._plan.o_part is first.o_part
    assert list(w._bufs["lengths"].get()[:2]) == [7, 130]
    p3 = make_paged(rng, [7, 130, 3], page_size=16, n_kv_heads=2, head_dim=128, kind="bfloat16")
    _plan_decode(w, p3, 8, n_splits=3, max_kv_len=256)
    assert w._plan.counters is not first.counters and w._plan.batch == 3


def test_plan_rejects_bad_input_and_changes_nothing(rng, host_if_no_gpu):
    p = make_paged(rng, [5, 12], page_size=4, n_kv_heads=2, head_dim=64, kind="float16")
    indptr, indices, last = p.csr()
    w = BatchDecodeWithPagedKVCacheWrapper()
    _plan_decode(w, p, 4)
    plan, tables = w._plan, {n: b.get() for n, b in w._bufs.items()}
    cases = [
        (ValueError, "indptr must hold", (indptr + 1, indices, last, 4, 2, 64, 4), {}),
        (ValueError, "at least one page", (np.array([0, 0, 5]), indices, last, 4, 2, 64, 4), {}),
        (ValueError, "within indices", (indptr, indices[:3], last, 4, 2, 64, 4), {}),
        (ValueError, "page ids", (indptr, -indices - 1, last, 4, 2, 64, 4), {}),
        (ValueError, "last_page_len", (indptr, indices, last * 0, 4, 2, 64, 4), {}),
        (ValueError, "last_page_len", (indptr, indices, last + 4, 4, 2, 64, 4), {}),
        (ValueError, "multiple of num_kv_heads", (indptr, indices, last, 3, 2, 64, 4), {}),
        (ValueError, "head_dim must be one of", (indptr, indices, last, 4, 2, 80, 4), {}),
        (ValueError, "pos_encoding_mode", (indptr, indices, last, 4, 2, 64, 4), dict(pos_encoding_mode="ROPE_LLAMA")),
        (ValueError, "sm_scale", (indptr, indices, last, 4, 2, 64, 4), dict(sm_scale=0.0)),
        (ValueError, "logits_soft_cap", (indptr, indices, last, 4, 2, 64, 4), dict(logits_soft_cap=-1.0)),
        (TypeError, "window_left", (indptr, indices, last, 4, 2, 64, 4), dict(window_left=2.5)),
        (TypeError, "kv_data_type", (indptr, indices, last, 4, 2, 64, 4), dict(kv_data_type="int8")),
        (ValueError, "n_splits", (indptr, indices, last, 4, 2, 64, 4), dict(n_splits=0)),
    ]
    for err, match, args, kw in cases:
        with pytest.raises(err, match=match):
            w.plan(*args, **kw)
    assert w._plan is plan and all(np.array_equal(w._bufs[n].get(), t) for n, t in tables.items())
    pre = BatchPrefillWithPagedKVCacheWrapper()
    pre.plan(np.array([0, 5, 17]), indptr, indices, last, 4, 2, 64, 4)
    before = pre._plan, pre._bufs["pages"].get()
    with pytest.raises(ValueError, match="qo_indptr"):  # 6 queries against 5 keys
        pre.plan(np.array([0, 6, 7]), indptr, np.flip(indices), last, 4, 2, 64, 4)
    assert pre._plan is before[0] and np.array_equal(pre._bufs["pages"].get(), before[1])
    with pytest.raises(ValueError, match="NHD"):
        BatchDecodeWithPagedKVCacheWrapper(None, "HND")


def test_run_checks_the_cache_against_the_plan(rng, host_if_no_gpu):
    launches = host_if_no_gpu
    p = make_paged(rng, [5, 12], page_size=4, n_kv_heads=2, head_dim=64, kind="float16")
    q = cupy.zeros((2, 4, 64), cupy.float32)
    w = BatchDecodeWithPagedKVCacheWrapper()
    with pytest.raises(RuntimeError, match="plan"):
        w.run(q, (p.k, p.v))
    _plan_decode(w, p, 4, q_data_type="float32")
    kv = p.combined()
    cases = [
        (TypeError, "kv_data_type float16", ((p.k.view(cupy.uint16), p.v.view(cupy.uint16)),), {}),
        (ValueError, "holds 3 pages", ((p.k[:3], p.v[:3]),), {}),
        (ValueError, r"k_cache must have shape \(num_pages, 4, 2, 64\)", ((p.k[:, :2].copy(), p.v[:, :2].copy()),), {}),
        (ValueError, "paged_kv_cache must have shape", (kv[:, :, :2].copy(),), {}),
        (ValueError, "k_cache, v_cache", ((p.k, p.v, p.v),), {}),
        (ValueError, "lse_base", ((p.k, p.v),), dict(lse_base="e")),
        (ValueError, "lse must have shape", ((p.k, p.v),), dict(lse=cupy.zeros((2, 3), cupy.float32))),
    ]
    for err, match, args, kw in cases:
        with pytest.raises(err, match=match):
            w.run(q, *args, **kw)
    with pytest.raises(TypeError, match="q_data_type float32"):
        w.run(q.astype(cupy.float16), (p.k, p.v))
    if launches is not None:
        assert not launches
    w.run(q, (p.k, p.v))
    w.run(q, kv, out=poison(cupy.empty(q.shape, q.dtype)))
    if launches is not None:
        assert sum(n for k, n in launches.items() if k.startswith("decode")) == 2


def test_combined_cache_is_read_in_place(rng, host_if_no_gpu, monkeypatch):
    """[num_pages, 2, page_size, ...]: K pool at the array, V pool half a page further, both with pages of
    twice the stride, addressed by the doubled page table; nothing copied."""
    seen = []
    monkeypatch.setattr(AttentionDispatch, "flash_attn_decode",
                        lambda self, plan, layer, q, out, **kw: seen.append(plan))
    p = make_paged(rng, [5, 12], page_size=4, n_kv_heads=2, head_dim=64, kind="bfloat16")
    w = BatchDecodeWithPagedKVCacheWrapper()
    _plan_decode(w, p, 4)
    kv = p.combined()
    w.run(cupy.zeros((2, 4, 64), cupy.float32), kv)
    view = seen[0].cache
    assert view.k_pool.data.ptr == kv.data.ptr and view.v_pool.data.ptr == kv.data.ptr + 4 * 2 * 64 * 2
    assert view.k_pool.shape == (2 * kv.shape[0], 4, 2, 64) and view.page_table is w._bufs["pages2"]
    assert seen[0].counters is w._plan.counters  # the plan's buffers, the run's pools


# ----------------------------------------------------------------------------- GPU

# (kind, head_dim, n_heads, n_kv_heads, page_size, lengths)
DECODE_CASES = [
    ("float16", 128, 8, 2, 16, [1, 15, 16, 17, 300]),
    ("bfloat16", 64, 4, 4, 1, [3, 129]),
    ("float32", 96, 6, 2, 5, [13, 50]),
    ("bfloat16", 256, 8, 1, 16, [700, 31]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{c[0]}-d{c[1]}-h{c[2]}/{c[3]}-p{c[4]}")
@pytest.mark.parametrize("layout", ["pair", "combined"])
@pytest.mark.parametrize("variant", ["plain", "window+softcap", "lse_ln"])
def test_decode_wrapper(rng, case, layout, variant):
    kind, d, h, hk, ps, lengths = case
    p = make_paged(rng, lengths, page_size=ps, n_kv_heads=hk, head_dim=d, kind=kind)
    plan_kw, kw = {}, {}
    if variant == "window+softcap":
        plan_kw = dict(window_left=9, logits_soft_cap=5.0, sm_scale=0.3)
        kw = dict(window_left=9, softcap=5.0, scale=0.3)
    w = BatchDecodeWithPagedKVCacheWrapper()
    _plan_decode(w, p, h, **plan_kw)
    qf = (rng.standard_normal((len(lengths), h, d)) * 2).astype(np.float32)
    out = poison(cupy.empty(qf.shape, cupy.float32))
    base = "ln" if variant == "lse_ln" else "log2"
    got, lse = w.run(cupy.asarray(qf), (p.k, p.v) if layout == "pair" else p.combined(), out=out, return_lse=True,
                     lse_base=base)
    want_o, want_lse = p.reference(qf, [1] * len(lengths), **kw)
    assert got is out
    assert_close(out, want_o, **DECODE_TOL)
    assert_close(lse, want_lse * (LOG2E if base == "log2" else 1.0), atol=LSE_TOL["float32"] * 2, rtol=0,
                 name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_decode_wrapper_q_in_cache_dtype(rng, kind):
    h, hk, d, ps = 8, 2, 128, 16
    p = make_paged(rng, [1, 40, 300], page_size=ps, n_kv_heads=hk, head_dim=d, kind=kind)
    w = BatchDecodeWithPagedKVCacheWrapper()
    _plan_decode(w, p, h, q_data_type=kind)
    q = _store(rng.standard_normal((3, h, d)).astype(np.float32), kind)
    out, lse = w.run(q, p.combined(), return_lse=True)
    want_o, want_lse = p.reference(ref.as_float64(q, kind), [1, 1, 1])
    assert out.dtype == q.dtype
    assert_close(ref.as_float64(out, kind), want_o, **TC_TOL[kind])
    assert_close(lse, want_lse * LOG2E, atol=2 * LSE_TOL["float32"], rtol=0, name="lse")


# (kind, head_dim, n_heads, n_kv_heads, page_size, kv lengths, q lengths, q kind)
PREFILL_CASES = [
    ("float16", 128, 4, 2, 16, [700, 129, 1, 33], [700, 40, 1, 7], "float16"),
    ("bfloat16", 64, 6, 2, 1, [100, 9], [31, 9], "bfloat16"),
    ("float16", 96, 4, 4, 5, [51, 20], [3, 20], "float32"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"{c[0]}-d{c[1]}-h{c[2]}/{c[3]}-p{c[4]}-q{c[7][5:]}")
@pytest.mark.parametrize("layout", ["pair", "combined"])
@pytest.mark.parametrize("variant", ["causal", "noncausal", "window+softcap"])
def test_prefill_wrapper(rng, case, layout, variant):
    kind, d, h, hk, ps, kv_lens, q_lens, q_kind = case
    p = make_paged(rng, kv_lens, page_size=ps, n_kv_heads=hk, head_dim=d, kind=kind)
    plan_kw, kw = dict(causal=variant != "noncausal"), dict(causal=variant != "noncausal")
    if variant == "window+softcap":
        plan_kw.update(window_left=20, logits_soft_cap=30.0)
        kw.update(window_left=20, softcap=30.0)
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    w = BatchPrefillWithPagedKVCacheWrapper()
    w.plan(cupy.asarray(qo), *p.csr(), h, hk, d, ps, kv_data_type=kind, **plan_kw)  # a device qo_indptr: read back
    q = _store(rng.standard_normal((qo[-1], h, d)).astype(np.float32), q_kind)
    lse = poison(cupy.empty((qo[-1], h), cupy.float32))
    out = w.run(q, (p.k, p.v) if layout == "pair" else p.combined(), lse=lse)
    want_o, want_lse = p.reference(ref.as_float64(q, q_kind), q_lens, **kw)
    tol = DECODE_TOL if q_kind == "float32" else TC_TOL[q_kind]
    assert_close(ref.as_float64(out, q_kind), want_o, **tol)
    assert_close(lse, want_lse * LOG2E, atol=2 * LSE_TOL[q_kind], rtol=0, name="lse")


@pytest.mark.gpu
def test_decode_wrapper_graph_replays_across_plans(rng):
    """FlashInfer's CUDA-graph use: plan, capture run once, then per step plan (a new batch of pages and
    lengths, the same batch size and fixed schedule) and replay; the graph reads the re-uploaded tables."""
    from cukern.streams import capture_graph
    h, hk, d, ps = 8, 2, 128, 16
    st = cupy.cuda.Stream(non_blocking=True)
    w = BatchDecodeWithPagedKVCacheWrapper()
    fixed = dict(n_splits=4, max_kv_len=1024, stream=st)
    p = make_paged(rng, [300, 45, 1000], page_size=ps, n_kv_heads=hk, head_dim=d, kind="float16", extra_pages=80)
    _plan_decode(w, p, h, **fixed)
    qf = rng.standard_normal((3, h, d)).astype(np.float32)
    q, out, lse = cupy.asarray(qf), cupy.empty((3, h, d), cupy.float32), cupy.empty((3, h), cupy.float32)
    cupy.cuda.Device().synchronize()
    w.run(q, (p.k, p.v), out=out, lse=lse, stream=st)  # kernels loaded before the capture
    graph = capture_graph(lambda s: w.run(q, (p.k, p.v), out=out, lse=lse, stream=s), stream=st)
    for lengths in ([301, 46, 1001], [17, 999, 2]):  # pages within the first pool's 165
        grown = make_paged(rng, lengths, page_size=ps, n_kv_heads=hk, head_dim=d, kind="float16")
        p.k[:grown.k.shape[0]], p.v[:grown.v.shape[0]] = grown.k, grown.v  # new contents, the same pools
        p.k64[:grown.k.shape[0]], p.v64[:grown.v.shape[0]] = grown.k64, grown.v64
        p.pages, p.lengths = grown.pages, grown.lengths
        plan = w._plan
        _plan_decode(w, p, h, **fixed)
        assert w._plan.counters is plan.counters  # the schedule held: the graph's buffers are the plan's
        poison(out)
        cupy.cuda.Device().synchronize()  # the new pages and the poison (current stream) before the replay (st)
        graph.replay()
        st.synchronize()
        want_o, want_lse = p.reference(qf, [1, 1, 1])
        assert_close(out, want_o, **DECODE_TOL)
        assert_close(lse, want_lse * LOG2E, atol=2 * LSE_TOL["float32"], rtol=0, name="lse")


@pytest.mark.gpu
def test_decode_wrapper_matches_torch_sdpa(rng):
    pytest.importorskip("torch")
    h, hk, d, ps = 8, 2, 128, 16
    p = make_paged(rng, [1, 300, 77], page_size=ps, n_kv_heads=hk, head_dim=d, kind="bfloat16")
    w = BatchDecodeWithPagedKVCacheWrapper()
    _plan_decode(w, p, h, window_left=50)
    qf = rng.standard_normal((3, h, d)).astype(np.float32)
    out = w.run(cupy.asarray(qf), p.combined())
    table = p.block_table()
    for b, n in enumerate(p.lengths):
        kb, vb = (ref.gather(pool, table[b], n, ps) for pool in (p.k64, p.v64))
        want = sdpa(qf[b:b + 1].astype(np.float64), kb, vb, np.array([n - 1]), True, 50)
        assert_close(out[b:b + 1], want, **DECODE_TOL, name=f"sequence {b}")
