"""Attention family against its float64 references (cukern/reference/attention.py).

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

from cukern.attention import AttentionDispatch, DecodeOverrides, PageAllocator, PagedKVCache  # noqa: E402
from cukern.reference import attention as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402

DECODE_TOL = dict(atol=1e-4, rtol=1e-4)
LSE_TOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-4}
TC_TOL = {"float16": dict(atol=1e-3, rtol=2e-3), "bfloat16": dict(atol=1e-2, rtol=1.6e-2)}


@pytest.fixture(scope="module")
def attn():
    return AttentionDispatch()


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


# ----------------------------------------------------------------------------- allocator (CPU)

def test_host_mirrors_of_kernel_shapes():
    """The host's copies of the kernels' shared-memory sizes and tiles (attention/plan.py) equal the
    shape structs the kernels use (decode.cuh, decode_tc.cuh, prefill.cuh, prefill_wg.cuh) for every
    instantiation the dispatch launches: generated static_asserts, compiled by NVRTC (no GPU)."""
    from cukern import runtime
    from cukern.attention import plan as P
    from cukern.attention.cache import HEAD_DIMS
    from cukern.attention.dispatch import _CTYPE, PREFILL_HEAD_DIMS, PREFILL_WG_HEAD_DIMS
    asserts = []
    for kind, t in _CTYPE.items():
        for d in HEAD_DIMS:
            for g in P._groups(d):
                asserts.append(f"DecodeShape<{t}, {d}, {g}>::SMEM == {P._decode_smem(kind, d, g)}")
    for d in HEAD_DIMS:
        if d <= P._TC_DECODE_MAX_D:
            for nw in P._tc_warps(d):
                asserts.append(f"DecodeTcShape<{d}, {nw}>::SMEM == {P._decode_tc_smem(d, nw)}")
    for d in PREFILL_HEAD_DIMS:
        nt, bm, smem = P._prefill_shape(d)
        asserts.append(f"PrefillShape<{d}>::NT == {nt} && PrefillShape<{d}>::BM == {bm} && "
                       f"PrefillShape<{d}>::SMEM_BYTES == {smem}")
    for d in PREFILL_WG_HEAD_DIMS:
        nt, bm, smem = P._prefill_wg_shape(d)
        asserts.append(f"PrefillWgShape<{d}>::NT == {nt} && PrefillWgShape<{d}>::BM == {bm} && "
                       f"PrefillWgShape<{d}>::SMEM_BYTES == {smem}")
    source = "\n".join(['#include "attention/decode.cuh"', '#include "attention/decode_tc.cuh"',
                         '#include "attention/prefill.cuh"', '#include "attention/prefill_wg.cuh"',
                         "namespace cukern { namespace attn {"]
                        + [f'static_assert({a}, "host mirror: {a}");' for a in asserts] + ["} }"])
    runtime.compile_ptx("probe:attention_shapes", source, (), 90, arch_specific=True)
    assert len(asserts) > 40


def test_allocator_add_extend_fork_free():
    a = PageAllocator(n_pages=8, page_size=4, max_seqs=3)
    s0 = a.add(5)  # 2 pages
    assert a.pages(s0) == [0, 1] and a.n_free_pages == 6
    assert a.extend(s0, 3) == 5 and a.pages(s0) == [0, 1]  # 8 tokens: still 2 pages
    assert a.extend(s0, 1) == 8 and a.pages(s0) == [0, 1, 2]
    child, copy = a.fork(s0)  # 9 tokens: 2 full pages shared, the third copied
    assert a.pages(child)[:2] == [0, 1] and copy == (2, a.pages(child)[2])
    assert list(a.refs[[0, 1, 2]]) == [2, 2, 1]
    a.free(s0)
    assert list(a.refs[[0, 1, 2]]) == [1, 1, 0] and 2 in a._free
    a.free(child)
    assert a.n_free_pages == 8 and a.active_slots() == []


def test_allocator_full_pool_and_bad_ids_change_nothing():
    a = PageAllocator(n_pages=4, page_size=2, max_seqs=2, max_pages_per_seq=3)
    s = a.add(3)
    before = (a.page_table.copy(), a.lengths.copy(), a.n_free_pages, a.refs.copy())

    def same():
        return (np.array_equal(a.page_table, before[0]) and np.array_equal(a.lengths, before[1])
                and a.n_free_pages == before[2] and np.array_equal(a.refs, before[3]))
    with pytest.raises(ValueError, match="exceed"):
        a.extend(s, 4)  # 7 tokens > 3 pages * 2
    assert same()
    with pytest.raises(ValueError, match="pool is full"):
        a.add(6)  # 3 pages, 2 free
    assert same()
    for bad in (1, 2, -1):
        with pytest.raises(ValueError, match="does not exist"):
            a.extend(bad, 1)
    with pytest.raises(TypeError):
        a.free("0")
    assert same()
    a.add(4)
    with pytest.raises(ValueError, match="no free sequence slot"):
        a.add(0)
    with pytest.raises(ValueError):
        PageAllocator(4, 0, 1)
    with pytest.raises(ValueError):
        PageAllocator(4, 257, 1)


def test_rejects_host_arrays_before_launch():
    attn = AttentionDispatch()  # no GPU needed to construct or to validate types
    q = np.zeros((2, 4, 64), np.float32)
    with pytest.raises(TypeError, match="v must be a cupy.ndarray"):
        attn.merge_states(q[:, None], np.zeros((2, 1, 4), np.float32), q)
    with pytest.raises(TypeError, match="q must be a cupy.ndarray"):
        attn.flash_attn_varlen(q.astype(np.float16), q, q, np.zeros(3, np.int32), np.zeros(3, np.int32), q,
                               max_seqlen_q=1)
    with pytest.raises(TypeError, match="plan must be a DecodePlan"):
        attn.flash_attn_decode(None, 0, q, q)


# ----------------------------------------------------------------------------- cache writes

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_write_kv_run_and_per_token(attn, rng, kind, page_size):
    cache = PagedKVCache(2, 40, page_size, 2, 96, max_seqs=4, dtype=kind)
    s0, s1 = cache.add(0), cache.add(0)
    cache.extend(s0, 17)
    cache.extend(s1, 5)
    k0 = rng.standard_normal((17, 2, 96)).astype(np.float32)
    v0 = rng.standard_normal((17, 2, 96)).astype(np.float32)
    attn.write_kv_run(cache, 1, cupy.asarray(k0), cupy.asarray(v0), s0, 0)
    # one token for each of the two sequences, the native dtype as source
    pos = [cache.extend(s0, 1), cache.extend(s1, 1)]
    k1 = rng.standard_normal((2, 2, 96)).astype(np.float32)
    v1 = rng.standard_normal((2, 2, 96)).astype(np.float32)
    attn.write_kv(cache, 1, _store(k1, kind), _store(v1, kind), cupy.asarray(np.array([s0, s1], np.int32)),
                  cupy.asarray(np.array(pos, np.int32)))
    kp, vp, pt, lens = _host(cache, 1)
    rtol = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 0}[kind]
    got_k = ref.gather(kp, pt[s0], 18, page_size)
    np.testing.assert_allclose(got_k[:17], k0, rtol=rtol, atol=1e-6)
    np.testing.assert_allclose(got_k[17], k1[0], rtol=rtol, atol=1e-6)
    np.testing.assert_allclose(ref.gather(vp, pt[s1], 6, page_size)[5], v1[1], rtol=rtol, atol=1e-6)
    assert list(lens[[s0, s1]]) == [18, 6]
    assert not np.any(ref.as_float64(cache.k_pools[0], kind))  # layer 0 untouched


def test_write_kv_rejects_bad_input_before_launch(attn, host_if_no_gpu):
    cache = PagedKVCache(1, 4, 16, 2, 64, max_seqs=2)
    s = cache.add(8)
    k = cupy.zeros((8, 2, 64), cupy.float16)
    with pytest.raises(ValueError, match="outside sequence"):
        attn.write_kv_run(cache, 0, k, k, s, 1)  # 1 ... 8 > length 8
    with pytest.raises(ValueError, match="does not exist"):
        attn.write_kv_run(cache, 0, k, k, s + 1, 0)
    with pytest.raises(TypeError, match="k must be"):
        attn.write_kv_run(cache, 0, k.astype(cupy.float64), k, s, 0)
    with pytest.raises(ValueError, match="shape"):
        attn.write_kv_run(cache, 0, cupy.zeros((8, 1, 64), cupy.float16), k, s, 0)
    with pytest.raises(ValueError, match="C-contiguous"):
        attn.write_kv_run(cache, 0, cupy.zeros((8, 2, 128), cupy.float16)[:, :, ::2], k, s, 0)
    with pytest.raises(ValueError, match="layer"):
        attn.write_kv_run(cache, 1, k, k, s, 0)
    with pytest.raises(ValueError, match="head_dim"):
        PagedKVCache(1, 4, 16, 2, 48, max_seqs=2)


@pytest.mark.gpu
def test_fork_copies_partial_page(attn, rng):
    cache, (s,) = _make_cache(rng, [21], page_size=8, attn=attn)
    child = cache.fork(s)
    assert cache.pages(child)[:2] == cache.pages(s)[:2] and cache.pages(child)[2] != cache.pages(s)[2]
    kp, vp, pt, lens = _host(cache)
    np.testing.assert_array_equal(ref.gather(kp, pt[child], 21, 8), ref.gather(kp, pt[s], 21, 8))
    np.testing.assert_array_equal(ref.gather(vp, pt[child], 21, 8), ref.gather(vp, pt[s], 21, 8))


# ----------------------------------------------------------------------------- decode

# (kind, head_dim, n_heads, n_kv_heads, page_size, lengths)
DECODE_CASES = [
    ("float16", 128, 8, 2, 16, [1, 15, 16, 17, 300]),   # length 1, page boundary - 1 / exact / + 1, ragged
    ("float16", 64, 4, 4, 1, [1, 2, 129]),              # MHA (G = 1), page size 1
    ("float16", 256, 8, 1, 32, [32, 700]),              # GQA 8, exactly one page
    ("bfloat16", 128, 16, 2, 16, [5, 260]),             # GQA 8
    ("float32", 96, 6, 2, 7, [13, 50]),                 # odd head_dim / page size, GQA 3 (masked heads)
    ("float16", 512, 4, 1, 16, [3, 90]),                # head_dim 512
    ("bfloat16", 160, 32, 2, 256, [600, 1]),            # GQA 16 (two head blocks), page size 256
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{c[0]}-d{c[1]}-h{c[2]}/{c[3]}-p{c[4]}")
@pytest.mark.parametrize("variant", ["plain", "window+sinks", "softcap+split7", "unsplit+window_big"])
def test_decode(attn, rng, case, variant):
    kind, d, h, hk, ps, lengths = case
    cache, slots = _make_cache(rng, lengths, n_kv_heads=hk, head_dim=d, page_size=ps, kind=kind, attn=attn)
    kw, n_splits = {}, None
    if variant == "window+sinks":
        kw = dict(window_left=9, sinks=rng.standard_normal(h).astype(np.float32) * 2)
    elif variant == "softcap+split7":
        kw, n_splits = dict(softcap=5.0, scale=0.3), 7
    elif variant == "unsplit+window_big":
        kw, n_splits = dict(window_left=10_000), 1
    qh, q = _q(rng, (len(slots), h, d), scale=2.0)
    order = slots[::-1]  # batch order differs from slot order
    qh, q = qh[::-1].copy(), q[::-1].copy()
    plan = attn.plan_decode(cache, order, h, n_splits=n_splits, window_left=kw.get("window_left", -1))
    out = poison(cupy.empty((len(slots), h, d), cupy.float32))
    lse = poison(cupy.empty((len(slots), h), cupy.float32))
    dev_kw = dict(kw)
    if "sinks" in kw:
        dev_kw["sinks"] = cupy.asarray(kw["sinks"])
    attn.flash_attn_decode(plan, 0, q, out, lse=lse, **dev_kw)
    kp, vp, pt, lens = _host(cache)
    want_o, want_lse = ref.paged_attention(qh, kp, vp, pt, lens, order, [1] * len(order), ps, **kw)
    assert_close(out, want_o, **DECODE_TOL)
    assert_close(lse, want_lse, atol=1e-4, rtol=0, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", [None, 2], ids=["ahead_rule", "ahead2"])
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("kind, d", [("float16", 128), ("bfloat16", 64)])
def test_decode_tc_warps(rng, warps, kind, d, ahead):
    """Both block shapes of the tensor-core decode (4 and 8 warps), over ragged lengths, with sinks,
    a window, a softcap and large queries (the power-of-two rescale that keeps f16 Q in range); with
    the in-loop L2 prefetch as the rule sets it (off at these lengths) and forced on."""
    attn = AttentionDispatch()
    forced = DecodeOverrides(warps=warps, l2_ahead=ahead)
    cache, slots = _make_cache(rng, [1, 63, 64, 65, 2000], n_kv_heads=2, head_dim=d, page_size=16, kind=kind,
                               attn=attn)
    h = 10  # GQA 5: the block's rows 5-7 are padding
    sinks = rng.standard_normal(h).astype(np.float32)
    for kw, n_splits, qscale in ((dict(sinks=sinks), 5, 1.0), (dict(softcap=4.0, scale=0.3), None, 1.0),
                                 (dict(window_left=70), None, 3e5)):  # q * scale * log2(e) past the f16 range
        qh, q = _q(rng, (len(slots), h, d), scale=qscale)
        plan = attn.plan_decode(cache, slots, h, n_splits=n_splits, window_left=kw.get("window_left", -1),
                                overrides=forced)
        assert plan.warps == warps
        out = poison(cupy.empty((len(slots), h, d), cupy.float32))
        lse = poison(cupy.empty((len(slots), h), cupy.float32))
        dev_kw = {k: (cupy.asarray(v) if k == "sinks" else v) for k, v in kw.items()}
        attn.flash_attn_decode(plan, 0, q, out, lse=lse, **dev_kw)
        kp, vp, pt, lens = _host(cache)
        want_o, want_lse = ref.paged_attention(qh, kp, vp, pt, lens, slots, [1] * len(slots), 16, **kw)
        assert_close(out, want_o, **DECODE_TOL)
        assert_close(lse, want_lse, atol=1e-4 * max(1.0, float(np.abs(want_lse).max())), rtol=0, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("page_size", [5, 16])
def test_decode_tc_page_tables(rng, page_size, warps):
    """The tensor-core decode's page-table lookups over scattered pages (no row a run of consecutive pages), a
    page size that is not a power of two among them, lengths at page boundaries +- 1, with the L2 prefetch before
    the wait (pdl) and in the loop forced on, each over more tiles than the prologue looks up."""
    attn = AttentionDispatch(pdl=True)
    forced = DecodeOverrides(warps=warps, l2_ahead=2, l2_prefetch=5)
    lengths = [1, page_size - 1, page_size, page_size + 1, 333, 3000]
    cache, slots = _make_cache(rng, lengths, n_kv_heads=2, head_dim=64, page_size=page_size, attn=attn, scatter=True)
    kp, vp, pt, lens = _host(cache)
    assert (np.diff(pt[slots[-1], :8]) != 1).all(), "the page table was meant to be scattered"
    h = 8
    for n_splits in (None, 3):
        qh, q = _q(rng, (len(slots), h, 64))
        plan = attn.plan_decode(cache, slots, h, n_splits=n_splits, overrides=forced)
        assert plan.warps == warps
        out = poison(cupy.empty((len(slots), h, 64), cupy.float32))
        attn.flash_attn_decode(plan, 0, q, out)
        want, _ = ref.paged_attention(qh, kp, vp, pt, lens, slots, [1] * len(slots), page_size)
        assert_close(out, want, **DECODE_TOL)


@pytest.mark.gpu
def test_decode_split_matches_unsplit_and_graph(attn, rng):
    from cukern.streams import capture_graph
    cache, slots = _make_cache(rng, [4000, 1, 777], n_kv_heads=2, head_dim=128, page_size=16, attn=attn)
    qh, q = _q(rng, (3, 8, 128))
    sinks = cupy.asarray(rng.standard_normal(8).astype(np.float32))
    outs = []
    for n_splits in (1, 3, 16, None):
        plan = attn.plan_decode(cache, slots, 8, n_splits=n_splits)
        for _ in range(2):  # the merge counters are left zero for the next launch of the plan
            out = poison(cupy.empty((3, 8, 128), cupy.float32))
            attn.flash_attn_decode(plan, 0, q, out, sinks=sinks)
            outs.append(out.get())
    for o in outs[1:]:
        assert_close(o, outs[0], atol=2e-5, rtol=2e-5, name="split vs unsplit")
    # the same step captured in a CUDA graph and replayed after the cache grew by one token
    plan = attn.plan_decode(cache, slots, 8, max_kv_len=4096)
    out = poison(cupy.empty((3, 8, 128), cupy.float32))
    graph = capture_graph(lambda st: attn.flash_attn_decode(plan, 0, q, out, sinks=sinks, stream=st))
    for s in slots:
        pos = cache.extend(s, 1)
        kv = cupy.asarray(rng.standard_normal((1, 2, 128)).astype(np.float32))
        attn.write_kv_run(cache, 0, kv, kv, s, pos)
    # the writes and the lengths' upload ran on the current stream, the graph replays on its own
    # non-blocking capture stream: nothing orders them but a synchronisation
    cupy.cuda.get_current_stream().synchronize()
    graph.replay()
    graph.stream.synchronize()
    kp, vp, pt, lens = _host(cache)
    want, _ = ref.paged_attention(qh, kp, vp, pt, lens, slots, [1, 1, 1], 16, sinks=sinks.get())
    assert_close(out, want, **DECODE_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("d, h, hk, warps, n_splits", [
    (256, 8, 1, None, 64),    # decode_tc, 8 KB states
    (128, 32, 8, 8, 256),     # decode_tc 8 warps, the most splits
    (512, 4, 1, None, 200),   # the SIMT decode
])
@pytest.mark.parametrize("apart", [False, True], ids=["fused", "apart"])
def test_decode_many_splits(rng, d, h, hk, warps, n_splits, apart):
    """Many split states merged by the decode's last block (its loads in batches of 16 states) or apart
    (merge_states launched after the decode): sinks and the LSE, two sequences (the second shorter
    than the split count, so some of its chunks are empty), against the float64 reference."""
    attn = AttentionDispatch()
    cache, slots = _make_cache(rng, [6000, 150], n_kv_heads=hk, head_dim=d, page_size=16, attn=attn)
    qh, q = _q(rng, (2, h, d))
    sinks = rng.standard_normal(h).astype(np.float32)
    plan = attn.plan_decode(cache, slots, h, n_splits=n_splits,
                            overrides=DecodeOverrides(warps=warps, merge_apart=apart))
    assert plan.n_splits == n_splits and plan.merge_apart == apart
    out = poison(cupy.empty((2, h, d), cupy.float32))
    lse = poison(cupy.empty((2, h), cupy.float32))
    for _ in range(2):  # the counters are left zero for the next launch
        attn.flash_attn_decode(plan, 0, q, out, lse=lse, sinks=cupy.asarray(sinks))
    kp, vp, pt, lens = _host(cache)
    want_o, want_lse = ref.paged_attention(qh, kp, vp, pt, lens, slots, [1, 1], 16, sinks=sinks)
    assert_close(out, want_o, **DECODE_TOL)
    assert_close(lse, want_lse, atol=1e-4 * max(1.0, float(np.abs(want_lse).max())), rtol=0, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("kind, d, h, hk", [("float16", 128, 8, 2), ("bfloat16", 64, 12, 4), ("float32", 96, 4, 2)])
def test_decode_pdl_chain_matches_plain_launches(rng, kind, d, h, hk, monkeypatch):
    """AttentionDispatch(pdl=True): a chain of decode steps over two layers, each step's q the previous
    step's output (the dependency pdl_wait must honour) and most steps preceded by a plain KV write of
    every sequence's newest token (the rows the kernel must not read before the wait), eager and replayed
    from a CUDA graph, equals the same chain launched plainly bit for bit (the kernels are deterministic,
    so a race shows)."""
    from cukern import dispatch
    from cukern.streams import capture_graph
    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90")
    pdl_launches = []
    real = dispatch._launch_pdl
    monkeypatch.setattr(dispatch, "_launch_pdl", lambda *a: (pdl_launches.append(a[0]), real(*a)))
    plain, fast = AttentionDispatch(), AttentionDispatch(pdl=True)
    # the L2 prefetch of a warp's next tiles before the wait (on or off by default), and the in-loop one (off by
    # default at these lengths), forced on in a second set of plans
    prefetch = dict(l2_prefetch=5, l2_ahead=3)
    lengths = [1, 17, 40, 300, 1500]  # the newest token in a warp's first tiles, split or not
    cache, slots = _make_cache(rng, lengths, n_kv_heads=hk, head_dim=d, page_size=16, kind=kind, n_layers=2,
                               attn=plain)
    b = len(slots)
    ids = cupy.asarray(np.array(slots, np.int32))
    newest = cupy.asarray(np.array(lengths, np.int32) - 1)
    n_steps = 9
    rows = [(cupy.asarray(rng.standard_normal((b, hk, d)).astype(np.float32)),
             cupy.asarray(rng.standard_normal((b, hk, d)).astype(np.float32))) for _ in range(n_steps)]
    sinks = cupy.asarray(rng.standard_normal(h).astype(np.float32))
    q0 = cupy.asarray(rng.standard_normal((b, h, d)).astype(np.float32))
    plan_sets = {}  # the split states of the third plan merged by a merge_states launch (under pdl too)
    for name, extra in (("plain", {}), ("prefetch", prefetch)):
        plan_sets[name] = [plain.plan_decode(cache, slots, h, n_splits=n, overrides=DecodeOverrides(**extra))
                           for n in (None, 5)]
        plan_sets[name].append(plain.plan_decode(cache, slots, h, n_splits=5,
                                                 overrides=DecodeOverrides(merge_apart=True, **extra)))
    plans = plan_sets["plain"]
    assert plans[2].merge_apart and not plans[1].merge_apart

    def chain(a, outs, plans=plans):
        q = q0
        for i, out in enumerate(outs):
            layer = i % 2
            if i % 3 != 2:  # every third step follows the previous decode directly
                a.write_kv(cache, layer, rows[i][0], rows[i][1], ids, newest)
            a.flash_attn_decode(plans[i // 3], layer, q, out, sinks=sinks)
            q = out

    want = [poison(cupy.empty((b, h, d), cupy.float32)) for _ in range(n_steps)]
    chain(plain, want)
    for name, graph in (("plain", False), ("plain", True), ("prefetch", False), ("prefetch", True)):  # eager first:
        got = [poison(cupy.empty((b, h, d), cupy.float32)) for _ in range(n_steps)]  # it also compiles outside the
        if graph:  # capture
            capture_graph(lambda stream: chain(fast, got, plan_sets[name])).replay(cupy.cuda.get_current_stream())
        else:
            chain(fast, got, plan_sets[name])
        for i, (x, y) in enumerate(zip(got, want)):
            assert bool(cupy.isfinite(y).all()), f"step {i}: the plain chain went wrong"
            assert bool((x == y).all()), f"step {i} differs with pdl (graph={graph}, plans={name})"
    assert len(pdl_launches) >= 4 * n_steps, "the pdl path was not taken"


def test_repeated_decode_calls_replay(rng, host_if_no_gpu, monkeypatch):
    """flash_attn_decode calls repeated with an equal plan (by its fields, the cache by identity), layer,
    arrays and values replay the first call's launches (cukern.repeat); another window or the plan of
    another cache of the same shapes runs in full, and the first call again replays."""
    bodies = []
    real = AttentionDispatch._prefetch_tiles
    monkeypatch.setattr(AttentionDispatch, "_prefetch_tiles", lambda self, *a: (bodies.append(1), real(self, *a))[1])
    d = AttentionDispatch()
    cache, slots = _make_cache(rng, [10, 3], attn=d)
    twin, twin_slots = _make_cache(rng, [10, 3], attn=d)
    q = cupy.zeros((2, 4, 64), cupy.float32)
    out = cupy.zeros_like(q)
    plan = d.plan_decode(cache, slots, 4)
    for _ in range(3):
        assert d.flash_attn_decode(plan, 0, q, out) is out
    assert len(bodies) == 1
    d.flash_attn_decode(plan, 0, q, out, window_left=4)
    d.flash_attn_decode(d.plan_decode(twin, twin_slots, 4), 0, q, out)
    assert len(bodies) == 3
    d.flash_attn_decode(plan, 0, q, out)
    assert len(bodies) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_repeated_decode_reads_the_grown_cache(rng, pdl):
    """A replayed decode (cukern.repeat) reads the page table and lengths on the device: after the
    sequences grow (new pages, new K/V) the repeated call matches the reference at the new lengths.
    Gemma 3's decode shape (one KV head of 256, four query heads), a sliding window and one without."""
    d = AttentionDispatch(pdl=pdl)
    cache, slots = _make_cache(rng, [50, 7], n_kv_heads=1, head_dim=256, page_size=16, attn=d, extra_pages=20)
    qh, q = _q(rng, (2, 4, 256))
    out = cupy.empty((2, 4, 256), cupy.float32)
    for window in (-1, 20):
        plan = d.plan_decode(cache, slots, 4, max_kv_len=200, window_left=window)
        for _ in range(3):
            poison(out)
            d.flash_attn_decode(plan, 0, q, out, window_left=window)
            kp, vp, pt, lens = _host(cache)
            want, _ = ref.paged_attention(qh, kp, vp, pt, lens, slots, [1, 1], 16, window_left=window)
            assert_close(out, want, **DECODE_TOL)
            for s in slots:
                pos = cache.extend(s, 9)
                kv = cupy.asarray(rng.standard_normal((9, 1, 256)).astype(np.float32))
                d.write_kv_run(cache, 0, kv, kv * 0.5, s, pos)
    assert sum(key[0] == "flash_attn_decode" for key in d._repeats) == 2  # one entry a plan: replays


@pytest.mark.gpu
@pytest.mark.parametrize("kind, d, h, hk", [("float16", 256, 4, 1), ("bfloat16", 128, 8, 2), ("float32", 64, 6, 3)])
def test_decode_partials_merge_to_the_decode(rng, kind, d, h, hk):
    """flash_attn_decode_partials leaves states that merge_states turns into flash_attn_decode's output
    and LSE, sinks added in the merge (a partials plan at 1, 3 and the plan's own split count; a sliding
    window that leaves early splits empty; the SIMT kernel for f32), and that match the reference."""
    d_ = AttentionDispatch(pdl=True)
    cache, slots = _make_cache(rng, [700, 5, 130], n_kv_heads=hk, head_dim=d, page_size=16, kind=kind, attn=d_)
    qh, q = _q(rng, (3, h, d), scale=2.0)
    sinks = cupy.asarray(rng.standard_normal(h).astype(np.float32))
    kp, vp, pt, lens = _host(cache)
    for n_splits in (1, 3, None):
        for window in (-1, 40):
            plan = d_.plan_decode(cache, slots, h, n_splits=n_splits, window_left=window, partials=True)
            o_part, lse_part = d_.flash_attn_decode_partials(plan, 0, q, window_left=window)
            assert o_part is plan.o_part and o_part.shape == (3, plan.n_splits, h, d)
            out, lse = poison(cupy.empty((3, h, d), cupy.float32)), poison(cupy.empty((3, h), cupy.float32))
            d_.merge_states(o_part, lse_part, out, lse=lse, sinks=sinks)
            want_o, want_lse = ref.paged_attention(qh, kp, vp, pt, lens, slots, [1, 1, 1], 16, window_left=window,
                                                   sinks=sinks.get())
            assert_close(out, want_o, **DECODE_TOL, name=f"s={plan.n_splits} window={window}")
            assert_close(lse, want_lse, atol=1e-4, rtol=0, name="lse")
            direct = poison(cupy.empty((3, h, d), cupy.float32))
            d_.flash_attn_decode(plan, 0, q, direct, sinks=sinks, window_left=window)  # a partials plan decodes too
            assert_close(direct, want_o, **DECODE_TOL, name="decode on a partials plan")


def test_decode_partials_rejects(rng, host_if_no_gpu):
    d_ = AttentionDispatch()
    cache, slots = _make_cache(rng, [10], n_kv_heads=2, head_dim=64, attn=d_)
    q = cupy.zeros((1, 4, 64), cupy.float32)
    with pytest.raises(ValueError, match="partials=True"):
        d_.flash_attn_decode_partials(d_.plan_decode(cache, slots, 4), 0, q)
    with pytest.raises(ValueError, match="contradicts"):
        d_.plan_decode(cache, slots, 4, partials=True, overrides=DecodeOverrides(merge_apart=False))
    plan = d_.plan_decode(cache, slots, 4, partials=True)
    assert plan.o_part.shape[:2] == (1, plan.n_splits) and plan.merge_apart == (plan.n_splits > 1)
    with pytest.raises(ValueError, match="shape"):
        d_.flash_attn_decode_partials(plan, 0, cupy.zeros((1, 4, 32), cupy.float32))
    with pytest.raises(ValueError, match="layer"):
        d_.flash_attn_decode_partials(plan, 3, q)


def test_decode_rejects_bad_input(attn, rng, host_if_no_gpu):
    cache, slots = _make_cache(rng, [10], n_kv_heads=2, head_dim=64, attn=attn)
    with pytest.raises(ValueError, match="does not exist"):
        attn.plan_decode(cache, [slots[0] + 1], 4)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        attn.plan_decode(cache, slots, 3)
    plan = attn.plan_decode(cache, slots, 4)
    q = cupy.zeros((1, 4, 64), cupy.float32)
    with pytest.raises(ValueError, match="shape"):
        attn.flash_attn_decode(plan, 0, cupy.zeros((1, 4, 32), cupy.float32), q)
    with pytest.raises(TypeError, match="dtype"):
        attn.flash_attn_decode(plan, 0, q.astype(cupy.float16), q)
    with pytest.raises(ValueError, match="softcap"):
        attn.flash_attn_decode(plan, 0, q, q, softcap=-1.0)


# ----------------------------------------------------------------------------- merge

@pytest.mark.gpu
@pytest.mark.parametrize("n,n_states,h,d", [(1, 1, 1, 32), (3, 5, 4, 128), (2, 17, 3, 96),
                                             (1, 40, 2, 176),    # column blocks of 9, 9, 9, 9, 8 float4s
                                             (1, 600, 1, 512)])  # 16 column blocks, two chunks of weights
@pytest.mark.parametrize("sinks", [False, True])
def test_merge_states(attn, rng, n, n_states, h, d, sinks):
    v = rng.standard_normal((n, n_states, h, d)).astype(np.float32)
    s = (rng.standard_normal((n, n_states, h)) * 3).astype(np.float32)
    s[0, 0, 0] = -np.inf  # an empty state
    sk = rng.standard_normal(h).astype(np.float32) if sinks else None
    out = poison(cupy.empty((n, h, d), cupy.float32))
    lse = poison(cupy.empty((n, h), cupy.float32))
    attn.merge_states(cupy.asarray(v), cupy.asarray(s), out, lse=lse, sinks=None if sk is None else cupy.asarray(sk))
    want_o, want_lse = ref.merge_states(v, s, sk)
    assert_close(out, want_o, atol=1e-5, rtol=1e-5)
    mask = np.isfinite(want_lse)
    assert_close(lse.get()[mask], want_lse[mask], atol=1e-5, rtol=1e-5, name="lse")
    assert np.all(np.isneginf(lse.get()[~mask]))


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


def test_reference_split_merge_equals_whole(rng):
    """The reference's LSE is a natural log: merging the two halves of the keys gives the whole."""
    q = rng.standard_normal((3, 4, 32))
    k = rng.standard_normal((20, 2, 32))
    v = rng.standard_normal((20, 2, 32))
    pos = np.array([19, 19, 19])
    whole, lse = ref.attention(q, k, v, pos, softcap=3.0)
    a = ref.attention(q, k[:7], v[:7], pos, causal=False, softcap=3.0)
    b = ref.attention(q, k[7:], v[7:], pos - 7, causal=False, softcap=3.0)
    merged, mlse = ref.merge_states(np.stack([a[0], b[0]], 1), np.stack([a[1], b[1]], 1))
    np.testing.assert_allclose(merged, whole, atol=1e-12)
    np.testing.assert_allclose(mlse, lse, atol=1e-12)
    # a sink adds exp(sink) to the denominator only
    sinks = np.array([0.5, -1.0, 2.0, 0.0])
    o_s, lse_s = ref.attention(q, k, v, pos, sinks=sinks)
    o, lse0 = ref.attention(q, k, v, pos)
    np.testing.assert_allclose(lse_s, np.logaddexp(lse0, sinks[None]), atol=1e-12)
    np.testing.assert_allclose(o_s, o * np.exp(lse0 - lse_s)[..., None], atol=1e-12)


def test_merge_cols4():
    """merge_states' column blocks: whole heads once the rows fill the SMs, else at least 8 float4s."""
    from cukern.attention.plan import _merge_cols4
    assert _merge_cols4(8, 256, 132) == 8      # B1, 8 heads of 256: 8 column blocks per head, 64 blocks
    assert _merge_cols4(32, 128, 132) == 8     # B1 32 heads of 128: 4 per head
    assert _merge_cols4(256, 128, 132) == 32   # enough rows: one block per row
    assert _merge_cols4(2, 176, 132) == 9      # 44 columns in 5 blocks (the last one of 8)
    assert _merge_cols4(1, 32, 132) == 8       # never narrower than 8


def test_choose_splits_fills_waves_without_needless_partials():
    from cukern.attention.plan import _choose_splits
    row = 2 * 128 * 2  # f16 D128: a K and a V row of one KV head
    assert _choose_splits(8, 8192, row, 4 * 128 * 8, 132) == 33      # B1, 8 KV heads: one full wave of 264 blocks
    assert _choose_splits(256, 4096, row, 4 * 128 * 8, 132) == 1     # B32: 256 blocks already fill the wave
    assert _choose_splits(1, 40, row, 4 * 256 * 8, 132) == 1         # chunks stay >= 32 tokens
    assert 1 < _choose_splits(1, 512, 2 * 256 * 2, 4 * 256 * 8, 132) <= 16  # Gemma 3, short KV: a few splits


@pytest.mark.parametrize("kind, h, hk, d, kv, force, want", [
    ("float16", 32, 8, 128, 8192, None, {"decode_tc<__half, 128, 8>": 1}),             # merged in the last block
    ("float16", 4, 1, 256, 8192, None, {"decode_tc<__half, 256, 4>": 1, "merge_states<float>": 1}),  # Gemma 3: apart
    ("float32", 4, 1, 96, 4096, True, {"decode<float, 96, 4>": 1, "merge_states<float>": 1}),  # SIMT, forced apart
    ("float16", 4, 1, 256, 8192, False, {"decode_tc<__half, 256, 4>": 1}),              # forced into the block
])
def test_decode_merge_place_host(monkeypatch, kind, h, hk, d, kv, force, want):
    """On CPU (tests/host_dispatch.py: host arrays, launches recorded, an H100's 132 SMs): the plan's
    choice of where the split states merge and the launches of a decode call under it (pdl too)."""
    from host_dispatch import patch
    from cukern import dispatch
    launches = patch(monkeypatch)
    monkeypatch.setattr(dispatch, "_pdl_supported", lambda device_id: True)  # as on an H100
    for pdl in (False, True):
        attn = AttentionDispatch(pdl=pdl)
        cache = PagedKVCache(1, kv // 16 + 1, 16, hk, d, max_seqs=1, dtype=kind)
        slot = cache.add(kv)
        plan = attn.plan_decode(cache, [slot], h, overrides=DecodeOverrides(merge_apart=force))
        assert plan.n_splits > 1 and plan.merge_apart == ("merge_states<float>" in want)
        q, out = cupy.empty((1, h, d)), cupy.empty((1, h, d))
        launches.clear()
        attn.flash_attn_decode(plan, 0, q, out, lse=cupy.empty((1, h)), sinks=cupy.zeros(h))
        assert dict(launches) == want


def test_decode_overrides_checked(monkeypatch):
    """On CPU: DecodeOverrides rejects values no plan can take, and plan_decode a warp count the head_dim's
    decode_tc does not have, or anything but a DecodeOverrides."""
    from host_dispatch import patch
    patch(monkeypatch)
    for bad in (dict(warps=6), dict(warps=True), dict(l2_prefetch=-1), dict(l2_ahead=1.5)):
        with pytest.raises(ValueError):
            DecodeOverrides(**bad)
    for bad in (dict(merge_apart=1), dict(evict_first="yes")):
        with pytest.raises(TypeError):
            DecodeOverrides(**bad)
    attn = AttentionDispatch()
    cache = PagedKVCache(1, 64, 16, 1, 256, max_seqs=1)
    slot = cache.add(500)
    assert attn.plan_decode(cache, [slot], 4, overrides=DecodeOverrides(warps=4)).warps == 4
    with pytest.raises(ValueError, match="overrides.warps"):
        attn.plan_decode(cache, [slot], 4, overrides=DecodeOverrides(warps=8))
    with pytest.raises(TypeError, match="DecodeOverrides"):
        attn.plan_decode(cache, [slot], 4, overrides={"warps": 4})
