"""The varlen backward (AttentionDispatch.flash_attn_varlen_backward, cuda_src/attention/varlen_bwd.cuh).

CPU: the float64 reference of the backward (cukern/reference/attention.py, explicit formulas) against
central finite differences of the float64 forward reference; argument checks and the launch sequence over the
host dispatch. GPU: ragged batches (length 1, lengths off the 32/64-row tiles, q_len > k_len) through our
forward and backward against the reference on the stored inputs, both dQ modes, outputs poisoned; the
deterministic mode's repeatability; torch SDPA's backward where torch is importable.

Tolerances, |got - want| <= rel (max |want| + |want|) per gradient: P, dS and the mma inputs are rounded to the
element type, so f16 rel 1e-2, bf16 rel 2e-2.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.reference import attention as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402
from attention_helpers import _store  # noqa: E402
from cukern.attention.backward import BWD_HEAD_DIMS  # noqa: E402

REL = {"float16": 1e-2, "bfloat16": 2e-2}

# masks and logit settings of the forward (and so of the backward)
MODES = {
    "plain": dict(causal=False),
    "causal": dict(causal=True),
    "window": dict(causal=True, window_left=37),
    "window_only": dict(causal=False, window_left=20),
    "softcap": dict(causal=True, softcap=3.0, scale=0.2),
    "upper_left": dict(causal=True, causal_variant="upper_left"),  # more queries than keys: rows past k_len see all
}


def _cu(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _grad_close(got, want, kind, name):
    rel = REL[kind]
    assert_close(ref.as_float64(got, kind), want, atol=rel * max(np.abs(want).max(), 1e-3), rtol=rel, name=name)


# ----------------------------------------------------------------------------- CPU: the reference

@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=False, softcap=1.5, window_left=2),
                                dict(causal=True, window_left=1, softcap=0.7, scale=0.5),
                                dict(causal=False, sinks=np.array([0.3, -1.0, 2.0, 0.0]))],
                         ids=["causal", "softcap-window", "causal-window-softcap-scale", "sinks"])
def test_reference_backward_matches_finite_differences(rng, kw):
    """GQA (4 query heads over 2 KV heads), a sequence with more queries than keys (causal: rows that see no
    key), a length-1 sequence."""
    cu_q, cu_k = _cu([3, 1, 5, 4]), _cu([5, 1, 6, 2])
    h, hk, d = 4, 2, 8
    q = rng.standard_normal((cu_q[-1], h, d))
    k = rng.standard_normal((cu_k[-1], hk, d))
    v = rng.standard_normal((cu_k[-1], hk, d))
    do = rng.standard_normal((cu_q[-1], h, d))
    want = ref.varlen_backward(do, q, k, v, cu_q, cu_k, **kw)

    def loss(*args):
        return float((ref.varlen(*args, cu_q, cu_k, **kw)[0] * do).sum())

    eps = 1e-6
    for which, (name, a) in enumerate((("dq", q), ("dk", k), ("dv", v))):
        num = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            args = [q, k, v]
            args[which] = a.copy()
            args[which][i] += eps
            up = loss(*args)
            args[which][i] -= 2 * eps
            num[i] = (up - loss(*args)) / (2 * eps)
        np.testing.assert_allclose(want[which], num, atol=1e-7, rtol=1e-6, err_msg=name)


# ----------------------------------------------------------------------------- CPU: checks and launches

def test_host_mirror_of_backward_shapes():
    """_bwd_shape and _bwd_wg_shape (cukern/attention/backward.py) agree with BwdShape (varlen_bwd.cuh) and
    BwdWgShape (varlen_bwd_wg.cuh): NVRTC static_asserts."""
    from cukern import runtime
    from cukern.attention.backward import BWD_HEAD_DIMS, _bwd_shape, _bwd_wg_shape
    asserts = []
    for d, (kw, bm) in itertools.product(BWD_HEAD_DIMS, ((4, 32), (8, 32), (8, 64))):
        s, kv = _bwd_shape(d, kw, bm), f"BwdShape<{d}, {kw}, {bm}>"
        asserts.append(f"{kv}::BN == {s['bn']} && {kv}::BM == {s['bm']} && {kv}::DKDV_SMEM == {s['dkdv_smem']} && "
                       f"BwdShape<{d}>::QM == {s['qm']} && BwdShape<{d}>::QN == {s['qn']} && "
                       f"BwdShape<{d}>::DQ_SMEM == {s['dq_smem']}")
    for d in BWD_HEAD_DIMS:
        s, wg = _bwd_wg_shape(d), f"BwdWgShape<{d}>"
        asserts.append(f"{wg}::NT == {s['threads']} && {wg}::BN == {s['bn']} && {wg}::BM == {s['bm']} && "
                       f"{wg}::SMEM_BYTES == {s['smem']}")
    source = "\n".join(['#include "attention/varlen_bwd_wg.cuh"', "namespace cukern { namespace attn {"]
                       + [f'static_assert({a}, "host mirror: {a}");' for a in asserts] + ["} }"])
    runtime.compile_ptx("probe:attention_bwd_shapes", source, (), 80)


def _args(kind="float16", h=4, hk=2, d=64, lens=(5, 17)):
    dt = np.float16 if kind == "float16" else np.uint16
    cu = cupy.asarray(_cu(lens))
    n = int(sum(lens))
    q, do, o = (cupy.zeros((n, h, d), dt) for _ in range(3))
    k, v = (cupy.zeros((n, hk, d), dt) for _ in range(2))
    lse = cupy.zeros((n, h), cupy.float32)
    return dict(dout=do, q=q, k=k, v=v, out=o, lse=lse, cu_seqlens_q=cu, cu_seqlens_k=cu,
                max_seqlen_q=max(lens), max_seqlen_k=max(lens))


def test_backward_launches(attn, host_if_no_gpu):
    """Default mode: preprocess, dK/dV with atomic dQ, convert; deterministic: preprocess, dK/dV, dQ (and no
    f32 dQ workspace allocated). The default dK/dV kernel: bwd_dkdv_wg on sm_90, elsewhere bwd_dkdv with 64-row
    steps where they fit."""
    launches = host_if_no_gpu
    a = _args()
    dq, dk, dv = attn.flash_attn_varlen_backward(**a)
    assert dq.shape == a["q"].shape and dk.shape == dv.shape == a["k"].shape and dq.dtype == np.float16
    rows = {d: 64 if attn._dkdv_fits(d, 8, 64) else 32 for d in (64, 128)}
    sm90 = attn._units["attention_bwd_f16"].is_sm90()

    def dkdv(t, d, red4):
        return f"bwd_dkdv_wg<{t}, {d}>" if sm90 else f"bwd_dkdv<{t}, {d}, 8, {rows[d]}, {str(red4).lower()}>"
    if launches is not None:
        assert dict(launches) == {"bwd_preprocess<__half, 64>": 1, dkdv("__half", 64, sm90): 1,
                                  "bwd_dq_convert<__half>": 1}
        launches.clear()
    attn.flash_attn_varlen_backward(**_args("bfloat16", d=128), deterministic=True, causal=True, window_left=3,
                                    softcap=2.0, scale=None)
    if launches is not None:
        assert dict(launches) == {"bwd_preprocess<__nv_bfloat16, 128>": 1, dkdv("__nv_bfloat16", 128, False): 1,
                                  "bwd_dq<__nv_bfloat16, 128>": 1}


def test_backward_variant_launches(attn, host_if_no_gpu, monkeypatch):
    """dkdv_rows=64 runs bwd_dkdv's 64-row steps; dq_vector_atomics=True its red.global.add.v4.f32 dQ (on an sm_90
    unit; the deterministic mode has no dQ atomics, so it runs the scalar instantiation)."""
    launches = host_if_no_gpu
    unit = attn._units["attention_bwd_f16"]
    monkeypatch.setattr(type(unit), "is_sm90", lambda self: True)
    attn.flash_attn_varlen_backward(**_args(d=128), dkdv_rows=64, dq_vector_atomics=True, causal=True,
                                    wgmma=False)
    attn.flash_attn_varlen_backward(**_args(), dkdv_rows=64, dq_vector_atomics=False)
    attn.flash_attn_varlen_backward(**_args(), dkdv_rows=32, dq_vector_atomics=True, deterministic=True)
    if launches is not None:
        dkdv = {k: n for k, n in launches.items() if k.startswith("bwd_dkdv")}
        assert dkdv == {"bwd_dkdv<__half, 128, 8, 64, true>": 1, "bwd_dkdv<__half, 64, 8, 64, false>": 1,
                        "bwd_dkdv<__half, 64, 8, 32, false>": 1}
    monkeypatch.setattr(type(unit), "is_sm90", lambda self: False)
    with pytest.raises(ValueError, match="dq_vector_atomics=True needs an sm_90"):
        attn.flash_attn_varlen_backward(**_args(), dq_vector_atomics=True)


def test_backward_wgmma_launches(attn, host_if_no_gpu, monkeypatch):
    """wgmma=True runs bwd_dkdv_wg (its own sm_90a unit) in place of bwd_dkdv: with dQ atomics (preprocess, dK/dV,
    convert) and deterministic (preprocess, dK/dV, bwd_dq); None does too on sm_90 (the default there), False and
    None with another tile's keywords run bwd_dkdv; off sm_90 and with the other tiles' keywords wgmma=True is
    refused before any launch."""
    launches = host_if_no_gpu
    wg_unit = attn._units["attention_bwd_wg_f16"]
    assert wg_unit.sm90a and attn._units["attention_bwd_wg_bf16"].sm90a
    monkeypatch.setattr(type(wg_unit), "is_sm90", lambda self: True)
    if launches is not None:
        attn.flash_attn_varlen_backward(**_args(d=128), wgmma=True, causal=True)
        assert dict(launches) == {"bwd_preprocess<__half, 128>": 1, "bwd_dkdv_wg<__half, 128>": 1,
                                  "bwd_dq_convert<__half>": 1}
        launches.clear()
        attn.flash_attn_varlen_backward(**_args("bfloat16"), wgmma=True, deterministic=True, dkdv_rows=64,
                                        dq_vector_atomics=True, window_left=5)
        assert dict(launches) == {"bwd_preprocess<__nv_bfloat16, 64>": 1, "bwd_dkdv_wg<__nv_bfloat16, 64>": 1,
                                  "bwd_dq<__nv_bfloat16, 64>": 1}
        launches.clear()
        attn.flash_attn_varlen_backward(**_args())
        assert dict(launches)["bwd_dkdv_wg<__half, 64>"] == 1
        launches.clear()
        for kw in (dict(wgmma=False), dict(dkdv_rows=32), dict(dq_vector_atomics=False)):
            attn.flash_attn_varlen_backward(**_args(), **kw)
        assert not [k for k in launches if k.startswith("bwd_dkdv_wg")]
        assert sum(n for k, n in launches.items() if k.startswith("bwd_dkdv<")) == 3
        launches.clear()
    for kw, match in ((dict(dkdv_rows=32), "dkdv_rows must be None or 64"),
                      (dict(dq_vector_atomics=False), "dq_vector_atomics must be None or True")):
        with pytest.raises(ValueError, match=match):
            attn.flash_attn_varlen_backward(**_args(), wgmma=True, **kw)
    monkeypatch.setattr(type(wg_unit), "is_sm90", lambda self: False)
    with pytest.raises(ValueError, match="wgmma=True needs an sm_90"):
        attn.flash_attn_varlen_backward(**_args(), wgmma=True)
    if launches is not None:
        assert not launches


def test_dkdv_warps_follow_the_shared_memory_limit(attn, monkeypatch):
    """8 warps (128-key tiles) where their shared memory fits a block (H100: 227 KB; sm_86 / sm_89's 99 KB at
    head_dim 64), else 4 (head_dim 128 on sm_86 / sm_89)."""
    for limit, want in ((227 * 1024, {64: 8, 128: 8}), (99 * 1024, {64: 8, 128: 4})):
        monkeypatch.setattr(type(attn), "max_shared_optin", lambda self, limit=limit: limit)
        assert {d: attn._dkdv_warps(d) for d in BWD_HEAD_DIMS} == want


def test_dkdv_rows_follow_the_shared_memory_limit(attn, monkeypatch):
    """dkdv_rows=64 (8 warps, 64-row stages: 158 KB at head_dim 128, 92 KB at 64) where it fits a block (H100's
    227 KB, A100's 163 KB; sm_86 / sm_89's 99 KB at head_dim 64 only), else ValueError; 32 is the
    32-row tile; None: 64 where it fits, else 32."""
    for limit, fits in ((227 * 1024, {64: True, 128: True}), (163 * 1024, {64: True, 128: True}),
                        (99 * 1024, {64: True, 128: False})):
        monkeypatch.setattr(type(attn), "max_shared_optin", lambda self, limit=limit: limit)
        for d in BWD_HEAD_DIMS:
            assert attn._dkdv_tile(d, 32) == (attn._dkdv_warps(d), 32)
            assert attn._dkdv_tile(d, None) == ((8, 64) if fits[d] else (attn._dkdv_warps(d), 32))
            if fits[d]:
                assert attn._dkdv_tile(d, 64) == (8, 64)
            else:
                with pytest.raises(ValueError, match="dkdv_rows=64 at head_dim 128 needs"):
                    attn._dkdv_tile(d, 64)


def test_backward_rejects_bad_input_before_launch(attn, host_if_no_gpu):
    launches = host_if_no_gpu
    a = _args()
    q, k = a["q"], a["k"]
    cases = [
        (TypeError, "k must be float16", dict(k=k.astype(cupy.float32))),
        (TypeError, "dout must be float16", dict(dout=q.view(cupy.uint16))),
        (TypeError, "q must be float16 or bfloat16", dict(q=q.astype(cupy.float32))),
        (ValueError, "head_dim must be one of", dict(q=q[..., :32].copy(), dout=q[..., :32].copy(),
                                                      out=q[..., :32].copy(), k=k[..., :32].copy(),
                                                      v=k[..., :32].copy())),
        (ValueError, "k has head_dim", dict(k=cupy.zeros((22, 2, 128), cupy.float16))),
        (ValueError, "multiple of n_kv_heads", dict(k=cupy.zeros((22, 3, 64), cupy.float16),
                                                    v=cupy.zeros((22, 3, 64), cupy.float16))),
        (ValueError, "v must have shape", dict(v=k[:5].copy())),
        (ValueError, "out must have shape", dict(out=q[:5].copy())),
        (ValueError, "lse must have shape", dict(lse=a["lse"][:, :2].copy())),
        (TypeError, "lse must have dtype", dict(lse=a["lse"].astype(cupy.float64))),
        (ValueError, "dq must have shape", dict(dq=q[:5].copy())),
        (ValueError, "dk must have shape", dict(dk=q.copy())),
        (ValueError, "delta must have shape", dict(delta=cupy.zeros((3, 4), cupy.float32))),
        (ValueError, "dq_accum must have shape", dict(dq_accum=cupy.zeros((3, 4, 64), cupy.float32))),
        (ValueError, "cu_seqlens_k must have shape", dict(cu_seqlens_k=a["cu_seqlens_k"][:2].copy())),
        (TypeError, "cu_seqlens_q must have dtype", dict(cu_seqlens_q=a["cu_seqlens_q"].astype(cupy.int64))),
        (ValueError, "max_seqlen_q", dict(max_seqlen_q=0)),
        (ValueError, "max_seqlen_k", dict(max_seqlen_k=-1)),
        (ValueError, "scale", dict(scale=-1.0)),
        (ValueError, "softcap", dict(softcap=float("nan"))),
        (TypeError, "window_left", dict(window_left=2.5)),
        (TypeError, "deterministic", dict(deterministic=1)),
        (ValueError, "dkdv_rows must be None or one of", dict(dkdv_rows=48)),
        (ValueError, "dkdv_rows must be None or one of", dict(dkdv_rows=True)),
        (TypeError, "dq_vector_atomics must be None, True or False", dict(dq_vector_atomics=1)),
        (TypeError, "wgmma must be None, True or False", dict(wgmma=1)),
        (TypeError, "wgmma must be None, True or False", dict(wgmma="yes")),
        (TypeError, "causal", dict(causal="yes")),
        (ValueError, "causal_variant must be one of", dict(causal=True, causal_variant="top_left")),
        (ValueError, "C-contiguous", dict(out=cupy.zeros((4, 22, 64), cupy.float16).transpose(1, 0, 2))),
    ]
    for err, match, kw in cases:
        with pytest.raises(err, match=match):
            attn.flash_attn_varlen_backward(**dict(a, **kw))
    if launches is not None:
        assert not launches


# ----------------------------------------------------------------------------- GPU

def _case(rng, kind, h, hk, d, q_lens, k_lens):
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    q, k, v = (_store(rng.standard_normal((n, hh, d)).astype(np.float32), kind)
               for n, hh in ((cu_q[-1], h), (cu_k[-1], hk), (cu_k[-1], hk)))
    do = _store(rng.standard_normal((cu_q[-1], h, d)).astype(np.float32), kind)
    return cu_q, cu_k, q, k, v, do


def _forward(attn, q, k, v, cu_q, cu_k, q_lens, **kw):
    out = poison(cupy.empty(q.shape, q.dtype))
    lse = poison(cupy.empty(q.shape[:2], cupy.float32))
    attn.flash_attn_varlen(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), out, max_seqlen_q=max(q_lens),
                           lse=lse, **kw)
    return out, lse


def _backward(attn, do, q, k, v, out, lse, cu_q, cu_k, q_lens, k_lens, deterministic, **kw):
    dq, dk, dv = (poison(cupy.empty(a.shape, a.dtype)) for a in (q, k, v))
    delta = poison(cupy.empty(lse.shape, cupy.float32))
    acc = None if deterministic else poison(cupy.empty(q.shape, cupy.float32))
    return attn.flash_attn_varlen_backward(do, q, k, v, out, lse, cupy.asarray(cu_q), cupy.asarray(cu_k),
                                           max(q_lens), max(k_lens), dq=dq, dk=dk, dv=dv, delta=delta,
                                           dq_accum=acc, deterministic=deterministic, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("d,h,hk", [(128, 4, 2), (64, 3, 3), (64, 4, 1)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_varlen_backward(attn, rng, kind, mode, d, h, hk, deterministic):
    """Ragged sequences: length 1, lengths off the tiles, more queries than keys, many K tiles."""
    q_lens, k_lens = [1, 130, 64, 7, 45], [1, 130, 200, 3, 301]
    kw = MODES[mode]
    cu_q, cu_k, q, k, v, do = _case(rng, kind, h, hk, d, q_lens, k_lens)
    out, lse = _forward(attn, q, k, v, cu_q, cu_k, q_lens, **kw)
    dq, dk, dv = _backward(attn, do, q, k, v, out, lse, cu_q, cu_k, q_lens, k_lens, deterministic, **kw)
    f = [ref.as_float64(a, kind) for a in (do, q, k, v)]
    want = ref.varlen_backward(*f, cu_q, cu_k, **kw)
    for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        _grad_close(got, w, kind, f"{name} ({mode}, {'deterministic' if deterministic else 'atomic'})")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("d,h,hk", [(128, 4, 2), (64, 4, 1)])
def test_varlen_backward_four_warp_tiles(attn, rng, monkeypatch, mode, d, h, hk):
    """bwd_dkdv's 4-warp, 64-key tiles (what a device with 99 KB a block runs at head_dim 128)."""
    monkeypatch.setattr(attn, "_dkdv_warps", lambda d: 4)
    q_lens, k_lens = [1, 130, 64, 7], [1, 130, 200, 301]
    kw = MODES[mode]
    cu_q, cu_k, q, k, v, do = _case(rng, "float16", h, hk, d, q_lens, k_lens)
    out, lse = _forward(attn, q, k, v, cu_q, cu_k, q_lens, **kw)
    dq, dk, dv = _backward(attn, do, q, k, v, out, lse, cu_q, cu_k, q_lens, k_lens, False, **kw)
    want = ref.varlen_backward(*[ref.as_float64(a, "float16") for a in (do, q, k, v)], cu_q, cu_k, **kw)
    for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        _grad_close(got, w, "float16", f"{name} ({mode}, 4 warps)")


# bwd_dkdv's variants (flash_attn_varlen_backward's keywords); ids in the racecheck pass's selection
# (profiling/device_check.sh: test_varlen_backward, float16, causal / softcap, 128-4-2)
# (the default: wgmma on sm_90, rows64 where it fits elsewhere; rows32 is the other devices' tile)
VARIANTS = {"rows32": dict(dkdv_rows=32, dq_vector_atomics=False),
            "rows64": dict(dkdv_rows=64, dq_vector_atomics=False),
            "red4": dict(dkdv_rows=32, dq_vector_atomics=True),
            "rows64-red4": dict(dkdv_rows=64, dq_vector_atomics=True, wgmma=False),
            "wgmma": dict(wgmma=True)}  # bwd_dkdv_wg (sm_90)


def _variant_or_skip(attn, kind, d, variant):
    kw = VARIANTS[variant]
    unit = attn._units[f"attention_bwd_{'f16' if kind == 'float16' else 'bf16'}"]
    if kw.get("dq_vector_atomics") and not unit.is_sm90():
        pytest.skip("dq_vector_atomics needs an sm_90 device")
    if kw.get("wgmma") and not attn._units[unit.family.name.replace("_bwd_", "_bwd_wg_")].is_sm90():
        pytest.skip("wgmma=True (bwd_dkdv_wg, wgmma) needs an sm_90 device")
    if kw.get("dkdv_rows") == 64 and not attn._dkdv_fits(d, 8, 64):
        pytest.skip("64-row steps exceed this device's shared memory a block at this head_dim")
    return kw


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("d,h,hk", [(128, 4, 2), (64, 3, 3), (64, 4, 1)])
def test_varlen_backward_variants(attn, rng, variant, kind, mode, d, h, hk):
    """bwd_dkdv's 32- and 64-row steps, scalar and vector dQ atomics, against the reference: ragged sequences
    (length 1, lengths off the 32 / 64-row steps and the 128-key tiles, more queries than keys, a query tile
    that ends past q_len)."""
    kw = dict(MODES[mode], **_variant_or_skip(attn, kind, d, variant))
    q_lens, k_lens = [1, 130, 64, 7, 45, 97], [1, 130, 200, 3, 301, 65]
    cu_q, cu_k, q, k, v, do = _case(rng, kind, h, hk, d, q_lens, k_lens)
    fw = {key: val for key, val in kw.items() if key in MODES[mode]}
    out, lse = _forward(attn, q, k, v, cu_q, cu_k, q_lens, **fw)
    dq, dk, dv = _backward(attn, do, q, k, v, out, lse, cu_q, cu_k, q_lens, k_lens, False, **kw)
    want = ref.varlen_backward(*[ref.as_float64(a, kind) for a in (do, q, k, v)], cu_q, cu_k, **fw)
    for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        _grad_close(got, w, kind, f"{name} ({mode}, {variant})")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_varlen_backward_variants_match_default(attn, rng, variant):
    """A variant's gradients against the default kernel's on the same inputs (GQA 8 over 2, causal, several
    128-key tiles and 64-row steps per sequence): dK and dV within f16 rounding, dQ within the atomics' order."""
    kind, d, q_lens = "float16", 128, [300, 513, 64]
    kw = _variant_or_skip(attn, kind, d, variant)
    cu_q, cu_k, q, k, v, do = _case(rng, kind, 8, 2, d, q_lens, q_lens)
    out, lse = _forward(attn, q, k, v, cu_q, cu_k, q_lens, causal=True)
    base = _backward(attn, do, q, k, v, out, lse, cu_q, cu_k, q_lens, q_lens, False, causal=True)
    got = _backward(attn, do, q, k, v, out, lse, cu_q, cu_k, q_lens, q_lens, False, causal=True, **kw)
    for name, a, b in zip(("dq", "dk", "dv"), got, base):
        w = ref.as_float64(b, kind)
        assert_close(ref.as_float64(a, kind), w, atol=4e-3 * np.abs(w).max(), rtol=4e-3, name=f"{name} ({variant})")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("d,h,hk", [(128, 4, 2), (64, 4, 1)])
def test_varlen_backward_wgmma_deterministic(attn, rng, kind, mode, d, h, hk):
    """wgmma=True with deterministic=True: dK and dV from bwd_dkdv_wg without dQ atomics, dQ from bwd_dq; against
    the reference, and the same bits on a second run."""
    kw = _variant_or_skip(attn, kind, d, "wgmma")
    q_lens, k_lens = [1, 130, 64, 7, 45, 97], [1, 130, 200, 3, 301, 65]
    cu_q, cu_k, q, k, v, do = _case(rng, kind, h, hk, d, q_lens, k_lens)
    out, lse = _forward(attn, q, k, v, cu_q, cu_k, q_lens, **MODES[mode])
    runs = [_backward(attn, do, q, k, v, out, lse, cu_q, cu_k, q_lens, k_lens, True, **MODES[mode], **kw)
            for _ in range(2)]
    want = ref.varlen_backward(*[ref.as_float64(a, kind) for a in (do, q, k, v)], cu_q, cu_k, **MODES[mode])
    for name, got, again, w in zip(("dq", "dk", "dv"), *runs, want):
        _grad_close(got, w, kind, f"{name} ({mode}, wgmma deterministic)")
        assert cupy.array_equal(got, again), name


@pytest.mark.gpu
def test_varlen_backward_delta_and_modes_agree(attn, rng):
    """delta holds rowsum(dO * O); the two dQ modes agree; the deterministic mode repeats bit for bit."""
    kind, q_lens, k_lens = "float16", [33, 100], [80, 100]
    cu_q, cu_k, q, k, v, do = _case(rng, kind, 4, 2, 128, q_lens, k_lens)
    out, lse = _forward(attn, q, k, v, cu_q, cu_k, q_lens, causal=True)
    delta = poison(cupy.empty(lse.shape, cupy.float32))
    g_atomic = attn.flash_attn_varlen_backward(do, q, k, v, out, lse, cupy.asarray(cu_q), cupy.asarray(cu_k),
                                               max(q_lens), max(k_lens), causal=True, delta=delta)
    want_delta = (ref.as_float64(do, kind) * ref.as_float64(out, kind)).sum(-1)
    assert_close(delta, want_delta, atol=1e-4, rtol=1e-4, name="delta")
    runs = [_backward(attn, do, q, k, v, out, lse, cu_q, cu_k, q_lens, k_lens, True, causal=True) for _ in range(2)]
    for a, b in zip(*runs):
        assert cupy.array_equal(a, b)
    for name, a, b in zip(("dq", "dk", "dv"), g_atomic, runs[0]):
        _grad_close(a, ref.as_float64(b, kind), kind, name)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_backward_against_torch_sdpa(attn, rng, causal):
    """torch SDPA's backward (float32 on the same stored inputs), per sequence of equal q and k lengths (where
    torch's top-left causal mask is ours), GQA through repeated K/V heads."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    kind, lens, h, hk, d = "bfloat16", [1, 77, 130], 4, 2, 128
    cu, _, q, k, v, do = _case(rng, kind, h, hk, d, lens, lens)
    out, lse = _forward(attn, q, k, v, cu, cu, lens, causal=causal)
    dq, dk, dv = _backward(attn, do, q, k, v, out, lse, cu, cu, lens, lens, False, causal=causal)
    f = [torch.tensor(ref.as_float64(a, kind), dtype=torch.float32, device="cuda") for a in (do, q, k, v)]
    for i in range(len(lens)):
        r = slice(int(cu[i]), int(cu[i + 1]))
        tq, tk, tv = (x[r].transpose(0, 1).clone().requires_grad_() for x in f[1:])
        # GQA by repeated K/V heads (autograd sums their gradients back)
        o = torch.nn.functional.scaled_dot_product_attention(
            tq[None], tk.repeat_interleave(h // hk, 0)[None], tv.repeat_interleave(h // hk, 0)[None],
            is_causal=causal)[0]
        o.backward(f[0][r].transpose(0, 1))
        for name, got, t in (("dq", dq, tq), ("dk", dk, tk), ("dv", dv, tv)):
            _grad_close(got[r], t.grad.transpose(0, 1).double().cpu().numpy(), kind, f"{name} seq {i}")
