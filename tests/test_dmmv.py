"""dmmv family against float64 references (cukern/reference/dmmv.py) built on gguf's own
dequantization.

Weights are random *valid* GGUF blocks (cukern.reference.dmmv.random_weight), so the kernel and
the reference see exactly the same blocks: the comparison is kernel(W_blocks, x) against
dequantize(W_blocks) @ x in float64. Tolerance: the issue's relative error 2e-3, plus an absolute
floor of 1e-4 * rms(reference) for outputs that cancel to near zero (f32 accumulation over k
terms is ~1e-6 relative; one wrong nibble is ~1e-2).
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern import dmmv as D  # noqa: E402
from cukern.dmmv import dense as DENSE  # noqa: E402 (kernel names of the f32 path)
from cukern.dmmv import q8 as Q8  # noqa: E402 (the int8 path's kernel names, shared memory, blocks)
from cukern.dmmv.weights import _q8x_col_bytes  # noqa: E402
from cukern.dispatch import Unit  # noqa: E402
from cukern.dmmv import DeviceError, DmmvDispatch, QWeight  # noqa: E402
from cukern.reference import dmmv as ref  # noqa: E402
from cukern.testing import assert_close, nmse, poison  # noqa: E402

TYPES = list(ref.TYPES)  # every GGML type id the family supports
NAMES = {q: ref.TYPES[q][0] for q in TYPES}
RTOL = 2e-3
# The int8 path against the exact x: the NMSE of x's 8-bit rounding alone, from the float64
# reference at these tests' shapes (300-4000 random draws per type and k): median ~3e-5,
# heavy-tailed at few blocks per row (max 8.7e-4, MXFP4 k = 32; Q4_K/Q5_K k = 256 up to 4.4e-4),
# so the former 2e-4 failed about 0.1-0.5% of checks. One wrong unit of 32 among a row's <= 41 is
# >= 2e-2; the element-wise check against x^ comes first in any case.
Q8_NMSE = 1e-3
# act(g) * u of two int8-path dots: g's error passes through act's log-derivative (1 + |g| on SiLU's
# negative tail), so the product's NMSE is a few times a dot's; over 33 outputs it measured up to
# 5.2e-4 (H100). Element-wise against x^, the kernel's own math, the bound stays RTOL.
Q8_NMSE_GLU = 2e-3


def _ks(q):
    """Valid k for a type: one block, a tail (k % 256 != 0) where the block allows, several steps."""
    be = ref.TYPES[q][1]
    if be == 1:
        return [4, 132, 1028]
    if be == 32:
        return [32, 224, 1312]
    return [256, 1280]


def _check(out, want, name="out"):
    want = np.asarray(want, dtype=np.float64)
    rms = float(np.sqrt(np.mean(want * want))) if want.size else 0.0
    assert_close(out, want, atol=1e-4 * rms + 1e-30, rtol=RTOL, name=name)


def _xhat(q, x, int8_path=True):
    """The x the kernel multiplies: the int8 path (dmmv, moe_dmmv without GLU, for D.Q8_TYPES) rounds
    x to 8 bits per 32 elements (ref.quantize_q8 emulates it exactly)."""
    return ref.quantize_q8(x) if int8_path and q in D.Q8_TYPES else x


def _check_q(out, q, f, x, name="out", bound=Q8_NMSE):
    """out against f(x^) element-wise; on the int8 path also its error against f(x), by NMSE."""
    _check(out, f(_xhat(q, x)), name)
    if q in D.Q8_TYPES and out.size >= 32:  # a norm over a handful of outputs is noise
        err = nmse(out, f(x))
        assert err < bound, f"{name}: NMSE {err:.3g} against the exact x"


def _weight(q, m, k, rng, *, pad_front=0, n_experts=0):
    """(QWeight on the device, float64 dequantized [m, k] or [n_e, m, k])."""
    rows = m * max(n_experts, 1)
    raw = ref.random_weight(q, rows, k, rng)
    dense = ref.dequantize(raw, q, rows, k)
    buf = np.concatenate([rng.integers(0, 256, pad_front, dtype=np.uint8), raw.ravel(),
                          rng.integers(0, 256, 7, dtype=np.uint8)])  # trailing bytes: never read as weights
    w = QWeight(cupy.asarray(buf), q, m, k, offset=pad_front, n_experts=n_experts)
    if n_experts:
        dense = dense.reshape(n_experts, m, k)
    return w, dense


def _x(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def d():
    return DmmvDispatch()


# ---------------------------------------------------------------------------- CPU
def test_families_declared():
    assert set(D.FAMILIES) == {"dmmv", "dmmv_glu", "dmmv_moe", "dmmv_moe_packed", "dmmv_q8x", "dmmv_two", "dmmv_nx",
                               "dmmv_three", "dmmv_mx"}
    names = {k.name for f in D.FAMILIES.values() for k in f.kernels}
    for q in TYPES:
        for n in (1, 2, 4, 8):
            assert DENSE._kernel(q, n) in names and f"dmmv_glu<{q}, {n}>" in names
        assert f"moe_down<{q}>" in names and f"dequantize<{q}>" in names
    for q in D.Q8_TYPES:
        assert Q8._q8_moe_glu_kernel(q) in names and Q8._q8_down_kernel(q) in names
    for q in D.Q8_TYPES:
        assert Q8._q8_kernel(q, None) in names and all(Q8._q8_kernel(q, n) in names for n in (1, 2, 4, 8))
        assert all(Q8._q8_kernel(q, n, pq=True) in names for n in (1, 2, 4, 8))
        assert all(Q8._q8_two_kernel(q, n, g) in names for n in (1, 2, 4, 8) for g in (False, True))
    assert {"quantize_x<false>", "quantize_x<true>"} <= names
    assert {f"quantize_glu<{il}, {a}>" for il in ("false", "true") for a in (0, 1)} <= names


@pytest.mark.parametrize("interleaved", [False, True])
def test_decode_quantized_x_layout(rng, interleaved):
    """ref.decode_quantized_x (what the GPU test of quantize_x reads its output with) inverts the layout
    that q8::load_x documents, written here byte by byte: q planes (bytes 0...15 of every block, then
    16...31; interleaved: byte 2j = element j, 2j + 1 = element 16 + j), then (f32 d, int16 sums)."""
    n, k = 3, 96
    q, d = ref.quantize_q8_blocks(_x(rng, n, k))
    buf = np.full((n, _q8x_col_bytes(k)), 0xEE, np.uint8)
    for c in range(n):
        for e in range(k):
            blk, j = divmod(e, 32)
            byte = (2 * j if j < 16 else 2 * (j - 16) + 1) if interleaved else j
            buf[c, blk * 16 + (k // 2 if byte & 16 else 0) + (byte & 15)] = np.int8(q[c, e]).view(np.uint8)
        for blk in range(k // 32):
            s0, s1 = (int(q[c, 32 * blk + 16 * h:32 * blk + 16 * h + 16].astype(np.int64).sum()) for h in (0, 1))
            rec = np.float32(d[c, blk]).tobytes() + np.array([s0, s1], np.int16).tobytes()
            buf[c, k + 8 * blk:k + 8 * blk + 8] = np.frombuffer(rec, np.uint8)
    got_q, got_d, sums = ref.decode_quantized_x(buf, k, interleaved)
    np.testing.assert_array_equal(got_q, q)
    np.testing.assert_array_equal(got_d, d)
    np.testing.assert_array_equal(sums, q.reshape(n, -1, 2, 16).astype(np.int64).sum(-1))
    assert _q8x_col_bytes(k) == 128 and _q8x_col_bytes(64) == 80  # 16-byte rounded k + k / 4


def test_prequantized_host_path(monkeypatch):
    """The host side of QuantizedX on CPU (tests/host_dispatch.py: host arrays, launches recorded):
    quantize_x is one launch of the layout's kernel; dmmv on a QuantizedX launches the dmmv_q8x unit's
    kernels for the same column chunks (8 + 2 + 1) as dmmv on the f32 x launches the dmmv unit's."""
    from host_dispatch import host_array, patch
    launches = patch(monkeypatch)
    d = DmmvDispatch()
    for name, k in (("Q4_K", 512), ("MXFP4", 96)):
        q = D.qtype_id(name)
        w = QWeight(host_array((5 * D.row_bytes(q, k),), np.uint8, 0), q, 5, k)
        x, y = host_array((11, k)), host_array((11, 5))
        qx = D.QuantizedX.empty((11, k), q)
        assert qx.interleaved == (name == "MXFP4") and qx.buf.shape == (11, _q8x_col_bytes(k))
        launches.clear()
        d.quantize_x(x, qx)
        d.quantize_glu(x, x, qx, act="geglu")
        d.dmmv(w, qx, y)
        d.dmmv(w, x, y)
        il = "true" if qx.interleaved else "false"
        want = {f"quantize_x<{il}>": 1, f"quantize_glu<{il}, 1>": 1}
        for n in (8, 2, 1):
            want[Q8._q8_kernel(q, n, pq=True)] = want[Q8._q8_kernel(q, n)] = 1
        assert dict(launches) == want


def test_two_matrix_int8_host_path(monkeypatch):
    """dmmv_pair and dmmv_glu on CPU (tests/host_dispatch.py): on the int8 path each column chunk (8 + 2 + 1)
    is one dmmv_q8_two launch within the resident blocks; the pair's grid is split by the matrices'
    rows (blocks1 W1 blocks of at most ceil(m1 / blocks1) rows); the GLU plan's shared memory holds
    2 floats per column and output of the fullest block; int8=False keeps the f32 kernels."""
    from host_dispatch import host_array, patch

    from cukern import dispatch
    patch(monkeypatch)
    calls = []
    monkeypatch.setattr(dispatch.Dispatch, "_call", staticmethod(
        lambda kernel, fn, grid, block, args, shared_mem, pdl=False: calls.append((kernel, grid, shared_mem, args))))
    d = DmmvDispatch()
    q, k = D.qtype_id("Q4_K"), 4096
    w1 = QWeight(host_array((14336 * D.row_bytes(q, k),), np.uint8, 0), q, 14336, k)
    w2 = QWeight(host_array((1024 * D.row_bytes(q, k),), np.uint8, 0), q, 1024, k)
    x = host_array((11, k))
    d.dmmv_pair(w1, w2, x, host_array((11, 14336)), host_array((11, 1024)))
    assert [c[0] for c in calls] == [Q8._q8_two_kernel(q, n, False) for n in (8, 2, 1)]
    for kernel, grid, smem, args in calls:
        _, plan_smem, resident = d._resident[("dmmv_two", kernel, k)]
        p = args[-1]
        b1, blocks = int(p["blocks1"]), grid[0]
        assert smem == plan_smem and blocks <= resident and 0 < b1 < blocks
        assert max(-(-14336 // b1), -(-1024 // (blocks - b1))) <= -(-15360 // resident) + 1  # balanced
    calls.clear()
    d.dmmv_glu(w1, w1, x, host_array((11, 14336)), act="geglu", accumulate=True)
    assert [c[0] for c in calls] == [Q8._q8_two_kernel(q, n, True) for n in (8, 2, 1)]
    for kernel, grid, smem, args in calls:
        nc = int(kernel.split(", ")[1])
        nw, plan_smem, resident = d._resident[("dmmv_two", kernel, k, 14336, 1)]
        assert grid[0] == Q8._q8_blocks(14336, resident) and int(args[-1]["mode"]) == 1
        assert smem == plan_smem >= Q8._q8_smem(q, nw, nc, k) + 8 * nc * -(-14336 // resident)
        assert smem <= d.max_shared_optin()
    calls.clear()
    d32 = DmmvDispatch(int8=False)
    d32.dmmv_glu(w1, w1, x[:1], host_array((1, 14336)))
    d32.dmmv_pair(w1, w2, x[:1], host_array((1, 14336)), host_array((1, 1024)))
    assert [c[0] for c in calls] == [f"dmmv_glu<{q}, 1>", DENSE._kernel(q, 1)]


def test_int8_path_shared_memory_mirror():
    """The host's size of the int8 kernels' dynamic shared memory (q8._q8_smem, which the launches
    request) equals the kernels' own q8::smem_bytes for every type's configuration, warp count and
    column count the plans pick, at short and long k: generated static_asserts compiled by NVRTC."""
    from cukern import runtime
    asserts = []
    for qt in D.Q8_TYPES:
        lu, st, _ = Q8._Q8_CONFIG[qt]
        for nw in (4, 8, 16, 32):
            for nc in (1, 2, 4, 8):
                for k in (640, 4096, 14336):
                    want = Q8._q8_smem(qt, nw, nc, k)
                    asserts.append(f"smem_bytes<{int(qt)}, {lu}, {st}>({nw}, {nc}, {k}u) == {want}u")
    source = "\n".join(['#include "dmmv/q8.cuh"', "namespace cukern { namespace q8 {"]
                        + [f'static_assert({a}, "host mirror: {a}");' for a in asserts] + ["} }"])
    runtime.compile_ptx("probe:q8_smem", source, (), 90)


def test_quantize_q8_reference():
    """The emulated int8 rounding of x: exact on zeros and on values d * q, within d/2 elsewhere."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    x[1, 32:64] = 0.0
    xh = ref.quantize_q8(x)
    b, bh = x.reshape(3, 3, 32).astype(np.float64), xh.reshape(3, 3, 32)
    d = np.abs(b).max(-1, keepdims=True) / 127
    assert np.all(np.abs(bh - b) <= d / 2 * (1 + 1e-6))
    assert np.all(xh[1, 32:64] == 0.0)
    np.testing.assert_allclose(np.abs(bh).max(-1), np.abs(b).max(-1), rtol=1e-6)
    # max|x| = 127 gives d = 127 * f32(1/127) = 1 exactly: halves round to even (the kernel's FMA
    # with 1.5 * 2^23), not away from zero
    ties = np.zeros(32, np.float32)
    ties[:8] = [127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]
    q, d1 = ref.quantize_q8_blocks(ties)
    assert d1[0] == 1.0
    np.testing.assert_array_equal(q[:8], [127, 0, 2, 2, 0, -2, -2, 126])


def test_rejects_host_buffers_and_unknown_types():
    with pytest.raises(TypeError, match="buf must be a cupy.ndarray"):
        QWeight(np.zeros(144, np.uint8), "Q4_K", 1, 256)
    with pytest.raises(ValueError, match="unsupported weight type"):
        QWeight(np.zeros(144, np.uint8), 3, 1, 256)  # Q4_1: not supported
    with pytest.raises(ValueError, match="unsupported weight type"):
        D.qtype_id("IQ2_XS")
    with pytest.raises(TypeError, match="must be a QWeight"):
        DmmvDispatch().dmmv(np.zeros(4), np.zeros(4, np.float32), np.zeros(1, np.float32))


@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
def test_reference_layouts_match_gguf(q):
    import gguf
    be, bb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(q)]
    assert (be, bb) == ref.TYPES[q][1:] == D.QTYPES[q][1:3]
    rng = np.random.default_rng(q)
    raw = ref.random_weight(q, 3, 512, rng)
    assert raw.shape == (3, 512 // be * bb) and D.row_bytes(q, 512) == raw.shape[1]
    w = ref.dequantize(raw, q, 3, 512)
    assert np.isfinite(w).all() and np.abs(w).max() > 0


@pytest.mark.parametrize("name", ["Q4_0", "Q5_0", "Q8_0", "MXFP4", "BF16"])
def test_gguf_quantizers_round_trip(name):
    """Where gguf can quantize, its blocks dequantize back close to the input (the reference's own
    sanity: the kernels are then tested on such blocks as well as on random ones)."""
    import gguf
    from gguf.quants import quantize
    q = D.qtype_id(name)
    x = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    raw = quantize(x, gguf.GGMLQuantizationType(q))
    back = ref.dequantize(raw, q, 4, 256)
    tol = {"Q4_0": 0.2, "Q5_0": 0.1, "Q8_0": 0.02, "MXFP4": 0.35, "BF16": 0.01}[name]
    assert np.max(np.abs(back - x)) / np.max(np.abs(x)) < tol


# ---------------------------------------------------------------------------- GPU: per element
@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
def test_dequantize_matches_gguf(d, rng, q):
    k = _ks(q)[-1]
    w, dense = _weight(q, 5, k, rng, pad_front=ref.TYPES[q][2] * 3 if ref.TYPES[q][1] > 1 else 16)
    out = poison(cupy.empty((5, k), cupy.float32))
    d.dequantize(w, out)
    assert_close(out, dense, atol=0, rtol=1e-6)


# ---------------------------------------------------------------------------- GPU: dmmv
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 67])
@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
def test_dmmv(d, rng, q, m):
    for k in _ks(q):
        w, dense = _weight(q, m, k, rng)
        x = _x(rng, k)
        y = poison(cupy.empty(m, cupy.float32))
        d.dmmv(w, cupy.asarray(x), y)
        _check_q(y, q, lambda v: ref.matvec(dense, v), x, name=f"{NAMES[q]} {m}x{k}")


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
def test_gguf_quantized_blocks(d, rng, q):
    """Blocks from gguf's own quantizer where it has one (not only random bit patterns)."""
    import gguf
    from gguf.quants import quantize
    if NAMES[q] not in ("Q4_0", "Q5_0", "Q8_0", "MXFP4", "BF16", "F16", "F32"):
        pytest.skip("gguf has no quantizer for this type (random valid blocks cover it)")
    m, k = 33, 512
    raw = quantize(rng.standard_normal((m, k)).astype(np.float32), gguf.GGMLQuantizationType(q))
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(m, -1)
    dense = ref.dequantize(raw, q, m, k)
    x = _x(rng, k)
    y = poison(cupy.empty(m, cupy.float32))
    d.dmmv(QWeight(cupy.asarray(raw.ravel()), q, m, k), cupy.asarray(x), y)
    _check_q(y, q, lambda v: ref.matvec(dense, v), x)


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
def test_dmmv_offset_accumulate_scale_gate(d, rng, q):
    m, k = 19, _ks(q)[1]
    align = D.QTYPES[q][3]
    w, dense = _weight(q, m, k, rng, pad_front=align * 37)  # inside a larger buffer
    x = _x(rng, k)
    y0 = _x(rng, m)
    want = ref.matvec(dense, _xhat(q, x))
    y = cupy.asarray(y0)
    d.dmmv(w, cupy.asarray(x), y, accumulate=True)
    _check(y, y0 + want, "accumulate")
    y = cupy.asarray(y0)
    d.dmmv_scale_acc(w, cupy.asarray(x), y, -0.375)
    _check(y, y0 - 0.375 * want, "scale-accumulate")
    y = poison(cupy.empty(m, cupy.float32))
    d.dmmv(w, cupy.asarray(x), y, alpha=2.5)
    _check(y, 2.5 * want, "alpha")
    x2 = _x(rng, 3, k)
    y0 = _x(rng, 3, m)
    g = np.array([0.3, -2.0, 4.0], np.float32)
    y = cupy.asarray(y0)
    d.dmmv_gated_acc(w, cupy.asarray(x2), y, cupy.asarray(g))
    _check(y, y0 + ref.sigmoid(g.astype(np.float64))[:, None] * ref.matvec(dense, _xhat(q, x2)), "sigmoid-gated")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 3, 4, 8, 11])
@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
def test_dmmv_batched(d, rng, q, n):
    m, k = 13, _ks(q)[1]
    w, dense = _weight(q, m, k, rng)
    x = _x(rng, n, k)
    y = poison(cupy.empty((n, m), cupy.float32))
    d.dmmv_batch(w, cupy.asarray(x), y)
    _check_q(y, q, lambda v: ref.matvec(dense, v), x)


def test_split_q8_0_reference_is_gguf_dequantization():
    """The split layout holds the GGUF blocks' own values: scales * quants == gguf's dequantization."""
    rng = np.random.default_rng(5)
    raw = ref.random_weight(8, 7, 96, rng)
    quants, scales = ref.split_q8_0(raw, 7, 96)
    assert quants.dtype == np.int8 and scales.dtype == np.float16 and scales.shape == (7, 3)
    np.testing.assert_array_equal(ref.split_dense(quants, scales), ref.dequantize(raw, 8, 7, 96))


def test_repeated_matvec_calls_replay(host_if_no_gpu, monkeypatch):
    """dmmv calls repeated with equal weights (QWeight and NormedX by their fields, so a new NormedX
    over the same arrays is the same call) replay the first call's launches; a change of int8 or of a
    weight's field runs the call in full."""
    from cukern.dmmv import dense
    bodies = []
    real = dense.Dense._normed
    monkeypatch.setattr(dense.Dense, "_normed", lambda self, *a, **k: (bodies.append(1), real(self, *a, **k))[1])
    d = DmmvDispatch(pdl=True)
    buf = cupy.zeros(22 * 2 * 8, cupy.uint8)
    z = lambda *s: cupy.zeros(s, cupy.float32)  # noqa: E731
    res, w_norm, y = z(64), z(64), z(8)
    for _ in range(3):
        assert d.dmmv(QWeight(buf, "Q5_0", 8, 64), D.NormedX(res, w_norm, eps=1e-6), y) is y
    assert len(bodies) == 1
    d.dmmv(QWeight(buf, "Q5_0", 4, 64), D.NormedX(res, w_norm, eps=1e-6), y[:4])   # another m
    d.dmmv(QWeight(buf, "Q5_0", 8, 64), D.NormedX(res, w_norm, eps=1e-5), y)       # another eps
    d.int8 = False
    d.dmmv(QWeight(buf, "Q5_0", 8, 64), D.NormedX(res, w_norm, eps=1e-6), y)       # another int8
    assert len(bodies) == 4


def test_split_q8_0_rejects(host_if_no_gpu):
    d = DmmvDispatch()
    w = QWeight(cupy.zeros(22 * 2, cupy.uint8), "Q5_0", 1, 64)
    with pytest.raises(ValueError, match="single Q8_0 matrix"):
        d.split_q8_0(w)
    with pytest.raises(TypeError, match="quants must have dtype int8"):
        D.SplitQ8(cupy.zeros((2, 64), cupy.uint8), cupy.zeros((2, 2), cupy.float16))
    with pytest.raises(ValueError, match="positive multiple of 32"):
        D.SplitQ8(cupy.zeros((2, 48), cupy.int8), cupy.zeros((2, 1), cupy.float16))
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 2\)"):
        D.SplitQ8(cupy.zeros((2, 64), cupy.int8), cupy.zeros((2, 3), cupy.float16))
    s = D.SplitQ8(cupy.zeros((2, 64), cupy.int8), cupy.zeros((2, 2), cupy.float16))
    with pytest.raises(ValueError, match=r"x must be \[64\]"):
        d.dmmv(s, cupy.zeros(32, cupy.float32), cupy.zeros(2, cupy.float32))
    with pytest.raises(ValueError, match=r"y must have shape \(2\), got \(3,\)"):
        d.dmmv(s, cupy.zeros(64, cupy.float32), cupy.zeros(3, cupy.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True])
def test_split_q8_0_and_its_matvec(d, rng, padded):
    """split_q8_0 copies the GGUF blocks' bytes (GGUF rows, or rows padded to 16-byte multiples);
    dmmv on the split matrix against float64 at ragged row counts (one warp's rows, one block's,
    many blocks with a partial last one), k of one block, 20 blocks (the LM head's 640), 41, and
    1, 3, 8 and 11 columns."""
    for m, k in ((1, 32), (67, 640), (1029, 1312), (3, 640)):
        raw = ref.random_weight(8, m, k, rng)
        rb = raw.shape[1]
        stride = (rb + 15) // 16 * 16 if padded else rb
        buf = np.zeros(m * stride + 32, np.uint8)
        for i in range(m):
            buf[16 + i * stride:16 + i * stride + rb] = raw[i]
        s = d.split_q8_0(QWeight(cupy.asarray(buf), "Q8_0", m, k, offset=16, row_stride=stride))
        quants, scales = ref.split_q8_0(raw, m, k)
        np.testing.assert_array_equal(s.quants.get(), quants)
        np.testing.assert_array_equal(s.scales.get().view(np.uint16), scales.view(np.uint16))
        dense = ref.split_dense(quants, scales)
        for n in (1, 3, 8, 11):
            x = _x(rng, n, k) if n > 1 else _x(rng, k)
            y = poison(cupy.empty(x.shape[:-1] + (m,), cupy.float32))
            d.dmmv(s, cupy.asarray(x), y)
            _check(y, ref.matvec(dense, x), f"split {m}x{k} n={n}")


@pytest.mark.gpu
def test_split_q8_0_epilogues(d, rng):
    m, k = 37, 224
    raw = ref.random_weight(8, m, k, rng)
    s = d.split_q8_0(QWeight(cupy.asarray(raw.ravel()), "Q8_0", m, k))
    dense = ref.dequantize(raw, 8, m, k)
    x = _x(rng, 3, k)
    y0 = _x(rng, 3, m)
    want = ref.matvec(dense, x)
    y = cupy.asarray(y0)
    d.dmmv(s, cupy.asarray(x), y, accumulate=True, alpha=-0.375)
    _check(y, y0 - 0.375 * want, "scale-accumulate")
    g = np.array([0.3, -2.0, 4.0], np.float32)
    y = cupy.asarray(y0)
    d.dmmv_gated_acc(s, cupy.asarray(x), y, cupy.asarray(g))
    _check(y, y0 + ref.sigmoid(g.astype(np.float64))[:, None] * want, "sigmoid-gated")


def _normed(rng, shape, post, *, out=True, offset=0.0):
    """(NormedX on the device, float64 x, float64 r) with post None, "add" or "norm"."""
    k = shape[-1]
    res = _x(rng, *shape) * 3
    proj = _x(rng, *shape) * 50 if post else None
    w = rng.uniform(-1, 2, k).astype(np.float32)
    wp = rng.uniform(-1, 2, k).astype(np.float32) if post == "norm" else None
    dev = lambda a: None if a is None else cupy.asarray(a)  # noqa: E731
    nx = D.NormedX(dev(res), dev(w), dev(proj), dev(wp), poison(cupy.empty(shape, cupy.float32)) if out else None,
                   eps=1e-5, weight_offset=offset)
    x, r = ref.normed_x(res, w, proj, wp, eps=1e-5, weight_offset=offset)
    return nx, x, r


@pytest.mark.gpu
@pytest.mark.parametrize("post", [None, "add", "norm"])
@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
def test_dmmv_normed_input(d, rng, q, post):
    """dmmv, dmmv_pair and dmmv_glu on a NormedX (x made by every block from the residual stream)
    against the norm and residual add in float64 followed by the matvec; the first block's r."""
    k = _ks(q)[1]
    d32 = DmmvDispatch(int8=False)
    for n in (1, 3, 11):
        shape = (n, k) if n > 1 else (k,)
        nx, x, r = _normed(rng, shape, post, offset=1.0 if n == 3 else 0.0)
        w1, d1 = _weight(q, 37, k, rng)
        w2, d2 = _weight(q, 5, k, rng)
        y1 = poison(cupy.empty(shape[:-1] + (37,), cupy.float32))
        y2 = poison(cupy.empty(shape[:-1] + (5,), cupy.float32))
        d32.dmmv(w1, nx, y1)
        _check(y1, ref.matvec(d1, x), f"dmmv n={n}")
        _check(nx.residual_out, r, "residual_out")
        d32.dmmv_pair(w1, w2, nx, y1, y2)
        _check(y1, ref.matvec(d1, x), f"pair y1 n={n}")
        _check(y2, ref.matvec(d2, x), f"pair y2 n={n}")
        wu, du = _weight(q, 37, k, rng)
        y0 = _x(rng, *shape[:-1], 37)
        y = cupy.asarray(y0)
        d.dmmv_glu(w1, wu, nx, y, act="geglu", accumulate=True, alpha=0.5)  # the int8 dispatch: f32 path too
        _check(y, y0 + 0.5 * ref.glu(d1, du, x, "geglu"), f"glu n={n}")


@pytest.mark.gpu
@pytest.mark.parametrize("q, q3", D.THREE_TYPES, ids=lambda t: NAMES.get(t, str(t)))
def test_dmmv_three(d, rng, q, q3):
    """q, k and v in one launch (dmmv_nx3): the third matrix of its own type, every block count
    ragged, against the norm in float64 followed by the three matvecs; the first block's r."""
    k = 1280  # whole blocks of every type
    for post, shape in (("norm", (k,)), (None, (1, k))):
        nx, x, r = _normed(rng, shape, post)
        ws = [_weight(qt, m, k, rng) for qt, m in ((q, 37), (q, 5), (q3, 13))]
        ys = [poison(cupy.empty(shape[:-1] + (m,), cupy.float32)) for m in (37, 5, 13)]
        d.dmmv_three(*(w for w, _ in ws), nx, *ys)
        for i, (y, (_, dense)) in enumerate(zip(ys, ws)):
            _check(y, ref.matvec(dense, x), f"y{i + 1} post={post}")
        _check(nx.residual_out, r, "residual_out")


def test_dmmv_three_rejects(host_if_no_gpu):
    d = DmmvDispatch()
    z = lambda *s: cupy.zeros(s, cupy.float32)  # noqa: E731
    q5 = QWeight(cupy.zeros(22 * 2 * 4, cupy.uint8), "Q5_0", 4, 64)
    q4 = QWeight(cupy.zeros(18 * 2 * 4, cupy.uint8), "Q4_0", 4, 64)
    nx = D.NormedX(z(64), z(64))
    with pytest.raises(ValueError, match="must share a type"):
        d.dmmv_three(q5, q4, q5, nx, z(4), z(4), z(4))
    with pytest.raises(ValueError, match="W3 of Q4_0 beside Q5_0 is not built"):
        d.dmmv_three(q5, q5, q4, nx, z(4), z(4), z(4))
    with pytest.raises(TypeError, match="takes a NormedX"):
        d.dmmv_three(q5, q5, q5, z(64), z(4), z(4), z(4))
    with pytest.raises(ValueError, match="one column"):
        d.dmmv_three(q5, q5, q5, D.NormedX(z(2, 64), z(64)), z(2, 4), z(2, 4), z(2, 4))
    with pytest.raises(ValueError, match=r"y3 must have shape \(4\)"):
        d.dmmv_three(q5, q5, q5, nx, z(4), z(4), z(5))


@pytest.mark.gpu
def test_dmmv_normed_input_without_residual_out(d, rng):
    nx, x, _ = _normed(rng, (640,), "norm", out=False)
    w, dense = _weight(6, 1029, 640, rng)
    y = poison(cupy.empty(1029, cupy.float32))
    d.dmmv(w, nx, y)
    _check(y, ref.matvec(dense, x))


def _merged(rng, s, h, d, *, sinks=False, empty=()):
    """(MergedX on the device, float64 x): s states of h heads of d; the states in ``empty`` have no keys
    (LSE -inf, O poisoned: never read)."""
    o = rng.standard_normal((s, h, d)).astype(np.float32)
    lse = (rng.standard_normal((s, h)) * 4).astype(np.float32)
    for i in empty:
        lse[i] = -np.inf
        o[i] = np.nan
    sk = (rng.standard_normal(h) * 2).astype(np.float32) if sinks else None
    mx = D.MergedX(cupy.asarray(o), cupy.asarray(lse), None if sk is None else cupy.asarray(sk))
    return mx, ref.merged_x(o, lse, sk)


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
def test_dmmv_merged_input(d, rng, q):
    """dmmv on a MergedX (the split attention states merged by every block) against the merge in
    float64 followed by the matvec: one state, many (more than a warp), empty states, a head with no
    keys at all, sinks, Gemma 3's 4 x 256 and ragged head counts; store and accumulate."""
    wide = ref.TYPES[q][1] == 256  # k a multiple of the 256-element super-block
    for s, h, dh, kw in ((1, 4, 256, {}), (7, 5, 256 if wide else 64, dict(sinks=True, empty=(2, 5))),
                         (37, 3 if not wide else 2, 128, {}), (4, 2, 640 if wide else 160, dict(empty=(0, 1, 2, 3))),
                         (3, 2, 384 if wide else 96, dict(sinks=True, empty=(0, 1, 2)))):
        mx, x = _merged(rng, s, h, dh, **kw)
        w, dense = _weight(q, 37, h * dh, rng)
        y = poison(cupy.empty(37, cupy.float32))
        d.dmmv(w, mx, y)
        _check(y, ref.matvec(dense, x), f"merged s={s} h={h} d={dh} {kw}")
        y0 = _x(rng, 1, 37)
        y = cupy.asarray(y0)
        d.dmmv(w, mx, y, accumulate=True, alpha=-0.5)
        _check(y, y0 - 0.5 * ref.matvec(dense, x), "merged, accumulate")


@pytest.mark.gpu
def test_dmmv_merged_input_from_split_decode(rng):
    """The attention output projection after a split decode: flash_attn_decode_partials' states as a
    MergedX into dmmv equal flash_attn_decode's merged output followed by the matvec (Gemma 3's decode
    shape: 4 query heads on 1 KV head of 256, an f16 cache), with and without sinks, under pdl."""
    from cukern.attention import AttentionDispatch, PagedKVCache
    attn, dp = AttentionDispatch(pdl=True), DmmvDispatch(int8=False, pdl=True)
    cache = PagedKVCache(1, 64, 16, 1, 256, max_seqs=2, dtype="float16")
    slots = [cache.add(0) for _ in range(2)]
    for s, n in zip(slots, (300, 9)):
        cache.extend(s, n)
        kv = cupy.asarray(rng.standard_normal((n, 1, 256)).astype(np.float32))
        attn.write_kv_run(cache, 0, kv, kv * 0.5, s, 0)
    w, dense = _weight(12, 640, 1024, rng)  # Q4_K o_proj
    for slot in slots:
        for sinks in (None, cupy.asarray(rng.standard_normal(4).astype(np.float32))):
            plan = attn.plan_decode(cache, [slot], 4, n_splits=5, partials=True)
            q = cupy.asarray(rng.standard_normal((1, 4, 256)).astype(np.float32))
            out = poison(cupy.empty((1, 4, 256), cupy.float32))
            attn.flash_attn_decode(plan, 0, q, out, sinks=sinks)
            o_part, lse_part = attn.flash_attn_decode_partials(plan, 0, q)
            y = poison(cupy.empty(640, cupy.float32))
            dp.dmmv(w, D.MergedX(o_part, lse_part, sinks), y)
            _check(y, ref.matvec(dense, out.get().reshape(-1).astype(np.float64)), f"slot {slot} sinks={sinks is not None}")


def test_merged_input_rejects(host_if_no_gpu):
    z = lambda *s: cupy.zeros(s, cupy.float32)  # noqa: E731
    with pytest.raises(ValueError, match=r"o_part must be \[S, H, D\]"):
        D.MergedX(z(4, 64), z(4))
    with pytest.raises(ValueError, match="multiple of 4"):
        D.MergedX(z(2, 3, 62), z(2, 3))
    with pytest.raises(ValueError, match=r"lse_part must have shape \(2, 3\)"):
        D.MergedX(z(2, 3, 64), z(3, 2))
    with pytest.raises(ValueError, match=r"sinks must have shape \(3\)"):
        D.MergedX(z(2, 3, 64), z(2, 3), z(4))
    with pytest.raises(TypeError, match="dtype float32"):
        D.MergedX(cupy.zeros((2, 3, 64), cupy.float16), z(2, 3))
    d = DmmvDispatch()
    w = QWeight(cupy.zeros(22 * 6 * 4, cupy.uint8), "Q5_0", 4, 192)
    mx = D.MergedX(z(2, 3, 64), z(2, 3))
    assert mx.k == 192 and D.MergedX(z(1, 2, 3, 64), z(1, 2, 3)).n_states == 2
    with pytest.raises(ValueError, match="no gate"):
        d.dmmv(w, mx, z(4), gate=z(1))
    with pytest.raises(ValueError, match=r"one column"):
        d.dmmv(w, mx, z(2, 4))
    with pytest.raises(ValueError, match="has k=128, w has k=192"):
        d.dmmv(w, D.MergedX(z(2, 2, 64), z(2, 2)), z(4))


def test_normed_input_rejects(host_if_no_gpu):
    z = lambda *s: cupy.zeros(s, cupy.float32)  # noqa: E731
    big = z(3, 64)
    res = big[:2]
    with pytest.raises(ValueError, match="overlaps NormedX.residual"):
        D.NormedX(res, z(64), z(2, 64), residual_out=big[1:])
    with pytest.raises(ValueError, match="w_post .* needs proj"):
        D.NormedX(res, z(64), w_post=z(64))
    with pytest.raises(ValueError, match="eps must be finite"):
        D.NormedX(res, z(64), eps=float("nan"))
    with pytest.raises(ValueError, match=r"NormedX.proj must have shape \(2, 64\)"):
        D.NormedX(res, z(64), z(3, 64))
    with pytest.raises(ValueError, match="multiple of 4"):
        D.NormedX(z(2, 62), z(62))
    d = DmmvDispatch()
    w = QWeight(cupy.zeros(22 * 2 * 4, cupy.uint8), "Q5_0", 4, 64)
    nx = D.NormedX(res, z(64))
    with pytest.raises(ValueError, match="no gate"):
        d.dmmv(w, nx, z(2, 4), gate=z(2))
    with pytest.raises(ValueError, match=r"y must have shape \(2, 4\)"):
        d.dmmv(w, nx, z(4))
    with pytest.raises(ValueError, match="has k=32, w has k=64"):
        d.dmmv(w, D.NormedX(z(32), z(32)), z(4))


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
def test_dmmv_pair(d, rng, q):
    """Two matrices on one x (int8 path: dmmv_q8_two, the grid split by the matrices' rows): a few rows,
    and rows enough for every block of the grid, ragged; 1, 2 and 11 (8 + 2 + 1) columns."""
    k = _ks(q)[-1]
    for m1, m2, cols in ((9, 4, (1, 2)), (1301, 267, (1, 11))):
        w1, d1 = _weight(q, m1, k, rng, pad_front=D.QTYPES[q][3] * 3)
        w2, d2 = _weight(q, m2, k, rng)
        for n in cols:
            x = _x(rng, n, k) if n > 1 else _x(rng, k)
            y1 = poison(cupy.empty(x.shape[:-1] + (m1,), cupy.float32))
            y2 = poison(cupy.empty(x.shape[:-1] + (m2,), cupy.float32))
            d.dmmv_pair(w1, w2, cupy.asarray(x), y1, y2)
            _check_q(y1, q, lambda v, d1=d1: ref.matvec(d1, v), x, f"y1 {m1} n={n}")
            _check_q(y2, q, lambda v, d2=d2: ref.matvec(d2, v), x, f"y2 {m2} n={n}")


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
def test_dmmv_glu(d, rng, q, act):
    """act(Wg x) * (Wu x) (int8 path: dmmv_q8_two's interleaved gate/up rows): a few outputs, and more
    outputs than blocks (ragged); 1, 3 and 11 columns; the accumulate epilogue with alpha."""
    k = _ks(q)[1]
    for m, cols in ((11, (1, 3)), (1037, (1, 11))):
        wg, dg = _weight(q, m, k, rng)
        wu, du = _weight(q, m, k, rng, pad_front=D.QTYPES[q][3] * 7)
        for n in cols:
            x = _x(rng, n, k) if n > 1 else _x(rng, k)
            y = poison(cupy.empty(x.shape[:-1] + (m,), cupy.float32))
            d.dmmv_glu(wg, wu, cupy.asarray(x), y, act=act)
            _check_q(y, q, lambda v, dg=dg, du=du: ref.glu(dg, du, v, act), x, f"{m} n={n}", bound=Q8_NMSE_GLU)
        y0 = _x(rng, 2, m)
        y = cupy.asarray(y0)
        x = _x(rng, 2, k)
        d.dmmv_glu(wg, wu, cupy.asarray(x), y, act=act, accumulate=True, alpha=-0.75)
        _check(y, y0 - 0.75 * ref.glu(dg, du, _xhat(q, x), act), f"{m} accumulate")


@pytest.mark.gpu
@pytest.mark.parametrize("q", D.Q8_TYPES, ids=NAMES.get)
def test_q8_row_tail_of_whole_lane_units(d, rng, q):
    """One column, k a multiple of 1024 (a row's units a multiple of 32, so every lane of a row's
    last, partial warp iteration has the same number of units: 1, 2 and 3 at LU = 4, the shape of
    4096x14336 included)."""
    for m, k in ((37, 1024), (3, 14336), (130, 7168)):
        w, dense = _weight(q, m, k, rng)
        x = _x(rng, k)
        y = poison(cupy.empty(m, cupy.float32))
        d.dmmv(w, cupy.asarray(x), y)
        _check_q(y, q, lambda v: ref.matvec(dense, v), x, name=f"{NAMES[q]} {m}x{k}")


@pytest.mark.gpu
@pytest.mark.parametrize("q", D.Q8_TYPES, ids=NAMES.get)
def test_q8_two_rows_split_between_warps(d, rng, q):
    """dmmv_q8_two with small forced grids: gate/up rows longer than a warp's share (parts summed after
    the barrier), an output's gate and up rows in different warps, a pair whose grid has one block per
    matrix; k = 6400 (6 iterations and a partial one per row at LU = 1)."""
    k = 6400
    wg, dg = _weight(q, 7, k, rng, pad_front=D.QTYPES[q][3] * 3)
    wu, du = _weight(q, 7, k, rng)
    x = _x(rng, 2, k)
    for nc, nw, resident in ((1, 8, 1), (2, 4, 3), (1, 2, 2)):
        kern = Q8._q8_two_kernel(q, nc, True)
        key = ("dmmv_two", kern, k, 7, 1)
        saved = d._resident.get(key)
        smem = Q8._q8_smem(q, nw, nc, k) + (8 * nc * -(-7 // resident) + 15) // 16 * 16
        d._resident[key] = (nw, smem, resident)
        d._two._function(kern, smem)
        try:
            y = poison(cupy.empty((nc, 7), cupy.float32))
            d.dmmv_glu(wg, wu, cupy.asarray(x[:nc]), y, act="swiglu")
            _check(y, ref.glu(dg, du, _xhat(q, x[:nc]), "swiglu"), f"{NAMES[q]} glu nw={nw} blocks={resident}")
        finally:
            d._resident.pop(key) if saved is None else d._resident.__setitem__(key, saved)
        kern = Q8._q8_two_kernel(q, nc, False)
        key = ("dmmv_two", kern, k)
        saved = d._resident.get(key)
        d._resident[key] = (nw, Q8._q8_smem(q, nw, nc, k), max(2, resident))
        d._two._function(kern, Q8._q8_smem(q, nw, nc, k))
        try:
            y1 = poison(cupy.empty((nc, 7), cupy.float32))
            y2 = poison(cupy.empty((nc, 7), cupy.float32))
            d.dmmv_pair(wg, wu, cupy.asarray(x[:nc]), y1, y2)
            _check(y1, ref.matvec(dg, _xhat(q, x[:nc])), f"{NAMES[q]} pair y1 nw={nw}")
            _check(y2, ref.matvec(du, _xhat(q, x[:nc])), f"{NAMES[q]} pair y2 nw={nw}")
        finally:
            d._resident.pop(key) if saved is None else d._resident.__setitem__(key, saved)


@pytest.mark.gpu
@pytest.mark.parametrize("q", D.Q8_TYPES, ids=NAMES.get)
def test_q8_rows_through_small_ring(d, rng, q):
    """The int8 path with one small block: each warp streams many rows of several iterations through
    its ring (copies in flight across row boundaries), a partial last iteration, ragged rows."""
    m, k = 45, _ks(q)[-1]
    w, dense = _weight(q, m, k, rng, pad_front=D.QTYPES[q][3] * 5)
    x = _x(rng, 2, k)
    for nc in (1, 2):
        key = ("dmmv", Q8._q8_kernel(q, nc), k)
        saved = d._resident.get(key)
        d._resident[key] = (4, Q8._q8_smem(q, 4, nc, k), 1)  # 1 block of 4 warps: ~11 rows per warp
        try:
            y = poison(cupy.empty((nc, m), cupy.float32))
            d.dmmv(w, cupy.asarray(x[:nc]), y)
            _check_q(y, q, lambda v: ref.matvec(dense, v), x[:nc], name=f"{NAMES[q]} nc={nc}")
        finally:
            d._resident.pop(key) if saved is None else d._resident.__setitem__(key, saved)
    n_e, T, top_k = 3, 2, 2
    we, de = _weight(q, m, k, rng, n_experts=n_e)
    ids = _ids(rng, T, top_k, n_e)
    key = ("dmmv_moe", Q8._q8_kernel(q, None), k)
    saved = d._resident.get(key)
    d._resident[key] = (2, Q8._q8_smem(q, 2, 1, k), 4)  # 1 block of 2 warps per slot
    try:
        y = poison(cupy.empty((T, top_k, m), cupy.float32))
        d.moe_dmmv(we, cupy.asarray(x), cupy.asarray(ids), y)
        _check_q(y, q, lambda v: ref.moe(de, v, ids), x)
    finally:
        d._resident.pop(key) if saved is None else d._resident.__setitem__(key, saved)


@pytest.mark.gpu
@pytest.mark.parametrize("q", D.Q8_TYPES, ids=NAMES.get)
def test_q8_rows_split_between_warps(d, rng, q):
    """The int8 path when a row is longer than a warp's share: its parts spread over several warps
    (summed after the block's last barrier), warps with no items (fewer items than warps), blocks of
    unequal row counts; the accumulate epilogue and two columns through the same combine."""
    k = 6400  # 200 units: 6 full iterations and a partial one per row at LU = 1
    for m, kk, nw, blocks in ((3, k, 8, 1), (2, 256, 8, 1), (7, k, 8, 3), (5, k, 4, 2)):
        w, dense = _weight(q, m, kk, rng, pad_front=D.QTYPES[q][3] * 3)
        x = _x(rng, 2, kk)
        y0 = _x(rng, 2, m)
        for nc in (1, 2):
            key = ("dmmv", Q8._q8_kernel(q, nc), kk)
            saved = d._resident.get(key)
            d._resident[key] = (nw, Q8._q8_smem(q, nw, nc, kk), blocks)
            try:
                y = cupy.asarray(y0[:nc])
                d.dmmv(w, cupy.asarray(x[:nc]), y, accumulate=True)
                _check(y, y0[:nc] + ref.matvec(dense, _xhat(q, x[:nc])), f"{NAMES[q]} {m}x{kk} nw={nw} nc={nc}")
            finally:
                d._resident.pop(key) if saved is None else d._resident.__setitem__(key, saved)


# ---------------------------------------------------------------------------- GPU: MoE
def _ids(rng, T, top_k, n_e):
    return np.stack([rng.permutation(n_e)[:top_k] for _ in range(T)]).astype(np.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
def test_moe_dmmv(d, rng, q):
    """Every slot's expert matvec, with and without GLU (int8 path: moe_dmmv_q8 / moe_dmmv_q8_glu): a few
    rows, and rows enough for several blocks per slot (ragged); x per token and per slot."""
    k = _ks(q)[1]
    for n_e, m, T, top_k in ((6, 7, 3, 2), (5, 301, 2, 3)):
        w, dense = _weight(q, m, k, rng, n_experts=n_e)
        wu, dense_u = _weight(q, m, k, rng, n_experts=n_e)
        ids = _ids(rng, T, top_k, n_e)
        for x in (_x(rng, T, k), _x(rng, T, top_k, k)):
            y = poison(cupy.empty((T, top_k, m), cupy.float32))
            d.moe_dmmv(w, cupy.asarray(x), cupy.asarray(ids), y)
            _check_q(y, q, lambda v, dense=dense, ids=ids: ref.moe(dense, v, ids), x, f"{m} rows")
            y = poison(cupy.empty((T, top_k, m), cupy.float32))
            d.moe_dmmv(w, cupy.asarray(x), cupy.asarray(ids), y, w_up=wu, act="swiglu", alpha=0.5)
            _check_q(y, q, lambda v, dense=dense, dense_u=dense_u, ids=ids:
                     0.5 * ref.moe(dense, v, ids, w_up=dense_u, act="swiglu"), x, f"{m} rows glu", bound=Q8_NMSE_GLU)
    d.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("q", [D.qtype_id(n) for n in ("Q4_K", "Q8_0", "MXFP4")], ids=NAMES.get)
def test_pdl_chain_matches_plain_launches(rng, q, monkeypatch):
    """DmmvDispatch(pdl=True): a chain of matvecs, each reading the previous one's output as x (the
    dependency pdl_wait must honour), eager and replayed from a CUDA graph, equals the same chain
    launched plainly bit for bit (the kernel is deterministic, so any race shows)."""
    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90")
    pdl_launches = _count_pdl_launches(monkeypatch)
    n = 1536
    ws = [_weight(q, n, n, rng) for _ in range(6)]
    alphas = [float(np.sqrt(n) / np.linalg.norm(dense)) for _, dense in ws]  # keeps |x| about steady
    x0 = cupy.asarray(_x(rng, n))

    def chain(dd, ys):
        x = x0
        for (w, _), a, y in zip(ws, alphas, ys):
            dd.dmmv(w, x, y, alpha=a)
            x = y
        dd.dmmv(ws[0][0], ys[-2], ys[-1], accumulate=True)  # y read and written after the wait

    _assert_pdl_chain_matches_plain(chain, len(ws), n)
    assert len(pdl_launches) >= 2 * 7, "the pdl path was not taken"


@pytest.mark.gpu
@pytest.mark.parametrize("m, nw, blocks", [(37, 8, 2), (13, 4, 3)])
def test_mxfp4_long_k_l2_prefetch(rng, m, nw, blocks):
    """MXFP4 at k >= 12288 under pdl asks L2 for one more item per warp before the wait
    (DmmvParams::l2_items), here on small forced grids so that every warp has several items, rows
    split between warps and the last rows end at the matrix's end: the output equals the plain
    launch's on the same grid bit for bit, and the reference."""
    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90")
    q, k = D.qtype_id("MXFP4"), 14336
    w, dense = _weight(q, m, k, rng, pad_front=17 * 3)
    x = cupy.asarray(_x(rng, k))
    plain, dp = DmmvDispatch(), DmmvDispatch(pdl=True)
    assert dp._l2_items(w) == 1 and plain._l2_items(w) == 0
    ys = []
    for dd in (plain, dp):
        dd._resident[("dmmv", Q8._q8_kernel(q, 1), k)] = (nw, Q8._q8_smem(q, nw, 1, k), blocks)
        ys.append(poison(cupy.empty(m, cupy.float32)))
        dd.dmmv(w, x, ys[-1])
    assert bool((ys[1] == ys[0]).all()), "pdl with the L2 prefetch differs from the plain launch"
    _check_q(ys[1], q, lambda v: ref.matvec(dense, v), cupy.asnumpy(x), name=f"MXFP4 {m}x{k} pdl")


def _count_pdl_launches(monkeypatch) -> list:
    """The kernel names of every pdl launch from here on: first calls (dispatch._launch_pdl) and the
    pdl replays of repeated ones (Dispatch._replay)."""
    from cukern import dispatch
    names = []
    launch, replay = dispatch._launch_pdl, dispatch.Dispatch._replay
    monkeypatch.setattr(dispatch, "_launch_pdl", lambda *a: (names.append(a[0]), launch(*a)))
    monkeypatch.setattr(dispatch.Dispatch, "_replay", staticmethod(
        lambda r, i, stream: (r.launches[i][6] and names.append(r.launches[i][0]), replay(r, i, stream))))
    return names


def _assert_pdl_chain_matches_plain(chain, steps: int, shape):
    """chain(dispatch, ys) with DmmvDispatch(pdl=True), eager and replayed from a CUDA graph, writes
    the bits that DmmvDispatch() writes into ``steps`` f32 outputs of ``shape``."""
    from cukern.streams import capture_graph
    want = [poison(cupy.empty(shape, cupy.float32)) for _ in range(steps)]
    chain(DmmvDispatch(), want)
    dp = DmmvDispatch(pdl=True)
    for graph in (False, True):  # eager first: it also compiles and plans outside the capture
        got = [poison(cupy.empty(shape, cupy.float32)) for _ in range(steps)]
        if graph:
            capture_graph(lambda stream: chain(dp, got)).replay(cupy.cuda.get_current_stream())
        else:
            chain(dp, got)
        for i, (a, b) in enumerate(zip(got, want)):
            assert bool(cupy.isfinite(b).all()), f"step {i}: the plain chain overflowed"
            assert bool((a == b).all()), f"step {i} differs with pdl (graph={graph})"


@pytest.mark.gpu
@pytest.mark.parametrize("q", D.Q8_TYPES, ids=NAMES.get)
def test_f32_path_of_int8_types(rng, q):
    """DmmvDispatch(int8=False): the same calls on the f32 path, x exact: element-wise against f(x)."""
    d32 = DmmvDispatch(int8=False)
    k = _ks(q)[1]
    for m, n in [(67, 1), (13, 3), (5, 8)]:
        w, dense = _weight(q, m, k, rng, pad_front=D.QTYPES[q][3] * 5)
        x = _x(rng, n, k)
        y0 = _x(rng, n, m)
        y = poison(cupy.empty((n, m), cupy.float32))
        d32.dmmv(w, cupy.asarray(x), y)
        _check(y, ref.matvec(dense, x), f"{NAMES[q]} {m}x{k} n={n}")
        y = cupy.asarray(y0)
        d32.dmmv(w, cupy.asarray(x), y, accumulate=True, alpha=-0.5)
        _check(y, y0 - 0.5 * ref.matvec(dense, x), "accumulate")
        wu, dense_u = _weight(q, m, k, rng)
        y = poison(cupy.empty((n, m), cupy.float32))
        d32.dmmv_glu(w, wu, cupy.asarray(x), y, act="geglu")
        _check(y, ref.glu(dense, dense_u, x, "geglu"), "glu")
        y2 = poison(cupy.empty((n, m), cupy.float32))
        d32.dmmv_pair(w, wu, cupy.asarray(x), y, y2)
        _check(y2, ref.matvec(dense_u, x), "pair")
    n_e, m, T, top_k = 4, 9, 3, 2
    w, dense = _weight(q, m, k, rng, n_experts=n_e)
    ids = _ids(rng, T, top_k, n_e)
    x = _x(rng, T, k)
    y = poison(cupy.empty((T, top_k, m), cupy.float32))
    d32.moe_dmmv(w, cupy.asarray(x), cupy.asarray(ids), y)
    _check(y, ref.moe(dense, x, ids))
    d32.moe_dmmv(w, cupy.asarray(x), cupy.asarray(ids), y, w_up=w, act="geglu")
    _check(y, ref.moe(dense, x, ids, w_up=dense, act="geglu"), "glu")
    h = _x(rng, T, top_k, k)
    wts = rng.uniform(0, 1, (T, top_k)).astype(np.float32)
    yd = poison(cupy.empty((T, m), cupy.float32))
    d32.moe_down(w, cupy.asarray(h), cupy.asarray(ids), cupy.asarray(wts), yd)
    _check(yd, ref.moe_down(dense, h, ids, wts), "down")
    d32.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
def test_moe_packed_and_route(d, rng, q):
    n_e, m, k, T, top_k = 5, 9, _ks(q)[0], 13, 3  # 39 slots over 5 experts: items of 8 and ragged ends
    w, dense = _weight(q, m, k, rng, n_experts=n_e)
    wu, dense_u = _weight(q, m, k, rng, n_experts=n_e)
    ids = _ids(rng, T, top_k, n_e)
    ids_d = cupy.asarray(ids)
    route = d.plan_moe_route(T, top_k, n_e)
    d.moe_route_pack(ids_d, route)
    counts = route.counts.get()
    np.testing.assert_array_equal(counts, ref.route_counts(ids, n_e))
    offsets, packed = route.offsets.get(), route.packed.get()
    np.testing.assert_array_equal(offsets[:-1], np.concatenate([[0], np.cumsum(counts)[:-1]]))
    for e in range(n_e):
        got = np.sort(packed[offsets[e]:offsets[e] + counts[e]])
        np.testing.assert_array_equal(got, np.flatnonzero(ids.ravel() == e))
    x = _x(rng, T, k)
    y = poison(cupy.empty((T, top_k, m), cupy.float32))
    d.moe_dmmv_packed(w, cupy.asarray(x), ids_d, route, y)
    _check(y, ref.moe(dense, x, ids))
    y = poison(cupy.empty((T, top_k, m), cupy.float32))
    d.moe_dmmv_packed(w, cupy.asarray(x), ids_d, route, y, w_up=wu, act="geglu")
    _check(y, ref.moe(dense, x, ids, w_up=dense_u, act="geglu"))
    c2 = poison(cupy.empty(n_e, cupy.int32))
    d.moe_count_experts(ids_d, c2)
    np.testing.assert_array_equal(c2.get(), counts)
    d.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
def test_moe_down(d, rng, q):
    """y[t] (+)= sum_j weights[t, j] W[ids[t, j]] h[t, j] (int8 path: moe_down_q8): a few rows, rows enough
    for several blocks per token (ragged), the accumulate epilogue with alpha; a token whose ids are all
    out of range gets an empty sum (0; accumulate: y unchanged) and the error flag."""
    for n_e, m, T, top_k in ((6, 10, 2, 4), (5, 301, 3, 3)):
        k = _ks(q)[1]
        w, dense = _weight(q, m, k, rng, n_experts=n_e)
        ids = _ids(rng, T, top_k, n_e)
        h = _x(rng, T, top_k, k)
        wts = rng.uniform(0, 1, (T, top_k)).astype(np.float32)
        y = poison(cupy.empty((T, m), cupy.float32))
        d.moe_down(w, cupy.asarray(h), cupy.asarray(ids), cupy.asarray(wts), y)
        def f(v, dense=dense, ids=ids, wts=wts):
            return ref.moe_down(dense, v, ids, wts)
        _check_q(y, q, f, h, f"{m} rows")
        y0 = _x(rng, T, m)
        y = cupy.asarray(y0)
        d.moe_down(w, cupy.asarray(h), cupy.asarray(ids), cupy.asarray(wts), y, accumulate=True, alpha=-1.5)
        _check(y, y0 - 1.5 * f(_xhat(q, h)), f"{m} rows accumulate")
    d.check_errors()
    bad = np.full((T, top_k), -1, np.int32)
    bad[1] = ids[1]
    y = poison(cupy.empty((T, m), cupy.float32))
    d.moe_down(w, cupy.asarray(h), cupy.asarray(bad), cupy.asarray(wts), y)
    _check(y, ref.moe_down(dense, _xhat(q, h), bad, wts), "invalid ids")
    y = cupy.asarray(y0)
    d.moe_down(w, cupy.asarray(h), cupy.asarray(bad), cupy.asarray(wts), y, accumulate=True)
    _check(y, y0 + ref.moe_down(dense, _xhat(q, h), bad, wts), "invalid ids, accumulate")
    with pytest.raises(DeviceError, match="expert id"):
        d.check_errors()


@pytest.mark.gpu
def test_moe_bad_expert_ids_are_flagged_and_zeroed(d, rng):
    q, n_e, m, k, T, top_k = 12, 4, 6, 256, 3, 2
    w, dense = _weight(q, m, k, rng, n_experts=n_e)
    ids = np.array([[0, 4], [-1, 2], [3, 1 << 30]], np.int32)  # 4, -1, 2^30: out of range
    x = _x(rng, T, k)
    d.check_errors()  # clean start
    y = poison(cupy.empty((T, top_k, m), cupy.float32))
    d.moe_dmmv(w, cupy.asarray(x), cupy.asarray(ids), y)
    _check(y, ref.moe(dense, _xhat(q, x), ids))  # bad slots: zeros
    with pytest.raises(DeviceError, match="expert id"):
        d.check_errors()
    d.check_errors()  # reset by the previous check
    route = d.plan_moe_route(T, top_k, n_e)
    d.moe_route_pack(cupy.asarray(ids), route)
    y = poison(cupy.empty((T, top_k, m), cupy.float32))
    d.moe_dmmv_packed(w, cupy.asarray(x), cupy.asarray(ids), route, y)
    _check(y, ref.moe(dense, x, ids))
    assert int(route.offsets.get()[-1]) == 3  # valid slots
    with pytest.raises(DeviceError):
        d.check_errors()
    h = _x(rng, T, top_k, k)
    wts = np.ones((T, top_k), np.float32)
    y = poison(cupy.empty((T, m), cupy.float32))
    d.moe_down(w, cupy.asarray(h), cupy.asarray(ids), cupy.asarray(wts), y)
    _check(y, ref.moe_down(dense, _xhat(q, h), ids, wts))
    with pytest.raises(DeviceError):
        d.check_errors()


# ---------------------------------------------------------------------------- GPU: pre-quantized x
@pytest.mark.gpu
@pytest.mark.parametrize("qt", ["Q4_K", "MXFP4"], ids=["planes", "interleaved"])
def test_quantize_x_matches_reference(d, rng, qt):
    """quantize_x writes the q, d and half sums of ref.quantize_q8_blocks bit for bit: one block,
    several columns, a thread block's chunk (2048 elements) with a ragged last one; an all-zero block
    gives d = 0, q = 0."""
    for shape in [(32,), (3, 96), (2, 2048 + 32), (5, 4096 + 2080)]:
        k, n = shape[-1], (shape[0] if len(shape) == 2 else 1)
        x = _x(rng, *shape)
        x[..., 32:64] = 0.0
        qx = D.QuantizedX.empty(shape, qt)
        poison(qx.buf)
        d.quantize_x(cupy.asarray(x), qx)
        q, dd, sums = ref.decode_quantized_x(qx.buf.get(), k, qx.interleaved)
        want_q, want_d = ref.quantize_q8_blocks(x.reshape(n, k))
        np.testing.assert_array_equal(q, want_q, err_msg=f"q {shape}")
        np.testing.assert_array_equal(dd, want_d, err_msg=f"d {shape}")
        np.testing.assert_array_equal(sums, want_q.reshape(n, -1, 2, 16).astype(np.int64).sum(-1), err_msg=f"sums {shape}")


def _glu32(act: str, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """act(g) * u in float32 as qmv::glu_act computes it (g / (1 + exp(-g)); the tanh form of GELU)."""
    g, u, one, half = g.astype(np.float32), u.astype(np.float32), np.float32(1), np.float32(0.5)
    if act == "swiglu":
        a = g / (one + np.exp(-g))
    else:
        a = half * g * (one + np.tanh(np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)))
    return (a * u).astype(np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
@pytest.mark.parametrize("qt", ["Q4_K", "MXFP4"], ids=["planes", "interleaved"])
def test_quantize_glu_matches_reference(d, rng, qt, act):
    """quantize_glu = quantize_x of act(gate) * up: against act in float32 (as the kernel computes it,
    up to the last bits of expf / tanhf) quantized by ref.quantize_q8_blocks, every q within 1 and
    almost all equal, every d within 1e-6 relative (8 ulp); the decoded x^ within d/2 of act(gate) * up in float64;
    the stored half sums are those of the stored q. Gate up to |8| (SiLU's and GELU's tails), up
    with zero blocks, ragged chunks."""
    for shape in [(32,), (3, 96), (2, 2048 + 32), (5, 4096 + 2080)]:
        k, n = shape[-1], (shape[0] if len(shape) == 2 else 1)
        g, u = 3.0 * _x(rng, *shape), _x(rng, *shape)
        u[..., 64:96] = 0.0
        qx = D.QuantizedX.empty(shape, qt)
        poison(qx.buf)
        d.quantize_glu(cupy.asarray(g), cupy.asarray(u), qx, act=act)
        q, dd, sums = ref.decode_quantized_x(qx.buf.get(), k, qx.interleaved)
        want_q, want_d = ref.quantize_q8_blocks(_glu32(act, g, u).reshape(n, k))
        np.testing.assert_allclose(dd, want_d, rtol=1e-6, atol=0, err_msg=f"d {shape}")  # tanhf, expf: a few ulp
        dq = np.abs(q.astype(np.int32) - want_q)
        n_diff = np.count_nonzero(dq)
        assert dq.max() <= 1 and n_diff <= max(2, q.size // 1000), f"q {shape}: {n_diff} differ"
        f = ref.gelu_tanh if act == "geglu" else ref.silu
        exact = (f(g.astype(np.float64)) * u).reshape(n, -1, 32)
        xhat = q.reshape(n, -1, 32) * dd[..., None].astype(np.float64)
        assert np.all(np.abs(xhat - exact) <= 0.5 * dd[..., None] * (1 + 1e-5) + 1e-6 * np.abs(exact)), f"x^ {shape}"
        assert k < 96 or not xhat[:, 2].any(), "a zero block of up gives q = 0"
        np.testing.assert_array_equal(sums, q.reshape(n, -1, 2, 16).astype(np.int64).sum(-1), err_msg=f"sums {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3, 11])
@pytest.mark.parametrize("q", D.Q8_TYPES, ids=NAMES.get)
def test_dmmv_prequantized_matches_f32_x(d, rng, q, n):
    """dmmv on a QuantizedX returns the bits of dmmv on the f32 x it holds (the same x^, the same
    arithmetic), for every epilogue and column chunking (11 = 8 + 2 + 1), ragged m, and matches the
    float64 reference on x^."""
    m, k = 37, _ks(q)[-1]
    w, dense = _weight(q, m, k, rng, pad_front=D.QTYPES[q][3] * 5)
    shape = (n, k) if n > 1 else (k,)
    x = cupy.asarray(_x(rng, *shape))
    qx = d.quantize_x(x, D.QuantizedX.empty(shape, q))
    y0 = cupy.asarray(_x(rng, *shape[:-1], m))
    g = cupy.asarray(_x(rng, n))
    for kw in ({}, {"accumulate": True, "alpha": -0.5}, {"gate": g, "alpha": 1.5}):
        want, got = y0.copy(), y0.copy()
        if not kw.get("accumulate") and "gate" not in kw:
            want, got = poison(want), poison(got)
        d.dmmv(w, x, want, **kw)
        d.dmmv(w, qx, got, **kw)
        assert bool((got == want).all()), f"{NAMES[q]} n={n} {sorted(kw)}: differs from the f32-x int8 path"
    _check(got, y0.get() + 1.5 * ref.sigmoid(g.get().astype(np.float64)).reshape(shape[:-1] + (1,))
           * ref.matvec(dense, ref.quantize_q8(x.get())), "gated on x^")


@pytest.mark.gpu
@pytest.mark.parametrize("q", [D.qtype_id(n) for n in ("Q4_K", "MXFP4")], ids=NAMES.get)
def test_prequantized_pdl_chain_and_graph(rng, q, monkeypatch):
    """Under pdl, per step: quantize_x of the previous step's output (overwriting the QuantizedX the
    matvecs before it read), then two matvecs sharing it (store, then accumulate), two columns;
    eager and from a CUDA graph, equal to the plain launches bit for bit."""
    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90")
    pdl_launches = _count_pdl_launches(monkeypatch)
    n, cols, steps = 1536, 2, 3
    ws = [(_weight(q, n, n, rng), _weight(q, n, n, rng)) for _ in range(steps)]
    alphas = [float(np.sqrt(n) / np.linalg.norm(a[1]) / 2) for a, _ in ws]  # keeps |x| about steady
    x0 = cupy.asarray(_x(rng, cols, n))
    qx = D.QuantizedX.empty((cols, n), q)

    def chain(dd, ys):
        x = x0
        for ((wa, _), (wb, _)), a, y in zip(ws, alphas, ys):
            dd.quantize_x(x, qx)
            dd.dmmv(wa, qx, y, alpha=a)
            dd.dmmv(wb, qx, y, alpha=a, accumulate=True)
            x = y

    _assert_pdl_chain_matches_plain(chain, steps, (cols, n))
    assert len(pdl_launches) >= 2 * 3 * steps, "the pdl path was not taken"


def test_prequantized_bad_input(d, rng, host_if_no_gpu):
    w = QWeight(cupy.zeros(2 * 144, cupy.uint8), "Q4_K", 2, 256)
    qx = D.QuantizedX.empty((256,), "Q4_K")
    y = cupy.full(2, 7.0, cupy.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        D.QuantizedX.empty((3, 48), "Q4_K")
    with pytest.raises(ValueError, match="take f32 x"):
        D.QuantizedX.empty((256,), "F16")
    with pytest.raises(ValueError, match="shape"):
        D.QuantizedX(cupy.zeros((1, 100), cupy.uint8), (256,), False)
    with pytest.raises(ValueError, match="MXFP4"):
        d.dmmv(QWeight(cupy.zeros(2 * 8 * 17, cupy.uint8), "MXFP4", 2, 256), qx, y)
    with pytest.raises(ValueError, match="k=512"):
        d.dmmv(QWeight(cupy.zeros(2 * 288, cupy.uint8), "Q4_K", 2, 512), D.QuantizedX.empty((256,), "Q4_K"), y)
    with pytest.raises(ValueError, match="int8 path only"):
        DmmvDispatch(int8=False).dmmv(w, qx, y)
    with pytest.raises(ValueError, match="int8 path only"):
        d.dmmv(QWeight(cupy.zeros(2 * 512, cupy.uint8), "F16", 2, 256), qx, y)
    with pytest.raises(ValueError, match="shape"):
        d.dmmv(w, qx, cupy.zeros((1, 2), cupy.float32))
    with pytest.raises(ValueError, match="shape"):
        d.quantize_x(cupy.zeros((2, 256), cupy.float32), qx)
    with pytest.raises(TypeError, match="QuantizedX"):
        d.quantize_x(cupy.zeros(256, cupy.float32), cupy.zeros((1, 320), cupy.uint8))
    z = cupy.zeros(256, cupy.float32)
    with pytest.raises(ValueError, match="act must be"):
        d.quantize_glu(z, z, qx, act="relu")
    with pytest.raises(ValueError, match="shape"):
        d.quantize_glu(z, cupy.zeros((2, 256), cupy.float32), qx)
    with pytest.raises(TypeError, match="dtype"):
        d.quantize_glu(z, cupy.zeros(256, cupy.float16), qx)
    with pytest.raises(ValueError, match="aligned"):
        d.quantize_glu(cupy.zeros(257, cupy.float32)[1:], z, qx)
    cupy.cuda.get_current_stream().synchronize()
    assert (y.get() == 7.0).all()  # nothing was launched


# ---------------------------------------------------------------------------- GPU: validation
def test_bad_input_raises_before_launch(d, rng, host_if_no_gpu):
    buf = cupy.zeros(10 * 144 + 64, cupy.uint8)
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size"):
        QWeight(buf, "Q4_K", 2, 300)
    with pytest.raises(ValueError, match="aligned"):
        QWeight(buf, "Q4_K", 2, 256, offset=2)
    with pytest.raises(ValueError, match="needs .* bytes"):
        QWeight(buf, "Q4_K", 11, 256)
    with pytest.raises(ValueError, match="needs .* bytes"):
        QWeight(buf, "Q4_K", 4, 256, n_experts=3)
    with pytest.raises(ValueError, match="multiple of 4"):
        QWeight(cupy.zeros(64, cupy.uint8), "F32", 1, 6)
    w = QWeight(buf, "Q4_K", 2, 256)
    x = cupy.zeros(256, cupy.float32)
    y = cupy.full(2, 7.0, cupy.float32)
    with pytest.raises(TypeError, match="dtype"):
        d.dmmv(w, x.astype(cupy.float16), y)
    with pytest.raises(ValueError, match="shape"):
        d.dmmv(w, cupy.zeros(255, cupy.float32), y)
    with pytest.raises(ValueError, match="16-byte aligned"):
        d.dmmv(w, cupy.zeros(257, cupy.float32)[1:], y)
    with pytest.raises(ValueError, match="shape"):
        d.dmmv(w, x, cupy.zeros(3, cupy.float32))
    w6 = QWeight(cupy.zeros(2 * 210, cupy.uint8), "Q6_K", 2, 256)
    with pytest.raises(ValueError, match="same type"):
        d.dmmv_pair(w, w6, x, y, cupy.zeros(2, cupy.float32))
    with pytest.raises(ValueError, match="act"):
        d.dmmv_glu(w, w, x, y, act="relu")
    with pytest.raises(ValueError, match="moe_"):
        d.dmmv(QWeight(buf, "Q4_K", 2, 256, n_experts=2), x, y)
    we = QWeight(buf, "Q4_K", 2, 256, n_experts=4)
    with pytest.raises(TypeError, match="ids"):
        d.moe_dmmv(we, x[None], cupy.zeros((1, 2), cupy.int64), cupy.zeros((1, 2, 2), cupy.float32))
    with pytest.raises(ValueError, match="x must be"):
        d.moe_dmmv(we, cupy.zeros((2, 256), cupy.float32), cupy.zeros((1, 2), cupy.int32),
                   cupy.zeros((1, 2, 2), cupy.float32))
    with pytest.raises(ValueError, match="experts"):
        d.plan_moe_route(1, 2, 5000)
    cupy.cuda.get_current_stream().synchronize()
    assert (y.get() == 7.0).all()  # nothing was launched


@pytest.mark.gpu
def test_loop_variants(d, rng):
    """Every (rows per block R, loop V) instantiation of dmmv<QT, NC, R, V> that _ONE_COL may pick
    (a unit of its own), on ragged rows and a k with a partial last step."""
    from cukern.runtime import FamilySpec, KernelSpec
    combos = [(nc, r, v) for nc in (1, 2) for r in (1, 4) for v in (0, 1)]
    names = [f"dmmv<{q}, {nc}, {r}, {v}>" for q in TYPES for nc, r, v in combos]
    unit = Unit(FamilySpec("dmmv_variants", tuple(KernelSpec(n, "DmmvParams") for n in names),
                           source="dmmv/dmmv.cu", params_header="dmmv/params.cuh"))
    for q in TYPES:
        m, k = 7, _ks(q)[-1]
        w, dense = _weight(q, m, k, rng)
        for nc, r, v in combos:
            x = _x(rng, nc, k)
            y = poison(cupy.empty((nc, m), cupy.float32))
            blocks = -(-m // r)
            p = d._params(w, blocks1=blocks, y_stride=m)
            for nw in (1, 3):
                unit._launch(f"dmmv<{q}, {nc}, {r}, {v}>", blocks, nw * 32, (y, y, w.buf, w.buf, cupy.asarray(x), y), p)
                _check(y, ref.matvec(dense, x), name=f"{NAMES[q]} NC={nc} R={r} V={v} nw={nw}")
