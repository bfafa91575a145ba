"""Attention family (cukern/attention/): host mirrors of kernel shapes, the page allocator, the
cache and its writes, and the host side of plans and merges (split choice, merge placement,
decode overrides) against cukern/reference/attention.py.

Tolerances: attention_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.attention import AttentionDispatch, DecodeOverrides, PageAllocator, PagedKVCache  # noqa: E402
from cukern.reference import attention as ref  # noqa: E402
from attention_helpers import _host, _make_cache, _store  # noqa: E402


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


# ----------------------------------------------------------------------------- varlen

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
