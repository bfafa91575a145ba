"""matmul family (cukern/matmul/dispatch.py) against float64 references (cukern/reference/matmul.py)
built on gguf's own dequantization of random valid GGUF blocks: the family declaration, plan rules,
replay, the tiled f16 GEMM, the Hopper wgmma GEMM, the paths agreeing and bad input.

Tolerances and the quantizers' rules: matmul_helpers.py.
"""

from __future__ import annotations

import gc
import types
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
from matmul_helpers import NAMES, TYPES, _b, _check, _check_glu, _k, _q8_1, _rms, _weight  # noqa: E402


def _kernel_w(mm, w, dense, b, wgmma=None):
    """The f16 weights the kernel gemm() picks multiplies: gemm_wgr's (ref.wgr_values, from the
    raw bytes read back) or the dense matrix (rounded to f16 by gemm_f16_inputs)."""
    if not mm._use_wg(w, w, b.shape[0], wgmma):
        return dense
    return ref.wgr_values(w.buf[w.offset:w.offset + w.m * w.row_bytes].get(), w.qtype, w.m, w.k)


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


def test_small_grid_rule(monkeypatch):
    """A gemm_f16 grid short of _FILL CTAs per SM takes smaller token tiles and K slices of 256 (Gemma 3
    270M's prompt GEMMs at 128 tokens on 132 SMs: the fastest measured tile and split of each); grids that
    already fill the GPU keep the token tile that holds n and the older split rule."""
    monkeypatch.setattr(MatmulDispatch, "sm_count", lambda self: 132)
    mm = MatmulDispatch.__new__(MatmulDispatch)
    w = lambda m, k: types.SimpleNamespace(m=m, k=k)  # noqa: E731 (the rule reads the shape alone)
    for (m, k, n), (bt, slices) in {(1024, 640, 128): (32, 3), (256, 640, 128): (16, 3), (640, 1024, 128): (32, 4),
                                    (640, 2048, 128): (64, 8), (256, 640, 1024): (64, 3),
                                    (4096, 4096, 512): (128, 3), (4096, 4096, 128): (128, 8)}.items():
        got_bt, grid, _ = mm._grid(n, w(m, k), None, "gemm", fill=True)
        assert (got_bt, grid[2]) == (bt, slices), (m, k, n)
        assert grid[0] == -(-n // bt)
    assert mm._grid(128, w(1024, 640), None, "gemm")[0] == 128  # without fill: the old rule
    assert mm._fill(128, 32, 128, 640, 256, split_ok=False) == (32, 1)  # the GLU GEMM's 64-row tiles of d_ff 2048
    assert mm._fill(16, 2, 16, 640, 256) == (16, 3)  # nothing smaller than the smallest tile


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


# ---------------------------------------------------------------------------- packed weights (gemm_wgr)

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


# ---------------------------------------------------------------------------- GPU: quantizers

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
