"""Shared helpers of the elementwise tests (test_elementwise*.py): device arrays, poisoned outputs, paged
caches and DeltaNet inputs.

Every output is poisoned with NaN first, so an element a kernel never writes fails. Tolerances: f32
outputs 1e-5 abs + 1e-5 rel (cukern.testing defaults); f16 caches 1e-3 + 2e-3; bf16 caches (uint16 bits)
1e-2 + 1.6e-2 (half an ulp of the one rounding, cukern.testing.TOLERANCES).
The DeltaNet state recurrences: 2e-5 abs + 1e-4 rel (dk-term dot products re-accumulated at every
step, compared over several consecutive steps).
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.reference import elementwise as ref  # noqa: E402
from cukern.reference.attention import as_float64  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402


gpu = pytest.mark.gpu


def _dev(a):
    return cupy.asarray(a)


def _randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _empty(*shape, dtype=cupy.float32):
    return poison(cupy.empty(shape, dtype))


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


def _paged_setup(rng, n_seqs, capacity, page_size, n_kv, hd, dtype):
    max_pages = -(-capacity // page_size)
    n_pages = n_seqs * max_pages + 2
    page_table = rng.permutation(n_pages)[:n_seqs * max_pages].reshape(n_seqs, max_pages).astype(np.int32)
    cache = poison(cupy.empty((n_pages, page_size, n_kv, hd), dtype))
    return page_table, cache


def _cache_kind(dtype) -> str:
    """'float32', 'float16' or 'bfloat16' (a uint16 cache holds bf16 bits, as PagedKVCache's does)."""
    return "bfloat16" if np.dtype(dtype) == np.uint16 else np.dtype(dtype).name


def _check_cache(cache, want, dtype, name):
    kind = _cache_kind(dtype)
    got = as_float64(cache, kind)
    written = ~np.isnan(want)
    assert np.isnan(got[~written]).all(), f"{name}: a row outside the written positions changed"
    assert_close(got[written], want[written], dtype=kind, name=name)


def _deltanet_inputs(rng, n_tok, n_qk, n_v, dk, dv):
    q = _randn(rng, n_tok, n_qk, dk)
    k = _randn(rng, n_tok, n_qk, dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # the model L2-normalises q and k
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    v = _randn(rng, n_tok, n_v, dv)
    g = (-rng.random((n_tok, n_v)) * 0.5).astype(np.float32)
    beta = rng.random((n_tok, n_v)).astype(np.float32)
    return q, k, v, g, beta
