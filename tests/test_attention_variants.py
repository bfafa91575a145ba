"""Attention variants the source engines pass (cukern/attention/): sinks from one buffer of every layer at a
``sink_offset`` with NaN for "no sink", top-left (``upper_left``) causal alignment beside FlashAttention's
bottom-right, decode over head-major contiguous K/V, and varlen in float32 and at head_dim 512 (the SIMT
kernel over packed rows); against cukern/reference/attention.py.

The CPU tests run the real dispatch over host arrays (tests/host_dispatch.py): checks before any launch, and
the kernels and params fields a call launches. Tolerances: attention_helpers.py (SIMT: DECODE_TOL, its LSE
1e-4; tensor cores: TC_TOL, LSE_TOL; a 16-bit out of the SIMT kernel is rounded once: TC_TOL).
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.attention import AttentionDispatch, DecodeOverrides  # noqa: E402
from cukern.reference import attention as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402
from attention_helpers import DECODE_TOL, LSE_TOL, TC_TOL, _host, _make_cache, _q, _store  # noqa: E402


def _sinks(rng, h: int, offset: int, nan_heads=(1,)):
    """A sink buffer of several layers ([offset + h + 3] f32, every entry real but the layer's NaN heads) and the
    layer's slice [h] that the reference takes."""
    buf = (rng.standard_normal(offset + h + 3) * 2).astype(np.float32)
    for i in nan_heads:
        buf[offset + i % h] = np.nan
    return buf, buf[offset:offset + h].copy()


def _check_lse(got, want, atol):
    """Finite entries within atol; -inf (a row that sees no key and has no sink) exactly -inf."""
    got = got.get() if hasattr(got, "get") else np.asarray(got)
    fin = np.isfinite(want)
    assert_close(got[fin], want[fin], atol=atol, rtol=0, name="lse")
    assert np.all(np.isneginf(got[~fin])), got[~fin]


def _cu(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


# ----------------------------------------------------------------------------- sinks (GPU)

# (kind, head_dim, n_heads, n_kv_heads, page_size, lengths): decode_tc (f16 / bf16), SIMT (f32, head_dim 512)
SINK_DECODE_CASES = [
    ("float16", 128, 8, 2, 16, [1, 17, 300]),
    ("bfloat16", 64, 4, 4, 1, [1, 129]),
    ("float32", 96, 6, 2, 7, [13, 50]),
    ("float16", 512, 4, 1, 16, [3, 90]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SINK_DECODE_CASES, ids=lambda c: f"{c[0]}-d{c[1]}-h{c[2]}/{c[3]}")
@pytest.mark.parametrize("split", ["unsplit", "split7", "split7_apart"])
def test_decode_sinks_offset_and_nan(attn, rng, case, split):
    kind, d, h, hk, ps, lengths = case
    cache, slots = _make_cache(rng, lengths, n_kv_heads=hk, head_dim=d, page_size=ps, kind=kind, attn=attn)
    buf, want_sinks = _sinks(rng, h, 2 * h + 1, nan_heads=(0, h - 1))
    n_splits = 1 if split == "unsplit" else 7
    ov = DecodeOverrides(merge_apart=True) if split == "split7_apart" else None
    plan = attn.plan_decode(cache, slots, h, n_splits=n_splits, overrides=ov)
    qh, q = _q(rng, (len(slots), h, d), scale=2.0)
    out = poison(cupy.empty((len(slots), h, d), cupy.float32))
    lse = poison(cupy.empty((len(slots), h), cupy.float32))
    attn.flash_attn_decode(plan, 0, q, out, lse=lse, sinks=cupy.asarray(buf), sink_offset=2 * h + 1, window_left=40)
    kp, vp, pt, lens = _host(cache)
    want_o, want_lse = ref.paged_attention(qh, kp, vp, pt, lens, slots, [1] * len(slots), ps, window_left=40,
                                           sinks=want_sinks)
    assert_close(out, want_o, **DECODE_TOL)
    _check_lse(lse, want_lse, 1e-4)


@pytest.mark.gpu
def test_decode_partials_merge_with_sink_offset(attn, rng):
    """The split pass alone, merged by merge_states with the sinks at an offset (NaN heads), equals the decode."""
    cache, slots = _make_cache(rng, [200, 31], n_kv_heads=2, head_dim=128, page_size=16, attn=attn)
    h = 8
    buf, want_sinks = _sinks(rng, h, h, nan_heads=(2, 5))
    plan = attn.plan_decode(cache, slots, h, n_splits=5, partials=True)
    qh, q = _q(rng, (2, h, 128))
    o_part, lse_part = attn.flash_attn_decode_partials(plan, 0, q)
    out = poison(cupy.empty((2, h, 128), cupy.float32))
    lse = poison(cupy.empty((2, h), cupy.float32))
    attn.merge_states(o_part, lse_part, out, lse=lse, sinks=cupy.asarray(buf), sink_offset=h)
    kp, vp, pt, lens = _host(cache)
    want_o, want_lse = ref.paged_attention(qh, kp, vp, pt, lens, slots, [1, 1], 16, sinks=want_sinks)
    assert_close(out, want_o, **DECODE_TOL)
    _check_lse(lse, want_lse, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("sinks", ["mixed", "all_nan"])
def test_merge_states_sink_offset_and_nan(attn, rng, sinks):
    n, ns, h, d = 3, 6, 4, 64
    v = rng.standard_normal((n, ns, h, d)).astype(np.float32)
    s = (rng.standard_normal((n, ns, h)) * 3).astype(np.float32)
    s[1, :, 2] = -np.inf  # a row of empty states: with a NaN sink, O = 0 and LSE -inf
    buf, want_sinks = _sinks(rng, h, 5, nan_heads=(2, 3) if sinks == "mixed" else range(h))
    out = poison(cupy.empty((n, h, d), cupy.float32))
    lse = poison(cupy.empty((n, h), cupy.float32))
    attn.merge_states(cupy.asarray(v), cupy.asarray(s), out, lse=lse, sinks=cupy.asarray(buf), sink_offset=5)
    want_o, want_lse = ref.merge_states(v, s, want_sinks)
    assert_close(out, want_o, atol=1e-5, rtol=1e-5)
    _check_lse(lse, want_lse, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,d,wgmma", [("float16", 128, None), ("float16", 128, False), ("bfloat16", 96, None)])
def test_batched_prefill_sinks_offset_and_nan(attn, rng, kind, d, wgmma):
    h, hk, ps, lengths, q_lens = 4, 2, 16, [150, 33], [150, 9]
    cache, slots = _make_cache(rng, lengths, n_kv_heads=hk, head_dim=d, page_size=ps, kind=kind, attn=attn)
    buf, want_sinks = _sinks(rng, h, 3 * h, nan_heads=(1,))
    qf = rng.standard_normal((sum(q_lens), h, d)).astype(np.float32)
    q = _store(qf, kind)
    plan = attn.plan_batched(cache, slots, q_lens)
    out = poison(cupy.empty(q.shape, q.dtype))
    lse = poison(cupy.empty((sum(q_lens), h), cupy.float32))
    attn.flash_attn_batched(plan, 0, q, out, lse=lse, sinks=cupy.asarray(buf), sink_offset=3 * h, wgmma=wgmma)
    kp, vp, pt, lens = _host(cache)
    want_o, want_lse = ref.paged_attention(ref.as_float64(q, kind), kp, vp, pt, lens, slots, q_lens, ps,
                                           sinks=want_sinks)
    assert_close(ref.as_float64(out, kind), want_o, **TC_TOL[kind])
    _check_lse(lse, want_lse, LSE_TOL[kind])


# ----------------------------------------------------------------------------- varlen: causal alignment, f32, 512

# (q_lens, k_lens): fewer queries than keys, more queries than keys (bottom-right rows that see no key), a
# sequence without keys
LEN_CASES = {
    "q<k": ([5, 70, 1, 3], [12, 130, 1, 40]),
    "q>k": ([20, 70, 9], [7, 65, 1]),
    "empty_k": ([4, 6], [0, 11]),
}


def _varlen_inputs(rng, kind, lens, h, hk, d):
    q_lens, k_lens = lens
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    q = _store(rng.standard_normal((cu_q[-1], h, d)).astype(np.float32), kind)
    k = _store(rng.standard_normal((max(cu_k[-1], 1), hk, d)).astype(np.float32), kind)
    v = _store(rng.standard_normal((max(cu_k[-1], 1), hk, d)).astype(np.float32), kind)
    return q, k, v, cu_q, cu_k


def _run_varlen(attn, rng, kind, d, h, hk, lens, variant, tol, lse_tol, **kw):
    q, k, v, cu_q, cu_k = _varlen_inputs(rng, kind, lens, h, hk, d)
    sk = {}
    if "sinks" in kw:
        buf, want = _sinks(rng, h, h, nan_heads=(0,))
        kw.pop("sinks")
        sk = dict(sinks=want)
        kw.update(sinks=cupy.asarray(buf), sink_offset=h)
    out = poison(cupy.empty(q.shape, q.dtype))
    lse = poison(cupy.empty((int(cu_q[-1]), h), cupy.float32))
    attn.flash_attn_varlen(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), out, max_seqlen_q=max(lens[0]),
                           causal=variant is not None, causal_variant=variant or "lower_right", lse=lse, **kw)
    ref_kw = {n: x for n, x in kw.items() if n in ("window_left", "softcap", "scale")}
    want_o, want_lse = ref.varlen(ref.as_float64(q, kind), ref.as_float64(k, kind), ref.as_float64(v, kind), cu_q,
                                  cu_k, causal=variant is not None, causal_variant=variant or "lower_right",
                                  **ref_kw, **sk)
    got = ref.as_float64(out, kind)
    assert_close(got, want_o, **tol)
    _check_lse(lse, want_lse, lse_tol)
    no_key = np.isneginf(want_lse)  # rows that see no key (and no sink): exactly zero
    assert np.all(got[no_key] == 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("lens", list(LEN_CASES), ids=str)
@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
@pytest.mark.parametrize("d,h,hk,wgmma", [(128, 4, 2, None), (128, 4, 2, False), (64, 3, 1, None)])
def test_varlen_causal_alignment_tensor_cores(attn, rng, kind, lens, variant, d, h, hk, wgmma):
    _run_varlen(attn, rng, kind, d, h, hk, LEN_CASES[lens], variant, TC_TOL[kind], LSE_TOL[kind], wgmma=wgmma)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_varlen_upper_left_window_and_sinks_tensor_cores(attn, rng, kind):
    _run_varlen(attn, rng, kind, 128, 4, 2, LEN_CASES["q>k"], "upper_left", TC_TOL[kind], LSE_TOL[kind],
                window_left=6, sinks=True)


@pytest.mark.gpu
@pytest.mark.parametrize("d,h,hk", [(64, 4, 2), (96, 3, 1), (512, 2, 1)])
@pytest.mark.parametrize("lens", list(LEN_CASES), ids=str)
@pytest.mark.parametrize("variant", ["upper_left", "lower_right", None])
def test_varlen_f32(attn, rng, d, h, hk, lens, variant):
    """float32 varlen on the SIMT kernel: f32 accuracy (DECODE_TOL), GQA, ragged, both alignments and none."""
    _run_varlen(attn, rng, "float32", d, h, hk, LEN_CASES[lens], variant, DECODE_TOL, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["window+sinks", "softcap"])
def test_varlen_f32_window_sinks_softcap(attn, rng, variant):
    kw = dict(window_left=5, sinks=True) if variant == "window+sinks" else dict(softcap=3.0, scale=0.4)
    _run_varlen(attn, rng, "float32", 128, 8, 2, LEN_CASES["q<k"], "lower_right", DECODE_TOL, 1e-4, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
def test_varlen_head_dim_512(attn, rng, kind, variant):
    """head_dim 512 in 16 bits on the SIMT kernel (q16 unit): f32 arithmetic, O rounded once (TC_TOL)."""
    _run_varlen(attn, rng, kind, 512, 4, 2, LEN_CASES["q>k"], variant, TC_TOL[kind], 1e-4, sinks=True)


@pytest.mark.gpu
def test_flash_api_varlen_func_upper_left(rng):
    from cukern.attention import flash_attn_varlen_func
    q, k, v, cu_q, cu_k = _varlen_inputs(rng, "float32", LEN_CASES["q<k"], 4, 2, 64)
    out, lse = flash_attn_varlen_func(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), 70, 130, causal=True,
                                      causal_variant="upper_left", return_lse=True)
    want_o, want_lse = ref.varlen(q.get(), k.get(), v.get(), cu_q, cu_k, causal=True, causal_variant="upper_left")
    assert_close(out, want_o, **DECODE_TOL)
    _check_lse(lse.T, want_lse, 1e-4)


@pytest.mark.gpu
def test_batched_simt_upper_left(attn, rng):
    """float32 queries against the paged cache (the SIMT batched path) with top-left alignment."""
    cache, slots = _make_cache(rng, [40, 9], n_kv_heads=1, head_dim=64, page_size=16, attn=attn)
    q_lens = [7, 9]
    qh, q = _q(rng, (16, 4, 64))
    plan = attn.plan_batched(cache, slots, q_lens)
    out = poison(cupy.empty((16, 4, 64), cupy.float32))
    lse = poison(cupy.empty((16, 4), cupy.float32))
    attn.flash_attn_batched(plan, 0, q, out, causal_variant="upper_left", lse=lse)
    kp, vp, pt, lens = _host(cache)
    outs, lses, r = [], [], 0
    for s, n in zip(slots, q_lens):
        kk, vv = ref.gather(kp, pt[s], int(lens[s]), 16), ref.gather(vp, pt[s], int(lens[s]), 16)
        o, ls = ref.attention(qh[r:r + n], kk, vv, np.arange(n))
        outs.append(o)
        lses.append(ls)
        r += n
    assert_close(out, np.concatenate(outs), **DECODE_TOL)
    _check_lse(lse, np.concatenate(lses), 1e-4)


# ----------------------------------------------------------------------------- contiguous head-major decode

# (kind, head_dim, n_heads, n_kv_heads, capacity, lengths): decode_tc, SIMT (f32; head_dim 512)
CONTIG_CASES = [
    ("float16", 128, 8, 2, 300, [300, 1, 37]),
    ("bfloat16", 256, 8, 1, 129, [100]),
    ("float32", 96, 6, 2, 77, [5, 77]),
    ("float16", 512, 4, 1, 64, [64, 3]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CONTIG_CASES, ids=lambda c: f"{c[0]}-d{c[1]}-h{c[2]}/{c[3]}-cap{c[4]}")
@pytest.mark.parametrize("variant", ["plain", "window+sinks", "softcap+split7", "split7_apart", "q_in_kv_dtype"])
def test_decode_contiguous(attn, rng, case, variant):
    kind, d, h, hk, cap, lengths = case
    b = len(lengths)
    kf = rng.standard_normal((b, hk, cap, d)).astype(np.float32)
    vf = rng.standard_normal((b, hk, cap, d)).astype(np.float32)
    k, v = _store(kf, kind), _store(vf, kind)
    kw, n_splits, ov, q_kind, ref_kw = {}, None, None, "float32", {}
    if variant == "window+sinks":
        buf, want = _sinks(rng, h, h + 2, nan_heads=(1,))
        kw = dict(window_left=9, sinks=cupy.asarray(buf), sink_offset=h + 2)
        ref_kw = dict(window_left=9, sinks=want)
    elif variant == "softcap+split7":
        kw, n_splits, ref_kw = dict(softcap=5.0, scale=0.3), 7, dict(softcap=5.0, scale=0.3)
    elif variant == "split7_apart":
        n_splits, ov = 7, DecodeOverrides(merge_apart=True)
    elif variant == "q_in_kv_dtype" and kind != "float32":
        q_kind = kind
    qf = (rng.standard_normal((b, h, d)) * 2).astype(np.float32)
    q = _store(qf, q_kind)
    plan = attn.plan_decode_contiguous(b, h, hk, d, cap, kind, n_splits=n_splits, overrides=ov,
                                       window_left=kw.get("window_left", -1))
    one = b == 1  # a batch of one as [n_kv_heads, capacity, D] K/V and [n_heads, D] q
    args = (q[0], k[0], v[0]) if one else (q, k, v)
    out = poison(cupy.empty(args[0].shape, q.dtype))
    lse = poison(cupy.empty(args[0].shape[:-1], cupy.float32))
    attn.flash_attn_decode_contiguous(plan, *args, cupy.asarray(np.array(lengths, np.int32)), out, lse=lse, **kw)
    want_o, want_lse = ref.decode_contiguous(ref.as_float64(q, q_kind), ref.as_float64(k, kind),
                                             ref.as_float64(v, kind), lengths, **ref_kw)
    got = ref.as_float64(out, q_kind).reshape(want_o.shape)
    assert_close(got, want_o, **(DECODE_TOL if q_kind == "float32" else TC_TOL[q_kind]))
    _check_lse(lse.reshape(want_lse.shape), want_lse, 1e-4)


# ----------------------------------------------------------------------------- CPU: checks and launches

def _capture(monkeypatch):
    """Host dispatch with every launch's (kernel, grid, args) kept (args[-1]: the packed params)."""
    from host_dispatch import patch
    from cukern import dispatch
    patch(monkeypatch, array_methods=True)
    calls = []
    monkeypatch.setattr(dispatch.Dispatch, "_call", staticmethod(
        lambda kernel, fn, grid, block, args, shared_mem, pdl=False: calls.append((kernel, grid, args))))
    return calls


def test_sink_and_causal_arguments_checked(rng, host_if_no_gpu):
    attn = AttentionDispatch()
    q = cupy.zeros((10, 4, 64), cupy.float16)
    k = cupy.zeros((10, 2, 64), cupy.float16)
    cu = cupy.asarray(np.array([0, 10], np.int32))
    s8 = cupy.zeros(8, cupy.float32)
    call = dict(max_seqlen_q=10, causal=True)
    for bad, exc, match in [
        (dict(sinks=s8, sink_offset=5), ValueError, "sink_offset 5 need 9"),
        (dict(sinks=s8, sink_offset=-1), ValueError, "sink_offset"),
        (dict(sink_offset=2), ValueError, "without sinks"),
        (dict(sinks=cupy.zeros((2, 4), cupy.float32)), ValueError, "dimensions"),
        (dict(sinks=cupy.zeros(8, cupy.float16)), TypeError, "sinks"),
        (dict(causal_variant="diagonal"), ValueError, "causal_variant"),
        (dict(causal=1), TypeError, "causal must be a bool"),
    ]:
        with pytest.raises(exc, match=match):
            attn.flash_attn_varlen(q, k, k, cu, cu, q.copy(), **(call | bad))
    v = cupy.zeros((1, 2, 4, 64), cupy.float32)
    s = cupy.zeros((1, 2, 4), cupy.float32)
    with pytest.raises(ValueError, match="sink_offset"):
        attn.merge_states(v, s, cupy.zeros((1, 4, 64), cupy.float32), sinks=cupy.zeros(6, cupy.float32),
                          sink_offset=3)
    cache, slots = _make_cache(rng, [10], n_kv_heads=2, head_dim=64, attn=attn)
    plan = attn.plan_decode(cache, slots, 4)
    qd = cupy.zeros((1, 4, 64), cupy.float32)
    with pytest.raises(ValueError, match="sink_offset"):
        attn.flash_attn_decode(plan, 0, qd, qd.copy(), sinks=s8, sink_offset=6)


def test_sinks_and_alignment_reach_the_params(monkeypatch):
    """sink_offset and the causal variant are packed into every kernel that takes them."""
    from cukern.attention import PagedKVCache
    calls = _capture(monkeypatch)
    attn = AttentionDispatch()
    cache = PagedKVCache(1, 8, 16, 2, 128, max_seqs=2, dtype="float16")
    slot = cache.add(40)
    sinks = cupy.zeros(20, cupy.float32)
    plan = attn.plan_batched(cache, [slot], [40])
    q = cupy.zeros((40, 4, 128), cupy.float16)
    attn.flash_attn_batched(plan, 0, q, q.copy(), causal_variant="upper_left", sinks=sinks, sink_offset=12,
                            wgmma=False)
    dplan = attn.plan_decode(cache, [slot], 4, n_splits=3, overrides=DecodeOverrides(merge_apart=True))
    qd = cupy.zeros((1, 4, 128), cupy.float32)
    attn.flash_attn_decode(dplan, 0, qd, qd.copy(), sinks=sinks, sink_offset=16)
    (k1, _, a1), (k2, _, a2), (k3, _, a3) = calls
    assert k1 == "prefill<__half, 128, false>".replace("false", "true")
    assert (a1[-1]["causal"], a1[-1]["has_sinks"], a1[-1]["sink_offset"]) == (2, 1, 12)
    assert k2.startswith("decode_tc<__half, 128") and k3 == "merge_states<float>"
    assert (a2[-1]["sink_offset"], a2[-1]["row_stride"], a2[-1]["head_stride"]) == (16, 256, 128)
    assert (a3[-1]["has_sinks"], a3[-1]["sink_offset"]) == (1, 16)
    calls.clear()
    attn.flash_attn_batched(plan, 0, q, q.copy(), causal=False, wgmma=False)
    assert calls[0][2][-1]["causal"] == 0 and calls[0][2][-1]["has_sinks"] == 0


@pytest.mark.parametrize("kind,d,want", [("float32", 64, "decode<float, 64, 4>"),
                                         ("float32", 512, "decode<float, 512, 4>"),
                                         ("float16", 512, "decode<__half, 512, 4, __half>"),
                                         ("bfloat16", 512, "decode<__nv_bfloat16, 512, 4, __nv_bfloat16>"),
                                         ("float16", 128, "prefill<__half, 128, false>")])
def test_varlen_routes_f32_and_512_to_the_simt_kernel(monkeypatch, kind, d, want):
    calls = _capture(monkeypatch)
    attn = AttentionDispatch()
    dt = np.uint16 if kind == "bfloat16" else kind
    q = cupy.zeros((9, 8, d), dt)
    k = cupy.zeros((12, 2, d), dt)
    cu_q = cupy.asarray(np.array([0, 4, 9], np.int32))
    cu_k = cupy.asarray(np.array([0, 2, 12], np.int32))
    attn.flash_attn_varlen(q, k, k.copy(), cu_q, cu_k, q.copy(), max_seqlen_q=5, causal=True,
                           causal_variant="upper_left", wgmma=False)
    (kernel, grid, args), = calls
    assert kernel == want
    if kernel.startswith("decode"):
        p = args[-1]
        assert grid == (1, 2, 9)  # (splits, KV heads x head blocks of 4, query rows)
        assert (p["kv_rows"], p["batched"], p["causal"], p["n_seqs"]) == (1, 1, 2, 2)
        assert (p["row_stride"], p["head_stride"], p["n_splits"]) == (2 * d, d, 1)
        assert args[8].data.ptr == cu_k.data.ptr and args[9].data.ptr == cu_k.data.ptr + 4  # starts, ends
        assert args[11].data.ptr == cu_q.data.ptr


def test_varlen_simt_limits(host_if_no_gpu):
    attn = AttentionDispatch()
    q = cupy.zeros((65536, 1, 64), cupy.float32)
    cu = cupy.asarray(np.array([0, 65536], np.int32))
    with pytest.raises(ValueError, match="65535 query rows"):
        attn.flash_attn_varlen(q, q, q, cu, cu, q.copy(), max_seqlen_q=65536)
    q = cupy.zeros((4, 1, 64), cupy.float32)
    cu = cupy.asarray(np.array([0, 4], np.int32))
    with pytest.raises(ValueError, match="SIMT"):
        attn.flash_attn_varlen(q, q, q, cu, cu, q.copy(), max_seqlen_q=4, wgmma=True)
    q = cupy.zeros((4, 1, 48), cupy.float16)
    with pytest.raises(ValueError, match="head_dim"):
        attn.flash_attn_varlen(q, q, q, cu, cu, q.copy(), max_seqlen_q=4)


def test_decode_contiguous_launch(monkeypatch):
    """The head-major K/V are read in place as pages of capacity rows: page ids b * n_kv_heads, row stride D,
    head stride capacity * D; one sequence may be passed without its batch axis."""
    from host_dispatch import host_view
    calls = _capture(monkeypatch)
    attn = AttentionDispatch()
    plan = attn.plan_decode_contiguous(3, 8, 2, 128, 300, "float16", n_splits=1)
    assert host_view(plan.cache.page_table).ravel().tolist() == [0, 2, 4]
    k = cupy.zeros((3, 2, 300, 128), cupy.float16)
    q = cupy.zeros((3, 8, 128), cupy.float32)
    lengths = cupy.asarray(np.array([1, 300, 37], np.int32))
    attn.flash_attn_decode_contiguous(plan, q, k, k.copy(), lengths, q.copy())
    (kernel, grid, args), = calls
    p = args[-1]
    assert kernel.startswith("decode_tc<__half, 128") and grid[1:] == (2, 3)
    assert (p["row_stride"], p["head_stride"], p["page_size"], p["max_pages"]) == (128, 300 * 128, 300, 1)
    assert args[6].data.ptr == k.data.ptr and args[9].data.ptr == lengths.data.ptr
    calls.clear()
    one = attn.plan_decode_contiguous(1, 4, 1, 512, 64, "float32")
    k1 = cupy.zeros((1, 64, 512), cupy.float32)
    q1 = cupy.zeros((4, 512), cupy.float32)
    out = attn.flash_attn_decode_contiguous(one, q1, k1, k1.copy(), cupy.asarray(np.array([64], np.int32)),
                                            lse=cupy.zeros(4, cupy.float32))
    assert out.shape == (4, 512) and calls[0][0].startswith("decode<float, 512")
    assert (calls[0][2][-1]["row_stride"], calls[0][2][-1]["head_stride"]) == (512, 64 * 512)


def test_decode_contiguous_rejects_before_launch(rng, host_if_no_gpu):
    attn = AttentionDispatch()
    with pytest.raises(ValueError, match="head_dim"):
        attn.plan_decode_contiguous(1, 4, 1, 100, 64)
    with pytest.raises(ValueError, match="32 bits"):
        attn.plan_decode_contiguous(64, 4, 8, 128, 2**23)
    with pytest.raises(ValueError, match="max_kv_len"):
        attn.plan_decode_contiguous(1, 4, 1, 128, 64, max_kv_len=65)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        attn.plan_decode_contiguous(1, 3, 2, 128, 64)
    plan = attn.plan_decode_contiguous(2, 4, 2, 64, 32, "bfloat16")
    k = cupy.zeros((2, 2, 32, 64), cupy.uint16)
    q = cupy.zeros((2, 4, 64), cupy.float32)
    lens = cupy.asarray(np.array([3, 32], np.int32))
    for args, exc, match in [
        ((q, k[:, :, :16].copy(), k, lens), ValueError, "k must have shape"),
        ((q, k, k.astype(cupy.float16), lens), TypeError, "v must be"),
        ((q, k, k, lens.astype(cupy.int64)), TypeError, "lengths"),
        ((q, k, k, cupy.asarray(np.array([3], np.int32))), ValueError, "lengths"),
        ((q[0], k, k, lens), ValueError, "q must have shape"),
        ((q.astype(cupy.float16), k, k, lens), TypeError, "q must be"),
    ]:
        with pytest.raises(exc, match=match):
            attn.flash_attn_decode_contiguous(plan, *args)
    cache, slots = _make_cache(rng, [10], n_kv_heads=2, head_dim=64, attn=attn)
    with pytest.raises(TypeError, match="plan_decode_contiguous"):
        attn.flash_attn_decode_contiguous(attn.plan_decode(cache, slots, 4), q, k, k, lens)
