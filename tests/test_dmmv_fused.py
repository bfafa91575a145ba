"""dmmv's fused inputs and epilogues against float64 references: RMS-normed and merged inputs,
three-matrix, pair and GLU matvecs.

Weights, inputs and tolerances: dmmv_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern import dmmv as D  # noqa: E402
from cukern.dmmv import DmmvDispatch, QWeight  # noqa: E402
from cukern.reference import dmmv as ref  # noqa: E402
from cukern.testing import poison  # noqa: E402
from dmmv_helpers import NAMES, Q8_NMSE_GLU, TYPES, _check, _check_q, _ks, _weight, _x, _xhat  # noqa: E402


@pytest.fixture(scope="module")
def d():
    return DmmvDispatch()


# ---------------------------------------------------------------------------- GPU: dmmv

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
@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
def test_ssm_alpha_beta_on_one_norm(d, rng, q):
    """A DeltaNet layer's alpha and beta projections of the RMS-normed hidden row in one dispatch:
    dmmv_pair on a NormedX (the norm made once per block, then both matvecs of the normed row), at
    the heads' widths (alpha, beta: n_v_heads rows each; ragged 7 and 13 too), decode and a few columns,
    on both dispatches (the int8 one takes the f32 path on a NormedX), y allocated when left None."""
    k = _ks(q)[-1]
    for n, (m_a, m_b) in ((1, (32, 32)), (1, (7, 13)), (5, (16, 16))):
        shape = (n, k) if n > 1 else (k,)
        nx, x, _ = _normed(rng, shape, None, out=False, offset=1.0 if n == 5 else 0.0)
        (wa, da), (wb, db) = _weight(q, m_a, k, rng), _weight(q, m_b, k, rng)
        for dd in (d, DmmvDispatch(int8=False)):
            ya, yb = dd.dmmv_pair(wa, wb, nx)
            assert ya.shape == shape[:-1] + (m_a,) and yb.shape == shape[:-1] + (m_b,)
            _check(ya, ref.matvec(da, x), f"alpha n={n}")
            _check(yb, ref.matvec(db, x), f"beta n={n}")


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
    (LSE -inf, O poisoned: never read). With ``sinks``: a buffer of three layers' sinks (the third
    layer's used, at sink_offset 2h; its head 1 NaN: no sink)."""
    o = rng.standard_normal((s, h, d)).astype(np.float32)
    lse = (rng.standard_normal((s, h)) * 4).astype(np.float32)
    for i in empty:
        lse[i] = -np.inf
        o[i] = np.nan
    if not sinks:
        return D.MergedX(cupy.asarray(o), cupy.asarray(lse)), ref.merged_x(o, lse)
    sk = (rng.standard_normal(3 * h) * 2).astype(np.float32)
    sk[2 * h + 1] = np.nan
    mx = D.MergedX(cupy.asarray(o), cupy.asarray(lse), cupy.asarray(sk), sink_offset=2 * h)
    return mx, ref.merged_x(o, lse, sk, sink_offset=2 * h)


@pytest.mark.gpu
@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
def test_dmmv_merged_input(d, rng, q):
    """dmmv on a MergedX (the split attention states merged by every block) against the merge in
    float64 followed by the matvec: one state, many (more than a warp), empty states, a head with no
    keys at all, sinks at a layer's offset (one NaN: none), Gemma 3's 4 x 256 and ragged head counts; store
    and accumulate."""
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
    shape: 4 query heads on 1 KV head of 256, an f16 cache), with and without sinks (a buffer of two layers'
    at layer 1's offset, one NaN), under pdl."""
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
        buf = rng.standard_normal(8).astype(np.float32)
        buf[6] = np.nan
        for sinks in (None, cupy.asarray(buf)):
            plan = attn.plan_decode(cache, [slot], 4, n_splits=5, partials=True)
            q = cupy.asarray(rng.standard_normal((1, 4, 256)).astype(np.float32))
            out = poison(cupy.empty((1, 4, 256), cupy.float32))
            off = 0 if sinks is None else 4
            attn.flash_attn_decode(plan, 0, q, out, sinks=sinks, sink_offset=off)
            o_part, lse_part = attn.flash_attn_decode_partials(plan, 0, q)
            y = poison(cupy.empty(640, cupy.float32))
            dp.dmmv(w, D.MergedX(o_part, lse_part, sinks, sink_offset=off), y)
            _check(y, ref.matvec(dense, out.get().reshape(-1).astype(np.float64)), f"slot {slot} sinks={sinks is not None}")


def test_merged_input_rejects(host_if_no_gpu):
    z = lambda *s: cupy.zeros(s, cupy.float32)  # noqa: E731
    with pytest.raises(ValueError, match=r"o_part must be \[S, H, D\]"):
        D.MergedX(z(4, 64), z(4))
    with pytest.raises(ValueError, match="multiple of 4"):
        D.MergedX(z(2, 3, 62), z(2, 3))
    with pytest.raises(ValueError, match=r"lse_part must have shape \(2, 3\)"):
        D.MergedX(z(2, 3, 64), z(3, 2))
    with pytest.raises(ValueError, match=r"sinks must be 1-D with at least sink_offset \+ n_heads = 3"):
        D.MergedX(z(2, 3, 64), z(2, 3), z(2))
    with pytest.raises(ValueError, match=r"sink_offset \+ n_heads = 5"):
        D.MergedX(z(2, 3, 64), z(2, 3), z(4), sink_offset=2)
    with pytest.raises(ValueError, match="sinks must be 1-D"):
        D.MergedX(z(2, 3, 64), z(2, 3), z(1, 3))
    with pytest.raises(ValueError, match="sink_offset must be an int"):
        D.MergedX(z(2, 3, 64), z(2, 3), z(4), sink_offset=-1)
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
