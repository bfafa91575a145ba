"""The grouped expert GEMMs (cukern/matmul/moe.py: MatmulDispatch.moe_gemm, moe_gemm_glu) against the float64
reference (cukern/reference/matmul.py: dequantize, gather each expert's slots, multiply), over routes that
DmmvDispatch.moe_route_pack fills on the device.

Tolerances (f16 tensor cores, as tests/matmul_helpers.py states for the GEMMs):
* moe_gemm (f32 out): |y - ref| <= 2e-3 * rms + 2e-3 |ref| against the exact product, 1e-4 * rms + 1e-4 |ref|
  against the product of the f16-rounded operands (the kernel's error alone);
* moe_gemm_glu (f16 out): against the f16-rounded operands' act(g, u), 2e-4 * rms + 1e-3 |ref| (the output's
  f16 rounding, 2^-11 relative, on top of the above); against the exact one, NMSE <= 1e-5 (f16 input
  rounding, ~2.4e-4 rms per product, carried through the activation).
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.dmmv import DmmvDispatch, QWeight  # noqa: E402
from cukern.matmul import MOE_QTYPES, MatmulDispatch  # noqa: E402
from cukern.matmul import common as M  # noqa: E402
from cukern.qtypes import GGMLType as T  # noqa: E402
from cukern.reference import matmul as ref  # noqa: E402
from cukern.testing import assert_close, nmse, poison  # noqa: E402
from test_models_moe import tiny_moe  # noqa: E402,F401 (the tiny MoE GGUF files, a module fixture)

gpu = pytest.mark.gpu
TYPES = list(MOE_QTYPES)
NAMES = {q: ref.TYPES[q][0] for q in TYPES}


def _rms(a):
    return float(np.sqrt(np.mean(np.square(a)))) + 1e-30


def _k(q):
    """Several stages, not a multiple of 256 where the block allows (MXFP4: k % 64 == 0)."""
    return 768 if ref.TYPES[q][1] == 256 else (576 if q == T.MXFP4 else 32 * 19)


def _experts(q, n_e, m, k, rng):
    raw = ref.random_weight(q, n_e * m, k, rng)
    dense = ref.dequantize(raw, q, n_e * m, k).reshape(n_e, m, k)
    return QWeight(cupy.asarray(raw.ravel()), q, m, k, n_experts=n_e), dense


def _ids(rng, n_tok, top_k, n_e, kind):
    """Routing of a kind: "uniform" (distinct experts per token), "skewed" (slot 0 of every token on expert 1,
    the rest on a few experts: most experts get 0 slots), "sparse" (only experts 0 and n_e - 1)."""
    if kind == "uniform":
        return np.stack([rng.permutation(n_e)[:top_k] for _ in range(n_tok)]).astype(np.int32)
    if kind == "skewed":
        ids = rng.integers(0, min(n_e, 3), size=(n_tok, top_k)).astype(np.int32)
        ids[:, 0] = 1 % n_e
        return ids
    return rng.choice([0, n_e - 1], size=(n_tok, top_k)).astype(np.int32)


def _route(dv, ids, n_e):
    route = dv.plan_moe_route(ids.shape[0], ids.shape[1], n_e)
    dv.moe_route_pack(cupy.asarray(ids), route)
    return route


@pytest.fixture(scope="module")
def mm():
    return MatmulDispatch()


@pytest.fixture(scope="module")
def dv():
    return DmmvDispatch()


# ---------------------------------------------------------------------------- CPU

def test_moe_units_declared():
    for q, s in MOE_QTYPES.items():
        unit = M.FAMILIES[f"matmul_moe_{s}"]
        names = {k.name for k in unit.kernels}
        assert f"moe_gemm_f16<{q}, 64, true, __half>" in names and f"moe_gemm_f16<{q}, 128, false, float>" in names
    assert T.MXFP4 in MOE_QTYPES and T.Q4_K in MOE_QTYPES and T.Q8_0 in MOE_QTYPES


def test_reference_gathers_per_expert(rng):
    w = rng.standard_normal((3, 5, 8))
    x = rng.standard_normal((4, 8))
    ids = np.array([[0, 2], [2, 2], [1, 0], [-1, 3]], np.int32)
    y = ref.moe_gemm(w, x, ids)
    for s, e in enumerate(ids.ravel()):
        want = w[e] @ x[s // 2] if 0 <= e < 3 else np.zeros(5)
        np.testing.assert_allclose(y[s], want)
    xs = rng.standard_normal((8, 8))
    np.testing.assert_allclose(ref.moe_gemm(w, xs, ids)[1], w[2] @ xs[1])


def test_moe_gemm_tile_rule(mm, host_if_no_gpu):
    from cukern.dmmv import MoeRoute
    z = cupy.zeros(1, cupy.int32)
    for n_slots, n_e, want in ((4096, 128, 32), (4096, 64, 64), (4096, 32, 128), (8192, 8, 128)):
        assert mm._moe_tile(MoeRoute(n_slots, n_e, 1, z, z, z, z, z), None) == want
    with pytest.raises(ValueError, match="tile"):
        mm._moe_tile(MoeRoute(16, 2, 1, z, z, z, z, z), 16)


def test_bad_input_raises_before_launch(mm, dv, rng, host_if_no_gpu):
    n_e, m, k, n_tok, top_k = 4, 64, 256, 6, 2
    w, _ = _experts(T.Q4_K, n_e, m, k, rng)
    x = cupy.zeros((n_tok, k), cupy.float16)
    route = dv.plan_moe_route(n_tok, top_k, n_e)
    y = cupy.zeros((n_tok * top_k, m), cupy.float32)
    with pytest.raises(TypeError, match="QWeight"):
        mm.moe_gemm("w", x, route, y)
    with pytest.raises(ValueError, match="single matrix"):
        mm.moe_gemm(QWeight(w.buf, T.Q4_K, m, k), x, route, y)
    with pytest.raises(ValueError, match="no grouped expert GEMM"):
        mm.moe_gemm(QWeight(cupy.zeros(n_e * m * k * 2, cupy.uint8), "F16", m, k, n_experts=n_e), x, route, y)
    with pytest.raises(TypeError, match="MoeRoute"):
        mm.moe_gemm(w, x, "route", y)
    with pytest.raises(ValueError, match="planned for"):
        mm.moe_gemm(w, x, dv.plan_moe_route(n_tok, top_k, n_e + 1), y)
    with pytest.raises(ValueError, match="one row per token"):
        mm.moe_gemm(w, cupy.zeros((5, k), cupy.float16), route, y)
    with pytest.raises(ValueError, match=r"\[n, 256\]"):
        mm.moe_gemm(w, cupy.zeros((n_tok, k + 32), cupy.float16), route, y)
    with pytest.raises(ValueError, match="16-byte aligned"):
        mm.moe_gemm(w, cupy.zeros(n_tok * k + 1, cupy.float16)[1:].reshape(n_tok, k), route, y)
    with pytest.raises(ValueError, match="one row per slot"):
        mm.moe_gemm(w, x, route, cupy.zeros((n_tok, m), cupy.float32))
    with pytest.raises(TypeError):
        mm.moe_gemm(w, x, route, y.astype(cupy.float16))
    with pytest.raises(ValueError, match="tile"):
        mm.moe_gemm(w, x, route, y, tile=48)
    with pytest.raises(ValueError, match="aligned"):  # MXFP4 rows an odd number of bytes apart (k / 32 odd)
        mm.moe_gemm(QWeight(cupy.zeros(n_e * m * 3 * 17, cupy.uint8), "MXFP4", m, 96, n_experts=n_e),
                    cupy.zeros((n_tok, 96), cupy.float16), route, y)
    h = cupy.zeros((n_tok * top_k, m), cupy.float16)
    wu, _ = _experts(T.Q4_K, n_e, m, k, rng)
    with pytest.raises(ValueError, match="act"):
        mm.moe_gemm_glu(w, wu, x, route, h, act="relu")
    with pytest.raises(ValueError, match="match w_gate"):
        mm.moe_gemm_glu(w, _experts(T.Q8_0, n_e, m, k, rng)[0], x, route, h)
    with pytest.raises(TypeError):
        mm.moe_gemm_glu(w, wu, x, route, h.astype(cupy.float32))
    b = cupy.zeros((n_e, m), cupy.float32)
    with pytest.raises(ValueError, match="both or neither"):
        mm.moe_gemm_glu(w, wu, x, route, h, gate_bias=b)
    with pytest.raises(ValueError):
        mm.moe_gemm_glu(w, wu, x, route, h, gate_bias=b[:, :8], up_bias=b[:, :8])
    with pytest.raises(ValueError, match="finite"):
        mm.moe_gemm_glu(w, wu, x, route, h, act="swiglu_oai", limit=float("inf"))
    if host_if_no_gpu is not None:
        assert not any(name.startswith("moe_gemm") for name in host_if_no_gpu)
        mm.moe_gemm(w, x, route, y)  # valid: recorded, not launched
        mm.moe_gemm_glu(w, wu, x.astype(cupy.float32), route, h, gate_bias=b, up_bias=b)
        assert {"moe_gemm_f16<12, 32, false, __half>", "moe_gemm_f16<12, 32, true, float>"} <= set(host_if_no_gpu)


def test_experts_grouped_takes_the_gemms_from_the_threshold(tiny_moe, monkeypatch):
    """The MoE model on host arrays (tests/host_dispatch.py) with the GEMM rule at 0 slots per expert: every
    grouped chunk runs moe_gemm_glu + moe_gemm and passes their checks; at the default rule (16) a
    16-row chunk of the tiny models stays on moe_dmmv_packed."""
    from host_dispatch import patch
    from cukern.models.gguf_loader import load_gguf
    from cukern.models.moe import MoeBlock
    from cukern.models.transformer import Transformer
    launches = patch(monkeypatch)
    monkeypatch.setattr(DmmvDispatch, "check_errors", lambda self, reset=True: None)
    m = load_gguf(tiny_moe["qwen3moe"])
    lm = Transformer(m, max_seqs=1, max_tokens=64, page_size=4, prefill_chunk=16)
    lm.generate([list(range(5, 30))], 2, use_graph=False)
    assert not any(k.startswith("moe_gemm") for k in launches)
    monkeypatch.setattr(MoeBlock, "gemm_min_slots_per_expert", 0)
    lm = Transformer(m, max_seqs=1, max_tokens=64, page_size=4, prefill_chunk=16)
    lm.generate([list(range(5, 30))], 2, use_graph=False)
    assert {"moe_gemm_f16<12, 32, true, float>", "moe_gemm_f16<8, 32, false, __half>"} <= set(launches)


# ---------------------------------------------------------------------------- GPU

def _check_y(y, dense, x, ids, name):
    want = ref.moe_gemm(dense, x, ids)
    tight = ref.moe_gemm(ref.f16(dense), ref.f16(x), ids)
    assert_close(y, want, atol=2e-3 * _rms(want), rtol=2e-3, name=name)
    assert_close(y, tight, atol=1e-4 * _rms(tight), rtol=1e-4, name=name + " (f16 inputs)")


CASES = [  # (n_tokens, top_k, n_experts, routing): ragged loads, n_tokens off the tiles
    (77, 4, 8, "uniform"), (45, 8, 32, "skewed"), (33, 8, 128, "sparse"), (130, 1, 8, "uniform"),
    (200, 4, 32, "skewed"), (3, 4, 128, "uniform")]


@gpu
@pytest.mark.parametrize("q", TYPES, ids=NAMES.get)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-top{c[1]}-E{c[2]}-{c[3]}")
def test_moe_gemm(mm, dv, rng, q, case):
    n_tok, top_k, n_e, kind = case
    m, k = 80, _k(q)  # m: a partial 128-row tile
    w, dense = _experts(q, n_e, m, k, rng)
    ids = _ids(rng, n_tok, top_k, n_e, kind)
    route = _route(dv, ids, n_e)
    for dt in (np.float16, np.float32):
        x = rng.standard_normal((n_tok, k)).astype(dt)
        y = poison(cupy.empty((n_tok * top_k, m), cupy.float32))
        mm.moe_gemm(w, cupy.asarray(x), route, y)
        _check_y(y.get(), dense, x, ids, f"y {np.dtype(dt).name}")
    dv.check_errors()


@gpu
@pytest.mark.parametrize("q", [T.Q4_K, T.Q8_0, T.MXFP4], ids=NAMES.get)
@pytest.mark.parametrize("tile", [32, 64, 128])
def test_moe_gemm_per_slot_accumulate_tiles(mm, dv, rng, q, tile):
    """x one row per slot (the down projection), y [n_tokens, top_k, m] added to, every token tile."""
    n_tok, top_k, n_e, m, k = 41, 4, 8, 136, _k(q)
    w, dense = _experts(q, n_e, m, k, rng)
    ids = _ids(rng, n_tok, top_k, n_e, "skewed")
    route = _route(dv, ids, n_e)
    x = rng.standard_normal((n_tok * top_k, k)).astype(np.float16)
    y0 = rng.standard_normal((n_tok, top_k, m)).astype(np.float32)
    y = cupy.asarray(y0)
    mm.moe_gemm(w, cupy.asarray(x), route, y, accumulate=True, tile=tile)
    got = y.get().reshape(-1, m) - y0.reshape(-1, m)
    want = ref.moe_gemm(dense, x, ids)
    assert_close(got, want, atol=2e-3 * _rms(want), rtol=2e-3, name="y += (per slot)")


@gpu
@pytest.mark.parametrize("q", [T.Q4_K, T.Q6_K, T.Q8_0, T.MXFP4], ids=NAMES.get)
@pytest.mark.parametrize("act", ["silu", "gelu", "swiglu_oai"])
def test_moe_gemm_glu(mm, dv, rng, q, act):
    n_tok, top_k, n_e, m, k = 57, 4, 16, 96, _k(q)
    wg, dg = _experts(q, n_e, m, k, rng)
    wu, du = _experts(q, n_e, m, k, rng)
    ids = _ids(rng, n_tok, top_k, n_e, "uniform")
    route = _route(dv, ids, n_e)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    kw, ref_kw = {}, {}
    if act == "swiglu_oai":  # gpt-oss: biases as column 0 of [n_e, m, 4] bias matrices, a limit that clamps
        mats = rng.standard_normal((2, n_e, m, 4)).astype(np.float32)
        bm = cupy.asarray(mats)
        kw = dict(gate_bias=bm[0, ..., 0], up_bias=bm[1, ..., 0], alpha=1.702, limit=1.5)
        ref_kw = dict(gate_bias=mats[0, ..., 0], up_bias=mats[1, ..., 0], alpha=1.702, limit=1.5)
    h = poison(cupy.empty((n_tok * top_k, m), cupy.float16))
    mm.moe_gemm_glu(wg, wu, cupy.asarray(x), route, h, act=act, **kw)
    got = h.get().astype(np.float64)
    tight = ref.moe_glu(ref.f16(dg), ref.f16(du), ref.f16(x), ids, act, **ref_kw)
    assert_close(got, tight, atol=2e-4 * _rms(tight), rtol=1e-3, name="h (f16 inputs)")
    assert nmse(got, ref.moe_glu(dg, du, x, ids, act, **ref_kw)) < 1e-5


@gpu
def test_moe_gemm_bad_ids_zero_and_graph_replay(mm, dv, rng):
    """Slots with an out-of-range id get zeros (the route sets the error flag); route + GEMM captured in a CUDA
    graph follow new ids on replay (no host round trip)."""
    from cukern.dmmv.moe import DeviceError
    from cukern.streams import capture_graph
    n_tok, top_k, n_e, m, k = 50, 4, 8, 64, 256
    w, dense = _experts(T.Q4_K, n_e, m, k, rng)
    ids = _ids(rng, n_tok, top_k, n_e, "uniform")
    ids[3, 1], ids[7, 0] = -1, n_e
    x = rng.standard_normal((n_tok, k)).astype(np.float16)
    xd, ids_d = cupy.asarray(x), cupy.asarray(ids)
    route = dv.plan_moe_route(n_tok, top_k, n_e)
    y = poison(cupy.empty((n_tok * top_k, m), cupy.float32))
    stream = cupy.cuda.Stream(non_blocking=True)

    def step(s):
        dv.moe_route_pack(ids_d, route, stream=s)
        mm.moe_gemm(w, xd, route, y, stream=s)

    step(stream)  # eager first (units loaded), then captured
    stream.synchronize()
    _check_y(y.get(), dense, x, ids, "y (bad ids)")
    with pytest.raises(DeviceError):
        dv.check_errors()
    graph = capture_graph(step, stream)
    ids2 = _ids(rng, n_tok, top_k, n_e, "skewed")
    ids_d[...] = cupy.asarray(ids2)
    y.fill(np.nan)
    graph.replay(stream)
    stream.synchronize()
    _check_y(y.get(), dense, x, ids2, "y (graph replay)")


@gpu
@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_gpu_moe_prefill_on_the_gemms_matches_reference(tiny_moe, name, rng, monkeypatch):
    """A tiny MoE model's 29-token prefill in chunks of 16 with the grouped GEMMs forced on (rule 0 slots per
    expert): the last logits against the float64 reference (activations rounded to f16 in the GEMMs)."""
    from test_models_moe import _model, _needs_yarn
    from cukern.models.gguf_loader import load_gguf
    from cukern.models.moe import MoeBlock
    from cukern.reference.models import ReferenceModel
    _needs_yarn(name)
    monkeypatch.setattr(MoeBlock, "gemm_min_slots_per_expert", 0)
    m, model = _model(tiny_moe[name], kv_dtype="float32", prefill_chunk=16)
    calls = []
    real = MatmulDispatch.moe_gemm
    monkeypatch.setattr(MatmulDispatch, "moe_gemm", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    prompt = rng.integers(0, m.config.vocab_size, size=29).tolist()
    logits = cupy.full(m.config.vocab_size, np.nan, cupy.float32)
    model.prefill(prompt, model.cache.add(0), logits)
    model.check_errors()
    assert calls, "the grouped GEMMs did not run"
    assert nmse(logits, ReferenceModel(m.config, load_gguf(tiny_moe[name]).tensors).forward(prompt)[-1]) < 1e-4
