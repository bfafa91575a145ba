"""Elementwise family against its float64 references (cukern/reference/elementwise.py).

Fixed boundary cases draw their data from the test-seeded ``rng`` fixture; the ``test_random_shapes_*``
tests draw every kernel's shapes, layouts and alignments per run from ``shape_rng`` (seed
CUKERN_TEST_SEED, else fresh entropy; every failure message names the seed); every output is poisoned with NaN first, so an element a kernel
never writes fails. Tolerances: f32 outputs 1e-5 abs + 1e-5 rel (cukern.testing defaults); f16 caches
1e-3 + 2e-3; the DeltaNet state recurrences 2e-5 abs + 1e-4 rel (dk-term dot products re-accumulated at
every step, compared over several consecutive steps).
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.elementwise import ElementwiseDispatch, contiguous_page_table  # noqa: E402
from cukern.reference import elementwise as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402

# (rows, cols): single element, odd widths (scalar loop path), multiples of 4 (register path) of
# every block size, the widest register row (32768), wider (loop path), a batch of 257 rows
NORM_SHAPES = [(1, 1), (3, 7), (1, 640), (5, 1030), (2, 4096), (4, 6001), (257, 256), (3, 5120), (1, 16384),
               (2, 32768), (1, 32772), (140, 4096), (133, 5120)]  # >= 132 rows: the many-rows configs

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def d():
    return ElementwiseDispatch()


def _dev(a):
    return cupy.asarray(a)


def _randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _empty(*shape, dtype=cupy.float32):
    return poison(cupy.empty(shape, dtype))


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


def _check_q8_1(q, y):
    rows, cols = y.shape
    dd, ss, qs = ref.unpack_q8_1(q.get(), cols)
    want_d, _, want_qs = ref.quantize_q8_1(y)
    assert_close(dd, want_d.astype(np.float16), atol=1e-7, rtol=1e-3, name="d")
    diff = np.abs(qs.astype(np.int64) - want_qs)
    assert diff.max() <= 1, "quantized values off by more than one step"
    assert (diff > 0).mean() < 0.01, "too many quantized values differ from round-half-away"
    qsum = qs.reshape(rows, -1, 32).astype(np.float64).sum(-1)
    assert_close(ss, (dd * qsum).astype(np.float16), atol=1e-6, rtol=2e-3, name="s")
    deq = (dd[..., None] * qs.reshape(rows, -1, 32)).reshape(rows, cols)
    # values were quantized with the f32 scale and are read back with its f16 rounding: |q| <= 127 steps
    # of at most 2**-11 relative error each on top of half a step
    bound = np.repeat(dd, 32, axis=1) * (0.5 + 127 * 2.0 ** -11) + 1e-6
    assert np.all(np.abs(deq - y) <= bound), "dequantized error above half a step"
    zero = np.all(y.reshape(rows, -1, 32) == 0, axis=-1)
    assert zero.any() and np.all(dd[zero] == 0) and np.all(qs.reshape(rows, -1, 32)[zero] == 0), "zero block"


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

def _paged_setup(rng, n_seqs, capacity, page_size, n_kv, hd, dtype):
    max_pages = -(-capacity // page_size)
    n_pages = n_seqs * max_pages + 2
    page_table = rng.permutation(n_pages)[:n_seqs * max_pages].reshape(n_seqs, max_pages).astype(np.int32)
    cache = poison(cupy.empty((n_pages, page_size, n_kv, hd), dtype))
    return page_table, cache


def _check_cache(cache, want, dtype, name):
    got = cache.get().astype(np.float64)
    written = ~np.isnan(want)
    assert np.isnan(got[~written]).all(), f"{name}: a row outside the written positions changed"
    tol = (1e-3, 2e-3) if dtype == cupy.float16 else (1e-5, 1e-5)
    assert_close(got[written], want[written], atol=tol[0], rtol=tol[1], name=name)


@gpu
@pytest.mark.parametrize("dtype", [cupy.float16, cupy.float32])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_kv_write_paged(d, rng, dtype, page_size):
    n_seqs, capacity, n_kv, hd = 3, 37, 2, 64
    page_table, cache = _paged_setup(rng, n_seqs, capacity, page_size, n_kv, hd, dtype)
    want = cache.get().astype(np.float64)
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
def test_kv_write_odd_rows(d, rng):
    """n_kv_heads * head_dim % 4 != 0: the one-element-per-thread path."""
    page_table, cache = _paged_setup(rng, 2, 10, 4, 1, 6, cupy.float32)
    src = _randn(rng, 7, 1, 6)
    pos, seq = np.array([3], np.int32), np.array([1], np.int32)
    d.kv_write(_dev(src), cache, _dev(page_table), _dev(pos), _dev(seq))
    want = ref.kv_write(src, np.full(cache.shape, np.nan), page_table, pos, seq)
    _check_cache(cache, want, cupy.float32, "cache")


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


# --------------------------------------------------------------------------------------------- MoE

@gpu
@pytest.mark.parametrize("n_tok,n_exp,k", [(1, 8, 2), (1, 128, 8), (5, 32, 4), (33, 64, 6), (7, 257, 32), (3, 1, 1),
                                           (2, 2048, 16)])
@pytest.mark.parametrize("renorm", [True, False])
def test_softmax_topk(d, rng, n_tok, n_exp, k, renorm):
    logits = _randn(rng, n_tok, n_exp, scale=3)
    ids, w = _empty(n_tok, k, dtype=cupy.int32), _empty(n_tok, k)
    d.softmax_topk(_dev(logits), ids, w, k=k, renorm=renorm, scale=1.5)
    want_ids, want_w = ref.softmax_topk(logits, k, renorm=renorm, scale=1.5)
    np.testing.assert_array_equal(ids.get(), want_ids)
    assert_close(w, want_w)


@gpu
def test_softmax_topk_ties_pick_lower_id(d):
    logits = np.array([[1, 3, 3, 0, 3, 2], [5, 5, 5, 5, 5, 5]], np.float32)
    ids, w = _empty(2, 4, dtype=cupy.int32), _empty(2, 4)
    d.softmax_topk(_dev(logits), ids, w, k=4)
    np.testing.assert_array_equal(ids.get(), [[1, 2, 4, 5], [0, 1, 2, 3]])
    assert_close(w, ref.softmax_topk(logits, 4)[1])


@gpu
@pytest.mark.parametrize("n_exp,k", [(128, 8), (128, 1), (64, 4), (100, 6), (124, 5), (4, 2), (8, 8), (96, 3)])
@pytest.mark.parametrize("renorm", [True, False])
def test_softmax_topk_many_tokens(d, rng, n_exp, k, renorm):
    """Token batches for the lane-group kernel (or, for 100 experts, the warp kernel), with tied logits
    (rounded), rows of one repeated value (more candidates than the list holds) and -inf logits."""
    n_tok = 32768 + 133
    logits = _randn(rng, n_tok, n_exp, scale=3)
    logits[::7] = np.round(logits[::7])  # many ties
    logits[5] = 1.0
    logits[9, : n_exp // 2] = -np.inf
    logits[11, 1:] = -np.inf
    ids, w = _empty(n_tok, k, dtype=cupy.int32), _empty(n_tok, k)
    d.softmax_topk(_dev(logits), ids, w, k=k, renorm=renorm, scale=1.5)
    want_ids, want_w = ref.softmax_topk(logits, k, renorm=renorm, scale=1.5)
    np.testing.assert_array_equal(ids.get(), want_ids)
    assert_close(w, want_w)


def _topk_rows(rng, n_tok, n_exp):
    """Logit rows for the lane-group kernel's paths: distinct values (threshold + rank), ties inside the
    top k and across its boundary (slot clash -> argmax rounds), +0/-0 ties, one repeated value (more
    candidates than slots), -inf halves, and a large-magnitude row."""
    logits = _randn(rng, n_tok, n_exp, scale=3)
    logits[1::6] = np.round(logits[1::6])  # many ties
    logits[2::6] = np.round(logits[2::6] * 4) / 4
    logits[3::6, : n_exp // 2] = -np.inf
    logits[4::6] = 1.0
    logits[5::6] = -np.abs(logits[5::6])
    logits[5::6, ::3] = 0.0
    logits[5::6, 1::5] = -0.0
    logits[0] *= 1e4
    return logits


@gpu
@pytest.mark.parametrize("n_exp,k", [(4, 1), (4, 4), (8, 8), (12, 3), (32, 4), (36, 5), (64, 16), (100, 6),
                                     (128, 8), (128, 16), (132, 2), (200, 11), (252, 9), (256, 16)])
@pytest.mark.parametrize("renorm", [True, False])
def test_softmax_topk_lanes(d, rng, n_exp, k, renorm):
    """Every (V, M) instance of softmax_topk_lanes, a ragged token count (masked groups) and every path."""
    n_tok = 8192 + 6 * 37 + 5  # from _TOPK_LANES_MIN_TOKENS
    logits = _topk_rows(rng, n_tok, n_exp)
    ids, w = _empty(n_tok, k, dtype=cupy.int32), _empty(n_tok, k)
    d.softmax_topk(_dev(logits), ids, w, k=k, renorm=renorm, scale=1.5)
    want_ids, want_w = ref.softmax_topk(logits, k, renorm=renorm, scale=1.5)
    np.testing.assert_array_equal(ids.get(), want_ids)
    assert_close(w, want_w)


@gpu
@pytest.mark.parametrize("n_tok,n_used,n_cols", [(1, 1, 1), (1, 8, 4096), (3, 4, 2880), (5, 6, 1030), (17, 2, 7)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_moe_weighted_sum(d, rng, n_tok, n_used, n_cols, accumulate):
    e, w = _randn(rng, n_tok, n_used, n_cols), _randn(rng, n_tok, n_used)
    base = _randn(rng, n_tok, n_cols)
    out = _dev(base) if accumulate else _empty(n_tok, n_cols)
    d.moe_weighted_sum(_dev(e), _dev(w), out, accumulate=accumulate)
    assert_close(out, ref.moe_weighted_sum(e, w, base if accumulate else None))


@gpu
@pytest.mark.parametrize("n_tok,n_cols", [(1, 1), (1, 2048), (4, 1030), (9, 4096)])
def test_shared_expert_accumulate(d, rng, n_tok, n_cols):
    h, s, g = _randn(rng, n_tok, n_cols), _randn(rng, n_tok, n_cols), _randn(rng, n_tok, scale=3)
    hd = _dev(h)
    d.shared_expert_accumulate(hd, _dev(s), _dev(g))
    assert_close(hd, ref.shared_expert_accumulate(h, s, g))


@gpu
@pytest.mark.parametrize("n_tok,n_exp,n_embd", [(1, 1, 4), (1, 128, 2048), (3, 60, 1028), (16, 64, 512), (37, 33, 260)])
def test_router_matvec(d, rng, n_tok, n_exp, n_embd):
    x, W, wn = _randn(rng, n_tok, n_embd, scale=2), _randn(rng, n_exp, n_embd, scale=0.05), _randn(rng, n_embd)
    logits = _empty(n_tok, n_exp)
    d.router_matvec(_dev(x), _dev(W), logits, scale=0.5)
    assert_close(logits, ref.router_matvec(x, W, scale=0.5), atol=1e-5, rtol=1e-4)  # n_embd-term dot products
    logits = _empty(n_tok, n_exp)
    d.router_rms_norm_matvec(_dev(x), _dev(wn), _dev(W), logits, eps=1e-6, weight_offset=1.0, scale=2.0)
    want = ref.router_rms_norm_matvec(x, wn, W, eps=1e-6, weight_offset=1.0, scale=2.0)
    assert_close(logits, want, atol=1e-5, rtol=1e-4, name="fused norm")


@gpu
@pytest.mark.parametrize("n_tok,n_exp,n_embd", [(4096, 128, 2048), (4100, 64, 260), (4127, 200, 1028), (4096, 64, 4),
                                                (4111, 129, 20)])
def test_router_gemm(d, rng, n_tok, n_exp, n_embd):
    """Token batches from _ROUTER_GEMM_MIN_TOKENS: the register-tiled GEMM, ragged in tokens (last block),
    experts (past one 128-expert tile) and n_embd (past one stage).

    Accuracy: normwise relative error <= 1e-5; per element, an absolute part scaled to the outputs' rms. Each
    output is one sequential f32 FMA chain over n_embd columns: at n_embd 2048 with outputs of rms ~6 (the
    fused case) single elements near zero miss 1e-5 absolute by up to 6e-5 (seen on an H100, and in a CPU
    emulation of the kernel's arithmetic: max |err| / rms(ref) ~ 1e-5, normwise ~ 9e-7)."""
    x, W, wn = _randn(rng, n_tok, n_embd, scale=2), _randn(rng, n_exp, n_embd, scale=0.05), _randn(rng, n_embd)

    def check(out, want, name):
        rms = float(np.sqrt(np.mean(want ** 2)))
        assert_close(out, want, atol=3e-5 * max(rms, 1.0), rtol=1e-4, name=name)
        assert np.linalg.norm(out.get() - want) <= 1e-5 * np.linalg.norm(want), name
    logits = _empty(n_tok, n_exp)
    d.router_matvec(_dev(x), _dev(W), logits, scale=0.5)
    check(logits, ref.router_matvec(x, W, scale=0.5), "router_matvec")
    logits = _empty(n_tok, n_exp)
    d.router_rms_norm_matvec(_dev(x), _dev(wn), _dev(W), logits, eps=1e-6, weight_offset=1.0, scale=2.0)
    check(logits, ref.router_rms_norm_matvec(x, wn, W, eps=1e-6, weight_offset=1.0, scale=2.0), "fused norm")


# ---------------------------------------------------------------------------------- SSM / DeltaNet

@gpu
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("C", [1, 37, 2048])
def test_conv1d_silu_decode_and_prefill(d, rng, K, C):
    w = _randn(rng, C, K, scale=0.7)
    state0 = _randn(rng, K - 1, C)
    state = _dev(state0)
    want_state = state0
    wd = _dev(w)
    for step, n_tok in enumerate([1, 1, 2, 1, 40, 17]):  # decode steps, short and long prefill chunks
        x = _randn(rng, n_tok, C, scale=2)
        y = _empty(n_tok, C)
        d.conv1d_silu(_dev(x), state, wd, y)
        want_y, want_state = ref.conv1d_silu(x, want_state, w)
        assert_close(y, want_y, name=f"y step {step}")
        assert_close(state, want_state, name=f"state step {step}")


def _deltanet_inputs(rng, n_tok, n_qk, n_v, dk, dv):
    q = _randn(rng, n_tok, n_qk, dk)
    k = _randn(rng, n_tok, n_qk, dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # the model L2-normalises q and k
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    v = _randn(rng, n_tok, n_v, dv)
    g = (-rng.random((n_tok, n_v)) * 0.5).astype(np.float32)
    beta = rng.random((n_tok, n_v)).astype(np.float32)
    return q, k, v, g, beta


@gpu
@pytest.mark.parametrize("n_qk,n_v,dk,dv", [(2, 4, 128, 128), (1, 1, 64, 40), (3, 3, 128, 70), (2, 2, 48, 33)])
def test_deltanet_baseline_and_tiled_agree_with_reference(d, rng, n_qk, n_v, dk, dv):
    tol = dict(atol=2e-5, rtol=1e-4)
    state0 = _randn(rng, n_v, dk, dv, scale=0.3)
    variants = [False, True] if dk in (64, 128) else [False]
    states = {t: _dev(state0) for t in variants}
    want_state = state0
    for step, n_tok in enumerate([1, 1, 1, 6, 1, 23]):  # decode steps and batched chunks, state carried
        q, k, v, g, beta = _deltanet_inputs(rng, n_tok, n_qk, n_v, dk, dv)
        want_o, want_state = ref.deltanet(q, k, v, g, beta, want_state)
        outs = {}
        for tiled in variants:
            o = _empty(n_tok, n_v, dv)
            d.deltanet(*map(_dev, (q, k, v, g, beta)), states[tiled], o, tiled=tiled)
            assert_close(o, want_o, name=f"o step {step} tiled={tiled}", **tol)
            assert_close(states[tiled], want_state, name=f"state step {step} tiled={tiled}", **tol)
            outs[tiled] = o.get()
        if len(outs) == 2:
            assert_close(outs[True], outs[False], name="tiled vs baseline", **tol)


# ---------------------------------------------------------------------- random shapes, drawn per run

_SEED = int(os.environ.get("CUKERN_TEST_SEED", np.random.SeedSequence().entropy % 2**63))


@pytest.fixture
def shape_rng(request):
    """Shapes and layouts drawn per run: seeded by CUKERN_TEST_SEED (default fresh) and the test id."""
    return np.random.default_rng([_SEED, zlib.crc32(request.node.nodeid.encode())])


def _tag(what):
    return f"{what} (CUKERN_TEST_SEED={_SEED})"


def _place(rng, a, misalign=True):
    """a (host) on the device; one time in three (misalign) 4 bytes off 16-byte alignment (scalar paths)."""
    if not misalign or rng.random() >= 1 / 3:
        return _dev(a)
    buf = cupy.empty(a.size + 1, a.dtype)
    v = buf[1:].reshape(a.shape)
    v[...] = _dev(a)
    return v


def _out(rng, *shape, dtype=cupy.float32, misalign=True):
    return poison(_place(rng, np.zeros(shape, dtype), misalign))


@gpu
def test_random_shapes_row_norms(d, shape_rng):
    rng = shape_rng
    for _ in range(4):
        rows = int(rng.integers(1, 300))
        cols = int(rng.integers(1, 9000)) if rng.random() < 0.5 else 32 * int(rng.integers(1, 300))
        x, r, w, w2 = _randn(rng, rows, cols, scale=2), _randn(rng, rows, cols), _randn(rng, cols), _randn(rng, cols)
        off = float(rng.choice([0.0, 1.0]))
        tag = _tag(f"{rows}x{cols}")
        out = _out(rng, rows, cols)
        d.rms_norm(_place(rng, x), _place(rng, w), out, weight_offset=off)
        assert_close(out, ref.rms_norm(x, w, weight_offset=off), name="rms_norm " + tag)
        out, rd = _out(rng, rows, cols), _place(rng, r)
        d.residual_rms_norm(_place(rng, x), rd, _place(rng, w), out, weight_offset=off)
        want_y, want_r = ref.residual_rms_norm(x, r, w, weight_offset=off)
        assert_close(out, want_y, name="residual_rms_norm " + tag)
        assert_close(rd, want_r, name="residual_rms_norm residual " + tag)
        out, rd = _out(rng, rows, cols), _place(rng, r)
        d.post_norm_residual_rms_norm(_place(rng, x), rd, _place(rng, w2), _place(rng, w), out, weight_offset=off)
        want_y, want_r = ref.post_norm_residual_rms_norm(x, r, w2, w, weight_offset=off)
        assert_close(out, want_y, name="post_norm_residual_rms_norm " + tag)
        assert_close(rd, want_r, name="post_norm_residual_rms_norm residual " + tag)
        hd = _place(rng, r)
        d.rms_norm_accumulate(_place(rng, x), _place(rng, w), hd, weight_offset=off)
        assert_close(hd, ref.rms_norm_accumulate(x, w, r, weight_offset=off), name="rms_norm_accumulate " + tag)
        if cols % 32 == 0 and cols <= 32768:  # the Q8_1 kernels: aligned arrays, whole blocks
            x[0, :32] = r[0, :32] = 0.0  # one all-zero block (_check_q8_1 wants one)
            q, rd = poison(cupy.empty((rows, cols // 32 * 36), cupy.uint8)), _dev(r)
            d.residual_rms_norm_q8_1(_dev(x), rd, _dev(w), q)
            y, want_r = ref.residual_rms_norm(x, r, w)
            assert_close(rd, want_r, name="residual_rms_norm_q8_1 residual " + tag)
            _check_q8_1(q, y)
            q = poison(cupy.empty((rows, cols // 32 * 36), cupy.uint8))
            d.quantize_q8_1(_dev(y.astype(np.float32)), q)
            _check_q8_1(q, y.astype(np.float32))


@gpu
def test_random_shapes_group_norms(d, shape_rng):
    rng = shape_rng
    for _ in range(5):
        gs = int(rng.choice([32, 64, 128, 256, int(rng.integers(1, 1100))]))
        lead = tuple(int(v) for v in rng.integers(1, 40, int(rng.integers(1, 3))))
        shape = lead + (gs * int(rng.integers(1, 4)),)
        x, z, w = _randn(rng, *shape, scale=2), _randn(rng, *shape, scale=2), _randn(rng, gs)
        tag = _tag(f"{shape}/{gs}")
        if shape[-1] == gs:
            out = _out(rng, *shape)
            d.head_rms_norm(_place(rng, x), _place(rng, w), out, weight_offset=1.0)
            assert_close(out, ref.group_norm(x, group_size=gs, w=w, weight_offset=1.0), name="head_rms_norm " + tag)
        l2, with_w = bool(rng.random() < 0.5), bool(rng.random() < 0.5)
        out = _out(rng, *shape)
        d.group_norm(_place(rng, x), out, group_size=gs, w=_place(rng, w) if with_w else None, l2=l2)
        assert_close(out, ref.group_norm(x, group_size=gs, w=w if with_w else None, l2=l2), name="group_norm " + tag)
        out = _out(rng, *shape)
        d.gated_rms_norm(_place(rng, x), _place(rng, z), _place(rng, w), out, group_size=gs)
        assert_close(out, ref.group_norm(x, group_size=gs, w=w, z=z), name="gated_rms_norm " + tag)


@gpu
def test_random_shapes_activations(d, shape_rng):
    rng = shape_rng
    for _ in range(4):
        n = int(rng.integers(1, 1 << 21))
        a, b = _randn(rng, n, scale=3), _randn(rng, n, scale=3)
        tag = _tag(f"n={n}")
        for name, call, want in [
                ("add", lambda o: d.add(_place(rng, a), _place(rng, b), o), a.astype(np.float64) + b),
                ("add_scaled", lambda o: d.add_scaled(_place(rng, a), _place(rng, b), o, alpha=-0.3),
                 ref.add_scaled(a, b, alpha=-0.3)),
                ("scale", lambda o: d.scale(_place(rng, a), o, alpha=0.7), ref.scale(a, alpha=0.7)),
                ("sigmoid_mul", lambda o: d.sigmoid_mul(_place(rng, a), _place(rng, b), o), ref.sigmoid_mul(a, b))]:
            out = _out(rng, n)
            call(out)
            assert_close(out, want, name=f"{name} {tag}")
        ad = _place(rng, a)
        d.scale_accumulate(ad, _place(rng, b), 1.25)
        assert_close(ad, ref.add_scaled(a, b, alpha=1.25), name="scale_accumulate " + tag)
        rows, cols = int(rng.integers(1, 200)), int(rng.integers(1, 6000))
        offset = int(rng.integers(0, 300))
        x, bias = _randn(rng, rows, cols), _randn(rng, offset + cols + int(rng.integers(0, 9)))
        out = _out(rng, rows, cols)
        d.bias_add(_place(rng, x), _place(rng, bias), out, offset=offset)
        assert_close(out, ref.bias_add(x, bias, offset=offset), name=_tag(f"bias_add {rows}x{cols}+{offset}"))
        g, u = _randn(rng, rows, cols, scale=4), _randn(rng, rows, cols, scale=4)
        for op, want in [("swiglu", ref.swiglu(g, u)), ("swiglu_oai", ref.swiglu_oai(g, u, alpha=1.702, limit=7.0)),
                         ("geglu", ref.geglu(g, u))]:
            out = _out(rng, rows, cols)
            getattr(d, op)(_place(rng, g), _place(rng, u), out)
            assert_close(out, want, name=_tag(f"{op} {rows}x{cols}"))
            out = _out(rng, rows, cols)
            getattr(d, op)(_place(rng, np.concatenate([g, u], axis=1)), None, out)
            assert_close(out, want, name=_tag(f"{op} fused {rows}x{cols}"))


def _rope_dims(rng):
    """(head_dim, rope_dim): the vectorised kernels' head sizes half the time, any even size else."""
    hd = int(rng.choice([32, 64, 128, 256])) if rng.random() < 0.5 else 2 * int(rng.integers(1, 160))
    rd = hd if rng.random() < 0.4 else 2 * int(rng.integers(1, hd // 2 + 1))
    if rng.random() < 0.3:
        rd = max(8, rd - rd % 8) if hd >= 8 else rd
    return hd, rd


@gpu
def test_random_shapes_rope(d, shape_rng):
    rng = shape_rng
    for _ in range(6):
        n_tok, n_heads = int(rng.integers(1, 300)), int(rng.integers(1, 12))
        hd, rd = _rope_dims(rng)
        neox = bool(rng.random() < 0.5)
        mode = str(rng.choice(["consecutive", "per_token", "mrope", "imrope"]))
        x, w = _randn(rng, n_tok, n_heads, hd, scale=2), _randn(rng, hd)
        sections = None
        if mode == "consecutive":
            positions = np.array([int(rng.integers(0, 100000))], np.int32)
        elif mode == "per_token":
            positions = rng.integers(0, 100000, n_tok).astype(np.int32)
        else:
            positions = rng.integers(0, 5000, (4, n_tok)).astype(np.int32)
            sections = [int(v) for v in rng.integers(0, rd // 2 + 1, 4)]
            sections[0] = max(sections[0], 1)
        kw = dict(rope_dim=rd, neox=neox, pos_mode=mode, sections=sections)
        if rng.random() < 0.5:
            kw["freqs"] = (rng.random(rd // 2) * 0.9 + 0.01).astype(np.float32)
        else:
            kw["freq_base"] = float(rng.choice([1e4, 5e5, 1e6]))
        dev_kw = dict(kw, freqs=_dev(kw["freqs"])) if "freqs" in kw else kw
        tag = _tag(f"{n_tok}x{n_heads}x{hd} rope_dim={rd} neox={neox} {mode} {sections}")
        in_place = bool(rng.random() < 0.3)
        xd = _place(rng, x)
        out = xd if in_place else _out(rng, n_tok, n_heads, hd)
        d.rope(xd, _dev(positions), out, **dev_kw)
        assert_close(out, ref.rope(x, positions, **kw), name="rope " + tag)
        xd = _place(rng, x)
        out = xd if in_place else _out(rng, n_tok, n_heads, hd)
        d.rms_norm_rope(xd, _place(rng, w), _dev(positions), out, weight_offset=1.0, **dev_kw)
        assert_close(out, ref.rms_norm_rope(x, w, positions, weight_offset=1.0, **kw), name="rms_norm_rope " + tag)


@gpu
def test_random_shapes_qk_norm_rope_kv(d, shape_rng):
    rng = shape_rng
    for _ in range(6):
        n_kv = int(rng.integers(1, 5))
        n_q = n_kv * int(rng.integers(1, 5))
        hd, rd = _rope_dims(rng)
        n_seqs, capacity = int(rng.integers(1, 4)), int(rng.integers(1, 80))
        page_size = int(rng.choice([1, 3, 16, int(rng.integers(1, 40))]))
        dtype = cupy.float16 if rng.random() < 0.5 else cupy.float32
        norm, batched = bool(rng.random() < 0.7), bool(rng.random() < 0.5)
        if batched:  # distinct (sequence, position) slots
            slots = rng.choice(n_seqs * capacity, int(rng.integers(1, min(n_seqs * capacity, 40) + 1)), replace=False)
            seq, pos, mode = (slots // capacity).astype(np.int32), (slots % capacity).astype(np.int32), "per_token"
            n_tok = len(slots)
        else:
            n_tok = int(rng.integers(1, capacity + 1))
            pos = np.array([int(rng.integers(0, capacity - n_tok + 1))], np.int32)
            seq, mode = np.array([int(rng.integers(0, n_seqs))], np.int32), "consecutive"
        page_table, k_cache = _paged_setup(rng, n_seqs, capacity, page_size, n_kv, hd, dtype)
        v_cache = poison(cupy.empty_like(k_cache))
        q, k, v = _randn(rng, n_tok, n_q, hd, scale=2), _randn(rng, n_tok, n_kv, hd, scale=2), _randn(rng, n_tok, n_kv, hd)
        wq, wk = _randn(rng, hd), _randn(rng, hd)
        tag = _tag(f"{n_tok} tok q{n_q} kv{n_kv} hd{hd} rd{rd} page{page_size} {mode} norm={norm} {dtype.__name__}")
        kw = dict(rope_dim=rd, neox=bool(rng.random() < 0.5), freq_base=1e6, pos_mode=mode)
        q_out = _out(rng, n_tok, n_q, hd)
        dpt, dpos, dseq = _dev(page_table), _dev(pos), _dev(seq)
        d.qk_norm_rope_kv_write(_place(rng, q), _place(rng, k), _place(rng, v), _place(rng, wq) if norm else None,
                                _place(rng, wk) if norm else None, q_out, k_cache, v_cache, dpt, dpos, dseq, **kw)
        rope_kw = dict(rope_dim=rd, neox=kw["neox"], freq_base=1e6, pos_mode="per_token")
        tok_pos = pos if batched else pos[0] + np.arange(n_tok, dtype=np.int32)
        qn = ref.group_norm(q, group_size=hd, w=wq) if norm else q
        kn = ref.group_norm(k, group_size=hd, w=wk) if norm else k
        assert_close(q_out, ref.rope(qn, tok_pos, **rope_kw), name="q_out " + tag)
        want_k = ref.kv_write(ref.rope(kn, tok_pos, **rope_kw), np.full(k_cache.shape, np.nan), page_table, pos, seq,
                              pos_mode=mode)
        want_v = ref.kv_write(v, np.full(v_cache.shape, np.nan), page_table, pos, seq, pos_mode=mode)
        _check_cache(k_cache, want_k, dtype, "k_cache " + tag)
        _check_cache(v_cache, want_v, dtype, "v_cache " + tag)
        k_only = poison(cupy.empty_like(k_cache))
        d.k_norm_rope_kv_write(_place(rng, k), _place(rng, wk) if norm else None, k_only, dpt, dpos, dseq, **kw)
        _check_cache(k_only, want_k, dtype, "k_cache (K only) " + tag)
        v_only = poison(cupy.empty_like(v_cache))
        d.kv_write(_place(rng, v), v_only, dpt, dpos, dseq, pos_mode=mode)
        _check_cache(v_only, want_v, dtype, "kv_write " + tag)


@gpu
def test_random_shapes_deinterleave_and_moe(d, shape_rng):
    rng = shape_rng
    for _ in range(4):
        shape = (int(rng.integers(1, 60)), int(rng.integers(1, 20)), 2 * int(rng.integers(1, 200)))
        x = _randn(rng, *shape)
        q, g = _out(rng, *shape[:2], shape[2] // 2), _out(rng, *shape[:2], shape[2] // 2)
        d.deinterleave(_place(rng, x), q, g)
        wq, wg = ref.deinterleave(x)
        assert_close(q, wq, name=_tag(f"deinterleave q {shape}"))
        assert_close(g, wg, name=_tag(f"deinterleave gate {shape}"))
        n_tok, n_exp = int(rng.integers(1, 300)), int(rng.integers(1, 2049))
        k = int(rng.integers(1, min(n_exp, 32) + 1))
        renorm = bool(rng.random() < 0.5)
        logits = _randn(rng, n_tok, n_exp, scale=3)
        ids, w = _empty(n_tok, k, dtype=cupy.int32), _empty(n_tok, k)
        d.softmax_topk(_dev(logits), ids, w, k=k, renorm=renorm, scale=1.5)
        want_ids, want_w = ref.softmax_topk(logits, k, renorm=renorm, scale=1.5)
        np.testing.assert_array_equal(ids.get(), want_ids, err_msg=_tag(f"softmax_topk {n_tok}x{n_exp} k={k}"))
        assert_close(w, want_w, name=_tag(f"softmax_topk weights {n_tok}x{n_exp} k={k}"))
        n_used, n_cols = int(rng.integers(1, 9)), int(rng.integers(1, 5000))
        e, ew, base = _randn(rng, n_tok, n_used, n_cols), _randn(rng, n_tok, n_used), _randn(rng, n_tok, n_cols)
        acc = bool(rng.random() < 0.5)
        out = _place(rng, base) if acc else _out(rng, n_tok, n_cols)
        d.moe_weighted_sum(_place(rng, e), _dev(ew), out, accumulate=acc)
        assert_close(out, ref.moe_weighted_sum(e, ew, base if acc else None),
                     name=_tag(f"moe_weighted_sum {n_tok}x{n_used}x{n_cols}"))
        s, gl = _randn(rng, n_tok, n_cols), _randn(rng, n_tok, scale=3)
        hd = _place(rng, base)
        d.shared_expert_accumulate(hd, _place(rng, s), _dev(gl))
        assert_close(hd, ref.shared_expert_accumulate(base, s, gl), name=_tag(f"shared_expert {n_tok}x{n_cols}"))
        n_embd, n_e = 4 * int(rng.integers(1, 1100)), int(rng.integers(1, 200))
        xr, W, wn = _randn(rng, n_tok, n_embd, scale=2), _randn(rng, n_e, n_embd, scale=0.05), _randn(rng, n_embd)
        lg = _empty(n_tok, n_e)
        d.router_matvec(_dev(xr), _dev(W), lg, scale=0.5)
        assert_close(lg, ref.router_matvec(xr, W, scale=0.5), atol=1e-5, rtol=1e-4,
                     name=_tag(f"router_matvec {n_tok}x{n_embd} @ {n_e}"))
        lg = _empty(n_tok, n_e)
        d.router_rms_norm_matvec(_dev(xr), _dev(wn), _dev(W), lg, weight_offset=1.0)
        assert_close(lg, ref.router_rms_norm_matvec(xr, wn, W, weight_offset=1.0), atol=1e-5, rtol=1e-4,
                     name=_tag(f"router_rms_norm_matvec {n_tok}x{n_embd} @ {n_e}"))


@gpu
def test_random_shapes_ssm(d, shape_rng):
    rng = shape_rng
    for _ in range(3):
        K, C = int(rng.choice([2, 3, 4])), int(rng.integers(1, 5000))
        w, state0 = _randn(rng, C, K, scale=0.7), _randn(rng, K - 1, C)
        state, want_state = _dev(state0), state0
        for step in range(4):
            n_tok = int(rng.choice([1, int(rng.integers(1, 70))]))
            x = _randn(rng, n_tok, C, scale=2)
            y = _empty(n_tok, C)
            d.conv1d_silu(_dev(x), state, _dev(w), y)
            want_y, want_state = ref.conv1d_silu(x, want_state, w)
            assert_close(y, want_y, name=_tag(f"conv1d_silu y K={K} C={C} step {step}"))
            assert_close(state, want_state, name=_tag(f"conv1d_silu state K={K} C={C} step {step}"))
    tol = dict(atol=2e-5, rtol=1e-4)
    for _ in range(3):
        n_qk = int(rng.integers(1, 4))
        n_v = n_qk * int(rng.integers(1, 3))
        dk = int(rng.choice([64, 128, int(rng.integers(1, 130))]))
        dv = int(rng.integers(1, 150))
        state0 = _randn(rng, n_v, dk, dv, scale=0.3)
        variants = [False, True] if dk in (64, 128) else [False]
        states, want_state = {t: _dev(state0) for t in variants}, state0
        for step in range(3):
            n_tok = int(rng.choice([1, int(rng.integers(1, 30))]))
            q, k, v, g, beta = _deltanet_inputs(rng, n_tok, n_qk, n_v, dk, dv)
            want_o, want_state = ref.deltanet(q, k, v, g, beta, want_state)
            for tiled in variants:
                o = _empty(n_tok, n_v, dv)
                d.deltanet(*map(_dev, (q, k, v, g, beta)), states[tiled], o, tiled=tiled)
                what = f"deltanet {n_tok} tok qk{n_qk} v{n_v} dk{dk} dv{dv} step {step} tiled={tiled}"
                assert_close(o, want_o, name=_tag("o " + what), **tol)
                assert_close(states[tiled], want_state, name=_tag("state " + what), **tol)


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
         "float16 or float32"),
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
