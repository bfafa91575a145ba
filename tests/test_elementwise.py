"""Elementwise family against its float64 references (cukern/reference/elementwise.py): host checks,
replay, the family declaration, the norms (cukern/elementwise/norms.py), the activations
(activations.py) and bad arguments.

Fixed boundary cases draw their data from the test-seeded ``rng`` fixture.
Every output is poisoned with NaN first, so an element a kernel never writes fails. Tolerances: f32
outputs 1e-5 abs + 1e-5 rel (cukern.testing defaults); f16 caches 1e-3 + 2e-3.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.elementwise import ElementwiseDispatch  # noqa: E402
from cukern.reference import elementwise as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402
from elementwise_helpers import _check_q8_1, _dev, _empty, _randn, gpu  # noqa: E402


# (rows, cols): single element, odd widths (scalar loop path), multiples of 4 (register path) of
# every block size, the widest register row (32768), wider (loop path), a batch of 257 rows
NORM_SHAPES = [(1, 1), (3, 7), (1, 640), (5, 1030), (2, 4096), (4, 6001), (257, 256), (3, 5120), (1, 16384),
               (2, 32768), (1, 32772), (140, 4096), (133, 5120)]  # >= 132 rows: the many-rows configs


@pytest.fixture(scope="module")
def d():
    return ElementwiseDispatch()


# --------------------------------------------------------------------------------------- CPU tests

def test_rejects_host_arrays_before_launch():
    d = ElementwiseDispatch()  # no GPU needed to construct or to validate types
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(TypeError, match="x must be a cupy.ndarray"):
        d.rms_norm(x, np.zeros(4, np.float32), x)
    with pytest.raises(TypeError, match="must be a cupy.ndarray"):
        d.rope(np.zeros((1, 2, 8), np.float32), np.zeros(1, np.int32), np.zeros((1, 2, 8), np.float32))
    with pytest.raises(TypeError, match="must be a cupy.ndarray"):
        d.softmax_topk(x, np.zeros((2, 1), np.int32), np.zeros((2, 1), np.float32), k=1)


def test_repeated_calls_replay_the_first_ones_launches(host_if_no_gpu, monkeypatch):
    """A call repeated with the same arrays and values (dispatch.repeatable) issues the first one's launches
    without running the method's body again; any difference in an array's pointer, shape or dtype, a
    value, the dispatch's pdl or the keywords runs it in full; a call that raised is not remembered."""
    from cukern.elementwise import norms
    bodies = []
    real = norms.Norms._row_norm
    monkeypatch.setattr(norms.Norms, "_row_norm", lambda self, *a, **k: (bodies.append(1), real(self, *a, **k))[1])
    rng = np.random.default_rng(0)
    ew = ElementwiseDispatch(pdl=True)
    xh = rng.standard_normal((3, 64)).astype(np.float32)
    wh = rng.standard_normal(64).astype(np.float32)
    x, w = cupy.asarray(xh), cupy.asarray(wh)
    y = poison(cupy.empty((3, 64), cupy.float32))
    assert ew.rms_norm(x, w, y, eps=1e-5) is y
    assert len(bodies) == 1
    y2 = y.view()  # another array object over the same memory: the same key
    y2.fill(np.nan) if host_if_no_gpu is not None else poison(y2)
    assert ew.rms_norm(x, w, y2, eps=1e-5) is y2
    assert len(bodies) == 1
    if host_if_no_gpu is not None:  # the launch counter of tests/host_dispatch.py: the replay launched too
        assert sum(n for k, n in host_if_no_gpu.items() if k.startswith("rms_norm")) == 2
    if host_if_no_gpu is None:  # on a GPU the replayed launch computed the norm again
        assert_close(y, ref.rms_norm(xh, wh, eps=1e-5), atol=1e-5, rtol=1e-5)
    ew.rms_norm(x, w, y, eps=2e-5)                      # another value
    ew.rms_norm(x[:2], w, y[:2], eps=1e-5)              # another shape
    ew.rms_norm(x.copy(), w, y, eps=1e-5)               # another pointer
    ew.rms_norm(x, w, y, eps=1e-5, weight_offset=0.0)   # another keyword
    ew.pdl = False
    ew.rms_norm(x, w, y, eps=1e-5)                      # another pdl
    assert len(bodies) == 6
    with pytest.raises(TypeError, match="dtype"):
        ew.rms_norm(x.astype(np.float16), w, y)
    with pytest.raises(TypeError, match="dtype"):
        ew.rms_norm(x.astype(np.float16), w, y)


def test_family_declares_every_group():
    from cukern.elementwise import FAMILIES
    names = {k.name.split("<")[0] for f in FAMILIES.values() for k in f.kernels}
    for n in ("rms_norm_reg", "residual_rms_norm_q8_1_reg", "group_norm", "binary_rows", "rope", "qk_norm_rope_kv",
              "kv_write", "deinterleave", "softmax_topk", "moe_weighted_sum", "shared_expert_accumulate",
              "router_matvec", "conv1d_silu", "deltanet", "deltanet_tiled"):
        assert n in names


# ------------------------------------------------------------------------------------------- norms

@gpu
@pytest.mark.parametrize("rows,cols", NORM_SHAPES)
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_rms_norm(d, rng, rows, cols, weight_offset):
    x = _randn(rng, rows, cols, scale=3)
    w = _randn(rng, cols)
    out = _empty(rows, cols)
    d.rms_norm(_dev(x), _dev(w), out, eps=1e-5, weight_offset=weight_offset)
    assert_close(out, ref.rms_norm(x, w, eps=1e-5, weight_offset=weight_offset))


@gpu
def test_rms_norm_random_shapes_in_place_and_misaligned(d, rng):
    for _ in range(6):
        rows, cols = int(rng.integers(1, 40)), int(rng.integers(1, 9000))
        x = _randn(rng, rows, cols)
        w = _randn(rng, cols)
        xd = _dev(x)
        d.rms_norm(xd, _dev(w), xd)  # in place
        assert_close(xd, ref.rms_norm(x, w), name=f"in place {rows}x{cols}")
    rows, cols = 3, 1024
    buf = _dev(_randn(rng, rows * cols + 1))
    x = buf[1:].reshape(rows, cols)  # 4-byte offset: the scalar path must be taken
    w = _randn(rng, cols)
    want = ref.rms_norm(x.get(), w)
    d.rms_norm(x, _dev(w), x)
    assert_close(x, want)


@gpu
@pytest.mark.parametrize("rows,cols", NORM_SHAPES)
def test_residual_rms_norm(d, rng, rows, cols):
    x, r, w = _randn(rng, rows, cols), _randn(rng, rows, cols), _randn(rng, cols)
    r_dev = _dev(r)
    out = _empty(rows, cols)
    d.residual_rms_norm(_dev(x), r_dev, _dev(w), out, eps=1e-6)
    want_out, want_r = ref.residual_rms_norm(x, r, w, eps=1e-6)
    assert_close(r_dev, want_r, name="residual")
    assert_close(out, want_out)


@gpu
@pytest.mark.parametrize("rows,cols", [(1, 1), (2, 7), (1, 2304), (5, 1030), (9, 4096), (2, 32768), (1, 33000)])
def test_post_norm_residual_rms_norm(d, rng, rows, cols):
    x, r = _randn(rng, rows, cols, scale=5), _randn(rng, rows, cols)
    wp, w = _randn(rng, cols), _randn(rng, cols)
    r_dev = _dev(r)
    out = _empty(rows, cols)
    d.post_norm_residual_rms_norm(_dev(x), r_dev, _dev(wp), _dev(w), out, eps=1e-6, weight_offset=1.0)
    want_out, want_r = ref.post_norm_residual_rms_norm(x, r, wp, w, eps=1e-6, weight_offset=1.0)
    assert_close(r_dev, want_r, name="residual")
    assert_close(out, want_out)


@gpu
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 13), (1, 640), (7, 4096), (2, 32772)])
def test_rms_norm_accumulate(d, rng, rows, cols):
    s, h, w = _randn(rng, rows, cols), _randn(rng, rows, cols), _randn(rng, cols)
    h_dev = _dev(h)
    d.rms_norm_accumulate(_dev(s), _dev(w), h_dev, eps=1e-6)
    assert_close(h_dev, ref.rms_norm_accumulate(s, w, h, eps=1e-6))


@gpu
@pytest.mark.parametrize("rows,cols", [(1, 32), (3, 96), (1, 2880), (5, 4096), (2, 5120), (1, 32768)])
def test_residual_rms_norm_q8_1(d, rng, rows, cols):
    x, r, w = _randn(rng, rows, cols), _randn(rng, rows, cols), _randn(rng, cols)
    x[0, :32] = 0.0  # an all-zero block after the norm needs r zero too
    r[0, :32] = 0.0
    r_dev = _dev(r)
    q = poison(cupy.empty((rows, cols // 32 * 36), cupy.uint8))
    d.residual_rms_norm_q8_1(_dev(x), r_dev, _dev(w), q, eps=1e-6)
    y, want_r = ref.residual_rms_norm(x, r, w, eps=1e-6)
    assert_close(r_dev, want_r, name="residual")
    _check_q8_1(q, y)
    # the unfused path (residual_rms_norm, then quantize_q8_1) on the same input
    q2 = poison(cupy.empty_like(q))
    y_dev = _empty(rows, cols)
    d.residual_rms_norm(_dev(x), _dev(r), _dev(w), y_dev, eps=1e-6)
    d.quantize_q8_1(y_dev, q2)
    _check_q8_1(q2, y)


@gpu
@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 64), (3, 4096), (1000, 96)])
def test_quantize_q8_1(d, rng, rows, cols):
    x = _randn(rng, rows, cols, scale=3)
    x[-1, -32:] = 0.0
    q = poison(cupy.empty((rows, cols // 32 * 36), cupy.uint8))
    d.quantize_q8_1(_dev(x), q)
    _check_q8_1(q, x)


@gpu
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 8, 128), (5, 2, 96), (2, 3, 7), (1, 40, 256), (3, 3, 1024),
                                   (1, 3, 1028)])
def test_head_rms_norm(d, rng, shape):
    x, w = _randn(rng, *shape, scale=2), _randn(rng, shape[-1])
    out = _empty(*shape)
    d.head_rms_norm(_dev(x), _dev(w), out, eps=1e-6, weight_offset=1.0)
    assert_close(out, ref.group_norm(x, group_size=shape[-1], w=w, eps=1e-6, weight_offset=1.0))


@gpu
@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("with_w", [False, True])
def test_group_norm(d, rng, l2, with_w):
    for shape, gs in [((3, 16, 128), 128), ((1, 5, 100), 50), ((7, 33), 11), ((2, 1), 1), ((3, 768), 256),
                      ((1, 2048), 2048), ((5, 1024), 1024), ((9, 8), 4), ((20001, 128), 128)]:
        x = _randn(rng, *shape)
        w = _randn(rng, gs) if with_w else None
        out = _empty(*shape)
        d.group_norm(_dev(x), out, group_size=gs, w=None if w is None else _dev(w), l2=l2, eps=1e-6)
        assert_close(out, ref.group_norm(x, group_size=gs, w=w, l2=l2, eps=1e-6), name=f"{shape}/{gs}")


@gpu
@pytest.mark.parametrize("shape,gs", [((1, 32, 128), 128), ((4, 6, 64), 64), ((3, 2, 50), 25), ((7, 1, 256), 256)])
def test_gated_rms_norm(d, rng, shape, gs):
    y, z, w = _randn(rng, *shape), _randn(rng, *shape, scale=2), _randn(rng, gs)
    out = _empty(*shape)
    d.gated_rms_norm(_dev(y), _dev(z), _dev(w), out, group_size=gs, eps=1e-6)
    assert_close(out, ref.group_norm(y, group_size=gs, w=w, z=z, eps=1e-6))


# ------------------------------------------------------------------------------------- activations

@gpu
@pytest.mark.parametrize("n", [1, 3, 4, 1001, 4096, 1 << 20, (1 << 20) + 3, 1 << 22, (1 << 22) + 1])
def test_add_scaled_add_scale(d, rng, n):
    a, b = _randn(rng, n), _randn(rng, n)
    out = _empty(n)
    d.add_scaled(_dev(a), _dev(b), out, alpha=-0.75)
    assert_close(out, ref.add_scaled(a, b, alpha=-0.75))
    a_dev = _dev(a)
    d.scale_accumulate(a_dev, _dev(b), 2.0)  # a += 2 b
    assert_close(a_dev, ref.add_scaled(a, b, alpha=2.0))
    out = _empty(n)
    d.add(_dev(a), _dev(b), out)
    assert_close(out, a.astype(np.float64) + b)
    out = _empty(n)
    d.scale(_dev(b), out, alpha=1.5)
    assert_close(out, ref.scale(b, alpha=1.5))
    out = _empty(n)
    d.sigmoid_mul(_dev(a), _dev(b * 4), out)
    assert_close(out, ref.sigmoid_mul(a, b * 4))


@gpu
def test_flat_ops_misaligned_and_nd(d, rng):
    buf_a, buf_b = _dev(_randn(rng, 1030)), _dev(_randn(rng, 1030))
    a, b = buf_a[1:1025].reshape(4, 256), buf_b[2:1026].reshape(4, 256)  # not 16-byte aligned
    out = _empty(4, 256)
    d.add_scaled(a, b, out, alpha=0.5)
    assert_close(out, ref.add_scaled(a.get(), b.get(), alpha=0.5))


@gpu
@pytest.mark.parametrize("rows,cols,offset", [(1, 1, 0), (3, 7, 5), (4, 4096, 0), (2, 128, 256), (5, 130, 3)])
def test_bias_add(d, rng, rows, cols, offset):
    x, bias = _randn(rng, rows, cols), _randn(rng, offset + cols + 9)
    out = _empty(rows, cols)
    d.bias_add(_dev(x), _dev(bias), out, offset=offset)
    assert_close(out, ref.bias_add(x, bias, offset=offset))


@gpu
@pytest.mark.parametrize("op", ["swiglu", "swiglu_oai", "geglu"])
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 7), (1, 14336), (5, 1030), (64, 512)])
def test_glu(d, rng, op, rows, cols):
    g, u = _randn(rng, rows, cols, scale=4), _randn(rng, rows, cols, scale=4)  # reaches gpt-oss's clamp (7)
    want = {"swiglu": lambda: ref.swiglu(g, u), "swiglu_oai": lambda: ref.swiglu_oai(g, u, alpha=1.702, limit=7.0),
            "geglu": lambda: ref.geglu(g, u)}[op]()
    out = _empty(rows, cols)
    getattr(d, op)(_dev(g), _dev(u), out)
    assert_close(out, want, name=f"{op} separate")
    fused = _dev(np.concatenate([g, u], axis=1))  # [gate | up] per row
    out = _empty(rows, cols)
    getattr(d, op)(fused, None, out)
    assert_close(out, want, name=f"{op} fused")


# ------------------------------------------------------------------------------------ bad arguments

def test_bad_arguments_raise_before_launch(d, host_if_no_gpu):
    x = cupy.ones((4, 8), cupy.float32)
    w = cupy.ones(8, cupy.float32)
    out = poison(cupy.empty((4, 8), cupy.float32))
    x3 = cupy.ones((2, 4, 8), cupy.float32)
    out3 = poison(cupy.empty((2, 4, 8), cupy.float32))
    pos = cupy.zeros(1, cupy.int32)
    ids = poison(cupy.empty((4, 2), cupy.int32))
    wts = poison(cupy.empty((4, 2), cupy.float32))
    cache = poison(cupy.empty((4, 4, 4, 8), cupy.float16))
    pt = cupy.zeros((1, 4), cupy.int32)
    cases = [
        (lambda: d.rms_norm(x, cupy.ones(7, cupy.float32), out), ValueError, "w must have shape"),
        (lambda: d.rms_norm(x.astype(cupy.float16), w, out), TypeError, "out must have dtype float16"),
        (lambda: d.rms_norm(x, w, cupy.empty((4, 9), cupy.float32)), ValueError, "out must have shape"),
        (lambda: d.rms_norm(x[:, ::2], w[:4], out[:, :4]), ValueError, "C-contiguous"),
        (lambda: d.rms_norm(x, w, out, eps=-1.0), ValueError, "eps must be >= 0"),
        (lambda: d.rms_norm(cupy.ones((0, 8), cupy.float32), w, out[:0]), ValueError, "non-empty"),
        (lambda: d.residual_rms_norm(x, out, w, out), ValueError, "must not overlap"),
        (lambda: d.residual_rms_norm_q8_1(x, x.copy(), w, cupy.empty((4, 9), cupy.uint8)), ValueError, "multiple of 32"),
        (lambda: d.add_scaled(x, w, out), ValueError, "b must have shape"),
        (lambda: d.scale(x, out, alpha=float("nan")), ValueError, "NaN"),
        (lambda: d.scale(x, out, alpha=1.0, stream=1.5), TypeError, "stream must be"),
        (lambda: d.bias_add(x, w, out, offset=1), ValueError, "exceeds bias length"),
        (lambda: d.swiglu(x[:, :7], None, out[:, :3]), ValueError, "C-contiguous"),
        (lambda: d.swiglu(cupy.ones((4, 7), cupy.float32), None, out[:, :3]), ValueError, "2 \\* n_ff"),
        (lambda: d.swiglu_oai(x, x, out, limit=0.0), ValueError, "limit"),
        (lambda: d.group_norm(x, out, group_size=3), ValueError, "group_size"),
        (lambda: d.rope(x3, pos, out3, rope_dim=5), ValueError, "rope_dim must be even"),
        (lambda: d.rope(x3, pos, out3, rope_dim=10), ValueError, "rope_dim must be even"),
        (lambda: d.rope(x3, pos, out3, freq_base=0.0), ValueError, "freq_base"),
        (lambda: d.rope(x3, pos, out3, pos_mode="per_token"), ValueError, "positions must have shape"),
        (lambda: d.rope(x3, cupy.zeros((4, 2), cupy.int32), out3, pos_mode="imrope"), ValueError, "sections"),
        (lambda: d.rope(x3, pos.astype(cupy.int64), out3), TypeError, "positions must have dtype int32"),
        (lambda: d.rope(cupy.ones((1, 1, 7), cupy.float32), pos, poison(cupy.empty((1, 1, 7), cupy.float32))),
         ValueError, "head_dim must be even"),
        (lambda: d.rope(x3, pos, out3, freqs=cupy.ones(3, cupy.float32)), ValueError, "freqs must have shape"),
        (lambda: d.softmax_topk(x, ids, wts, k=9), ValueError, "k must be in"),
        (lambda: d.softmax_topk(x, ids, wts, k=3), ValueError, "ids must have shape"),
        (lambda: d.kv_write(cupy.ones((2, 3, 8), cupy.float32), cache, pt, pos, pos), ValueError, "cache must be"),
        (lambda: d.kv_write(cupy.ones((2, 4, 8), cupy.float32), cache.astype(cupy.int8), pt, pos, pos), TypeError,
         "float16, bfloat16 \\(uint16 bits\\) or float32"),
        (lambda: d.kv_write(cupy.ones((2, 4, 8), cupy.float32), cache, pt, pos, pos, pos_mode="per_token"),
         ValueError, "positions must have shape"),
        (lambda: d.conv1d_silu(x, cupy.ones((3, 8), cupy.float32), cupy.ones((8, 5), cupy.float32), out),
         ValueError, "kernel_size"),
        (lambda: d.conv1d_silu(x, cupy.ones((2, 8), cupy.float32), cupy.ones((8, 4), cupy.float32), out),
         ValueError, "state must have shape"),
        (lambda: d.router_matvec(cupy.ones((2, 6), cupy.float32), cupy.ones((3, 6), cupy.float32),
                                 poison(cupy.empty((2, 3), cupy.float32))), ValueError, "n_embd % 4"),
        (lambda: d.deltanet(x3, x3, x3, cupy.ones((2, 4), cupy.float32), cupy.ones((2, 4), cupy.float32),
                            cupy.ones((4, 8, 7), cupy.float32), out3), ValueError, "state must have shape"),
        (lambda: d.deltanet(*(cupy.ones((1, 1, 48), cupy.float32),) * 3, cupy.ones((1, 1), cupy.float32),
                            cupy.ones((1, 1), cupy.float32), cupy.ones((1, 48, 48), cupy.float32),
                            cupy.ones((1, 1, 48), cupy.float32), tiled=True), ValueError, "tiled kernel needs dk"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    cupy.cuda.get_current_stream().synchronize()
    for a in (out, out3, wts, cache):
        assert np.isnan(a.get()).all(), "a rejected call wrote its output"
    assert (ids.get() == np.iinfo(np.int32).max).all()
