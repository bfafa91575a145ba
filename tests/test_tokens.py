"""Tokens family: embedding gather by device ids, greedy and top-k/top-p sampling, position advance.

References: cukern/reference/tokens.py (float64) and gguf.quants for the block formats."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest

from cukern.reference import tokens as ref

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def td():
    from cukern.tokens import TokensDispatch
    return TokensDispatch()


def _table(rng, qtype, rows, cols):
    from cukern.models.tiny import random_blocks
    import gguf
    raw = random_blocks(rng, rows, cols, gguf.GGMLQuantizationType(qtype), 1.0)
    f64 = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(rows, cols).astype(np.float64)
    return raw, f64


@gpu
@pytest.mark.parametrize("qtype,cols", [(0, 100), (1, 36), (2, 96), (6, 160), (8, 640), (12, 256), (13, 512),
                                        (14, 768)])
def test_embed_matches_reference(td, rng, qtype, cols):
    import cupy
    from cukern.testing import assert_close, poison
    raw, f64 = _table(rng, qtype, 37, cols)
    ids = np.array([0, 36, 5, 5, -1, 37, 12], np.int32)          # repeats and two ids outside the table
    out = poison(cupy.empty((ids.size, cols), cupy.float32))
    td.embed(cupy.asarray(raw), qtype, cols, cupy.asarray(ids), out, scale=1.5)
    assert_close(out, ref.embed(f64, ids, scale=1.5), atol=1e-6, rtol=1e-6)  # f32 dequantization of f16 scales


def test_embed_validates_before_launch(td, host_if_no_gpu):
    import cupy
    t = cupy.zeros((4, 34), cupy.uint8)
    ids = cupy.zeros(2, cupy.int32)
    out = cupy.zeros((2, 32), cupy.float32)
    with pytest.raises(ValueError, match="unsupported table type"):
        td.embed(t, 3, 32, ids, out)
    with pytest.raises(ValueError, match="34 bytes"):
        td.embed(t, 8, 64, ids, cupy.zeros((2, 64), cupy.float32))
    with pytest.raises(TypeError, match="ids"):
        td.embed(t, 8, 32, ids.astype(cupy.int64), out)
    with pytest.raises(ValueError, match="out"):
        td.embed(t, 8, 32, ids, cupy.zeros((3, 32), cupy.float32))


@gpu
@pytest.mark.parametrize("rows,vocab", [(1, 262144), (3, 151936), (2, 1000), (5, 1)])
def test_greedy_matches_argmax(td, rng, rows, vocab):
    import cupy
    from cukern.tokens import SamplePlan
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    if vocab > 10:
        x[0, [3, vocab - 2]] = 50.0                                   # a tie: the lower id wins
        x[-1, 7] = np.nan                                             # NaN counts as -inf
    plan = SamplePlan(rows, vocab, sampling=False, history_len=4)
    plan.next_ids.fill(-5)
    got = td.sample(plan, cupy.asarray(x)).get()
    np.testing.assert_array_equal(got, ref.greedy(x))
    assert plan.draws.get().tolist() == [1] * rows and plan.history.get()[:, 0].tolist() == got.tolist()


@gpu
@pytest.mark.parametrize("vocab", [50, 4099, 262144])
def test_sampling_top_k_1_and_tiny_temperature_are_greedy(td, rng, vocab):
    import cupy
    from cukern.tokens import SamplePlan
    x = rng.standard_normal((4, vocab)).astype(np.float32)
    plan = SamplePlan(4, vocab, sampling=True)
    np.testing.assert_array_equal(td.sample(plan, cupy.asarray(x), temperature=1.0, top_k=1).get(), ref.greedy(x))
    np.testing.assert_array_equal(td.sample(plan, cupy.asarray(x), temperature=1e-3).get(), ref.greedy(x))


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 64, 1.0), (0.7, 10, 1.0), (1.3, 64, 0.8)])
def test_sampling_distribution(td, rng, temperature, top_k, top_p):
    """Many rows holding the same logits (vocabulary 3000, spread so that the top 64 matter): the
    frequencies of the draws match the reference probabilities within 5 binomial standard deviations
    (plus 1e-3), and no draw falls outside the candidate set."""
    import cupy
    from cukern.tokens import SamplePlan
    rows, vocab = 8192, 3000
    base = (rng.standard_normal(vocab) * 2).astype(np.float32)
    x = cupy.asarray(np.tile(base, (rows, 1)))
    plan = SamplePlan(rows, vocab, sampling=True)
    counts = np.zeros(vocab)
    for seed in range(4):
        got = td.sample(plan, x, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed).get()
        counts += np.bincount(got, minlength=vocab)
    ids, p = ref.candidate_probs(base, temperature=temperature, top_k=top_k, top_p=top_p)
    n = counts.sum()
    outside = np.setdiff1d(np.flatnonzero(counts), ids)
    assert outside.size == 0, f"draws outside the candidate set: {outside[:10]}"
    freq = counts[ids] / n
    bound = 5 * np.sqrt(p * (1 - p) / n) + 1e-3
    bad = np.flatnonzero(np.abs(freq - p) > bound)
    assert bad.size == 0, f"ids {ids[bad][:5]}: frequency {freq[bad][:5]} vs probability {p[bad][:5]}"


# ---- the sampling path against the float64 reference: stage-1 candidates slot by slot, and every draw

_NO_ID = 0x7FFFFFFF
_KINDS = ("normal", "ties", "special")


def _logits(rng, kind, rows, n):
    """[rows, n] f32 logits. ties: values 0..3 with P(3) = 1%, so the 64th best of a chunk falls inside a
    run of equal values; special: NaN, -inf, +0 and -0 among normal values, and (rows > 1) a last row of
    only NaN and -inf."""
    if kind == "normal":
        x = rng.standard_normal((rows, n)) * 3
    elif kind == "ties":
        x = rng.choice(np.array([0.0, 1.0, 2.0, 3.0]), size=(rows, n), p=[0.6, 0.3, 0.09, 0.01])
    else:
        x = rng.standard_normal((rows, n)) * 3
        u = rng.random((rows, n))
        x[u < 0.2] = np.nan
        x[(u >= 0.2) & (u < 0.4)] = -np.inf
        x[(u >= 0.4) & (u < 0.45)] = 0.0
        x[(u >= 0.45) & (u < 0.5)] = -0.0
        if rows > 1:
            x[-1] = np.where(u[-1] < 0.5, np.nan, -np.inf)
    return x.astype(np.float32)


def _ref_top64(x):
    """The best 64 (value, id) of x in the kernels' order, padded with (-inf, NO_ID)."""
    v = np.asarray(x, np.float64)
    v = np.where(np.isnan(v), -np.inf, v)
    order = np.lexsort((np.arange(v.size), -v))[:64]
    val = np.full(64, -np.inf)
    ids = np.full(64, _NO_ID, np.int64)
    val[:order.size], ids[:order.size] = v[order], order
    return val, ids


def _check_candidates(plan, x):
    """Stage 1's output, [row, slot, chunk], equals the reference's best 64 of every chunk."""
    cv, ci = plan.cand_val.get(), plan.cand_idx.get()
    assert cv.shape == ci.shape == (plan.n_rows, 64, plan.n_chunks)
    for r in range(plan.n_rows):
        for c in range(plan.n_chunks):
            val, ids = _ref_top64(x[r, c * plan.chunk:(c + 1) * plan.chunk])
            ids = np.where(ids == _NO_ID, _NO_ID, ids + c * plan.chunk)
            assert np.array_equal(ci[r, :, c], ids), (r, c, ci[r, :, c], ids)
            assert np.array_equal(cv[r, :, c], val), (r, c, cv[r, :, c], val)


def _acceptable_picks(row, temperature, top_k, top_p, u, tol=1e-4):
    """Ids the sampler may return for uniform number u: the reference's pick, plus its neighbour where u
    (or the top_p cut) lies within tol of a boundary of the cumulative distribution (the kernel works in
    f32 with __expf). A row without a finite logit gives token 0."""
    x = np.asarray(row, np.float64)
    x = np.where(np.isnan(x), -np.inf, x)
    if not x.max() > -np.inf:
        return {0}
    order = np.lexsort((np.arange(x.size), -x))[:top_k]
    w = np.exp((x[order] - x[order[0]]) / temperature)
    c = np.cumsum(w)
    ok = set()
    for keep in range(1, order.size + 1):
        if c[keep - 1] < top_p * c[-1] * (1 - tol):
            continue
        ck = c[:keep] / c[keep - 1]
        lo = np.concatenate([[0.0], ck[:-1]])
        hit = (w[:keep] > 0) & (lo - tol <= u) & (u < ck + tol)
        ok.update(order[:keep][hit].tolist())
        if c[keep - 1] >= top_p * c[-1] * (1 + tol):
            break
    return ok


def _sample_and_check(td, plan, x, xg, *, temperature, top_k, top_p, seed):
    from cukern.testing import poison
    draw = plan.draws.get()
    poison(plan.next_ids)
    got = td.sample(plan, xg, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed).get()
    for r in range(plan.n_rows):
        ok = _acceptable_picks(x[r], temperature, top_k, top_p, ref.uniform(seed, r, draw[r]))
        assert got[r] in ok, f"row {r} draw {draw[r]} top_k {top_k} top_p {top_p}: got {got[r]}, want {sorted(ok)}"
    assert (plan.draws.get() == draw + 1).all()
    hist = plan.history.get()
    for r in range(plan.n_rows):
        if draw[r] < plan.history_len:
            assert hist[r, draw[r]] == got[r]
    return got


@gpu
@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize("n_cols,rows", [(1, 3), (63, 1), (64, 8), (65, 2), (4097, 5), (262144, 1), (262144, 8),
                                         (300007, 3)])
def test_sampling_matches_reference(td, rng, kind, n_cols, rows):
    """Every (top_k, top_p) of {1, 7, 64} x {0.1, 0.95, 1.0}: stage 1's candidates equal the reference's best
    64 of each chunk (checked after the first call, on poisoned buffers), and every draw is the reference's
    pick for the kernel's uniform number."""
    import cupy
    from cukern.testing import poison
    from cukern.tokens import SamplePlan
    x = _logits(rng, kind, rows, n_cols)
    xg = cupy.asarray(x)
    plan = SamplePlan(rows, n_cols, sampling=True, history_len=4)
    for a in (plan.cand_val, plan.cand_idx, plan.history):
        poison(a)
    seed = int(rng.integers(0, 2**63))
    for n, (top_k, top_p) in enumerate(itertools.product((1, 7, 64), (0.1, 0.95, 1.0))):
        _sample_and_check(td, plan, x, xg, temperature=0.7, top_k=top_k, top_p=top_p, seed=seed)
        if n == 0:
            _check_candidates(plan, x)


@gpu
@pytest.mark.parametrize("kind", ("normal", "ties"))
@pytest.mark.parametrize("n_cols", [64, 4097, 262144, 300007])
def test_sampling_order_is_exact_at_flat_temperature(td, rng, kind, n_cols, monkeypatch):
    """At T = 1e30 (past the public bound, lifted here: the kernel's order is what is tested) every one of
    the 64 candidates weighs exactly 1 in f32, so draw u picks position floor(64 u) of stage 2's order
    exactly: 8 rows x 16 draws check that order (ties by id) slot by slot."""
    import cupy
    import cukern.tokens
    monkeypatch.setattr(cukern.tokens, "MAX_TEMPERATURE", 1e31)
    from cukern.tokens import SamplePlan
    rows = 8
    x = _logits(rng, kind, rows, n_cols)
    plan = SamplePlan(rows, n_cols, sampling=True)
    xg = cupy.asarray(x)
    seed = int(rng.integers(0, 2**63))
    order = [_ref_top64(x[r])[1] for r in range(rows)]
    for draw in range(16):
        got = td.sample(plan, xg, temperature=1e30, top_k=64, top_p=1.0, seed=seed).get()
        want = [order[r][int(ref.uniform(seed, r, draw) * 64)] for r in range(rows)]
        assert got.tolist() == want, f"draw {draw}"


@gpu
@pytest.mark.parametrize("rows", range(1, 9))
def test_sampling_batches(td, rng, rows):
    """Batch 1 ... 8 at Gemma's vocabulary (the plan's split changes with the batch), rows of different
    data, T 1.3, top_k 40, top_p 0.9."""
    import cupy
    from cukern.tokens import SamplePlan
    n_cols = 262144
    x = _logits(rng, "normal", rows, n_cols)
    plan = SamplePlan(rows, n_cols, sampling=True, history_len=2)
    xg = cupy.asarray(x)
    for seed in (3, 4):
        _sample_and_check(td, plan, x, xg, temperature=1.3, top_k=40, top_p=0.9, seed=seed)
    _check_candidates(plan, x)


@gpu
@pytest.mark.parametrize("n_chunks", [1, 7, 40])
def test_sampling_plan_override(td, rng, n_chunks):
    """SamplePlan(n_chunks=) changes the split, not the results."""
    import cupy
    from cukern.tokens import SamplePlan
    from cukern.tokens import sample_chunks
    n_cols = 4000
    x = _logits(rng, "ties", 2, n_cols)
    plan = SamplePlan(2, n_cols, sampling=True, n_chunks=n_chunks)
    assert (plan.chunk, plan.n_chunks) == sample_chunks(2, n_cols, n_chunks) != sample_chunks(2, n_cols)
    _sample_and_check(td, plan, x, cupy.asarray(x), temperature=0.5, top_k=64, top_p=0.95, seed=11)
    _check_candidates(plan, x)


@gpu
def test_sampling_plan_greedy_with_inf(td, rng):
    """temperature 0 on a sampling plan (the K = 64 kernels): the argmax, +inf included, lowest id on ties;
    the candidates hold +inf, NaN (as -inf), -inf and pads in order."""
    import cupy
    from cukern.tokens import SamplePlan
    n_cols = 5000
    x = _logits(rng, "special", 4, n_cols)
    x[0, [17, 4000, 4999]] = np.inf
    x[1, 3] = np.inf
    plan = SamplePlan(4, n_cols, sampling=True)
    got = td.sample(plan, cupy.asarray(x)).get()
    np.testing.assert_array_equal(got, ref.greedy(x))
    assert got[0] == 17 and got[1] == 3 and got[3] == 0
    _check_candidates(plan, x)


@gpu
def test_sampling_is_reproducible_and_advances_draws(td, rng):
    import cupy
    from cukern.tokens import SamplePlan
    x = cupy.asarray(rng.standard_normal((2, 500)).astype(np.float32))
    a, b = SamplePlan(2, 500, sampling=True, history_len=3), SamplePlan(2, 500, sampling=True, history_len=3)
    for _ in range(3):
        td.sample(a, x, temperature=2.0, seed=7)
        td.sample(b, x, temperature=2.0, seed=7)
    np.testing.assert_array_equal(a.history.get(), b.history.get())
    assert len(set(a.history.get()[0].tolist())) > 1           # fresh draws per call (T = 2 over 64 candidates)
    assert a.draws.get().tolist() == [3, 3]


def test_sample_validates_before_launch(td, host_if_no_gpu):
    import cupy
    from cukern.tokens import SamplePlan
    plan = SamplePlan(2, 100, sampling=False)
    x = cupy.zeros((2, 100), cupy.float32)
    with pytest.raises(ValueError, match="sampling=True"):
        td.sample(plan, x, temperature=1.0)
    with pytest.raises(ValueError, match="temperature"):
        td.sample(plan, x, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        td.sample(SamplePlan(2, 100, sampling=True), x, temperature=1.0, top_k=65)
    with pytest.raises(ValueError, match="top_p"):
        td.sample(plan, x, top_p=0.0)
    with pytest.raises(ValueError, match="logits"):
        td.sample(plan, cupy.zeros((2, 99), cupy.float32))
    with pytest.raises(ValueError, match="at most"):
        SamplePlan(1, 262144 * 4, sampling=True)
    assert plan.draws.get().tolist() == [0, 0]


@gpu
def test_advance_positions(td):
    import cupy
    pos = cupy.asarray(np.array([4, 9], np.int32))
    lengths = cupy.asarray(np.array([0, 5, 7, 10], np.int32))
    td.advance_positions(pos, lengths, cupy.asarray(np.array([1, 3], np.int32)))
    assert pos.get().tolist() == [5, 10] and lengths.get().tolist() == [0, 6, 7, 11]


def test_reference_candidates():
    ids, p = ref.candidate_probs(np.array([0.0, 3.0, 3.0, 1.0, np.nan]), temperature=1.0, top_k=3, top_p=1.0)
    assert ids.tolist() == [1, 2, 3] and np.isclose(p.sum(), 1.0)
    ids, _ = ref.candidate_probs(np.array([0.0, 10.0, 1.0]), temperature=1.0, top_k=3, top_p=0.5)
    assert ids.tolist() == [1]


@pytest.mark.parametrize("arch", [80, 90])
def test_tokens_family_compiles_with_struct_sizes(arch):
    """NVRTC alone (no GPU): every kernel compiles, takes its struct last, and the PTX parameter size
    matches the parsed struct; the params header's static_asserts hold."""
    from cukern import check
    from cukern.tokens import FAMILY
    rows = check.check_family(FAMILY, arch) + [check.check_header(FAMILY.params_header, arch)]
    assert rows and all(r.ok for r in rows), [r.error for r in rows if not r.ok]
    assert {r.kernel for r in rows} >= {k.name for k in FAMILY.kernels}


# ---- CPU emulation of the sampling path's selection (block_top64 in cuda_src/tokens/sample.cuh) with the
# kernels' thread and item layout, checked against the reference order: the bound, the radix passes and
# their early exit, the tie at the threshold (by id, then first come), the slots and the ranks.

_T, _W, _K, _PAD_KEY = 256, 8, 64, 0x007FFFFF
_SAMPLE_CUH = Path(__file__).resolve().parents[1] / "cuda_src" / "tokens" / "sample.cuh"


def _order_key(x):
    x = np.asarray(x, np.float32)
    x = np.where(np.isnan(x), np.float32(-np.inf), x)
    b = x.view(np.uint32).copy()
    b[x == 0] = 0
    return np.where(b & 0x80000000, ~b, b | 0x80000000).astype(np.uint32)


def _key_value(k):
    k = np.asarray(k, np.uint32)
    return np.where(k & 0x80000000, k & 0x7FFFFFFF, ~k).astype(np.uint32).view(np.float32)


def _warp_sort_desc(v):
    v, lane = np.asarray(v, np.uint32).copy(), np.arange(32)
    size = 2
    while size <= 32:
        stride = size // 2
        while stride:
            o = v[lane ^ stride]
            v = np.where(((lane & size) == 0) == ((lane & stride) == 0), np.maximum(v, o), np.minimum(v, o))
            stride //= 2
        size *= 2
    return v


def _radix_select(part, kof, need):
    prefix = mask = tied = 0
    for shift in (24, 16, 8, 0):
        sel = part & ((kof & np.uint32(mask)) == prefix)
        hist = np.bincount(((kof[sel] >> np.uint32(shift)) & 0xFF).astype(np.int64), minlength=256)
        h = hist[::-1]                                   # thread t holds digit 255 - t
        above = np.concatenate([[0], np.cumsum(h)[:-1]])
        hits = np.flatnonzero((above < need) & (need <= above + h))
        assert hits.size == 1, (shift, need, h.sum())
        t = int(hits[0])
        prefix |= (255 - t) << shift
        mask |= 0xFF << shift
        need, tied = need - int(above[t]), int(h[t])
        assert 1 <= need <= tied
        if tied == need:
            break
    return prefix, mask, need, tied


def _block_top64(key, ids, rng):
    """key, ids: [THREADS, per] (item j of thread t is element j * THREADS + t; key 0: absent)."""
    assert key.shape[0] == _T and (key != 0).sum() >= _K
    m = key.max(axis=1)
    bound = min(int(_warp_sort_desc(m[w * 32:(w + 1) * 32])[_K // _W - 1]) for w in range(_W))
    top = np.sort(key[key != 0])[::-1][:_K]
    assert bound <= top[-1], "the bound cut one of the best 64"
    cand = (key != 0) & (key >= bound)
    prefix, mask, need, tied = _radix_select(cand, key, _K)
    by_id = tied != need
    nid = (~ids.astype(np.int64)) & 0xFFFFFFFF
    nid = nid.astype(np.uint32)
    if by_id:
        assert mask == 0xFFFFFFFF
        prefix2, mask2, need2, tied2 = _radix_select(cand & (key == prefix), nid, need)
    km = key & np.uint32(mask)
    edge = cand & (km == prefix)
    take = cand & (km > prefix)
    assert take.sum() == _K - need
    if not by_id:
        take |= edge
    else:
        k2 = nid & np.uint32(mask2)
        take |= edge & (k2 > prefix2)
        dup = np.flatnonzero(edge & (k2 == prefix2))
        if tied2 == need2:
            take.flat[dup] = True
        else:                                            # equal (key, id): any of them, first come
            assert len(set(ids.flat[dup].tolist())) == 1
            take.flat[rng.choice(dup, need2, replace=False)] = True
    assert take.sum() == _K
    perm = rng.permutation(_K)                           # slots: in no particular order
    sk, si = key[take][perm], ids[take][perm].astype(np.int64)
    c = np.arange(_K)
    before = (sk[None, :] > sk[:, None]) | ((sk[None, :] == sk[:, None]) & (
        (si[None, :] < si[:, None]) | ((si[None, :] == si[:, None]) & (c[None, :] < c[:, None]))))
    r = before.sum(axis=1)
    assert sorted(r.tolist()) == list(range(_K))
    out_k, out_i = np.empty(_K, np.uint32), np.empty(_K, np.int64)
    out_k[r], out_i[r] = sk, si
    return _key_value(out_k), out_i


def _emulate_sampling(x, chunk, n_chunks, rng):
    """Stage 1 (slot-major candidates [64, n_chunks]) and stage 2 (the row's best 64) of one row."""
    n_cols = x.size
    per1 = -(-chunk // _T)
    assert per1 <= 16 and chunk >= _K
    cv, ci = np.empty((_K, n_chunks), np.float32), np.empty((_K, n_chunks), np.int64)
    q = np.arange(per1)[None, :] * _T + np.arange(_T)[:, None]
    for c in range(n_chunks):
        i = c * chunk + q
        present, real = q < chunk, (q < chunk) & (i < n_cols)
        key = np.zeros(q.shape, np.uint32)
        key[real] = _order_key(x[i[real]])
        key[present & ~real] = _PAD_KEY
        cv[:, c], ci[:, c] = _block_top64(key, np.where(i < n_cols, i, _NO_ID), rng)
    n = _K * n_chunks
    per2 = -(-n // _T)
    assert per2 <= 32
    e = np.arange(per2)[None, :] * _T + np.arange(_T)[:, None]
    ok = e < n
    key = np.zeros(e.shape, np.uint32)
    key[ok] = _order_key(cv.ravel()[e[ok]])
    ids = np.full(e.shape, -7, np.int64)
    ids[ok] = ci.ravel()[e[ok]]
    return cv, ci, _block_top64(key, ids, rng)


def _emulation_input(rng, kind, n):
    if kind in ("normal", "ties", "special"):
        return _logits(rng, kind, 1, n)[0]
    x = np.zeros(n, np.float32)
    few = rng.choice(n, min(n, 5), replace=False)
    if kind == "equal":
        x[:] = 1.5
    elif kind == "neg_inf":
        x[:] = -np.inf
        x[few] = rng.standard_normal(few.size)
    elif kind == "nan":
        x[:] = np.nan
        x[few] = rng.standard_normal(few.size)
    elif kind == "zeros":
        x[:] = np.where(rng.random(n) < 0.5, -0.0, 0.0)
        x[few] = rng.choice([-1.0, 1.0], few.size)
    elif kind == "inf":
        x[:] = rng.standard_normal(n)
        x[rng.random(n) < 0.3] = np.inf
        x[rng.random(n) < 0.3] = -np.inf
    elif kind == "ascending":
        x[:] = np.arange(n) * 1e-3
    elif kind == "descending":
        x[:] = -np.arange(n) * 1e-3
    return x


@pytest.mark.parametrize("kind", ["normal", "ties", "special", "equal", "neg_inf", "nan", "zeros", "inf",
                                  "ascending", "descending"])
@pytest.mark.parametrize("n_cols,n_rows", [(1, 1), (2, 4), (63, 1), (64, 1), (65, 8), (100, 1), (4097, 1),
                                           (5000, 3), (65537, 8), (262144, 1), (300007, 2)])
def test_selection_emulation_matches_reference(rng, kind, n_cols, n_rows):
    from cukern.tokens import sample_chunks
    x = _emulation_input(rng, kind, n_cols)
    chunk, n_chunks = sample_chunks(n_rows, n_cols)
    cv, ci, (val, ids) = _emulate_sampling(x, chunk, n_chunks, rng)
    for c in range(n_chunks):
        v, i = _ref_top64(x[c * chunk:(c + 1) * chunk])
        np.testing.assert_array_equal(ci[:, c], np.where(i == _NO_ID, _NO_ID, i + c * chunk))
        np.testing.assert_array_equal(cv[:, c], v)
    v, i = _ref_top64(x)
    np.testing.assert_array_equal(ids, i)
    np.testing.assert_array_equal(val, v)


def test_warp_sort_emulation_sorts():
    r = np.random.default_rng(5)
    for _ in range(50):
        v = r.integers(0, 6, 32).astype(np.uint32) * r.integers(1, 2**28)
        assert _warp_sort_desc(v).tolist() == sorted(v.tolist(), reverse=True)


def test_order_key_orders_like_floats():
    x = np.array([-np.inf, -3e38, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0, 3e38, np.inf, np.nan], np.float32)
    k = _order_key(x)
    assert (np.diff(k[:4].astype(np.int64)) > 0).all() and k[4] == k[5] and (np.diff(k[5:10].astype(np.int64)) > 0).all()
    assert k[10] == k[0] == _PAD_KEY and (k > 0).all()
    np.testing.assert_array_equal(_key_value(k[:10]), np.where(x[:10] == 0, 0.0, x[:10]))


def test_sample_chunks_rule():
    from cukern.tokens import MAX_SAMPLE_COLS, sample_chunks
    assert sample_chunks(1, 262144) == (2048, 128) and sample_chunks(8, 262144) == (4096, 64)
    for n_rows in (1, 2, 3, 5, 8, 64, 65535):
        for n_cols in (1, 31, 63, 64, 65, 1000, 4097, 32000, 151936, 262144, 300007, MAX_SAMPLE_COLS):
            chunk, n = sample_chunks(n_rows, n_cols)
            assert 64 <= chunk <= 4096 and chunk % 32 == 0 and 1 <= n <= 128
            assert (n - 1) * chunk < n_cols <= n * chunk
    with pytest.raises(ValueError, match="at most"):
        sample_chunks(1, MAX_SAMPLE_COLS + 1)
    with pytest.raises(ValueError, match="n_chunks"):
        sample_chunks(1, 1000, 129)
    assert sample_chunks(1, 262144, 100) == (2624, 100) and sample_chunks(1, 4000, 1) == (4000, 1)
    assert sample_chunks(1, 262144, 7) == (4096, 64)       # the override is a target; chunk stays <= 4096


def test_sample_constants_mirror_the_kernel():
    """cukern/tokens.py restates sample.cuh's sizes: they must agree."""
    from cukern import tokens
    src = _SAMPLE_CUH.read_text()
    c = {name: int(v) for name, v in re.findall(r"constexpr int (\w+) = (\d+);", src)}
    assert c["SAMPLE_MAX_K"] == tokens.MAX_TOP_K and c["THREADS"] == tokens._THREADS
    assert c["THREADS"] * c["CHUNK_ITEMS"] == tokens._MAX_CHUNK
    assert c["THREADS"] * c["MERGE_ITEMS"] // c["SAMPLE_MAX_K"] == tokens._MAX_CHUNKS
    assert tokens._CHUNK_ALIGN % 32 == 0 and tokens._MAX_CHUNK % tokens._CHUNK_ALIGN == 0
