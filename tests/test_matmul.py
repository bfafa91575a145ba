"""matmul family against float64 references (cukern/reference/matmul.py) built on gguf's own
dequantization of random valid GGUF blocks.

Tolerances (f16 tensor-core path; W and B are rounded to f16, products accumulate in f32):
* against the exact float64 product: |out - ref| <= 2e-3 * rms(ref) + 2e-3 * |ref| (the issue's
  2e-3 relative; the rms floor covers outputs that cancel to near zero, where f16 input rounding,
  ~2.4e-4 * rms per output, dominates any element-wise relative bound); 4e-3 * rms for the fused
  act(gate) * up, where the rounding noise of both products adds up;
* against the float64 product of the f16-rounded operands (kernel error alone):
  |out - ref| <= 1e-4 * rms(ref) + 1e-4 * |ref|. One wrong nibble or scale is ~1e-2 * rms. For
  gemm_wgr the f16 weights are those of its f16 arithmetic (``ref.wgr_values``: the K-quants with
  one rounding more than dequantize_f16, element for element).
Quantizers: int8 values agree exactly with the f32 re-computation of the kernel's arithmetic; d
and s to their f16 rounding.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.dmmv import QWeight  # noqa: E402
from cukern.matmul import MatmulDispatch  # noqa: E402
from cukern.matmul import common as M  # noqa: E402 (the family's constants and operand helpers)
from cukern.qtypes import GGMLType as T  # noqa: E402
from cukern.reference import matmul as ref  # noqa: E402
from cukern.reference import dmmv as dmmv_ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402

TYPES = list(M.GEMM_QTYPES)
NAMES = {q: ref.TYPES[q][0] for q in TYPES}


def _k(q, mult=3):
    """A valid k with several stages and, for the 32-blocks, not a multiple of 256."""
    return 256 * mult if ref.TYPES[q][1] == 256 else 32 * (8 * mult + 3)


def _rms(a):
    return float(np.sqrt(np.mean(np.square(a)))) + 1e-30


def _check(out, want, tight, name="d", loose=2e-3):
    assert_close(out, want, atol=loose * _rms(want), rtol=2e-3, name=name)
    assert_close(out, tight, atol=1e-4 * _rms(tight), rtol=1e-4, name=name + " (f16 inputs)")


def _act_slope(g, act):
    """act'(g) in float64, analytically (a difference quotient cancels in GELU's far tail)."""
    if act == "swiglu":
        s = 1.0 / (1.0 + np.exp(-g))
        return s * (1.0 + g * (1.0 - s))
    c = np.sqrt(2.0 / np.pi)
    t = np.tanh(c * (g + 0.044715 * g ** 3))
    return 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * g * g)


def _check_glu(out, w_gate, w_up, b, act, tight, name="d", loose=2e-3):
    """act(g) * u (g = W_gate b, u = W_up b) against float64, each product's error bounded as
    _check bounds one product (loose * (rms + |value|)) and carried to first order element by
    element: |d(act(g) u)| <= loose * (|act'(g) u| (rms(g) + |g|) + |act(g)| (rms(u) + |u|)), plus
    a floor of loose / 100 * rms(act(g) u) for the f32 evaluation. A bound relative to
    rms(act(g) u) alone does not hold where |u| is large and act(g) small (near g = 0 the error is
    act'(0) u dg = u dg / 2). Then the tight check against the kernel's f16 inputs."""
    g, u = ref.gemm(w_gate, b), ref.gemm(w_up, b)
    a = dmmv_ref.silu(g) if act == "swiglu" else dmmv_ref.gelu_tanh(g)
    want = a * u
    sens = (np.abs(_act_slope(g, act) * u) * (_rms(g) + np.abs(g)) + np.abs(a) * (_rms(u) + np.abs(u))
            + 1e-2 * _rms(want))
    assert_close(out / sens, want / sens, atol=loose, rtol=0, name=name + " / sensitivity")
    assert_close(out, tight, atol=1e-4 * _rms(tight), rtol=1e-4, name=name + " (f16 inputs)")


def _weight(q, m, k, rng, *, pad_front=0):
    raw = ref.random_weight(q, m, k, rng)
    dense = ref.dequantize(raw, q, m, k)
    buf = np.concatenate([rng.integers(0, 256, pad_front, dtype=np.uint8), raw.ravel(),
                          rng.integers(0, 256, 5, dtype=np.uint8)])
    return QWeight(cupy.asarray(buf), q, m, k, offset=pad_front), dense


def _kernel_w(mm, w, dense, b, wgmma=None):
    """The f16 weights the kernel gemm() picks multiplies: gemm_wgr's (ref.wgr_values, from the
    raw bytes read back) or the dense matrix (rounded to f16 by gemm_f16_inputs)."""
    if not mm._use_wg(w, w, b.shape[0], wgmma):
        return dense
    return ref.wgr_values(w.buf[w.offset:w.offset + w.m * w.row_bytes].get(), w.qtype, w.m, w.k)


def _b(rng, n, k, dtype):
    return rng.standard_normal((n, k)).astype(dtype)


@pytest.fixture(scope="module")
def mm():
    return MatmulDispatch()


# ---------------------------------------------------------------------------- CPU

def test_families_declared():
    import cukern
    names = {f.name for f in cukern.families()}
    assert set(M.FAMILIES) <= names
    for q, s in M.GEMM_QTYPES.items():
        unit = M.FAMILIES[f"matmul_f16_{s}"]
        own = (f"gemm_f16<{q}, ", f"gemm_wgr<{q}, ", f"gemm_wgr<{100 + q}, ", f"pack_wgr<{q}>")
        assert all(k.name.startswith(own) for k in unit.kernels)
        assert any(k.name == f"pack_wgr<{q}>" for k in unit.kernels) == (q in M.PACKED_LAYOUTS)


def test_reference_quantizer_rule():
    x = np.array([[0.5, -0.25] + [0.0] * 29 + [127.0]], np.float32)
    d, qs = ref.quantize_q8_f32(x)
    assert d[0, 0] == np.float32(1.0)
    assert qs[0, 0] == 1 and qs[0, 1] == 0 and qs[0, -1] == 127  # half away from zero; 0.25 -> 0
    d, qs = ref.quantize_q8_f32(np.zeros((1, 32), np.float32))
    assert d[0, 0] == 0 and not qs.any()


def test_plan_path_rule():
    assert MatmulDispatch.plan_path(T.Q4_K, 1) == "matvec"
    assert MatmulDispatch.plan_path(T.Q4_K, MatmulDispatch.MATVEC_MAX_N + 1) == "f16"
    assert MatmulDispatch.plan_path(T.Q4_K, 512) == "f16"
    assert MatmulDispatch.plan_path(T.Q4_K, 512, q8_1=True) == "int8"


@pytest.mark.parametrize("q", TYPES, ids=lambda q: NAMES[q])
def test_wgr_values(q):
    """gemm_wgr's f16 weights (ref.wgr_values): the _0 types are dequantize_f16's; the K-quants
    are within two f16 roundings of the dense values, and a product of them stays as far inside
    the issue's 2e-3 as one of the f16-rounded dense values (about half the bound at this size)."""
    rng = np.random.default_rng(7)
    m, n, k = 300, 80, 2048
    raw = ref.random_weight(q, m, k, rng)
    dense = ref.dequantize(raw, q, m, k)
    w = ref.wgr_values(raw, q, m, k)
    assert np.array_equal(w, ref.f16(w)), "not f16 values"
    if ref.TYPES[q][0] not in ("Q4_K", "Q5_K", "Q6_K"):
        assert np.array_equal(w, ref.f16(dense))
        return
    scale = np.repeat(np.abs(ref.k_scales(raw, q, m, k)), 32 if q != T.Q6_K else 16, axis=1)
    assert np.all(np.abs(w - dense) <= 2 ** -10 * (np.abs(dense) + scale + np.repeat(ref.k_mins(raw, q, m, k), 32, 1)))
    b = rng.standard_normal((n, k)).astype(np.float16)
    want = ref.gemm(dense, b)
    err = np.abs(ref.gemm_f16_inputs(w, b) - want) / (2e-3 * _rms(want) + 2e-3 * np.abs(want))
    assert err.max() < 0.75, err.max()


def test_gemm_replays_repeated_calls(monkeypatch):
    """On CPU (tests/host_dispatch.py: host arrays, launches recorded): a repeated gemm / gemm_glu
    call (same weights, buffers and options) replays its checked launch, so the checks and the plan
    run once per distinct call; a call that differs in any argument goes through them again, and
    bad input still raises before a launch."""
    from host_dispatch import host_array, patch
    launches = patch(monkeypatch)
    checks = []
    orig = MatmulDispatch._float_activations
    monkeypatch.setattr(MatmulDispatch, "_float_activations", lambda self, *a: checks.append(1) or orig(self, *a))
    mm = MatmulDispatch()
    m, n, k = 64, 40, 512
    raw = [ref.random_weight(12, m, k, np.random.default_rng(i)).ravel() for i in range(2)]
    w, w2 = (QWeight(host_array(r.shape, np.uint8, r), T.Q4_K, m, k) for r in raw)
    b, d = host_array((n, k), np.float32, 0.5), host_array((n, m))
    for _ in range(3):
        mm.gemm(w, b, d)
    assert (sum(launches.values()), len(checks)) == (3, 1)
    mm.gemm(w, b, d, accumulate=True)
    mm.gemm(w, b, d, split_k=2)
    mm.gemm(w, b, d, split_k=2)
    mm.gemm(w2, b, d)
    assert (sum(launches.values()), len(checks)) == (7, 4)
    mm.gemm_glu(w, w2, b, d)
    mm.gemm_glu(w, w2, b, d)
    mm.gemm_glu(w, w2, b, d, act="geglu")
    assert (sum(launches.values()), len(checks)) == (10, 6)
    with pytest.raises(ValueError):
        mm.gemm(w, b, host_array((n + 1, m)))
    with pytest.raises(TypeError):
        mm.gemm(w, b, d, wgmma="yes")
    assert sum(launches.values()) == 10
    # the kept launches hold bare pointers: no caller's array stays alive through them
    assert not any(isinstance(a, cupy.ndarray) for _, launch, _ in mm._calls.values() for a in launch[4])
    d2 = host_array((n, m))
    mm.gemm(w, b, d2)
    ref_d2 = weakref.ref(d2)
    del d2
    gc.collect()
    assert ref_d2() is None


def test_wgr_plan():
    """gemm_wgr's tile and K split on a 132-SM device: whole super-stages per slice, no split when
    the tiles fill the machine, a split when they cannot, no split for the GLU (not splittable)."""
    mm = MatmulDispatch()
    mm.sm_count = lambda: 132
    for (m, k, n) in [(4096, 4096, 512), (4096, 14336, 512), (14336, 4096, 512), (4096, 4096, 2048),
                      (14336, 4096, 2048), (1000, 4096, 300), (64, 1024, 256)]:
        bt, split = mm._wgr_plan(n, -(-m // 128), k, True)
        k_split = -(-(-(-k // split)) // 256) * 256
        assert bt in (128, 256) and 1 <= split <= 16 and -(-k // k_split) == split, (m, k, n, bt, split)
        assert mm._wgr_plan(n, -(-m // 128), k, False)[1] == 1
    assert mm._wgr_plan(2048, 112, 4096, True) == (256, 1)   # 896 CTAs: no split
    assert mm._wgr_plan(512, 32, 14336, True) == (256, 2)    # 64 CTAs of 224 stages: two slices
    assert mm._wgr_plan(256, 32, 4096, True)[1] > 1


def test_wgr_needs_aligned_rows(monkeypatch):
    """gemm_wgr from WG_MIN_N columns only where every weight row is 16-byte aligned: Q5_0 rows of
    k = 640 (440 bytes) stay on gemm_f16 unless forced; k = 512 (352 bytes) take gemm_wgr."""
    from host_dispatch import host_array
    mm = MatmulDispatch()
    monkeypatch.setattr(mm._units[T.Q5_0], "is_sm90", lambda: True)
    aligned = QWeight(host_array(64 * 352, np.uint8, 0), T.Q5_0, 64, 512)
    odd = QWeight(host_array(64 * 440, np.uint8, 0), T.Q5_0, 64, 640)
    shifted = QWeight(host_array(64 * 352 + 8, np.uint8, 0), T.Q5_0, 64, 512, offset=8)
    assert mm._use_wg(aligned, aligned, mm.WG_MIN_N, None)
    assert not mm._use_wg(aligned, aligned, mm.WG_MIN_N - 1, None)
    assert not mm._use_wg(odd, odd, 4096, None)
    assert not mm._use_wg(shifted, shifted, 4096, None)
    assert not mm._use_wg(aligned, odd, 4096, None)
    assert mm._use_wg(odd, odd, 16, True)


# ---------------------------------------------------------------------------- GPU: tiled f16 GEMM

@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("m,n", [(77, 1), (203, 37), (130, 129), (64, 16)])
@pytest.mark.parametrize("bdt", [np.float32, np.float16], ids=["b32", "b16"])
def test_gemm(mm, rng, q, m, n, bdt):
    k = _k(q)
    w, dense = _weight(q, m, k, rng, pad_front=32)
    b = _b(rng, n, k, bdt)
    d = poison(cupy.empty((n, m), cupy.float32))
    mm.gemm(w, cupy.asarray(b), d)
    _check(d.get(), ref.gemm(dense, b), ref.gemm_f16_inputs(dense, b))


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=lambda q: NAMES[q])
def test_gemm_aligned_rows(mm, rng, q):
    """k = 2048: every row 16-byte aligned, so the raw super-stages go through cp.async (Q6_K's
    210-byte super-blocks start at every even offset mod 16); both the f16 and the int8 GEMM."""
    m, n, k = 70, 40, 2048
    raw = ref.random_weight(q, m, k, rng)
    dense = ref.dequantize(raw, q, m, k)
    w = QWeight(cupy.asarray(raw.ravel()), q, m, k)
    assert M._raw16(w) == 1
    b = _b(rng, n, k, np.float16)
    d = poison(cupy.empty((n, m), cupy.float32))
    mm.gemm(w, cupy.asarray(b), d)
    _check(d.get(), ref.gemm(dense, b), ref.gemm_f16_inputs(dense, b))
    qa, (da, sa, qs) = _q8_1(mm, b.astype(np.float32))
    d8 = poison(cupy.empty((n, m), cupy.float32))
    mm.gemm_q8(w, qa, d8)
    exact = ref.gemm_q8_1(dense, ref.k_mins(raw, q, m, k), da, sa, qs)
    assert_close(d8.get(), exact, atol=2e-5 * _rms(exact), rtol=1e-5, name="d (int8)")


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=lambda q: NAMES[q])
def test_gemm_split_accumulate_strided(mm, rng, q):
    """Forced K splits (atomics into a zeroed d), accumulate mode, row-strided b and d views."""
    m, n, k = 150, 45, _k(q, 4)
    w, dense = _weight(q, m, k, rng)
    b_full = _b(rng, n, k + 40, np.float32)  # row stride k + 40 (a multiple of 4 floats)
    b = cupy.asarray(b_full)[:, :k]
    d_full = cupy.asarray(rng.standard_normal((n, m + 3)).astype(np.float32))
    d = d_full[:, :m]
    want = ref.gemm(dense, b_full[:, :k])
    tight = ref.gemm_f16_inputs(dense, b_full[:, :k])
    mm.gemm(w, b, d, split_k=3)
    _check(d.get(), want, tight, "split")
    base = d_full.get()
    mm.gemm(w, b, d, accumulate=True, split_k=1)
    _check(d.get(), base[:, :m] + want, base[:, :m] + tight, "accumulate")
    mm.gemm(w, b, d, accumulate=True, split_k=2)
    _check(d.get(), base[:, :m] + 2 * want, base[:, :m] + 2 * tight, "accumulate split")
    assert np.array_equal(d_full.get()[:, m:], base[:, m:]), "columns past m were written"


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
@pytest.mark.parametrize("n", [3, 100])
def test_gemm_glu(mm, rng, q, act, n):
    m, k = 90, _k(q)
    wg, dg = _weight(q, m, k, rng)
    wu, du = _weight(q, m, k, rng)
    b = _b(rng, n, k, np.float16 if n == 100 else np.float32)
    d = poison(cupy.empty((n, m), cupy.float32))
    mm.gemm_glu(wg, wu, cupy.asarray(b), d, act=act)
    _check_glu(d.get(), dg, du, b, act, ref.glu(dg, du, b, act, inputs=ref.gemm_f16_inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("q", [T.Q5_0, T.Q8_0, T.Q4_0], ids=lambda q: NAMES[q])
@pytest.mark.parametrize("n", [37, 300])
def test_gemm_padded_rows(mm, rng, q, n):
    """pad_rows: rows of k = 640 (Q5_0 440 bytes, Q8_0 680; Q4_0's 360) copied 16 bytes apart, the gap
    poisoned after the copy to prove it is never read; gemm (gemm_f16 at n = 37, gemm_wgr at 300), the
    fused GLU and the int8 GEMM on the padded copies against float64, as on the GGUF rows."""
    m, k = 77, 640
    w, dense = _weight(q, m, k, rng, pad_front=2)
    wu, du = _weight(q, m, k, rng)
    pw, pu = mm.pad_rows(w), mm.pad_rows(wu)
    assert pw.row_stride % 16 == 0 and pw.row_stride - 16 < pw.row_bytes == w.row_bytes and M._raw16(pw)
    rows = pw.buf.reshape(m, pw.row_stride)
    assert (rows[:, :w.row_bytes].get() == w.buf[w.offset:w.offset + m * w.row_bytes].get().reshape(m, -1)).all()
    rows[:, w.row_bytes:] = 0xFF
    b = _b(rng, n, k, np.float32)
    d = poison(cupy.empty((n, m), cupy.float32))
    mm.gemm(pw, cupy.asarray(b), d)
    _check(d.get(), ref.gemm(dense, b), ref.gemm_f16_inputs(dense, b))
    mm.gemm_glu(pw, pu, cupy.asarray(b), d, act="swiglu")
    _check_glu(d.get(), dense, du, b, "swiglu", ref.glu(dense, du, b, "swiglu", inputs=ref.gemm_f16_inputs))
    qa, (da, sa, qs) = _q8_1(mm, b)
    d8 = poison(cupy.empty((n, m), cupy.float32))
    mm.gemm_q8(pw, qa, d8)
    exact = ref.gemm_q8_1(dense, ref.k_mins(w.buf[w.offset:w.offset + m * w.row_bytes].get().reshape(m, -1), q, m, k),
                          da, sa, qs)
    assert_close(d8.get(), exact, atol=2e-5 * _rms(exact), rtol=1e-5, name="d (int8)")


def test_pad_rows_host(monkeypatch):
    """pad_rows on the host (tests/host_dispatch.py): the rows land 16 bytes apart with a zero gap, an aligned
    weight comes back as itself; QWeight checks row_stride (at least the row, a multiple of the block's
    alignment, inside the buffer); the matvecs and a mismatched GLU pair refuse padded rows before a launch."""
    from host_dispatch import host_array, host_view, patch
    from cukern.dmmv import DmmvDispatch
    launches = patch(monkeypatch)
    mm = MatmulDispatch()
    raw = np.random.default_rng(1).integers(0, 256, 5 * 440, dtype=np.uint8)
    w = QWeight(host_array(raw.size, np.uint8, raw), T.Q5_0, 5, 640)
    pw = mm.pad_rows(w)
    assert (pw.row_bytes, pw.row_stride, pw.m, pw.k) == (440, 448, 5, 640)
    rows = host_view(pw.buf).reshape(5, 448)
    assert (rows[:, :440] == raw.reshape(5, 440)).all() and not rows[:, 440:].any()
    aligned = QWeight(host_array(4 * 352, np.uint8, 0), T.Q5_0, 4, 512)
    assert mm.pad_rows(aligned) is aligned and mm.pad_rows(pw) is pw
    for stride, err in ((400, "must be >= 440"), (441, "multiple of 2")):
        with pytest.raises(ValueError, match=err):
            QWeight(host_array(5 * 448, np.uint8, 0), T.Q5_0, 5, 640, row_stride=stride)
    with pytest.raises(ValueError, match="needs"):
        QWeight(host_array(4 * 448 + 100, np.uint8, 0), T.Q5_0, 5, 640, row_stride=448)
    x, y = host_array(640), host_array(5)
    with pytest.raises(ValueError, match="padded rows are the tiled GEMMs'"):
        DmmvDispatch().dmmv(pw, x, y)
    with pytest.raises(ValueError, match="same row_stride"):
        mm.gemm_glu(pw, w, host_array((16, 640)), host_array((16, 5)), act="swiglu")
    assert not launches


# ---------------------------------------------------------------------------- packed weights (gemm_wgr)
PACKED = list(M.PACKED_LAYOUTS)


def test_packed_reference_values():
    """ref.pack_wgr's values are the GGUF weights to f16 accuracy (one or two f16 roundings)."""
    rng = np.random.default_rng(3)
    for q in PACKED:
        m, k = 70, 512
        raw = ref.random_weight(q, m, k, rng)
        _, vals = ref.pack_wgr(raw, q, m, k)
        dense = ref.dequantize(raw, q, m, k)
        assert np.abs(vals.astype(np.float64) - dense).max() <= 2e-3 * np.abs(dense).max(), NAMES[q]


def test_packed_glu_reference_rows():
    """ref.pack_wgr_glu's tiles are pack_wgr's rows of the two matrices, interleaved by 8-row groups (64 of
    each a tile), the rows past m zero; its values are pack_wgr's."""
    rng = np.random.default_rng(4)
    for q in PACKED:
        m, k, stride = 150, 512, M.PACKED_LAYOUTS[q][1]
        raws = [ref.random_weight(q, m, k, rng) for _ in range(2)]
        got, vg, vu = ref.pack_wgr_glu(raws[0], raws[1], q, m, k)
        tiles = got.reshape(3, 2, 128, stride)  # [tile, super-block, tile row, stride]
        for mat, raw in enumerate(raws):
            one, vals = ref.pack_wgr(raw, q, m, k)
            rows = one.reshape(2, 2, 128, stride).transpose(0, 2, 1, 3).reshape(256, 2, stride)[:m]
            assert np.array_equal((vg, vu)[mat], vals)
            for r in range(3 * 128):
                src = 64 * (r // 128) + 8 * ((r % 128) // 16) + r % 8
                if (r // 8) % 2 == mat:
                    want = rows[src] if src < m else 0
                    assert np.array_equal(tiles[r // 128, :, r % 128], np.broadcast_to(want, (2, stride))), (q, r)


def test_pack_rejects_before_launch(mm, rng, host_if_no_gpu):
    f16 = QWeight(cupy.zeros(10 * 256 * 2, cupy.uint8), 1, 10, 256)  # F16: no tiled GEMM, no packed layout
    with pytest.raises(ValueError, match="no tiled GEMM"):
        mm.pack(f16)
    w, _ = _weight(8, 10, 32 * 9, rng)  # k not whole super-blocks
    with pytest.raises(ValueError, match="multiple of 256"):
        mm.pack(w)


@pytest.mark.gpu
@pytest.mark.parametrize("q", PACKED, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("m,n,k_mult", [(77, 1, 1), (203, 300, 3), (130, 129, 2), (196, 257, 2)])
def test_gemm_packed(mm, rng, q, m, n, k_mult):
    """MatmulDispatch.pack writes ref.pack_wgr's bytes exactly (rows past m zero); gemm on the packed weight
    (gemm_wgr, sm_90) against the float64 product of the packed values (kernel error) and of the GGUF
    weights (the issue's bound); ragged m and n, split K, accumulate."""
    k, pad = 256 * k_mult, M._W_ALIGN[q] * 3  # a nonzero offset, aligned as the type must be
    w, dense = _weight(q, m, k, rng, pad_front=pad)
    pw = mm.pack(w)
    want_bytes, vals = ref.pack_wgr(w.buf[pad:pad + m * w.row_bytes].get(), q, m, k)
    assert np.array_equal(pw.buf.get(), want_bytes), "device packer"
    if not mm._units[q].is_sm90():
        pytest.skip("packed weights run on gemm_wgr (sm_90 only)")
    b = _b(rng, n, k, np.float16)
    d = poison(cupy.empty((n, m), cupy.float32))
    mm.gemm(pw, cupy.asarray(b), d, split_k=1)
    tight = ref.gemm(vals.astype(np.float64), b)
    _check(d.get(), ref.gemm(dense, b), tight)
    mm.gemm(pw, cupy.asarray(b), d, accumulate=True, split_k=k_mult)
    _check(d.get(), 2 * ref.gemm(dense, b), 2 * tight, "accumulate split")


@pytest.mark.gpu
@pytest.mark.parametrize("q", PACKED, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
@pytest.mark.parametrize("m,n,bt", [(90, 100, 128), (92, 257, 256), (64, 1, 256)])
def test_gemm_glu_packed(mm, rng, q, act, m, n, bt, monkeypatch):
    """MatmulDispatch.pack_glu writes ref.pack_wgr_glu's bytes exactly; gemm_glu on it (gemm_wgr, sm_90)
    against the float64 GLU of the packed values (kernel error) and of the GGUF weights; ragged m and n,
    d by element stores (m = 90) and tensor stores (m = 92, 64)."""
    k = 512
    wg, dg = _weight(q, m, k, rng)
    wu, du = _weight(q, m, k, rng, pad_front=M._W_ALIGN[q] * 5)
    pw = mm.pack_glu(wg, wu)
    want_bytes, vg, vu = ref.pack_wgr_glu(*(w.buf[w.offset:w.offset + m * w.row_bytes].get() for w in (wg, wu)),
                                          q, m, k)
    assert np.array_equal(pw.buf.get(), want_bytes), "device packer"
    if not mm._units[q].is_sm90():
        pytest.skip("packed weights run on gemm_wgr (sm_90 only)")
    monkeypatch.setattr(mm, "WG_TILE", bt)
    b = _b(rng, n, k, np.float16)
    d = poison(cupy.empty((n, m), cupy.float32))
    mm.gemm_glu(pw, None, cupy.asarray(b), d, act=act)
    tight = ref.glu(vg.astype(np.float64), vu.astype(np.float64), b, act)
    _check_glu(d.get(), dg, du, b, act, tight)


def test_packed_bad_input(mm, rng, host_if_no_gpu):
    w, _ = _weight(12, 40, 512, rng)
    pw = mm.pack(w)
    b = cupy.zeros((8, 256), cupy.float16)  # k mismatch
    with pytest.raises(ValueError):
        mm.gemm(pw, b, cupy.zeros((8, 40), cupy.float32))
    with pytest.raises(ValueError, match="gemm_wgr only"):
        mm.gemm(pw, cupy.zeros((8, 512), cupy.float16), cupy.zeros((8, 40), cupy.float32), wgmma=False)
    with pytest.raises(TypeError):
        mm.gemm_glu(pw, pw, cupy.zeros((8, 512), cupy.float16), cupy.zeros((8, 40), cupy.float32))
    with pytest.raises(ValueError, match="needs"):  # a hand-made PackedWeight too small for its shape
        M.PackedWeight(pw.buf[:1024], 12, 40, 512)
    with pytest.raises(ValueError, match="no packed layout"):
        M.PackedWeight(pw.buf, 1, 40, 512)
    # the two kinds through their own entries only; pack_glu's pair alike
    wu, _ = _weight(12, 40, 512, rng)
    pg = mm.pack_glu(w, wu)
    b, d = cupy.zeros((8, 512), cupy.float16), cupy.zeros((8, 40), cupy.float32)
    with pytest.raises(TypeError, match="gemm_glu"):
        mm.gemm(pg, b, d)
    with pytest.raises(TypeError, match="gemm_glu"):
        mm.gemm_glu(pw, None, b, d)
    with pytest.raises(TypeError, match="w_up must be None"):
        mm.gemm_glu(pg, wu, b, d)
    with pytest.raises(ValueError, match="act"):
        mm.gemm_glu(pg, None, b, d, act="relu")
    with pytest.raises(ValueError, match="same type and shape"):
        mm.pack_glu(w, _weight(12, 41, 512, rng)[0])
    with pytest.raises(ValueError, match="needs"):  # a glu image needs twice the tiles
        M.PackedWeight(pw.buf, 12, 40 + 64, 512, glu=True)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("q, n", [(12, 300), (14, 300), (8, 300), (12, 700), (14, 700), (8, 700), (6, 700)])
def test_gemm_large(mm, rng, q, n):
    """A prefill-sized product by the default rule (on Hopper gemm_wgr from N = 256, elsewhere gemm_f16):
    several tiles, ragged both ways, long K."""
    m, k = 1000, 4096
    w, dense = _weight(q, m, k, rng)
    b = _b(rng, n, k, np.float16)
    d = poison(cupy.empty((n, m), cupy.float32))
    mm.gemm(w, cupy.asarray(b), d)
    _check(d.get(), ref.gemm(dense, b), ref.gemm_f16_inputs(_kernel_w(mm, w, dense, b), b))


@pytest.mark.gpu
@pytest.mark.parametrize("q", [T.Q4_K, T.Q8_0], ids=lambda q: NAMES[q])
def test_gemm_replay(mm, rng, q):
    """A repeated call replays the first one's launch: it reads the buffers' new contents and, with K
    slices, zeroes d again first (gemm_wgr on Hopper at this N, gemm_f16 elsewhere)."""
    m, n, k = 200, 300, 1024
    w, dense = _weight(q, m, k, rng)
    b = cupy.asarray(_b(rng, n, k, np.float16))
    d = cupy.empty((n, m), cupy.float32)
    for split in (None, 3):
        mm.gemm(w, b, d, split_k=split)
        b_new = _b(rng, n, k, np.float16)
        b[...] = cupy.asarray(b_new)
        poison(d)
        mm.gemm(w, b, d, split_k=split)
        _check(d.get(), ref.gemm(dense, b_new), ref.gemm_f16_inputs(_kernel_w(mm, w, dense, b_new), b_new),
               name=f"replay split {split}")


# ---------------------------------------------------------------------------- GPU: Hopper wgmma GEMM

def _needs_wg(mm):
    if not mm._units[T.Q8_0].is_sm90():
        pytest.skip("gemm_wgr runs on sm_90 (Hopper) only")


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("m,n,bt", [(77, 1, 128), (203, 37, 256), (130, 300, 128), (300, 129, 256),
                                    (196, 37, 256), (260, 257, 128)])
def test_gemm_wg(mm, rng, q, m, n, bt, monkeypatch):
    """gemm_wgr with both token tiles, ragged M and N, 5 super-stages (the raw ring wraps) and, for
    the 32-block types, a K tail; rows not 16-byte aligned for most types (synchronous raw copies).
    d is written by tensor stores where its rows are 16-byte aligned (m % 4 == 0, or n = 1), by
    element stores otherwise (m = 203, 130)."""
    _needs_wg(mm)
    monkeypatch.setattr(mm, "WG_TILE", bt)
    k = _k(q, 5)
    w, dense = _weight(q, m, k, rng, pad_front=32)
    b = _b(rng, n, k, np.float16)
    d = poison(cupy.empty((n, m), cupy.float32))
    mm.gemm(w, cupy.asarray(b), d, wgmma=True)
    _check(d.get(), ref.gemm(dense, b), ref.gemm_f16_inputs(_kernel_w(mm, w, dense, b, True), b))


@pytest.mark.gpu
@pytest.mark.parametrize("q", [T.Q4_K, T.Q6_K, T.Q4_0], ids=lambda q: NAMES[q])
def test_gemm_wg_f32_activations(mm, rng, q):
    """f32 activations on the gemm_wgr path (the default rule from WG_MIN_N columns on Hopper):
    rounded to f16 into the dispatch's staging buffer from a row-strided b, at an n that fits the
    buffer and one that regrows it, a replay converting new contents, and the fused GLU."""
    _needs_wg(mm)
    m, k = 150, _k(q)
    w, dense = _weight(q, m, k, rng)
    wu, du = _weight(q, m, k, rng)
    for n in (300, 260, 520):
        b_full = _b(rng, n, k + 8, np.float32)  # row stride k + 8 floats
        b = cupy.asarray(b_full)[:, :k]
        d = poison(cupy.empty((n, m), cupy.float32))
        for _ in range(2):  # the second call replays (b's new contents converted again)
            b_full = _b(rng, n, k + 8, np.float32)
            b[...] = cupy.asarray(b_full)[:, :k]
            poison(d)
            mm.gemm(w, b, d)
            bb = b_full[:, :k]
            _check(d.get(), ref.gemm(dense, bb), ref.gemm_f16_inputs(_kernel_w(mm, w, dense, bb), bb), name=f"n {n}")
    mm.gemm_glu(w, wu, b, poison(d), act="swiglu")
    kg, ku = _kernel_w(mm, w, dense, bb), _kernel_w(mm, wu, du, bb)
    _check_glu(d.get(), dense, du, bb, "swiglu", ref.glu(kg, ku, bb, "swiglu", inputs=ref.gemm_f16_inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("d_pad", [3, 4])
def test_gemm_wg_aligned_split_accumulate(mm, rng, q, d_pad):
    """gemm_wgr with 16-byte aligned rows (cp.async raw copies), forced K splits, accumulate mode
    and row-strided b and d views: d's rows m + d_pad floats apart, by element stores (3) or by
    tensor stores and reduce-adds (4); the columns past m stay untouched either way."""
    _needs_wg(mm)
    m, n, k = 140, 200, 2048
    raw = ref.random_weight(q, m, k, rng)
    dense = ref.dequantize(raw, q, m, k)
    w = QWeight(cupy.asarray(raw.ravel()), q, m, k)
    assert M._raw16(w) == 1
    b_full = _b(rng, n, k + 40, np.float16)  # row stride k + 40 halves (80 bytes)
    b = cupy.asarray(b_full)[:, :k]
    d_full = cupy.asarray(rng.standard_normal((n, m + d_pad)).astype(np.float32))
    d = d_full[:, :m]
    want = ref.gemm(dense, b_full[:, :k])
    tight = ref.gemm_f16_inputs(ref.wgr_values(raw, q, m, k), b_full[:, :k])
    mm.gemm(w, b, d, split_k=3, wgmma=True)
    _check(d.get(), want, tight, "split")
    base = d_full.get()
    mm.gemm(w, b, d, accumulate=True, split_k=1, wgmma=True)
    _check(d.get(), base[:, :m] + want, base[:, :m] + tight, "accumulate")
    mm.gemm(w, b, d, accumulate=True, split_k=2, wgmma=True)
    _check(d.get(), base[:, :m] + 2 * want, base[:, :m] + 2 * tight, "accumulate split")
    assert np.array_equal(d_full.get()[:, m:], base[:, m:]), "columns past m were written"


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=lambda q: NAMES[q])
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
@pytest.mark.parametrize("m,n,bt", [(90, 100, 128), (92, 300, 256), (90, 130, 128), (92, 257, 256)])
def test_gemm_glu_wg(mm, rng, q, act, m, n, bt, monkeypatch):
    """The fused GLU on gemm_wgr; d by element stores (m = 90) or tensor stores (m = 92)."""
    _needs_wg(mm)
    monkeypatch.setattr(mm, "WG_TILE", bt)
    k = _k(q)
    wg, dg = _weight(q, m, k, rng)
    wu, du = _weight(q, m, k, rng)
    b = _b(rng, n, k, np.float16)
    d = poison(cupy.empty((n, m), cupy.float32))
    mm.gemm_glu(wg, wu, cupy.asarray(b), d, act=act, wgmma=True)
    kg, ku = _kernel_w(mm, wg, dg, b, True), _kernel_w(mm, wu, du, b, True)
    _check_glu(d.get(), dg, du, b, act, ref.glu(kg, ku, b, act, inputs=ref.gemm_f16_inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=lambda q: NAMES[q])
def test_dequantize_f16(mm, rng, q):
    m, k = 33, _k(q)
    w, dense = _weight(q, m, k, rng, pad_front=16)
    out = poison(cupy.empty((m, k), cupy.float16))
    mm.dequantize(w, out)
    assert np.array_equal(out.get(), dense.astype(np.float16)), "f16 dequantization must round once, exactly"


# ---------------------------------------------------------------------------- GPU: int8 GEMM

def _q8_1(mm, b):
    """Q8_1 rows of b quantized on the GPU, and their (d, s, qs) read back."""
    n, k = b.shape
    q = cupy.empty((n, k // 32 * ref.Q8_1_BYTES), cupy.uint8)
    mm.quantize_q8_1(cupy.asarray(b), q)
    return q, ref.unpack_q8(q.get(), k, "q8_1")


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


@pytest.mark.gpu
def test_matmul_paths_agree(mm, rng):
    """matmul() by each path: matvec (dmmv), f16 and int8 against the float64 product."""
    q, m, k = 12, 96, 512
    w, dense = _weight(q, m, k, rng)
    for n, path in [(3, None), (3, "f16"), (40, None), (40, "matvec")]:
        b = _b(rng, n, k, np.float32)
        d = poison(cupy.empty((n, m), cupy.float32))
        mm.matmul(w, cupy.asarray(b), d, path=path)
        x = b
        if path == "matvec" or (path is None and n <= mm.MATVEC_MAX_N):
            # the dmmv family's default: its int8 path for this type (x rounded to 8 bits per 32)
            x = dmmv_ref.quantize_q8(b)
        assert_close(d.get(), ref.gemm(dense, x), atol=2e-3 * _rms(ref.gemm(dense, x)), rtol=2e-3, name=str(path))
    qa, _ = _q8_1(mm, b)
    d = poison(cupy.empty((40, m), cupy.float32))
    mm.matmul(w, qa, d)
    want = ref.gemm(dense, b)
    assert float(np.mean((d.get() - want) ** 2) / np.mean(want ** 2)) <= 5e-4
    with pytest.raises(ValueError, match="Q8_1"):
        mm.matmul(w, cupy.asarray(b), d, path="int8")
    with pytest.raises(ValueError, match="path must be"):
        mm.matmul(w, cupy.asarray(b), d, path="cublas")


# ---------------------------------------------------------------------------- GPU: bad input

def test_bad_input_raises_before_launch(mm, rng, host_if_no_gpu):
    w, _ = _weight(12, 64, 256, rng)
    b = cupy.zeros((4, 256), cupy.float32)
    d = cupy.zeros((4, 64), cupy.float32)
    with pytest.raises(TypeError):
        mm.gemm("not a weight", b, d)
    with pytest.raises(ValueError, match="no tiled GEMM"):
        mm.gemm(QWeight(cupy.zeros(64 * 256 * 2, cupy.uint8), "F16", 64, 256), b, d)
    with pytest.raises(ValueError, match="at least one column"):
        mm.gemm(w, cupy.zeros((0, 256), cupy.float32), cupy.zeros((0, 64), cupy.float32))
    with pytest.raises(ValueError, match=r"\[n, 256\]"):
        mm.gemm(w, cupy.zeros((4, 255), cupy.float32), d)
    with pytest.raises(ValueError):
        mm.gemm(w, b, cupy.zeros((5, 64), cupy.float32))
    with pytest.raises(TypeError):
        mm.gemm(w, b.astype(cupy.float64), d)
    with pytest.raises(ValueError, match="16-byte aligned"):
        mm.gemm(w, cupy.zeros(4 * 256 + 1, cupy.float32)[1:].reshape(4, 256), d)
    with pytest.raises(ValueError, match="overlap"):
        buf = cupy.zeros((4, 320), cupy.float32)
        mm.gemm(w, buf[:, :256], buf[:, 256:])
    with pytest.raises(ValueError, match="aligned"):  # Q4_K rows are read as uint4: 16-byte start
        mm.gemm(QWeight(cupy.zeros(64 * 144 + 4, cupy.uint8), "Q4_K", 64, 256, offset=4), b, d)
    with pytest.raises(ValueError):
        QWeight(cupy.zeros(64 * 144 - 1, cupy.uint8), "Q4_K", 64, 256)  # buffer too small
    with pytest.raises(ValueError):
        QWeight(cupy.zeros(64 * 144, cupy.uint8), "Q4_K", 64, 200)  # k not a multiple of 256
    with pytest.raises(ValueError, match="act"):
        mm.gemm_glu(w, w, b, d, act="relu")
    w8, _ = _weight(8, 64, 256, rng)
    with pytest.raises(ValueError, match="same type"):
        mm.gemm_glu(w, w8, b, d)
    with pytest.raises(ValueError, match="split_k"):
        mm.gemm(w, b, d, split_k=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        mm.quantize_q8_1(cupy.zeros((2, 48), cupy.float32), cupy.zeros((2, 54), cupy.uint8))
    with pytest.raises(ValueError, match=r"q must be uint8 \[2, 72\]"):
        mm.quantize_q8_1(cupy.zeros((2, 64), cupy.float32), cupy.zeros((2, 68), cupy.uint8))
    with pytest.raises(ValueError):
        mm.dequantize(w, cupy.zeros((64, 256), cupy.float16)[:, :128])
    with pytest.raises(ValueError, match="Q8_1 rows"):
        mm.gemm_q8(w, cupy.zeros((4, 256 // 32 * 34), cupy.uint8), d)
    with pytest.raises(ValueError, match="at least one column"):
        mm.gemm_q8(w, cupy.zeros((0, 288), cupy.uint8), cupy.zeros((0, 64), cupy.float32))
    with pytest.raises(ValueError, match="4-byte aligned"):
        mm.gemm_q8(w, cupy.zeros(4 * 288 + 2, cupy.uint8)[2:].reshape(4, 288), d)
    qa = cupy.zeros((4, 288), cupy.uint8)
    with pytest.raises(ValueError, match="m % 32"):
        w60, _ = _weight(12, 60, 256, rng)
        mm.gemm_q8_glu(w60, w60, qa, cupy.zeros((4, 2 * 36), cupy.uint8), out_format="q8_1")
    with pytest.raises(ValueError, match="out_format"):
        mm.gemm_q8_glu(w, w, qa, d, out_format="q4")
    with pytest.raises(ValueError, match=r"uint8 \[n, 68\]"):
        mm.gemm_q8_glu(w, w, qa, cupy.zeros((4, 72), cupy.uint8), out_format="q8_0")
