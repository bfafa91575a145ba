"""Attention decode (cukern/attention/decode.py) and the merge of partial states against their
float64 references (cukern/reference/attention.py).

Every paged kernel is checked against the reference computed on K/V gathered back from the pages;
tolerances: attention_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.attention import AttentionDispatch, DecodeOverrides  # noqa: E402
from cukern.reference import attention as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402
from attention_helpers import DECODE_TOL, _host, _make_cache, _q  # noqa: E402


# ----------------------------------------------------------------------------- decode

# (kind, head_dim, n_heads, n_kv_heads, page_size, lengths)
DECODE_CASES = [
    ("float16", 128, 8, 2, 16, [1, 15, 16, 17, 300]),   # length 1, page boundary - 1 / exact / + 1, ragged
    ("float16", 64, 4, 4, 1, [1, 2, 129]),              # MHA (G = 1), page size 1
    ("float16", 256, 8, 1, 32, [32, 700]),              # GQA 8, exactly one page
    ("bfloat16", 128, 16, 2, 16, [5, 260]),             # GQA 8
    ("float32", 96, 6, 2, 7, [13, 50]),                 # odd head_dim / page size, GQA 3 (masked heads)
    ("float16", 512, 4, 1, 16, [3, 90]),                # head_dim 512
    ("bfloat16", 160, 32, 2, 256, [600, 1]),            # GQA 16 (two head blocks), page size 256
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{c[0]}-d{c[1]}-h{c[2]}/{c[3]}-p{c[4]}")
@pytest.mark.parametrize("variant", ["plain", "window+sinks", "softcap+split7", "unsplit+window_big"])
def test_decode(attn, rng, case, variant):
    kind, d, h, hk, ps, lengths = case
    cache, slots = _make_cache(rng, lengths, n_kv_heads=hk, head_dim=d, page_size=ps, kind=kind, attn=attn)
    kw, n_splits = {}, None
    if variant == "window+sinks":
        kw = dict(window_left=9, sinks=rng.standard_normal(h).astype(np.float32) * 2)
    elif variant == "softcap+split7":
        kw, n_splits = dict(softcap=5.0, scale=0.3), 7
    elif variant == "unsplit+window_big":
        kw, n_splits = dict(window_left=10_000), 1
    qh, q = _q(rng, (len(slots), h, d), scale=2.0)
    order = slots[::-1]  # batch order differs from slot order
    qh, q = qh[::-1].copy(), q[::-1].copy()
    plan = attn.plan_decode(cache, order, h, n_splits=n_splits, window_left=kw.get("window_left", -1))
    out = poison(cupy.empty((len(slots), h, d), cupy.float32))
    lse = poison(cupy.empty((len(slots), h), cupy.float32))
    dev_kw = dict(kw)
    if "sinks" in kw:
        dev_kw["sinks"] = cupy.asarray(kw["sinks"])
    attn.flash_attn_decode(plan, 0, q, out, lse=lse, **dev_kw)
    kp, vp, pt, lens = _host(cache)
    want_o, want_lse = ref.paged_attention(qh, kp, vp, pt, lens, order, [1] * len(order), ps, **kw)
    assert_close(out, want_o, **DECODE_TOL)
    assert_close(lse, want_lse, atol=1e-4, rtol=0, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", [None, 2], ids=["ahead_rule", "ahead2"])
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("kind, d", [("float16", 128), ("bfloat16", 64)])
def test_decode_tc_warps(rng, warps, kind, d, ahead):
    """Both block shapes of the tensor-core decode (4 and 8 warps), over ragged lengths, with sinks,
    a window, a softcap and large queries (the power-of-two rescale that keeps f16 Q in range); with
    the in-loop L2 prefetch as the rule sets it (off at these lengths) and forced on."""
    attn = AttentionDispatch()
    forced = DecodeOverrides(warps=warps, l2_ahead=ahead)
    cache, slots = _make_cache(rng, [1, 63, 64, 65, 2000], n_kv_heads=2, head_dim=d, page_size=16, kind=kind,
                               attn=attn)
    h = 10  # GQA 5: the block's rows 5-7 are padding
    sinks = rng.standard_normal(h).astype(np.float32)
    for kw, n_splits, qscale in ((dict(sinks=sinks), 5, 1.0), (dict(softcap=4.0, scale=0.3), None, 1.0),
                                 (dict(window_left=70), None, 3e5)):  # q * scale * log2(e) past the f16 range
        qh, q = _q(rng, (len(slots), h, d), scale=qscale)
        plan = attn.plan_decode(cache, slots, h, n_splits=n_splits, window_left=kw.get("window_left", -1),
                                overrides=forced)
        assert plan.warps == warps
        out = poison(cupy.empty((len(slots), h, d), cupy.float32))
        lse = poison(cupy.empty((len(slots), h), cupy.float32))
        dev_kw = {k: (cupy.asarray(v) if k == "sinks" else v) for k, v in kw.items()}
        attn.flash_attn_decode(plan, 0, q, out, lse=lse, **dev_kw)
        kp, vp, pt, lens = _host(cache)
        want_o, want_lse = ref.paged_attention(qh, kp, vp, pt, lens, slots, [1] * len(slots), 16, **kw)
        assert_close(out, want_o, **DECODE_TOL)
        assert_close(lse, want_lse, atol=1e-4 * max(1.0, float(np.abs(want_lse).max())), rtol=0, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("page_size", [5, 16])
def test_decode_tc_page_tables(rng, page_size, warps):
    """The tensor-core decode's page-table lookups over scattered pages (no row a run of consecutive pages), a
    page size that is not a power of two among them, lengths at page boundaries +- 1, with the L2 prefetch before
    the wait (pdl) and in the loop forced on, each over more tiles than the prologue looks up."""
    attn = AttentionDispatch(pdl=True)
    forced = DecodeOverrides(warps=warps, l2_ahead=2, l2_prefetch=5)
    lengths = [1, page_size - 1, page_size, page_size + 1, 333, 3000]
    cache, slots = _make_cache(rng, lengths, n_kv_heads=2, head_dim=64, page_size=page_size, attn=attn, scatter=True)
    kp, vp, pt, lens = _host(cache)
    assert (np.diff(pt[slots[-1], :8]) != 1).all(), "the page table was meant to be scattered"
    h = 8
    for n_splits in (None, 3):
        qh, q = _q(rng, (len(slots), h, 64))
        plan = attn.plan_decode(cache, slots, h, n_splits=n_splits, overrides=forced)
        assert plan.warps == warps
        out = poison(cupy.empty((len(slots), h, 64), cupy.float32))
        attn.flash_attn_decode(plan, 0, q, out)
        want, _ = ref.paged_attention(qh, kp, vp, pt, lens, slots, [1] * len(slots), page_size)
        assert_close(out, want, **DECODE_TOL)


@pytest.mark.gpu
def test_decode_split_matches_unsplit_and_graph(attn, rng):
    from cukern.streams import capture_graph
    cache, slots = _make_cache(rng, [4000, 1, 777], n_kv_heads=2, head_dim=128, page_size=16, attn=attn)
    qh, q = _q(rng, (3, 8, 128))
    sinks = cupy.asarray(rng.standard_normal(8).astype(np.float32))
    outs = []
    for n_splits in (1, 3, 16, None):
        plan = attn.plan_decode(cache, slots, 8, n_splits=n_splits)
        for _ in range(2):  # the merge counters are left zero for the next launch of the plan
            out = poison(cupy.empty((3, 8, 128), cupy.float32))
            attn.flash_attn_decode(plan, 0, q, out, sinks=sinks)
            outs.append(out.get())
    for o in outs[1:]:
        assert_close(o, outs[0], atol=2e-5, rtol=2e-5, name="split vs unsplit")
    # the same step captured in a CUDA graph and replayed after the cache grew by one token
    plan = attn.plan_decode(cache, slots, 8, max_kv_len=4096)
    out = poison(cupy.empty((3, 8, 128), cupy.float32))
    graph = capture_graph(lambda st: attn.flash_attn_decode(plan, 0, q, out, sinks=sinks, stream=st))
    for s in slots:
        pos = cache.extend(s, 1)
        kv = cupy.asarray(rng.standard_normal((1, 2, 128)).astype(np.float32))
        attn.write_kv_run(cache, 0, kv, kv, s, pos)
    # the writes and the lengths' upload ran on the current stream, the graph replays on its own
    # non-blocking capture stream: nothing orders them but a synchronisation
    cupy.cuda.get_current_stream().synchronize()
    graph.replay()
    graph.stream.synchronize()
    kp, vp, pt, lens = _host(cache)
    want, _ = ref.paged_attention(qh, kp, vp, pt, lens, slots, [1, 1, 1], 16, sinks=sinks.get())
    assert_close(out, want, **DECODE_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("d, h, hk, warps, n_splits", [
    (256, 8, 1, None, 64),    # decode_tc, 8 KB states
    (128, 32, 8, 8, 256),     # decode_tc 8 warps, the most splits
    (512, 4, 1, None, 200),   # the SIMT decode
])
@pytest.mark.parametrize("apart", [False, True], ids=["fused", "apart"])
def test_decode_many_splits(rng, d, h, hk, warps, n_splits, apart):
    """Many split states merged by the decode's last block (its loads in batches of 16 states) or apart
    (merge_states launched after the decode): sinks and the LSE, two sequences (the second shorter
    than the split count, so some of its chunks are empty), against the float64 reference."""
    attn = AttentionDispatch()
    cache, slots = _make_cache(rng, [6000, 150], n_kv_heads=hk, head_dim=d, page_size=16, attn=attn)
    qh, q = _q(rng, (2, h, d))
    sinks = rng.standard_normal(h).astype(np.float32)
    plan = attn.plan_decode(cache, slots, h, n_splits=n_splits,
                            overrides=DecodeOverrides(warps=warps, merge_apart=apart))
    assert plan.n_splits == n_splits and plan.merge_apart == apart
    out = poison(cupy.empty((2, h, d), cupy.float32))
    lse = poison(cupy.empty((2, h), cupy.float32))
    for _ in range(2):  # the counters are left zero for the next launch
        attn.flash_attn_decode(plan, 0, q, out, lse=lse, sinks=cupy.asarray(sinks))
    kp, vp, pt, lens = _host(cache)
    want_o, want_lse = ref.paged_attention(qh, kp, vp, pt, lens, slots, [1, 1], 16, sinks=sinks)
    assert_close(out, want_o, **DECODE_TOL)
    assert_close(lse, want_lse, atol=1e-4 * max(1.0, float(np.abs(want_lse).max())), rtol=0, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("kind, d, h, hk", [("float16", 128, 8, 2), ("bfloat16", 64, 12, 4), ("float32", 96, 4, 2)])
def test_decode_pdl_chain_matches_plain_launches(rng, kind, d, h, hk, monkeypatch):
    """AttentionDispatch(pdl=True): a chain of decode steps over two layers, each step's q the previous
    step's output (the dependency pdl_wait must honour) and most steps preceded by a plain KV write of
    every sequence's newest token (the rows the kernel must not read before the wait), eager and replayed
    from a CUDA graph, equals the same chain launched plainly bit for bit (the kernels are deterministic,
    so a race shows)."""
    from cukern import dispatch
    from cukern.streams import capture_graph
    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90")
    pdl_launches = []
    real = dispatch._launch_pdl
    monkeypatch.setattr(dispatch, "_launch_pdl", lambda *a: (pdl_launches.append(a[0]), real(*a)))
    plain, fast = AttentionDispatch(), AttentionDispatch(pdl=True)
    # the L2 prefetch of a warp's next tiles before the wait (on or off by default), and the in-loop one (off by
    # default at these lengths), forced on in a second set of plans
    prefetch = dict(l2_prefetch=5, l2_ahead=3)
    lengths = [1, 17, 40, 300, 1500]  # the newest token in a warp's first tiles, split or not
    cache, slots = _make_cache(rng, lengths, n_kv_heads=hk, head_dim=d, page_size=16, kind=kind, n_layers=2,
                               attn=plain)
    b = len(slots)
    ids = cupy.asarray(np.array(slots, np.int32))
    newest = cupy.asarray(np.array(lengths, np.int32) - 1)
    n_steps = 9
    rows = [(cupy.asarray(rng.standard_normal((b, hk, d)).astype(np.float32)),
             cupy.asarray(rng.standard_normal((b, hk, d)).astype(np.float32))) for _ in range(n_steps)]
    sinks = cupy.asarray(rng.standard_normal(h).astype(np.float32))
    q0 = cupy.asarray(rng.standard_normal((b, h, d)).astype(np.float32))
    plan_sets = {}  # the split states of the third plan merged by a merge_states launch (under pdl too)
    for name, extra in (("plain", {}), ("prefetch", prefetch)):
        plan_sets[name] = [plain.plan_decode(cache, slots, h, n_splits=n, overrides=DecodeOverrides(**extra))
                           for n in (None, 5)]
        plan_sets[name].append(plain.plan_decode(cache, slots, h, n_splits=5,
                                                 overrides=DecodeOverrides(merge_apart=True, **extra)))
    plans = plan_sets["plain"]
    assert plans[2].merge_apart and not plans[1].merge_apart

    def chain(a, outs, plans=plans):
        q = q0
        for i, out in enumerate(outs):
            layer = i % 2
            if i % 3 != 2:  # every third step follows the previous decode directly
                a.write_kv(cache, layer, rows[i][0], rows[i][1], ids, newest)
            a.flash_attn_decode(plans[i // 3], layer, q, out, sinks=sinks)
            q = out

    want = [poison(cupy.empty((b, h, d), cupy.float32)) for _ in range(n_steps)]
    chain(plain, want)
    for name, graph in (("plain", False), ("plain", True), ("prefetch", False), ("prefetch", True)):  # eager first:
        got = [poison(cupy.empty((b, h, d), cupy.float32)) for _ in range(n_steps)]  # it also compiles outside the
        if graph:  # capture
            capture_graph(lambda stream: chain(fast, got, plan_sets[name])).replay(cupy.cuda.get_current_stream())
        else:
            chain(fast, got, plan_sets[name])
        for i, (x, y) in enumerate(zip(got, want)):
            assert bool(cupy.isfinite(y).all()), f"step {i}: the plain chain went wrong"
            assert bool((x == y).all()), f"step {i} differs with pdl (graph={graph}, plans={name})"
    assert len(pdl_launches) >= 4 * n_steps, "the pdl path was not taken"


def test_repeated_decode_calls_replay(rng, host_if_no_gpu, monkeypatch):
    """flash_attn_decode calls repeated with an equal plan (by its fields, the cache by identity), layer,
    arrays and values replay the first call's launches (cukern.repeat); another window or the plan of
    another cache of the same shapes runs in full, and the first call again replays."""
    bodies = []
    real = AttentionDispatch._prefetch_tiles
    monkeypatch.setattr(AttentionDispatch, "_prefetch_tiles", lambda self, *a: (bodies.append(1), real(self, *a))[1])
    d = AttentionDispatch()
    cache, slots = _make_cache(rng, [10, 3], attn=d)
    twin, twin_slots = _make_cache(rng, [10, 3], attn=d)
    q = cupy.zeros((2, 4, 64), cupy.float32)
    out = cupy.zeros_like(q)
    plan = d.plan_decode(cache, slots, 4)
    for _ in range(3):
        assert d.flash_attn_decode(plan, 0, q, out) is out
    assert len(bodies) == 1
    d.flash_attn_decode(plan, 0, q, out, window_left=4)
    d.flash_attn_decode(d.plan_decode(twin, twin_slots, 4), 0, q, out)
    assert len(bodies) == 3
    d.flash_attn_decode(plan, 0, q, out)
    assert len(bodies) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_repeated_decode_reads_the_grown_cache(rng, pdl):
    """A replayed decode (cukern.repeat) reads the page table and lengths on the device: after the
    sequences grow (new pages, new K/V) the repeated call matches the reference at the new lengths.
    Gemma 3's decode shape (one KV head of 256, four query heads), a sliding window and one without."""
    d = AttentionDispatch(pdl=pdl)
    cache, slots = _make_cache(rng, [50, 7], n_kv_heads=1, head_dim=256, page_size=16, attn=d, extra_pages=20)
    qh, q = _q(rng, (2, 4, 256))
    out = cupy.empty((2, 4, 256), cupy.float32)
    for window in (-1, 20):
        plan = d.plan_decode(cache, slots, 4, max_kv_len=200, window_left=window)
        for _ in range(3):
            poison(out)
            d.flash_attn_decode(plan, 0, q, out, window_left=window)
            kp, vp, pt, lens = _host(cache)
            want, _ = ref.paged_attention(qh, kp, vp, pt, lens, slots, [1, 1], 16, window_left=window)
            assert_close(out, want, **DECODE_TOL)
            for s in slots:
                pos = cache.extend(s, 9)
                kv = cupy.asarray(rng.standard_normal((9, 1, 256)).astype(np.float32))
                d.write_kv_run(cache, 0, kv, kv * 0.5, s, pos)
    assert sum(key[0] == "flash_attn_decode" for key in d._repeats) == 2  # one entry a plan: replays


@pytest.mark.gpu
@pytest.mark.parametrize("kind, d, h, hk", [("float16", 256, 4, 1), ("bfloat16", 128, 8, 2), ("float32", 64, 6, 3)])
def test_decode_partials_merge_to_the_decode(rng, kind, d, h, hk):
    """flash_attn_decode_partials leaves states that merge_states turns into flash_attn_decode's output
    and LSE, sinks added in the merge (a partials plan at 1, 3 and the plan's own split count; a sliding
    window that leaves early splits empty; the SIMT kernel for f32), and that match the reference."""
    d_ = AttentionDispatch(pdl=True)
    cache, slots = _make_cache(rng, [700, 5, 130], n_kv_heads=hk, head_dim=d, page_size=16, kind=kind, attn=d_)
    qh, q = _q(rng, (3, h, d), scale=2.0)
    sinks = cupy.asarray(rng.standard_normal(h).astype(np.float32))
    kp, vp, pt, lens = _host(cache)
    for n_splits in (1, 3, None):
        for window in (-1, 40):
            plan = d_.plan_decode(cache, slots, h, n_splits=n_splits, window_left=window, partials=True)
            o_part, lse_part = d_.flash_attn_decode_partials(plan, 0, q, window_left=window)
            assert o_part is plan.o_part and o_part.shape == (3, plan.n_splits, h, d)
            out, lse = poison(cupy.empty((3, h, d), cupy.float32)), poison(cupy.empty((3, h), cupy.float32))
            d_.merge_states(o_part, lse_part, out, lse=lse, sinks=sinks)
            want_o, want_lse = ref.paged_attention(qh, kp, vp, pt, lens, slots, [1, 1, 1], 16, window_left=window,
                                                   sinks=sinks.get())
            assert_close(out, want_o, **DECODE_TOL, name=f"s={plan.n_splits} window={window}")
            assert_close(lse, want_lse, atol=1e-4, rtol=0, name="lse")
            direct = poison(cupy.empty((3, h, d), cupy.float32))
            d_.flash_attn_decode(plan, 0, q, direct, sinks=sinks, window_left=window)  # a partials plan decodes too
            assert_close(direct, want_o, **DECODE_TOL, name="decode on a partials plan")


def test_decode_partials_rejects(rng, host_if_no_gpu):
    d_ = AttentionDispatch()
    cache, slots = _make_cache(rng, [10], n_kv_heads=2, head_dim=64, attn=d_)
    q = cupy.zeros((1, 4, 64), cupy.float32)
    with pytest.raises(ValueError, match="partials=True"):
        d_.flash_attn_decode_partials(d_.plan_decode(cache, slots, 4), 0, q)
    with pytest.raises(ValueError, match="contradicts"):
        d_.plan_decode(cache, slots, 4, partials=True, overrides=DecodeOverrides(merge_apart=False))
    plan = d_.plan_decode(cache, slots, 4, partials=True)
    assert plan.o_part.shape[:2] == (1, plan.n_splits) and plan.merge_apart == (plan.n_splits > 1)
    with pytest.raises(ValueError, match="shape"):
        d_.flash_attn_decode_partials(plan, 0, cupy.zeros((1, 4, 32), cupy.float32))
    with pytest.raises(ValueError, match="layer"):
        d_.flash_attn_decode_partials(plan, 3, q)


def test_decode_rejects_bad_input(attn, rng, host_if_no_gpu):
    cache, slots = _make_cache(rng, [10], n_kv_heads=2, head_dim=64, attn=attn)
    with pytest.raises(ValueError, match="does not exist"):
        attn.plan_decode(cache, [slots[0] + 1], 4)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        attn.plan_decode(cache, slots, 3)
    plan = attn.plan_decode(cache, slots, 4)
    q = cupy.zeros((1, 4, 64), cupy.float32)
    with pytest.raises(ValueError, match="shape"):
        attn.flash_attn_decode(plan, 0, cupy.zeros((1, 4, 32), cupy.float32), q)
    with pytest.raises(TypeError, match="dtype"):
        attn.flash_attn_decode(plan, 0, q.astype(cupy.float16), q)
    with pytest.raises(ValueError, match="softcap"):
        attn.flash_attn_decode(plan, 0, q, q, softcap=-1.0)


# ----------------------------------------------------------------------------- merge

@pytest.mark.gpu
@pytest.mark.parametrize("n,n_states,h,d", [(1, 1, 1, 32), (3, 5, 4, 128), (2, 17, 3, 96),
                                             (1, 40, 2, 176),    # column blocks of 9, 9, 9, 9, 8 float4s
                                             (1, 600, 1, 512)])  # 16 column blocks, two chunks of weights
@pytest.mark.parametrize("sinks", [False, True])
def test_merge_states(attn, rng, n, n_states, h, d, sinks):
    v = rng.standard_normal((n, n_states, h, d)).astype(np.float32)
    s = (rng.standard_normal((n, n_states, h)) * 3).astype(np.float32)
    s[0, 0, 0] = -np.inf  # an empty state
    sk = rng.standard_normal(h).astype(np.float32) if sinks else None
    out = poison(cupy.empty((n, h, d), cupy.float32))
    lse = poison(cupy.empty((n, h), cupy.float32))
    attn.merge_states(cupy.asarray(v), cupy.asarray(s), out, lse=lse, sinks=None if sk is None else cupy.asarray(sk))
    want_o, want_lse = ref.merge_states(v, s, sk)
    assert_close(out, want_o, atol=1e-5, rtol=1e-5)
    mask = np.isfinite(want_lse)
    assert_close(lse.get()[mask], want_lse[mask], atol=1e-5, rtol=1e-5, name="lse")
    assert np.all(np.isneginf(lse.get()[~mask]))
