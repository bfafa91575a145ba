"""Elementwise kernels of every group at random shapes against their float64 references.

The ``test_random_shapes_*`` tests draw every kernel's shapes, layouts and alignments per run from
``shape_rng`` (seed CUKERN_TEST_SEED, else fresh entropy; every failure message names the seed).
Outputs are poisoned with NaN first; tolerances: elementwise_helpers.py.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.elementwise import ElementwiseDispatch  # noqa: E402
from cukern.reference import elementwise as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402
from elementwise_helpers import _check_cache, _check_q8_1, _deltanet_inputs, _dev, _empty  # noqa: E402
from elementwise_helpers import _paged_setup, _randn, gpu  # noqa: E402


@pytest.fixture(scope="module")
def d():
    return ElementwiseDispatch()


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
