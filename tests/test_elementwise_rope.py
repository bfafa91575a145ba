"""Elementwise RoPE (cukern/elementwise/rope.py) and KV writes / layout (kv.py) against their float64
references.

Outputs are poisoned with NaN first; tolerances: elementwise_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.elementwise import ElementwiseDispatch, contiguous_page_table  # noqa: E402
from cukern.reference import elementwise as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402
from elementwise_helpers import _check_cache, _dev, _empty, _paged_setup, _randn, gpu  # noqa: E402


@pytest.fixture(scope="module")
def d():
    return ElementwiseDispatch()


# -------------------------------------------------------------------------------------------- RoPE

ROPE_CASES = [  # (n_tokens, n_heads, head_dim, rope_dim)
    (1, 1, 2, 2), (1, 8, 128, 128), (5, 3, 64, 32), (17, 4, 96, 64), (3, 2, 256, 128), (2, 5, 80, 80), (1, 2, 1024, 1024),
]


@gpu
@pytest.mark.parametrize("case", ROPE_CASES)
@pytest.mark.parametrize("neox", [True, False])
def test_rope(d, rng, case, neox):
    n_tok, n_heads, hd, rd = case
    x = _randn(rng, n_tok, n_heads, hd)
    pos0 = int(rng.integers(0, 100000))
    positions = np.array([pos0], np.int32)
    out = _empty(n_tok, n_heads, hd)
    d.rope(_dev(x), _dev(positions), out, rope_dim=rd, neox=neox, freq_base=1e6)
    assert_close(out, ref.rope(x, positions, rope_dim=rd, neox=neox, freq_base=1e6), name="consecutive")
    per_tok = rng.integers(0, 40000, n_tok).astype(np.int32)
    freqs = (rng.random(rd // 2) * 0.9 + 0.01).astype(np.float32)
    xd = _dev(x)
    d.rope(xd, _dev(per_tok), xd, rope_dim=rd, neox=neox, freqs=_dev(freqs), pos_mode="per_token")  # in place
    assert_close(xd, ref.rope(x, per_tok, rope_dim=rd, neox=neox, freqs=freqs, pos_mode="per_token"), name="freqs")


@gpu
def test_rope_blocks_loop_over_steps(d, rng):
    """More token steps than resident blocks: each block loops, reusing its inverse-frequency table."""
    n_tok, n_heads, hd = 9001, 2, 64
    x, w = _randn(rng, n_tok, n_heads, hd), _randn(rng, hd)
    positions = rng.integers(0, 100000, n_tok).astype(np.int32)
    out = _empty(n_tok, n_heads, hd)
    d.rms_norm_rope(_dev(x), _dev(w), _dev(positions), out, pos_mode="per_token", freq_base=5e5)
    assert_close(out, ref.rms_norm_rope(x, w, positions, pos_mode="per_token", freq_base=5e5))
    page_table, k_cache = _paged_setup(rng, 1, n_tok, 64, n_heads, hd, cupy.float32)
    pos, seq = np.array([0], np.int32), np.array([0], np.int32)
    d.k_norm_rope_kv_write(_dev(x), None, k_cache, _dev(page_table), _dev(pos), _dev(seq), freq_base=5e5)
    want = ref.kv_write(ref.rope(x, pos, freq_base=5e5), np.full(k_cache.shape, np.nan), page_table, pos, seq)
    _check_cache(k_cache, want, cupy.float32, "k_cache")


@gpu
@pytest.mark.parametrize("mode,sections", [("mrope", [16, 24, 24, 0]), ("imrope", [24, 20, 20, 0]),
                                           ("imrope", [3, 2, 2, 1]), ("mrope", [5, 3, 0, 2])])
def test_rope_multi_section(d, rng, mode, sections):
    n_tok, n_heads, hd = 7, 4, 128
    x = _randn(rng, n_tok, n_heads, hd)
    positions = rng.integers(0, 3000, (4, n_tok)).astype(np.int32)
    out = _empty(n_tok, n_heads, hd)
    d.rope(_dev(x), _dev(positions), out, pos_mode=mode, sections=sections, freq_base=5e6)
    assert_close(out, ref.rope(x, positions, pos_mode=mode, sections=sections, freq_base=5e6))


@gpu
@pytest.mark.parametrize("case", [(1, 8, 128, 128), (9, 3, 64, 32), (4, 2, 256, 200)])
def test_rms_norm_rope(d, rng, case):
    n_tok, n_heads, hd, rd = case
    x, w = _randn(rng, n_tok, n_heads, hd, scale=3), _randn(rng, hd)
    positions = np.array([int(rng.integers(0, 5000))], np.int32)
    xd = _dev(x)
    d.rms_norm_rope(xd, _dev(w), _dev(positions), xd, eps=1e-6, weight_offset=1.0, rope_dim=rd, neox=False)
    want = ref.rms_norm_rope(x, w, positions, eps=1e-6, weight_offset=1.0, rope_dim=rd, neox=False)
    assert_close(xd, want)


# ------------------------------------------------------------------------------ KV writes / layout

@gpu
@pytest.mark.parametrize("dtype", [cupy.float16, cupy.float32, cupy.uint16])  # uint16: bf16 bits
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_kv_write_paged(d, rng, dtype, page_size):
    n_seqs, capacity, n_kv, hd = 3, 37, 2, 64
    page_table, cache = _paged_setup(rng, n_seqs, capacity, page_size, n_kv, hd, dtype)
    want = np.full(cache.shape, np.nan)
    # a prefill chunk of 11 tokens into sequence 1 from position 20 (crosses pages), then a decode batch
    src = _randn(rng, 11, n_kv, hd)
    pos, seq = np.array([20], np.int32), np.array([1], np.int32)
    d.kv_write(_dev(src), cache, _dev(page_table), _dev(pos), _dev(seq))
    want = ref.kv_write(src, want, page_table, pos, seq)
    src = _randn(rng, 3, n_kv, hd)
    pos, seq = np.array([36, 0, 5], np.int32), np.array([0, 2, 1], np.int32)
    d.kv_write(_dev(src), cache, _dev(page_table), _dev(pos), _dev(seq), pos_mode="per_token")
    want = ref.kv_write(src, want, page_table, pos, seq, pos_mode="per_token")
    _check_cache(cache, want, dtype, "cache")


@gpu
@pytest.mark.parametrize("dtype", [cupy.float16, cupy.float32, cupy.uint16])
def test_kv_write_odd_rows(d, rng, dtype):
    """n_kv_heads * head_dim % 4 != 0: the one-element-per-thread path."""
    page_table, cache = _paged_setup(rng, 2, 10, 4, 1, 6, dtype)
    src = _randn(rng, 7, 1, 6)
    pos, seq = np.array([3], np.int32), np.array([1], np.int32)
    d.kv_write(_dev(src), cache, _dev(page_table), _dev(pos), _dev(seq))
    want = ref.kv_write(src, np.full(cache.shape, np.nan), page_table, pos, seq)
    _check_cache(cache, want, dtype, "cache")


@gpu
def test_kv_write_contiguous(d, rng):
    n_seqs, capacity, n_kv, hd = 2, 9, 3, 32
    cache = poison(cupy.empty((n_seqs, capacity, n_kv, hd), cupy.float16))
    pt = contiguous_page_table(n_seqs)
    src = _randn(rng, 4, n_kv, hd)
    pos, seq = np.array([5], np.int32), np.array([1], np.int32)
    d.kv_write_contiguous(_dev(src), cache, pt, _dev(pos), _dev(seq))
    want = ref.kv_write(src, np.full(cache.shape, np.nan), pt.get(), pos, seq)
    _check_cache(cache, want, cupy.float16, "contiguous cache")


@gpu
@pytest.mark.parametrize("dtype", [cupy.float16, cupy.float32])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("step", ["decode", "batched", "prefill"])
def test_qk_norm_rope_kv_write(d, rng, dtype, norm, step):
    n_q, n_kv, hd, rd, page_size = 8, 2, 128, 64, 16
    batched = step == "batched"
    n_tok = {"decode": 1, "batched": 5, "prefill": 13}[step]
    page_table, k_cache = _paged_setup(rng, 3, 64, page_size, n_kv, hd, dtype)
    v_cache = poison(cupy.empty_like(k_cache))
    q, k, v = _randn(rng, n_tok, n_q, hd, scale=2), _randn(rng, n_tok, n_kv, hd, scale=2), _randn(rng, n_tok, n_kv, hd)
    wq, wk = _randn(rng, hd), _randn(rng, hd)
    if batched:  # a decode batch of several sequences: per-token positions and sequence ids
        pos = rng.integers(0, 64, n_tok).astype(np.int32)
        pos[:3] = [0, 17, 63]
        seq = np.array([0, 1, 2, 1, 0], np.int32)
        pos[4] = (pos[0] + 1) % 64  # distinct (seq, pos) pairs
        pos[3] = (pos[1] + 2) % 64
        mode = "per_token"
    else:
        pos, seq, mode = np.array([int(rng.integers(0, 64 - n_tok))], np.int32), np.array([2], np.int32), "consecutive"
    q_out = _empty(n_tok, n_q, hd)
    kw = dict(eps=1e-6, rope_dim=rd, neox=True, freq_base=1e6, pos_mode=mode)
    d.qk_norm_rope_kv_write(_dev(q), _dev(k), _dev(v), _dev(wq) if norm else None, _dev(wk) if norm else None, q_out,
                            k_cache, v_cache, _dev(page_table), _dev(pos), _dev(seq), **kw)
    rope_kw = dict(rope_dim=rd, neox=True, freq_base=1e6, pos_mode="per_token")
    tok_pos = pos if batched else pos[0] + np.arange(n_tok, dtype=np.int32)
    qn = ref.group_norm(q, group_size=hd, w=wq, eps=1e-6) if norm else q
    kn = ref.group_norm(k, group_size=hd, w=wk, eps=1e-6) if norm else k
    assert_close(q_out, ref.rope(qn, tok_pos, **rope_kw), name="q_out")
    want_k = ref.kv_write(ref.rope(kn, tok_pos, **rope_kw), np.full(k_cache.shape, np.nan), page_table, pos, seq,
                          pos_mode=mode)
    want_v = ref.kv_write(v, np.full(v_cache.shape, np.nan), page_table, pos, seq, pos_mode=mode)
    _check_cache(k_cache, want_k, dtype, "k_cache")
    _check_cache(v_cache, want_v, dtype, "v_cache")
    # the K-only sibling
    k_only = poison(cupy.empty_like(k_cache))
    d.k_norm_rope_kv_write(_dev(k), _dev(wk) if norm else None, k_only, _dev(page_table), _dev(pos), _dev(seq), **kw)
    _check_cache(k_only, want_k, dtype, "k_cache (K only)")


@gpu
@pytest.mark.parametrize("hd,n_q,n_kv,n_tok", [(256, 4, 1, 37), (128, 8, 2, 13), (64, 6, 3, 1), (32, 5, 5, 129)])
def test_qk_norm_rope_kv_write_half_q_out(d, rng, hd, n_q, n_kv, n_tok):
    """q_out in the f16 cache's dtype (a prompt chunk's Q for the tensor-core prefill): the f32 result
    rounded once (tolerance of an f16 rounding: rtol 1e-3, atol 1e-3), the caches as with an f32 q_out."""
    page_size = 16
    page_table, k_cache = _paged_setup(rng, 2, n_tok + 20, page_size, n_kv, hd, cupy.float16)
    v_cache = poison(cupy.empty_like(k_cache))
    q, k, v = _randn(rng, n_tok, n_q, hd, scale=2), _randn(rng, n_tok, n_kv, hd, scale=2), _randn(rng, n_tok, n_kv, hd)
    wq, wk = _randn(rng, hd), _randn(rng, hd)
    pos, seq = np.array([int(rng.integers(0, 20))], np.int32), np.array([1], np.int32)
    q_out = _empty(n_tok, n_q, hd, dtype=cupy.float16)
    kw = dict(eps=1e-6, neox=True, freq_base=1e6, pos_mode="consecutive")
    d.qk_norm_rope_kv_write(_dev(q), _dev(k), _dev(v), _dev(wq), _dev(wk), q_out, k_cache, v_cache, _dev(page_table),
                            _dev(pos), _dev(seq), **kw)
    tok_pos = pos[0] + np.arange(n_tok, dtype=np.int32)
    rope_kw = dict(rope_dim=hd, neox=True, freq_base=1e6, pos_mode="per_token")
    want_q = ref.rope(ref.group_norm(q, group_size=hd, w=wq, eps=1e-6), tok_pos, **rope_kw)
    assert_close(q_out.astype(cupy.float32), want_q, atol=1e-3, rtol=1e-3, name="f16 q_out")
    want_k = ref.kv_write(ref.rope(ref.group_norm(k, group_size=hd, w=wk, eps=1e-6), tok_pos, **rope_kw),
                          np.full(k_cache.shape, np.nan), page_table, pos, seq, pos_mode="consecutive")
    _check_cache(k_cache, want_k, cupy.float16, "k_cache")
    _check_cache(v_cache, ref.kv_write(v, np.full(v_cache.shape, np.nan), page_table, pos, seq), cupy.float16,
                 "v_cache")


def test_qk_norm_rope_kv_write_half_q_out_rejected(monkeypatch):
    """An f16 q_out needs an f16 cache and the vectorised kernel's shapes: both refused before any launch."""
    from host_dispatch import host_array, patch
    launches = patch(monkeypatch)
    d = ElementwiseDispatch()
    pt, pos, seq = host_array((1, 4), np.int32, 0), host_array(1, np.int32, 0), host_array(1, np.int32, 0)

    def call(hd, cache_dtype, q_dtype):
        q, k = host_array((3, 2, hd)), host_array((3, 1, hd))
        kc, vc = host_array((4, 16, 1, hd), cache_dtype), host_array((4, 16, 1, hd), cache_dtype)
        w = host_array(hd, np.float32, 1.0)
        d.qk_norm_rope_kv_write(q, k, host_array((3, 1, hd)), w, w, host_array((3, 2, hd), q_dtype), kc, vc, pt,
                                pos, seq)

    with pytest.raises(TypeError, match="q_out must be float32 or the caches'"):
        call(128, np.float32, np.float16)
    with pytest.raises(ValueError, match="needs the vectorised kernel"):
        call(96, np.float16, np.float16)
    assert not launches
    call(128, np.float16, np.float16)
    assert launches == {"qk_norm_rope_kv_vec<__half, true, true, 16, __half>": 1}


@gpu
@pytest.mark.parametrize("hd,rd,n_kv,dtype,mode", [(128, 128, 8, cupy.float16, "consecutive"),
                                                   (128, 64, 6, cupy.float32, "per_token"),
                                                   (64, 32, 3, cupy.float16, "per_token"),
                                                   (256, 256, 1, cupy.float32, "consecutive")])
def test_k_norm_rope_kv_write_many_rows(d, rng, hd, rd, n_kv, dtype, mode):
    """Enough head rows for several rows per thread, including tokens split between threads (n_kv % 4)."""
    n_tok, page_size = 4800 // n_kv + 7, 16
    n_seqs = 2
    capacity = n_tok + 5
    page_table, k_cache = _paged_setup(rng, n_seqs, capacity, page_size, n_kv, hd, dtype)
    k, wk = _randn(rng, n_tok, n_kv, hd, scale=2), _randn(rng, hd)
    if mode == "per_token":  # distinct (sequence, position) slots
        slots = rng.choice(n_seqs * capacity, n_tok, replace=False)
        seq, pos = (slots // capacity).astype(np.int32), (slots % capacity).astype(np.int32)
        tok_pos = pos
    else:
        pos, seq = np.array([3], np.int32), np.array([1], np.int32)
        tok_pos = pos[0] + np.arange(n_tok, dtype=np.int32)
    kw = dict(eps=1e-6, rope_dim=rd, neox=n_kv != 3, freq_base=1e6, pos_mode=mode)
    d.k_norm_rope_kv_write(_dev(k), _dev(wk), k_cache, _dev(page_table), _dev(pos), _dev(seq), **kw)
    kn = ref.group_norm(k, group_size=hd, w=wk, eps=1e-6)
    rope_kw = dict(rope_dim=rd, neox=kw["neox"], freq_base=1e6, pos_mode="per_token")
    want = ref.kv_write(ref.rope(kn, tok_pos, **rope_kw), np.full(k_cache.shape, np.nan), page_table, pos, seq,
                        pos_mode=mode)
    _check_cache(k_cache, want, dtype, "k_cache (K only)")


@gpu
@pytest.mark.parametrize("shape", [(1, 1, 2), (1, 16, 256), (7, 3, 10), (33, 8, 128)])
def test_deinterleave(d, rng, shape):
    x = _randn(rng, *shape)
    q, g = _empty(*shape[:2], shape[2] // 2), _empty(*shape[:2], shape[2] // 2)
    d.deinterleave(_dev(x), q, g)
    wq, wg = ref.deinterleave(x)
    assert_close(q, wq, name="q")
    assert_close(g, wg, name="gate")
