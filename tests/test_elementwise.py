"""Elementwise family against its float64 references (cukern/reference/elementwise.py)."""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.elementwise import ElementwiseDispatch  # noqa: E402
from cukern.reference import elementwise as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402

# (rows, cols): single element, odd widths (scalar path), widths that are multiples of 4 (float4
# path), a row wider than the block many times over, and a batch of 257 rows
SHAPES = [(1, 1), (3, 7), (1, 640), (5, 1030), (2, 4096), (4, 6001), (257, 256), (1, 16384)]


@pytest.fixture(scope="module")
def d():
    return ElementwiseDispatch()


def _dev(a):
    return cupy.asarray(a)


def test_rejects_host_arrays_before_launch():
    d = ElementwiseDispatch()  # no GPU needed to construct or to validate types
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(TypeError, match="x must be a cupy.ndarray"):
        d.rms_norm(x, np.zeros(4, np.float32), x)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_rms_norm(d, rng, rows, cols, weight_offset):
    x = rng.standard_normal((rows, cols), dtype=np.float32) * 3
    w = rng.standard_normal(cols, dtype=np.float32)
    out = poison(cupy.empty((rows, cols), cupy.float32))
    d.rms_norm(_dev(x), _dev(w), out, eps=1e-5, weight_offset=weight_offset)
    assert_close(out, ref.rms_norm(x, w, eps=1e-5, weight_offset=weight_offset))


@pytest.mark.gpu
def test_rms_norm_in_place_and_misaligned(d, rng):
    rows, cols = 3, 1024
    buf = cupy.asarray(rng.standard_normal(rows * cols + 1, dtype=np.float32))
    x = buf[1:].reshape(rows, cols)  # 4-byte offset: the scalar path must be taken
    w = rng.standard_normal(cols, dtype=np.float32)
    want = ref.rms_norm(x.get(), w)
    d.rms_norm(x, _dev(w), x)
    assert_close(x, want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_residual_rms_norm(d, rng, rows, cols):
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    r = rng.standard_normal((rows, cols), dtype=np.float32)
    w = rng.standard_normal(cols, dtype=np.float32)
    r_dev = _dev(r)
    out = poison(cupy.empty((rows, cols), cupy.float32))
    d.residual_rms_norm(_dev(x), r_dev, _dev(w), out, eps=1e-6)
    want_out, want_r = ref.residual_rms_norm(x, r, w, eps=1e-6)
    assert_close(r_dev, want_r, name="residual")
    assert_close(out, want_out)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3, 4, 1001, 4096, 1 << 20, (1 << 20) + 3])
def test_add_scaled_and_scale(d, rng, n):
    a = rng.standard_normal(n, dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    out = poison(cupy.empty(n, cupy.float32))
    d.add_scaled(_dev(a), _dev(b), out, alpha=-0.75)
    assert_close(out, ref.add_scaled(a, b, alpha=-0.75))
    a_dev = _dev(a)
    d.add_scaled(a_dev, _dev(b), a_dev, alpha=2.0)  # in place: a += 2 b
    assert_close(a_dev, ref.add_scaled(a, b, alpha=2.0))
    out = poison(cupy.empty(n, cupy.float32))
    d.scale(_dev(b), out, alpha=1.5)
    assert_close(out, ref.scale(b, alpha=1.5))


@pytest.mark.gpu
def test_bad_arguments_raise_before_launch(d):
    x = cupy.ones((4, 8), cupy.float32)
    w = cupy.ones(8, cupy.float32)
    out = poison(cupy.empty((4, 8), cupy.float32))
    cases = [
        (lambda: d.rms_norm(x, cupy.ones(7, cupy.float32), out), ValueError, "w must have shape"),
        (lambda: d.rms_norm(x.astype(cupy.float16), w, out), TypeError, "x must have dtype float32"),
        (lambda: d.rms_norm(x, w, cupy.empty((4, 9), cupy.float32)), ValueError, "out must have shape"),
        (lambda: d.rms_norm(x[:, ::2], w[:4], out[:, :4]), ValueError, "C-contiguous"),
        (lambda: d.rms_norm(x, w, out, eps=-1.0), ValueError, "eps must be >= 0"),
        (lambda: d.rms_norm(cupy.ones((0, 8), cupy.float32), w, out[:0]), ValueError, "non-empty"),
        (lambda: d.residual_rms_norm(x, out, w, out), ValueError, "must not alias"),
        (lambda: d.add_scaled(x, w, out), ValueError, "b must have shape"),
        (lambda: d.scale(x, out, alpha=float("nan")), ValueError, "NaN"),
        (lambda: d.scale(x, out, alpha=1.0, stream=1), TypeError, "stream must be"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    cupy.cuda.get_current_stream().synchronize()
    assert bool(cupy.isnan(out).all()), "a rejected call wrote its output"
