"""dmmv family against float64 references (cukern/reference/dmmv.py) built on gguf's own
dequantization: the family declaration, the GGUF layouts, the f32 matvec path (cukern/dmmv/dense.py),
the split Q8_0 layout, pdl chains, loop variants and bad input.

Weights are random *valid* GGUF blocks (cukern.reference.dmmv.random_weight), so the kernel and
the reference see exactly the same blocks: the comparison is kernel(W_blocks, x) against
dequantize(W_blocks) @ x in float64. Tolerances: see dmmv_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern import dmmv as D  # noqa: E402
from cukern.dmmv import dense as DENSE  # noqa: E402 (kernel names of the f32 path)
from cukern.dmmv import q8 as Q8  # noqa: E402 (the int8 path's kernel names, shared memory, blocks)
from cukern.dispatch import Unit  # noqa: E402
from cukern.dmmv import DmmvDispatch, QWeight  # noqa: E402
from cukern.reference import dmmv as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402
from dmmv_helpers import NAMES, TYPES, _assert_pdl_chain_matches_plain, _check, _check_q, _matvec_chain  # noqa: E402
from dmmv_helpers import _check_matvec, _count_pdl_launches, _ks, _weight, _x, _xhat  # noqa: E402


@pytest.fixture(scope="module")
def d():
    return DmmvDispatch()


# ---------------------------------------------------------------------------- CPU

def test_families_declared():
    assert set(D.FAMILIES) == {"dmmv", "dmmv_glu", "dmmv_moe", "dmmv_moe_packed", "dmmv_q8x", "dmmv_two", "dmmv_nx",
                               "dmmv_three", "dmmv_mx", "dmmv_split_tc"}
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
    assert all(DENSE._split_kernel(n) in names for n in (1, 2, 4, 8))
    assert {DENSE._split_tc_kernel(n) for n in (2, 4, 8)} == {k.name for k in D.FAMILIES["dmmv_split_tc"].kernels}
    assert {f"quantize_glu<{il}, {a}>" for il in ("false", "true") for a in (0, 1)} <= names


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
        _check_matvec(d, q, m, k, rng)


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


def test_split_tc_dispatch_rule():
    """dmmv_split_tc takes the chunks of 2, 4 and 8 columns on sm_80+ where x's two f16 parts fit the
    block's shared memory; one column, older devices and long rows stay on dmmv_split."""
    fits, smem = DENSE._split_tc_fits, DENSE._split_tc_smem
    assert smem(8, 640) == 2 * 8 * 672 * 2 and smem(2, 96) == 2 * 2 * 96 * 2  # rows k | 32 halves apart
    assert all(fits(n, 640, 90, 232448) and fits(n, 32, 80, 232448) for n in (2, 4, 8))
    assert not fits(1, 640, 90, 232448) and not fits(8, 640, 75, 232448)
    assert fits(4, 8192, 90, 232448) and not fits(8, 8192, 90, 232448)


def _split(d, rng, m, k):
    """(SplitQ8 of random Q8_0 blocks, float64 dense [m, k])."""
    raw = ref.random_weight(8, m, k, rng)
    s = d.split_q8_0(QWeight(cupy.asarray(raw.ravel()), "Q8_0", m, k))
    return s, ref.split_dense(*ref.split_q8_0(raw, m, k))


@pytest.mark.gpu
@pytest.mark.parametrize("k", [32, 96, 640, 2080])
def test_split_tc_matches_float64(d, rng, k):
    """dmmv on a SplitQ8 at 2 to 8 columns (dmmv_split_tc for the chunks of 2, 4 and 8, dmmv_split for a
    chunk of 1: n = 3, 5 mix them) against float64, at the split kernel's tolerance: ragged m (below one
    16-row tile, one tile and a bit, a block's 256 rows and a bit, many blocks with a partial last one),
    k of one block, an odd block count (the last 64-element chunk half full), the LM head's 640 and 65
    blocks; outputs poisoned before the store."""
    if int(cupy.cuda.Device().compute_capability) < 80:
        pytest.skip("dmmv_split_tc needs sm_80 (mma.sync m16n8k16)")
    for m in (5, 17, 263, 1029):
        s, dense = _split(d, rng, m, k)
        assert all(d._split_tc_fits(w, k) for w in (2, 4, 8)), "the tensor-core kernel was not picked"
        for n in (2, 3, 5, 8):
            x = _x(rng, n, k)
            y = poison(cupy.empty((n, m), cupy.float32))
            d.dmmv(s, cupy.asarray(x), y)
            _check(y, ref.matvec(dense, x), f"split tc {m}x{k} n={n}")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4, 8])
def test_split_tc_large_and_small_x(d, rng, n):
    """x's hi + lo f16 parts under a per-column power of two keep f32 accuracy at any magnitude: columns
    scaled by 1e6, 1e-6, 1e30, 1e-20, one whose elements span 1e-6 ... 1e6, and one of zeros (per
    column, so a large column does not swamp a small one in the same launch)."""
    if int(cupy.cuda.Device().compute_capability) < 80:
        pytest.skip("dmmv_split_tc needs sm_80 (mma.sync m16n8k16)")
    m, k = 301, 640
    s, dense = _split(d, rng, m, k)
    scales = [1e6, 1e-6, 0.0, 1e30, 1e-20, 1.0, 3e-3, 7e4][:n]
    x = _x(rng, n, k) * np.array(scales, np.float32)[:, None]
    x[n - 1] *= (10.0 ** rng.uniform(-6, 6, k)).astype(np.float32)  # mixed magnitudes within a column
    y = poison(cupy.empty((n, m), cupy.float32))
    d.dmmv(s, cupy.asarray(x), y)
    want = ref.matvec(dense, x.astype(np.float64))
    for c in range(n):  # per column: each has its own scale
        _check(y[c], want[c], f"split tc n={n} column {c} (x scaled {scales[c]:g})")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_split_tc_epilogues(d, rng, n):
    """Store with alpha, accumulate with alpha, and the sigmoid-gated accumulate on dmmv_split_tc."""
    if int(cupy.cuda.Device().compute_capability) < 80:
        pytest.skip("dmmv_split_tc needs sm_80 (mma.sync m16n8k16)")
    m, k = 277, 160
    s, dense = _split(d, rng, m, k)
    x = _x(rng, n, k)
    y0 = _x(rng, n, m)
    want = ref.matvec(dense, x)
    y = poison(cupy.empty((n, m), cupy.float32))
    d.dmmv(s, cupy.asarray(x), y, alpha=2.5)
    _check(y, 2.5 * want, "store alpha")
    y = cupy.asarray(y0)
    d.dmmv(s, cupy.asarray(x), y, accumulate=True, alpha=-0.375)
    _check(y, y0 - 0.375 * want, "scale-accumulate")
    g = rng.uniform(-4, 4, n).astype(np.float32)
    y = cupy.asarray(y0)
    d.dmmv_gated_acc(s, cupy.asarray(x), y, cupy.asarray(g), alpha=0.5)
    _check(y, y0 + 0.5 * ref.sigmoid(g.astype(np.float64))[:, None] * want, "sigmoid-gated")


@pytest.mark.gpu
def test_split_tc_pdl_chain_matches_plain_launches(rng, monkeypatch):
    """dmmv_split_tc under programmatic dependent launch: a chain of 8-column matvecs on SplitQ8s, each
    reading the previous one's output as x, eager and from a CUDA graph, equals plain launches bit for bit."""
    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90")
    pdl_launches = _count_pdl_launches(monkeypatch)
    d0 = DmmvDispatch()
    n = 1056  # m = k: a block's 256 rows do not divide it
    mats = [_split(d0, rng, n, n) for _ in range(4)]
    alphas = [float(np.sqrt(n) / np.linalg.norm(dense)) for _, dense in mats]
    _assert_pdl_chain_matches_plain(_matvec_chain(mats, alphas, cupy.asarray(_x(rng, 8, n))), len(mats), (8, n))
    assert sum(name.startswith("dmmv_split_tc") for name in pdl_launches) >= 2 * 5, "the pdl path was not taken"


# ---------------------------------------------------------------------------- GPU: MoE

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
    _assert_pdl_chain_matches_plain(_matvec_chain(ws, alphas, cupy.asarray(_x(rng, n))), len(ws), n)
    assert len(pdl_launches) >= 2 * 7, "the pdl path was not taken"


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
