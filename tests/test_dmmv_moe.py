"""dmmv's mixture-of-experts matvecs (cukern/dmmv/moe.py) against float64 references: per-slot
expert matvecs, routing and packing, the down projection and bad expert ids.

The same random valid GGUF blocks and tolerances as the other dmmv tests: dmmv_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.dmmv import DeviceError, DmmvDispatch, QWeight  # noqa: E402
from cukern.reference import dmmv as ref  # noqa: E402
from cukern.reference import elementwise as ew_ref  # noqa: E402
from cukern.routing import RouteSlot  # noqa: E402
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


# ------------------------------------------- strided routing captures, RouteSlot, packed accumulate

def _slot(ids, wts):
    """A RouteSlot over a device copy of ref.route_slot(ids, wts)."""
    return RouteSlot(cupy.asarray(ew_ref.route_slot(ids, wts)), ids.shape[1])


@pytest.mark.gpu
@pytest.mark.parametrize("T,top_k,n_e,n_layers", [(13, 3, 5, 4), (1, 8, 8, 3), (700, 2, 37, 2)])
def test_moe_count_experts_strided_capture(d, rng, T, top_k, n_e, n_layers):
    """One layer's slice of a [n_tokens, n_layers, top_k] capture (the other layers hold other experts and
    out-of-range ids, so a read outside the slice shows), a view with a row stride, and a RouteSlot."""
    cap = np.stack([_ids(rng, T, top_k, n_e) for _ in range(n_layers)], axis=1)
    cap[:, ::2] = -3  # every other layer out of range
    layer = 1
    want = ref.route_counts(cap[:, layer], n_e)
    cap_d = cupy.asarray(cap)
    counts = poison(cupy.empty(n_e, cupy.int32))
    d.moe_count_experts(cap_d, counts, layer=layer)
    np.testing.assert_array_equal(counts.get(), want)
    counts = poison(cupy.empty(n_e, cupy.int32))
    d.moe_count_experts(cap_d.reshape(T, n_layers * top_k)[:, layer * top_k:(layer + 1) * top_k], counts)
    np.testing.assert_array_equal(counts.get(), want)
    counts = poison(cupy.empty(n_e, cupy.int32))
    d.moe_count_experts(_slot(cap[:, layer], rng.random((T, top_k))), counts)
    np.testing.assert_array_equal(counts.get(), want)
    d.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
def test_moe_route_slot_and_packed_accumulate(d, rng, q):
    """Every MoE consumer on a RouteSlot (ids then the weights' bits in one [T, 2 top_k] buffer) against the
    separate-array reference; moe_dmmv_packed adding into y (accumulate, alpha) and summing the weighted
    slots into y [T, m] (the down projection, atomics), one slot's id out of range (its term dropped)."""
    for n_e, m, T, top_k in ((5, 9, 13, 3), (6, 301, 2, 4)):
        k = _ks(q)[1]
        w, dense = _weight(q, m, k, rng, n_experts=n_e)
        ids = _ids(rng, T, top_k, n_e)
        wts = rng.uniform(0, 1, (T, top_k)).astype(np.float32)
        slot = _slot(ids, wts)
        x, h = _x(rng, T, k), _x(rng, T, top_k, k)
        y = poison(cupy.empty((T, top_k, m), cupy.float32))
        d.moe_dmmv(w, cupy.asarray(x), slot, y)
        _check_q(y, q, lambda v, dense=dense, ids=ids: ref.moe(dense, v, ids), x, f"{m} rows moe_dmmv")
        y = poison(cupy.empty((T, m), cupy.float32))
        d.moe_down(w, cupy.asarray(h), slot, None, y)
        _check_q(y, q, lambda v, dense=dense, ids=ids, wts=wts: ref.moe_down(dense, v, ids, wts), h,
                 f"{m} rows moe_down")
        route = d.plan_moe_route(T, top_k, n_e)
        d.moe_route_pack(slot, route)
        np.testing.assert_array_equal(route.counts.get(), ref.route_counts(ids, n_e))
        y0 = _x(rng, T, top_k, m)
        y = cupy.asarray(y0)
        d.moe_dmmv_packed(w, cupy.asarray(x), slot, route, y, accumulate=True, alpha=-0.5)
        _check(y, y0 - 0.5 * ref.moe(dense, x, ids), f"{m} rows packed accumulate")
        d.check_errors()
        bad = ids.copy()
        bad[-1, 0] = n_e  # out of range: the term dropped
        slot = _slot(bad, wts)
        d.moe_route_pack(slot, route)
        r0 = _x(rng, T, m)
        y = cupy.asarray(r0)
        d.moe_dmmv_packed(w, cupy.asarray(h), slot, route, y, accumulate=True, weights=slot.weights, alpha=1.5)
        _check(y, r0 + 1.5 * ref.moe_down(dense, h, bad, wts), f"{m} rows packed down into y")
        with pytest.raises(DeviceError, match="expert id"):
            d.check_errors()


def test_moe_routing_views_reject(host_if_no_gpu):
    d = DmmvDispatch()
    buf = cupy.zeros(4 * 2 * 144, cupy.uint8)
    we = QWeight(buf, "Q4_K", 2, 256, n_experts=4)
    x = cupy.zeros((3, 256), cupy.float32)
    ids = cupy.zeros((3, 2), cupy.int32)
    y = cupy.full((3, 2, 2), 7.0, cupy.float32)
    counts = cupy.full(4, 7, cupy.int32)
    route = d.plan_moe_route(3, 2, 4)
    with pytest.raises(ValueError, match="RouteSlot: buf must be"):
        RouteSlot(cupy.zeros((3, 5), cupy.uint32), 2)
    with pytest.raises(TypeError, match="RouteSlot.buf must have dtype"):
        RouteSlot(cupy.zeros((3, 4), cupy.float16), 2)
    with pytest.raises(ValueError, match="ids: the entries of a row must be contiguous"):
        d.moe_count_experts(cupy.zeros((3, 4), cupy.int32)[:, ::2], counts)
    with pytest.raises(ValueError, match="ids: the entries of a row must be contiguous"):
        d.moe_dmmv(we, x, cupy.zeros((2, 3), cupy.int32).T, y)
    with pytest.raises(ValueError, match="layer in"):
        d.moe_count_experts(cupy.zeros((3, 2, 2), cupy.int32), counts, layer=2)
    with pytest.raises(ValueError, match="layer in"):
        d.moe_count_experts(cupy.zeros((3, 2, 2), cupy.int32), counts)
    with pytest.raises(ValueError, match="needs accumulate=True"):
        d.moe_dmmv_packed(we, x, ids, route, cupy.zeros((3, 2), cupy.float32), weights=cupy.ones((3, 2), cupy.float32))
    with pytest.raises(ValueError, match=r"y must have shape \(3, 2\)"):
        d.moe_dmmv_packed(we, x, ids, route, y, accumulate=True, weights=cupy.ones((3, 2), cupy.float32))
    with pytest.raises(ValueError, match=r"weights must have shape \(3, 2\)"):
        d.moe_down(we, cupy.zeros((3, 2, 256), cupy.float32), ids, cupy.ones((3, 3), cupy.float32), y[:, 0])
    with pytest.raises(TypeError, match="weights must be a cupy.ndarray"):
        d.moe_down(we, cupy.zeros((3, 2, 256), cupy.float32), ids, None, y[:, 0])
    cupy.cuda.get_current_stream().synchronize()
    assert (y.get() == 7.0).all() and (counts.get() == 7).all()  # nothing was launched
