"""dmmv's int8 path (cukern/dmmv/q8.py: x quantized to 8 bits, dp4a dots) against float64
references: the quantized-x layout and quantizers, prequantized inputs, row splits between warps,
the shared-memory mirror, and the f32 path of the int8 types.

Weights, inputs and tolerances (Q8_NMSE, Q8_NMSE_GLU for the int8 path against the exact x):
dmmv_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern import dmmv as D  # noqa: E402
from cukern.dmmv import dense as DENSE  # noqa: E402 (kernel names of the f32 path)
from cukern.dmmv import q8 as Q8  # noqa: E402 (the int8 path's kernel names, shared memory, blocks)
from cukern.dmmv.weights import _q8x_col_bytes  # noqa: E402
from cukern.dmmv import DmmvDispatch, QWeight  # noqa: E402
from cukern.reference import dmmv as ref  # noqa: E402
from cukern.testing import poison  # noqa: E402
from dmmv_helpers import NAMES, _assert_pdl_chain_matches_plain, _check, _check_q  # noqa: E402
from dmmv_helpers import _check_matvec, _count_pdl_launches, _ids, _ks, _weight, _x, _xhat  # noqa: E402


@pytest.fixture(scope="module")
def d():
    return DmmvDispatch()


# ---------------------------------------------------------------------------- CPU

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


# ---------------------------------------------------------------------------- GPU: dmmv

@pytest.mark.gpu
@pytest.mark.parametrize("q", D.Q8_TYPES, ids=NAMES.get)
def test_q8_row_tail_of_whole_lane_units(d, rng, q):
    """One column, k a multiple of 1024 (a row's units a multiple of 32, so every lane of a row's
    last, partial warp iteration has the same number of units: 1, 2 and 3 at LU = 4, the shape of
    4096x14336 included)."""
    for m, k in ((37, 1024), (3, 14336), (130, 7168)):
        _check_matvec(d, q, m, k, rng)


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
