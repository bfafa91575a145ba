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


# (q/k type, v type, n_q_heads, n_kv_heads, head_dim, rope_dim, neox, Q/K norm, v_norm, cache dtype, q_out dtype,
#  freqs): Gemma 3 270M's layer; Qwen3's head_dim 128 with a bf16 cache and partial interleaved rotation; no
# norm on an f32 cache; a head of 18 rows that blocks of 4 rows straddle (one block counts into two heads)
_ROPE_CASES = [
    (6, 8, 4, 1, 256, 256, True, True, "none", "float16", "float32", False),
    (12, 14, 8, 2, 128, 64, False, True, "weight", "bfloat16", "bfloat16", True),
    (1, 1, 6, 3, 64, 64, True, False, "unit", "float32", "float32", False),
    (2, 8, 6, 2, 18, 10, True, True, "none", "float16", "float16", False),
]


def _cache_dtype(name):
    return cupy.uint16 if name == "bfloat16" else getattr(cupy, name)


@pytest.mark.gpu
@pytest.mark.parametrize("case", _ROPE_CASES, ids=lambda c: f"{NAMES.get(c[0])}-{NAMES.get(c[1])}-hd{c[4]}-{c[9]}")
def test_dmmv_three_rope_kv(rng, case):
    """dmmv_three with its RopeKV epilogue: y1..y3 against the float64 matvecs; q_out and the token's K and V
    cache rows against the float64 qk_norm_rope_kv_write of the kernel's own y (the epilogue's error alone, at
    the output dtype's tolerance) and, for an f32 q_out, of the float64 matvecs (the matvec's tolerance);
    every other cache row keeps its NaN poison. Two launches at two positions on one RopeKV (the counters
    left zero by the first), with pdl."""
    from cukern.reference.attention import as_float64
    from cukern.testing import assert_close
    from elementwise_helpers import _check_cache, _paged_setup
    qt, qt3, nq, nkv, hd, rd, neox, norm, v_norm, kind, q_kind, use_freqs = case
    k = 1280
    dt = _cache_dtype(kind)
    page_table, k_cache = _paged_setup(rng, 3, 40, 16, nkv, hd, dt)
    v_cache = poison(cupy.empty(k_cache.shape, dt))
    q_out = poison(cupy.empty((1, nq, hd), _cache_dtype(q_kind)))
    w = lambda: rng.uniform(-1, 2, hd).astype(np.float32)  # noqa: E731
    wq, wk, wv = (w(), w()) if norm else (None, None), w() if v_norm == "weight" else None
    freqs = (0.5 ** np.arange(rd // 2) / 3).astype(np.float32) if use_freqs else None
    dev = lambda a: None if a is None else cupy.asarray(a)  # noqa: E731
    positions, seq_ids = cupy.asarray(np.array([7, 0], np.int32)), cupy.asarray(np.array([2, 1], np.int32))
    rk = dict(eps=1e-5, weight_offset=0.5 if norm else 0.0, rope_dim=rd, neox=neox, freq_base=5000.0,
              attn_scale=1.25 if use_freqs else 1.0, v_norm=v_norm != "none")
    rope = D.RopeKV(q_out, k_cache, v_cache, cupy.asarray(page_table), positions, seq_ids, wq=dev(wq), wk=dev(wk),
                    freqs=dev(freqs), wv=dev(wv), **rk)
    ws = [_weight(t, m, k, rng) for t, m in ((qt, nq * hd), (qt, nkv * hd), (qt3, nkv * hd))]
    want_k, want_v = np.full(k_cache.shape, np.nan), np.full(v_cache.shape, np.nan)
    dd = DmmvDispatch(int8=False, pdl=True)
    for pos in (7, 29):
        positions[:1] = pos
        nx, x, _ = _normed(rng, (1, k), "norm")
        ys = [poison(cupy.empty((1, w.m), cupy.float32)) for w, _ in ws]
        dd.dmmv_three(*(w for w, _ in ws), nx, *ys, rope=rope)
        exact = [ref.matvec(dense, x) for _, dense in ws]
        for i, (y, want) in enumerate(zip(ys, exact)):
            _check(y, want, f"y{i + 1} pos={pos}")
        kw = dict(rk, wq=wq, wk=wk, wv=wv, freqs=freqs)
        pt, pa, sa = page_table, np.array([pos], np.int32), np.array([2], np.int32)
        want_q, want_k, want_v = ref.three_rope_kv(*(y.get() for y in ys), nq, nkv, want_k, want_v, pt, pa, sa, **kw)
        assert_close(as_float64(q_out, q_kind).reshape(nq, hd), want_q, dtype=q_kind, name=f"q_out pos={pos}")
        _check_cache(k_cache, want_k, dt, f"k_cache pos={pos}")
        _check_cache(v_cache, want_v, dt, f"v_cache pos={pos}")
        if q_kind == "float32":
            chain_q, _, _ = ref.three_rope_kv(*exact, nq, nkv, np.full(k_cache.shape, np.nan),
                                              np.full(v_cache.shape, np.nan), pt, pa, sa, **kw)
            _check(q_out.reshape(nq, hd), chain_q, f"q_out from the float64 matvecs pos={pos}")
    assert int(abs(rope.counters).sum()) == 0, "the counters are left zero"


def test_dmmv_three_rope_kv_rejects(host_if_no_gpu):
    """RopeKV's own checks and dmmv_three's of a RopeKV against the matrices, before any launch."""
    d = DmmvDispatch()
    z = lambda *s, dt=cupy.float32: cupy.zeros(s, dt)  # noqa: E731
    i32 = lambda *s: cupy.zeros(s, cupy.int32)  # noqa: E731
    kc, vc, pt = z(4, 16, 1, 64, dt=cupy.float16), z(4, 16, 1, 64, dt=cupy.float16), i32(2, 2)
    base = dict(q_out=z(2, 64), k_cache=kc, v_cache=vc, page_table=pt, positions=i32(1), seq_ids=i32(1),
                counters=i32(4))
    bad = [
        (dict(q_out=z(2, 64, dt=cupy.uint16)), TypeError, "q_out must be float32 or the caches'"),
        (dict(v_cache=z(4, 16, 1, 64)), TypeError, "v_cache must have dtype float16"),
        (dict(q_out=z(2, 32)), ValueError, r"q_out must be \[n_q_heads, 64\]"),
        (dict(k_cache=z(4, 16, 1, 63, dt=cupy.float16), v_cache=z(4, 16, 1, 63, dt=cupy.float16)), ValueError,
         "must be even"),
        (dict(wq=z(64)), ValueError, "both wq and wk"),
        (dict(wv=z(64)), ValueError, "pass v_norm=True"),
        (dict(rope_dim=66), ValueError, "rope_dim must be an even int"),
        (dict(freqs=z(31)), ValueError, r"freqs must have shape \(32\)"),
        (dict(positions=i32(0)), ValueError, "at least one entry"),
        (dict(counters=i32(3)), ValueError, r"n_q_heads \+ 2 n_kv_heads = 4"),
        (dict(attn_scale=0.0), ValueError, "attn_scale must be > 0"),
    ]
    for change, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            D.RopeKV(**{**base, **change})
    rope = D.RopeKV(**base)
    q5 = lambda m: QWeight(cupy.zeros(22 * 2 * m, cupy.uint8), "Q5_0", m, 64)  # noqa: E731
    nx = D.NormedX(z(64), z(64))
    with pytest.raises(ValueError, match=r"n_q_heads \* head_dim = 128 rows"):
        d.dmmv_three(q5(64), q5(64), q5(64), nx, z(64), z(64), z(64), rope=rope)
    with pytest.raises(TypeError, match="rope must be a RopeKV"):
        d.dmmv_three(q5(128), q5(64), q5(64), nx, z(128), z(64), z(64), rope=object())
    with pytest.raises(ValueError, match="y1 overlaps rope.q_out"):
        d.dmmv_three(q5(128), q5(64), q5(64), nx, rope.q_out.reshape(128), z(64), z(64), rope=rope)


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
