"""Scaled RoPE (freqs=, attn_scale=, yarn_freqs) and the KV writers' V write, V norm and bf16 caches
(cukern/elementwise/rope.py, kv.py) against their float64 references.

Outputs are poisoned with NaN first (bf16 caches with 0xFFFF, a bf16 NaN). Tolerances: cukern.testing's per
dtype (f32 1e-5 + 1e-5 rel, f16 1e-3 + 2e-3, bf16 1e-2 + 1.6e-2); the YaRN table 1e-7 rel (one f32 rounding).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.elementwise import ElementwiseDispatch  # noqa: E402
from cukern.elementwise.rope import yarn_freqs  # noqa: E402
from cukern.reference import elementwise as ref  # noqa: E402
from cukern.reference.attention import as_float64, to_storage  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402
from elementwise_helpers import _check_cache, _dev, _empty, _paged_setup, _randn, gpu  # noqa: E402

GPT_OSS = dict(base=150000.0, factor=32.0, original_context=4096)  # gpt-oss.rope.* of its GGUF
CACHE_DTYPES = [cupy.float32, cupy.float16, cupy.uint16]  # uint16: bf16 bits


@pytest.fixture(scope="module")
def d():
    return ElementwiseDispatch()


# ------------------------------------------------------------------------------------- YaRN (CPU)

@pytest.mark.parametrize("hd,kw", [(64, GPT_OSS), (128, dict(base=10000.0, factor=4.0, original_context=2048)),
                                   (96, dict(base=1e6, factor=8.0, original_context=32768, beta_fast=16.0)),
                                   (64, dict(GPT_OSS, ext_factor=0.0, attn_factor=0.7)),
                                   (32, dict(GPT_OSS, ext_factor=0.5, attn_factor=1.2)),
                                   (8, dict(base=500.0, factor=2.0, original_context=64))])
def test_yarn_freqs_against_direct_evaluation(hd, kw):
    """The table is the per-pair angle at position 1 of llama.cpp's rope_yarn, rounded once to f32."""
    freqs, scale = yarn_freqs(hd, **kw)
    assert freqs.dtype == np.float32 and freqs.shape == (hd // 2,)
    angles, want_scale = ref.yarn_angles(np.array([1.0, 1000.0]), hd, **kw)
    assert_close(freqs, angles[0], atol=0.0, rtol=1e-7, name="freqs")
    assert_close(freqs.astype(np.float64) * 1000.0, angles[1], atol=0.0, rtol=1e-7, name="freqs * 1000")
    assert abs(scale - want_scale) <= 1e-12 * want_scale


def test_yarn_freqs_gpt_oss_values():
    """gpt-oss (head_dim 64, base 150000, factor 32, original context 4096): correction dims floor(8.09) = 8 and
    ceil(17.4) = 18; pairs up to 8 keep base^(-2j/64), pairs from 18 on are that / 32; mscale 1 + 0.1 ln 32."""
    freqs, scale = yarn_freqs(64, **GPT_OSS)
    plain = 150000.0 ** (-np.arange(32) / 32.0)
    assert_close(freqs[:9], plain[:9], atol=0.0, rtol=1e-7, name="extrapolated pairs")
    assert_close(freqs[18:], plain[18:] / 32.0, atol=0.0, rtol=1e-7, name="interpolated pairs")
    between = freqs[9:18].astype(np.float64)
    assert np.all((between < plain[9:18]) & (between > plain[9:18] / 32.0)), "ramp pairs between the two"
    assert abs(scale - (1.0 + 0.1 * math.log(32.0))) < 1e-12


def test_yarn_freqs_rejects_bad_arguments():
    with pytest.raises(ValueError, match="head_dim must be even"):
        yarn_freqs(63, **GPT_OSS)
    with pytest.raises(ValueError, match="base must be > 1"):
        yarn_freqs(64, base=1.0, factor=32.0, original_context=4096)
    with pytest.raises(ValueError, match="factor"):
        yarn_freqs(64, base=1e4, factor=0.0, original_context=4096)
    with pytest.raises(ValueError, match="original_context must be >= 1"):
        yarn_freqs(64, base=1e4, factor=2.0, original_context=0)
    with pytest.raises(TypeError, match="factor must be a real number"):
        yarn_freqs(64, base=1e4, factor=True, original_context=4096)
    with pytest.raises(ValueError, match="attn_factor must be finite"):
        yarn_freqs(64, **GPT_OSS, attn_factor=float("nan"))


# ----------------------------------------------------------------------- host checks (CPU fakes)

def _recorder(monkeypatch):
    """The host-dispatch fakes, recording (kernel, packed params) of every launch."""
    from host_dispatch import patch

    from cukern import dispatch
    patch(monkeypatch)
    seen = []
    monkeypatch.setattr(dispatch.Dispatch, "_call", staticmethod(
        lambda kernel, fn, grid, block, args, shared_mem, pdl=False: seen.append((kernel, args[-1]))))
    return seen


def test_scaled_rope_and_v_write_host_checks(monkeypatch):
    """attn_scale and the V write's arguments are checked before any launch; accepted calls pick the K + V
    kernels, the bf16 instances (in the elementwise_kv_bf16 unit) and pack attn_scale and v_norm."""
    from host_dispatch import host_array
    seen = _recorder(monkeypatch)
    d = ElementwiseDispatch()
    pt, pos, seq = host_array((1, 4), np.int32, 0), host_array(1, np.int32, 0), host_array(1, np.int32, 0)
    x, w = host_array((3, 2, 128)), host_array(128, np.float32, 1.0)

    def kv(hd=128, n_kv=1, dtype=np.float16):
        return (host_array((3, n_kv, hd)), host_array((3, n_kv, hd)), host_array((4, 16, n_kv, hd), dtype),
                host_array((4, 16, n_kv, hd), dtype))

    k, v, kc, vc = kv()
    cases = [
        (lambda: d.rope(x, pos, host_array((3, 2, 128)), attn_scale=0.0), ValueError, "attn_scale must be > 0"),
        (lambda: d.rope(x, pos, host_array((3, 2, 128)), attn_scale=float("inf")), ValueError, "attn_scale must be"),
        (lambda: d.rms_norm_rope(x, w, pos, host_array((3, 2, 128)), attn_scale="1"), TypeError, "attn_scale"),
        (lambda: d.k_norm_rope_kv_write(k, w, kc, pt, pos, seq, attn_scale=-1.0), ValueError, "attn_scale"),
        (lambda: d.k_norm_rope_kv_write(k, w, kc, pt, pos, seq, v=v), ValueError, "give v and v_cache together"),
        (lambda: d.k_norm_rope_kv_write(k, w, kc, pt, pos, seq, v_cache=vc), ValueError, "together"),
        (lambda: d.k_norm_rope_kv_write(k, w, kc, pt, pos, seq, v_norm=True), ValueError, "need v and v_cache"),
        (lambda: d.k_norm_rope_kv_write(k, w, kc, pt, pos, seq, v=v, v_cache=vc, wv=w), ValueError,
         "pass v_norm=True"),
        (lambda: d.k_norm_rope_kv_write(k, w, kc, pt, pos, seq, v=v, v_cache=vc, v_norm=True, wv=host_array(64)),
         ValueError, "wv must have shape"),
        (lambda: d.k_norm_rope_kv_write(k, w, kc, pt, pos, seq, v=host_array((3, 2, 128)), v_cache=vc), ValueError,
         "v must have shape"),
        (lambda: d.k_norm_rope_kv_write(k, w, kc, pt, pos, seq, v=v, v_cache=host_array(kc.shape, np.float32)),
         ValueError, "same shape and dtype"),
        (lambda: d.k_norm_rope_kv_write(k, w, kc, pt, pos, seq, v=v, v_cache=vc, v_norm=True, eps=-1.0), ValueError,
         "eps must be >= 0"),
        (lambda: d.qk_norm_rope_kv_write(x, k, v, w, w, host_array((3, 2, 128)), kc, vc, pt, pos, seq,
                                         attn_scale=0.0), ValueError, "attn_scale"),
        (lambda: d.kv_write(k, host_array(kc.shape, np.int16), pt, pos, seq), TypeError, "bfloat16 \\(uint16 bits\\)"),
        (lambda: d.qk_norm_rope_kv_write(x, k, None, w, w, host_array((3, 2, 128)), kc, vc, pt, pos, seq), TypeError,
         "v must be a cupy.ndarray"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    assert not seen

    d.rope(x, pos, host_array((3, 2, 128)), attn_scale=1.25, freqs=host_array(64, np.float32, 0.5))
    k, v, kc, vc = kv(dtype=np.uint16)
    d.k_norm_rope_kv_write(k, w, kc, pt, pos, seq, v=v, v_cache=vc, v_norm=True, attn_scale=1.5)
    d.k_norm_rope_kv_write(k, None, kc, pt, pos, seq, v=v, v_cache=vc, v_norm=True, wv=w)
    d.k_norm_rope_kv_write(k, w, kc, pt, pos, seq)
    d.qk_norm_rope_kv_write(x, k, v, w, w, host_array((3, 2, 128), np.uint16), kc, vc, pt, pos, seq)
    d.kv_write(k, kc, pt, pos, seq)
    k, v, kc, vc = kv(hd=96, dtype=np.float32)
    d.k_norm_rope_kv_write(k, None, kc, pt, pos, seq, v=v, v_cache=vc)
    assert [s[0] for s in seen] == [
        "rope_vec<false, 16>", "qk_norm_rope_kv_vec<__nv_bfloat16, false, true, 16>",
        "qk_norm_rope_kv_vec<__nv_bfloat16, false, true, 16>", "k_norm_rope_kv_vec<__nv_bfloat16, 16, 1>",
        "qk_norm_rope_kv_vec<__nv_bfloat16, true, true, 16, __nv_bfloat16>", "kv_write<__nv_bfloat16, true>",
        "qk_norm_rope_kv<float, false, true, 2, 4>"]
    fields = [tuple(float(p[f]) for f in ("attn_scale", "v_norm") if f in p.dtype.names) for _, p in seen]
    assert fields == [(1.25,), (1.5, 1), (1.0, 2), (1.0, 0), (1.0, 0), (), (1.0, 0)]
    assert {ElementwiseDispatch._UNIT_OF[s[0]] for s in seen[1:6]} == {"elementwise_kv_bf16"}


# ------------------------------------------------------------------------------------- GPU: RoPE

def _yarn(rd):
    freqs, scale = yarn_freqs(rd, **GPT_OSS)
    return freqs, scale


@gpu
@pytest.mark.parametrize("case", [(1, 1, 64, 64), (5, 8, 128, 128), (7, 3, 96, 64), (3, 2, 256, 128), (2, 5, 80, 80),
                                  (33, 4, 64, 40)])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16"])
def test_rope_yarn_freqs_attn_scale(d, rng, case, neox, kind):
    """rope and rms_norm_rope with a YaRN table and its mscale (the rotated part scaled, the tail copied)."""
    n_tok, n_heads, hd, rd = case
    freqs, scale = _yarn(rd)
    host = to_storage(_randn(rng, n_tok, n_heads, hd, scale=2), kind)
    x = as_float64(host, kind)
    pos = np.array([int(rng.integers(0, 100000))], np.int32)
    out = poison(cupy.empty(host.shape, host.dtype))
    kw = dict(rope_dim=rd, neox=neox, freqs=_dev(freqs), attn_scale=scale)
    d.rope(_dev(host), _dev(pos), out, **kw)
    want = ref.rope(x, pos, rope_dim=rd, neox=neox, freqs=freqs, attn_scale=scale)
    assert_close(as_float64(out, kind), want, dtype=kind, name=f"rope {kind}")
    w = _randn(rng, hd)
    per_tok = rng.integers(0, 131072, n_tok).astype(np.int32)
    out = poison(cupy.empty(host.shape, host.dtype))
    d.rms_norm_rope(_dev(host), _dev(w), _dev(per_tok), out, pos_mode="per_token", weight_offset=1.0, **kw)
    want = ref.rms_norm_rope(x, w, per_tok, weight_offset=1.0, pos_mode="per_token", rope_dim=rd, neox=neox,
                             freqs=freqs, attn_scale=scale)
    assert_close(as_float64(out, kind), want, dtype=kind, name=f"rms_norm_rope {kind}")


@gpu
def test_rope_yarn_matches_rope_yarn_angles(d, rng):
    """The chain: yarn_freqs' table through the kernel against llama.cpp's per-angle evaluation. Positions below
    64 keep the table's f32 rounding (64 * 2^-24 rad) under 5e-6 of every output."""
    n_tok, n_heads, hd = 64, 4, 64
    freqs, scale = _yarn(hd)
    x = _randn(rng, n_tok, n_heads, hd)
    out = _empty(n_tok, n_heads, hd)
    d.rope(_dev(x), _dev(np.array([0], np.int32)), out, freqs=_dev(freqs), attn_scale=scale)
    ang, mscale = ref.yarn_angles(np.arange(n_tok), hd, **GPT_OSS)
    c, s = mscale * np.cos(ang)[:, None, :], mscale * np.sin(ang)[:, None, :]
    x0, x1 = x[..., :hd // 2].astype(np.float64), x[..., hd // 2:].astype(np.float64)
    want = np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
    assert_close(out, want, atol=2e-5, rtol=1e-5, name="yarn chain")


# ------------------------------------------------------------------------------- GPU: KV writers

def _kv_case(rng, step, n_kv, hd, dtype, capacity=64, n_seqs=3, page_size=16):
    """(page_table, k_cache, v_cache, positions, seq_ids, pos_mode, n_tokens) for a decode step, a batched
    decode of several sequences at distinct slots, or a prefill chunk crossing pages."""
    page_table, k_cache = _paged_setup(rng, n_seqs, capacity, page_size, n_kv, hd, dtype)
    v_cache = poison(cupy.empty_like(k_cache))
    if step == "batched":
        n_tok = 5
        slots = rng.choice(n_seqs * capacity, n_tok, replace=False)
        seq, pos = (slots // capacity).astype(np.int32), (slots % capacity).astype(np.int32)
        return page_table, k_cache, v_cache, pos, seq, "per_token", n_tok
    n_tok = {"decode": 1, "prefill": 37}[step]
    pos = np.array([int(rng.integers(0, capacity - n_tok))], np.int32)
    return page_table, k_cache, v_cache, pos, np.array([2], np.int32), "consecutive", n_tok


@gpu
@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("v_norm", ["copy", "unit", "weighted"])
@pytest.mark.parametrize("hd,rd,n_kv,step", [(128, 128, 2, "prefill"), (64, 64, 8, "decode"), (96, 64, 3, "batched"),
                                             (128, 36, 1, "prefill"), (256, 256, 1, "batched")])
def test_k_norm_rope_kv_write_with_v(d, rng, dtype, v_norm, hd, rd, n_kv, step):
    """K + V in one launch (vectorised: head_dim 64..256 with rope_dim % 8 == 0; scalar otherwise), with the
    V row copied or RMS-normed, a YaRN table and its mscale, into f32, f16 and bf16 caches."""
    page_table, k_cache, v_cache, pos, seq, mode, n_tok = _kv_case(rng, step, n_kv, hd, dtype)
    k, v = _randn(rng, n_tok, n_kv, hd, scale=2), _randn(rng, n_tok, n_kv, hd, scale=3)
    wk, wv = _randn(rng, hd), _randn(rng, hd)
    freqs, scale = _yarn(rd)
    norm_kw = {"copy": {}, "unit": dict(v_norm=True), "weighted": dict(v_norm=True, wv=_dev(wv))}[v_norm]
    kw = dict(eps=1e-6, weight_offset=0.5, rope_dim=rd, neox=hd != 96, pos_mode=mode)
    d.k_norm_rope_kv_write(_dev(k), _dev(wk), k_cache, _dev(page_table), _dev(pos), _dev(seq), v=_dev(v),
                           v_cache=v_cache, freqs=_dev(freqs), attn_scale=scale, **norm_kw, **kw)
    _, want_k, want_v = ref.qkv_rope_kv_write(
        k, np.full(k_cache.shape, np.nan), np.full(v_cache.shape, np.nan), page_table, pos, seq, v=v, wk=wk,
        v_norm=v_norm != "copy", wv=wv if v_norm == "weighted" else None, freqs=freqs, attn_scale=scale, **kw)
    _check_cache(k_cache, want_k, dtype, "k_cache")
    _check_cache(v_cache, want_v, dtype, f"v_cache ({v_norm})")


@gpu
@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("hd,rd,step", [(64, 64, "prefill"), (128, 64, "batched"), (96, 96, "decode")])
@pytest.mark.parametrize("v_norm", [False, True])
def test_qk_norm_rope_kv_write_yarn(d, rng, dtype, hd, rd, step, v_norm):
    """Q, K and V with a YaRN table: attn_scale on Q and K alike; q_out f32; caches of every dtype."""
    n_q, n_kv = 8, 2
    page_table, k_cache, v_cache, pos, seq, mode, n_tok = _kv_case(rng, step, n_kv, hd, dtype)
    q, k, v = (_randn(rng, n_tok, n, hd, scale=2) for n in (n_q, n_kv, n_kv))
    wq, wk = _randn(rng, hd), _randn(rng, hd)
    freqs, scale = _yarn(rd)
    q_out = _empty(n_tok, n_q, hd)
    kw = dict(eps=1e-6, rope_dim=rd, neox=True, pos_mode=mode)
    d.qk_norm_rope_kv_write(_dev(q), _dev(k), _dev(v), _dev(wq), _dev(wk), q_out, k_cache, v_cache,
                            _dev(page_table), _dev(pos), _dev(seq), freqs=_dev(freqs), attn_scale=scale,
                            v_norm=v_norm, **kw)
    want_q, want_k, want_v = ref.qkv_rope_kv_write(
        k, np.full(k_cache.shape, np.nan), np.full(v_cache.shape, np.nan), page_table, pos, seq, q=q, v=v, wq=wq,
        wk=wk, v_norm=v_norm, freqs=freqs, attn_scale=scale, **kw)
    assert_close(q_out, want_q, name="q_out")
    _check_cache(k_cache, want_k, dtype, "k_cache")
    _check_cache(v_cache, want_v, dtype, "v_cache")


@gpu
@pytest.mark.parametrize("hd,n_q,n_kv,n_tok", [(128, 8, 2, 13), (64, 6, 3, 1), (256, 4, 1, 37)])
def test_qk_norm_rope_kv_write_bf16_q_out(d, rng, hd, n_q, n_kv, n_tok):
    """q_out in the bf16 cache's dtype (rounded once), as the f16 one."""
    page_table, k_cache, v_cache, pos, seq, mode, _ = _kv_case(rng, "decode", n_kv, hd, cupy.uint16,
                                                               capacity=n_tok + 20)
    pos = np.array([int(rng.integers(0, 20))], np.int32)
    q, k, v = (_randn(rng, n_tok, n, hd, scale=2) for n in (n_q, n_kv, n_kv))
    wq, wk = _randn(rng, hd), _randn(rng, hd)
    q_out = poison(cupy.empty((n_tok, n_q, hd), cupy.uint16))
    kw = dict(eps=1e-6, freq_base=1e6, attn_scale=0.8)
    d.qk_norm_rope_kv_write(_dev(q), _dev(k), _dev(v), _dev(wq), _dev(wk), q_out, k_cache, v_cache,
                            _dev(page_table), _dev(pos), _dev(seq), **kw)
    want_q, want_k, want_v = ref.qkv_rope_kv_write(
        k, np.full(k_cache.shape, np.nan), np.full(v_cache.shape, np.nan), page_table, pos, seq, q=q, v=v, wq=wq,
        wk=wk, **kw)
    assert_close(as_float64(q_out, "bfloat16"), want_q, dtype="bfloat16", name="bf16 q_out")
    _check_cache(k_cache, want_k, cupy.uint16, "k_cache")
    _check_cache(v_cache, want_v, cupy.uint16, "v_cache")


@gpu
@pytest.mark.parametrize("hd,n_kv,mode", [(128, 8, "consecutive"), (64, 3, "per_token")])
def test_k_norm_rope_kv_write_many_rows_scaled(d, rng, hd, n_kv, mode):
    """The multi-row K-only kernel (>= 4096 head rows: 2 rows a thread) with a YaRN table, bf16 cache."""
    n_tok, page_size, n_seqs = 4800 // n_kv + 7, 16, 2
    capacity = n_tok + 5
    page_table, k_cache = _paged_setup(rng, n_seqs, capacity, page_size, n_kv, hd, cupy.uint16)
    k, wk = _randn(rng, n_tok, n_kv, hd, scale=2), _randn(rng, hd)
    if mode == "per_token":
        slots = rng.choice(n_seqs * capacity, n_tok, replace=False)
        seq, pos = (slots // capacity).astype(np.int32), (slots % capacity).astype(np.int32)
    else:
        pos, seq = np.array([3], np.int32), np.array([1], np.int32)
    freqs, scale = _yarn(hd)
    kw = dict(eps=1e-6, neox=n_kv != 3, pos_mode=mode)
    d.k_norm_rope_kv_write(_dev(k), _dev(wk), k_cache, _dev(page_table), _dev(pos), _dev(seq), freqs=_dev(freqs),
                           attn_scale=scale, **kw)
    _, want, _ = ref.qkv_rope_kv_write(k, np.full(k_cache.shape, np.nan), None, page_table, pos, seq, wk=wk,
                                       freqs=freqs, attn_scale=scale, **kw)
    _check_cache(k_cache, want, cupy.uint16, "k_cache (K only, bf16)")
