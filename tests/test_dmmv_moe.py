"""dmmv's mixture-of-experts matvecs (cukern/dmmv/moe.py) against float64 references: per-slot
expert matvecs, routing and packing, the down projection and bad expert ids.

The same random valid GGUF blocks and tolerances as the other dmmv tests: dmmv_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.dmmv import DeviceError, DmmvDispatch  # noqa: E402
from cukern.reference import dmmv as ref  # noqa: E402
from cukern.testing import poison  # noqa: E402
from dmmv_helpers import NAMES, Q8_NMSE_GLU, TYPES, _check, _check_q, _ids, _ks, _weight, _x  # noqa: E402
from dmmv_helpers import _xhat  # noqa: E402


@pytest.fixture(scope="module")
def d():
    return DmmvDispatch()


# ---------------------------------------------------------------------------- GPU: MoE

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
