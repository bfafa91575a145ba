"""matmul's int8 path and quantizers (cukern/matmul/int8.py: Q8_1 activations against int8 quants,
the activation quantizers, the whole-matrix dequantizer) against float64 references.

Tolerances and the quantizers' rules: matmul_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.dmmv import QWeight  # noqa: E402
from cukern.matmul import MatmulDispatch  # noqa: E402
from cukern.qtypes import GGMLType as T  # noqa: E402
from cukern.reference import matmul as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402
from matmul_helpers import NAMES, TYPES, _b, _k, _q8_1, _rms, _weight  # noqa: E402


@pytest.fixture(scope="module")
def mm():
    return MatmulDispatch()


# ---------------------------------------------------------------------------- GPU: Hopper wgmma GEMM

@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=lambda q: NAMES[q])
def test_dequantize_f16(mm, rng, q):
    m, k = 33, _k(q)
    w, dense = _weight(q, m, k, rng, pad_front=16)
    out = poison(cupy.empty((m, k), cupy.float16))
    mm.dequantize(w, out)
    assert np.array_equal(out.get(), dense.astype(np.float16)), "f16 dequantization must round once, exactly"


# ---------------------------------------------------------------------------- GPU: int8 GEMM

@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("m,n", [(77, 1), (203, 37), (130, 129)])
def test_gemm_q8(mm, rng, q, m, n):
    """Exact agreement (up to f32 rounding: 2e-5 * rms) with the same math on the quantized
    activations; NMSE <= 5e-4 against the float64 product with the unquantized activations."""
    k = _k(q)
    raw = ref.random_weight(q, m, k, rng)
    dense = ref.dequantize(raw, q, m, k)
    w = QWeight(cupy.asarray(np.concatenate([np.zeros(16, np.uint8), raw.ravel()])), q, m, k, offset=16)
    b = _b(rng, n, k, np.float32)
    qa, (da, sa, qs) = _q8_1(mm, b)
    d = poison(cupy.empty((n, m), cupy.float32))
    mm.gemm_q8(w, qa, d)
    exact = ref.gemm_q8_1(dense, ref.k_mins(raw, q, m, k), da, sa, qs)
    assert_close(d.get(), exact, atol=2e-5 * _rms(exact), rtol=1e-5, name="d (quantized activations)")
    full = ref.gemm(dense, b)
    err = float(np.mean((d.get() - full) ** 2) / np.mean(full ** 2))
    assert err <= 5e-4, f"NMSE {err:.2e} against the unquantized product"


@pytest.mark.gpu
@pytest.mark.parametrize("q", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda q: NAMES[q])
@pytest.mark.parametrize("pad,split", [(16, 1), (2, 2)], ids=["aligned", "unaligned-split2"])
def test_gemm_q8_deep_pipeline(mm, rng, q, pad, split):
    """128-token tiles (4 activation stages in flight, 2 raw super-stage buffers) over a long K with
    a ragged tail, ragged M and N; raw rows 16-byte aligned (cp.async) or not (2-byte copies)."""
    m, n, k = 200, 260, _k(q, 9)
    raw = ref.random_weight(q, m, k, rng)
    dense = ref.dequantize(raw, q, m, k)
    if pad % 2 == 0 and q in (T.Q4_K, T.Q5_K):
        pad = 16  # K4/K5 quants are read as uint4: their rows must start 16-byte aligned
    w = QWeight(cupy.asarray(np.concatenate([np.zeros(pad, np.uint8), raw.ravel()])), q, m, k, offset=pad)
    b = _b(rng, n, k, np.float32)
    qa, (da, sa, qs) = _q8_1(mm, b)
    d = poison(cupy.empty((n, m), cupy.float32))
    mm.gemm_q8(w, qa, d, split_k=split)
    exact = ref.gemm_q8_1(dense, ref.k_mins(raw, q, m, k), da, sa, qs)
    assert_close(d.get(), exact, atol=2e-5 * _rms(exact), rtol=1e-5, name="d (quantized activations)")


@pytest.mark.gpu
@pytest.mark.parametrize("q", [T.Q4_0, T.Q4_K, T.Q6_K], ids=lambda q: NAMES[q])
def test_gemm_q8_split_accumulate_strided(mm, rng, q):
    m, n, k = 140, 20, _k(q, 4)
    raw = ref.random_weight(q, m, k, rng)
    dense = ref.dequantize(raw, q, m, k)
    w = QWeight(cupy.asarray(raw.ravel()), q, m, k)
    b = _b(rng, n, k, np.float32)
    nb = k // 32 * ref.Q8_1_BYTES
    qa = cupy.zeros((n, nb + 8), cupy.uint8)[:, :nb]  # strided rows
    mm.quantize_q8_1(cupy.asarray(b), qa)
    da, sa, qs = ref.unpack_q8(qa.get(), k, "q8_1")
    exact = ref.gemm_q8_1(dense, ref.k_mins(raw, q, m, k), da, sa, qs)
    d_full = cupy.asarray(rng.standard_normal((n, m + 5)).astype(np.float32))
    d = d_full[:, :m]
    base = d_full.get()
    mm.gemm_q8(w, qa, d, split_k=3)
    assert_close(d.get(), exact, atol=2e-5 * _rms(exact), rtol=1e-5, name="split")
    mm.gemm_q8(w, qa, d, accumulate=True, split_k=1)
    assert_close(d.get(), 2 * exact, atol=4e-5 * _rms(exact), rtol=1e-5, name="accumulate")
    assert np.array_equal(d_full.get()[:, m:], base[:, m:])


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
@pytest.mark.parametrize("n", [5, 70])
def test_gemm_q8_glu(mm, rng, q, act, n):
    """f32 out: the quantized-activation math up to f32 rounding (and the activation's own f32
    error: 1e-4 * rms); Q8_1 / Q8_0 out: the blocks quantize_q8_f32 makes of the f32 out."""
    m, k = 96, _k(q)
    raws = [ref.random_weight(q, m, k, rng) for _ in range(2)]
    dense = [ref.dequantize(r, q, m, k) for r in raws]
    buf = cupy.asarray(np.concatenate([r.ravel() for r in raws]))
    wg = QWeight(buf, q, m, k)
    wu = QWeight(buf, q, m, k, offset=raws[0].nbytes)
    b = _b(rng, n, k, np.float32)
    qa, (da, sa, qs) = _q8_1(mm, b)
    h = poison(cupy.empty((n, m), cupy.float32))
    mm.gemm_q8_glu(wg, wu, qa, h, act=act)
    g, u = (ref.gemm_q8_1(dn, ref.k_mins(r, q, m, k), da, sa, qs) for dn, r in zip(dense, raws))
    want = (ref.silu(g) if act == "swiglu" else ref.gelu_tanh(g)) * u
    hh = h.get()
    assert_close(hh, want, atol=1e-4 * _rms(want), rtol=1e-4, name="h")
    for fmt in ("q8_1", "q8_0"):
        nb = m // 32 * (ref.Q8_1_BYTES if fmt == "q8_1" else ref.Q8_0_BYTES)
        out = cupy.full((n, nb), 0xA5, cupy.uint8)
        mm.gemm_q8_glu(wg, wu, qa, out, act=act, out_format=fmt)
        d_, s_, q_ = ref.unpack_q8(out.get(), m, fmt)
        want_d, want_q = ref.quantize_q8_f32(hh)
        np.testing.assert_array_equal(q_, want_q)
        np.testing.assert_array_equal(d_, want_d.astype(np.float16).astype(np.float64))


# ---------------------------------------------------------------------------- GPU: quantizers

@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["q8_1", "q8_0"])
@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 4096), (33, 96)])
def test_quantize(mm, rng, fmt, rows, cols):
    x = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 10, (rows, 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: d = 0, qs = 0
    nb = (ref.Q8_1_BYTES if fmt == "q8_1" else ref.Q8_0_BYTES) * (cols // 32)
    q = cupy.full((rows, nb + 8), 0xA5, cupy.uint8)[:, :nb]  # strided rows; the pad must stay untouched
    (mm.quantize_q8_1 if fmt == "q8_1" else mm.quantize_q8_0)(cupy.asarray(x), q)
    d, s, qs = ref.unpack_q8(q.get(), cols, fmt)
    want_d, want_qs = ref.quantize_q8_f32(x)
    np.testing.assert_array_equal(qs, want_qs)
    np.testing.assert_array_equal(d, want_d.astype(np.float16).astype(np.float64))
    if s is not None:
        want_s = (want_d.astype(np.float64) * want_qs.reshape(rows, cols // 32, 32).sum(-1)).astype(np.float32)
        np.testing.assert_array_equal(s, want_s.astype(np.float16).astype(np.float64))
    assert (q.base.get()[:, nb:] == 0xA5).all()
    # and the float64 rule of the elementwise reference: dequantized values within half a step, up
    # to the f32 arithmetic of the rounding itself (x * (1 / d) carries ~2 ulp, which can move a
    # value within ~|x| 2^-22 of a half step to the other side)
    back = ref.dequantize_q8(want_d, want_qs)
    assert np.all(np.abs(back - x) <= 0.5 * np.repeat(want_d, 32, axis=1) * (1 + 1e-6) + np.abs(x) * 2.0**-21 + 1e-30)


# ---------------------------------------------------------------------------- GPU: the Q8 activation chain

@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("n", [1, 9, 70])
def test_q8_1_activation_chain(mm, rng, q, n):
    """The FFN on Q8_1 activations end to end: quantize_q8_1(x) -> gemm_q8_glu(out_format="q8_1") ->
    gemm_q8 reading those blocks. The down GEMM agrees with the float64 math on the blocks the chain wrote
    (2e-5 * rms); the blocks stand for act(g) * u within half a step plus the f16 scale's rounding; the
    whole chain's NMSE against the float64 FFN on the unquantized x (two 8-bit roundings) is below 2e-3."""
    k, f, m = _k(q), _k(q, 2), 77  # d_model, the FFN width (a valid k of the down weights), d_model out
    raws = [ref.random_weight(q, f, k, rng) for _ in range(2)]
    buf = cupy.asarray(np.concatenate([r.ravel() for r in raws]))
    wg, wu = QWeight(buf, q, f, k), QWeight(buf, q, f, k, offset=raws[0].nbytes)
    raw_d = ref.random_weight(q, m, f, rng)
    wd, dense_d = QWeight(cupy.asarray(raw_d), q, m, f), ref.dequantize(raw_d, q, m, f)
    x = _b(rng, n, k, np.float32)
    qa, (da, sa, qs) = _q8_1(mm, x)
    h8 = cupy.full((n, f // 32 * ref.Q8_1_BYTES), 0xA5, cupy.uint8)
    mm.gemm_q8_glu(wg, wu, qa, h8, act="swiglu", out_format="q8_1")
    y = poison(cupy.empty((n, m), cupy.float32))
    mm.gemm_q8(wd, h8, y)
    dh, sh, qh = ref.unpack_q8(h8.get(), f, "q8_1")
    exact = ref.gemm_q8_1(dense_d, ref.k_mins(raw_d, q, m, f), dh, sh, qh)
    assert_close(y.get(), exact, atol=2e-5 * _rms(exact), rtol=1e-5, name="y (the chain's own h blocks)")
    dense_gu = [ref.dequantize(r, q, f, k) for r in raws]
    g, u = (ref.gemm_q8_1(dn, ref.k_mins(r, q, f, k), da, sa, qs) for dn, r in zip(dense_gu, raws))
    h = ref.silu(g) * u
    step = np.repeat(dh, 32, axis=1)
    assert np.all(np.abs(ref.dequantize_q8(dh, qh) - h) <= step * (0.5 + 127 * 2.0 ** -11) + 1e-4 * _rms(h)), \
        "h blocks further than half a step from act(g) * u"
    full = ref.gemm(dense_d, ref.glu(*dense_gu, x))
    err = float(np.mean((y.get() - full) ** 2) / np.mean(full ** 2))
    assert err <= 2e-3, f"NMSE {err:.2e} of the chain against the float64 FFN on the unquantized x"
