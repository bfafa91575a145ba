"""matmul's gemm_wgr and its packed / padded weights (cukern/matmul/wgr.py) against float64
references (cukern/reference/matmul.py).

Tolerances: matmul_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.dmmv import QWeight  # noqa: E402
from cukern.matmul import MatmulDispatch  # noqa: E402
from cukern.matmul import common as M  # noqa: E402 (the family's constants and operand helpers)
from cukern.qtypes import GGMLType as T  # noqa: E402
from cukern.reference import matmul as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402
from matmul_helpers import NAMES, TYPES, _b, _check, _check_glu, _q8_1, _rms, _weight  # noqa: E402


@pytest.fixture(scope="module")
def mm():
    return MatmulDispatch()


# ---------------------------------------------------------------------------- CPU

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
