"""The DeltaNet hybrid with Qwen3-Next's MoE FFN (qwen3next files with experts): tiny files, metadata, the float64
reference, bad files (CPU); the real forward's dispatches on host-backed arrays and its orchestration on NumPy
fakes, the routing error flag (CPU); the GPU forward against the reference (prefill and decode logits, greedy
continuations b1 and b8, the error flag after a step). The dense-FFN hybrid is tests/test_models_hybrid.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from cukern.models import GGUFError, load_gguf
from cukern.models.hybrid_tiny import HybridSpec, write_tiny
from cukern.models.tiny import write_tiny_gguf
from cukern.reference.models import silu
from cukern.testing import nmse
from test_models_hybrid import _check_greedy, _gpu_model, _ref, _set_keys

gpu = pytest.mark.gpu

MOE = dict(n_experts=16, top_k=5, d_ff_exp=96, d_ff_shexp=160)
SPECS = {
    "m4": HybridSpec(**MOE),                                          # DN, attn, DN, attn; 16 experts, top 5
    "m6": HybridSpec(n_layers=6, interval=3, ssm_k_heads=1, ssm_v_heads=2, ssm_dk=32, ssm_dv=48, conv_kernel=3,
                     head_dim=128, rope_dim=32, n_kv_heads=1, tied=True, n_experts=24, top_k=10, d_ff_exp=64,
                     d_ff_shexp=224, types={"ffn_up_shexp.weight": QT.Q4_K, "ffn_down_exps.weight": QT.Q5_0}),
}


@pytest.fixture(scope="module")
def hybrid_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid_moe")
    return {k: write_tiny_gguf(d / f"{k}.gguf", s, seed=40 + i) for i, (k, s) in enumerate(SPECS.items())}


# ----------------------------------------------------------------------------------------------- CPU

def test_moe_file_loads_and_metadata_parses(hybrid_moe):
    m = load_gguf(hybrid_moe["m4"])
    c = m.config
    assert (c.ffn, c.n_experts, c.n_experts_used, c.d_ff_exp, c.d_ff_shexp, c.norm_topk) == ("moe", 16, 5, 96, 160, True)
    e = c.moe   # what the MoE block and its reference read
    assert (e.d_ff, e.n_experts, e.n_experts_used, e.d_ff_shexp, e.shared_expert, e.gpt_oss) == (96, 16, 5, 160, True,
                                                                                                False)
    assert (e.d_model, e.rms_eps) == (c.d_model, c.rms_eps)
    t = {n: (m[f"blk.1.{n}"].shape, m[f"blk.1.{n}"].qtype) for n in
         ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
          "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_down_shexp.weight")}
    assert t == {"ffn_gate_inp.weight": ((16, 256), QT.F32), "ffn_gate_exps.weight": ((16, 96, 256), QT.Q4_K),
                 "ffn_up_exps.weight": ((16, 96, 256), QT.Q4_K), "ffn_down_exps.weight": ((16, 256, 96), QT.Q8_0),
                 "ffn_gate_inp_shexp.weight": ((256,), QT.F32), "ffn_gate_shexp.weight": ((160, 256), QT.Q8_0),
                 "ffn_down_shexp.weight": ((256, 160), QT.Q8_0)}
    assert "blk.0.ffn_gate.weight" not in m.tensors
    c6 = load_gguf(hybrid_moe["m6"]).config
    assert (c6.n_experts, c6.n_experts_used, c6.moe.d_ff, c6.d_ff_shexp, c6.recurrent) == (24, 10, 64, 224,
                                                                                          (True, True, False) * 2)


@pytest.mark.parametrize("which", list(SPECS))
def test_reference_decode_matches_prefill(hybrid_moe, which, rng):
    m = load_gguf(hybrid_moe[which])
    r = _ref(m)
    toks = rng.integers(0, m.config.vocab_size, size=13).tolist()
    full = r.forward(toks)
    assert np.isfinite(full).all() and full.std() > 0.1
    r.reset()
    steps = np.concatenate([r.forward(toks[:5]), *(r.forward([t]) for t in toks[5:])])
    assert np.abs(steps - full).max() < 1e-9


def test_reference_moe_ffn_by_hand(hybrid_moe, rng):
    """The hybrid reference's FFN of a layer, written out for each row: a softmax over all 16 experts, the top 5
    renormalised to sum to 1, each a SwiGLU, plus the shared expert times sigmoid(ffn_gate_inp_shexp . h)."""
    from cukern.reference.models_hybrid import FFN_REFERENCES
    m = load_gguf(hybrid_moe["m4"])
    r, c = _ref(m), m.config
    h = rng.standard_normal((3, c.d_model))
    got = FFN_REFERENCES["moe"](r, 2, h)
    w = lambda n: r.w("blk.2." + n)   # noqa: E731
    for t in range(3):
        p = np.exp(w("ffn_gate_inp.weight") @ h[t])
        p /= p.sum()
        top = np.argsort(-p)[:5]
        want = sum(p[e] / p[top].sum() * w("ffn_down_exps.weight")[e]
                   @ (silu(w("ffn_gate_exps.weight")[e] @ h[t]) * (w("ffn_up_exps.weight")[e] @ h[t])) for e in top)
        shared = w("ffn_down_shexp.weight") @ (silu(w("ffn_gate_shexp.weight") @ h[t]) * (w("ffn_up_shexp.weight") @ h[t]))
        want = want + shared / (1.0 + np.exp(-(w("ffn_gate_inp_shexp.weight") @ h[t])))
        assert np.abs(got[t] - want).max() < 1e-10


# --------------------------------------------------------------------------------------- bad files

def _bad(tmp_path, name, skip=()):
    return write_tiny(tmp_path / f"{name}.gguf", HybridSpec(**MOE), skip=skip)


@pytest.mark.parametrize("tensor", ["blk.0.ffn_gate_inp.weight", "blk.3.ffn_gate_inp.weight",
                                    "blk.0.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight",
                                    "blk.2.ffn_down_exps.weight", "blk.0.ffn_gate_inp_shexp.weight",
                                    "blk.1.ffn_gate_shexp.weight", "blk.2.ffn_up_shexp.weight",
                                    "blk.3.ffn_down_shexp.weight"])
def test_missing_moe_tensor_is_named(tmp_path, tensor):
    p = _bad(tmp_path, "hole", skip=(tensor,))
    with pytest.raises(GGUFError, match=rf"hole\.gguf: missing tensor '{tensor}'"):
        load_gguf(p)


@pytest.mark.parametrize("key,value,match", [
    # the file's experts disagree with the count: the first tensor sized by it is named
    ("qwen3next.expert_count", 12, r"tensor 'blk\.0\.ffn_gate_inp\.weight' has shape \(16, 256\), expected \(12, 256\)"),
    ("qwen3next.expert_count", 5000, r"metadata key 'qwen3next\.expert_count'.*5000.*at most 1023"),
    ("qwen3next.expert_count", 0, r"metadata key 'qwen3next\.expert_count'"),
    ("qwen3next.expert_used_count", 17, r"metadata key 'qwen3next\.expert_used_count'.*expert_count = 16"),
    ("qwen3next.expert_feed_forward_length", 128,
     r"tensor 'blk\.0\.ffn_gate_exps\.weight' has shape \(16, 96, 256\), expected \(16, 128, 256\)"),
    ("qwen3next.expert_shared_feed_forward_length", 64,
     r"tensor 'blk\.0\.ffn_gate_shexp\.weight' has shape \(160, 256\), expected \(64, 256\)"),
])
def test_bad_expert_metadata_is_named(tmp_path, key, value, match):
    p = _bad(tmp_path, "meta")
    _set_keys(p, {key: value})
    with pytest.raises(GGUFError, match=r"meta\.gguf: .*" + match):
        load_gguf(p)


def test_experts_without_expert_count_name_the_key(hybrid_moe, tmp_path):
    from test_models_moe import _rewrite
    p = _rewrite(hybrid_moe["m4"], tmp_path / "nocount.gguf", drop_key="qwen3next.expert_count")
    with pytest.raises(GGUFError, match=r"nocount\.gguf: missing metadata key 'qwen3next\.expert_count'"):
        load_gguf(p)


def test_quantized_router_is_refused(hybrid_moe, tmp_path):
    from test_models_moe import _rewrite
    p = _rewrite(hybrid_moe["m4"], tmp_path / "qrouter.gguf", retype="blk.1.ffn_gate_inp.weight")
    with pytest.raises(GGUFError, match=r"qrouter\.gguf: tensor 'blk\.1\.ffn_gate_inp\.weight' has unsupported type Q8_0"):
        load_gguf(p)


# ------------------------------------------------------------------------- the real forward on the CPU

@pytest.mark.parametrize("which", list(SPECS))
def test_forward_passes_every_dispatch_check_without_gpu(hybrid_moe, which, monkeypatch):
    """The real HybridModel with the MoE FFN on host-backed arrays, launches recorded (tests/host_dispatch.py):
    every dispatch passes its family's validation for prompt chunks of 5 rows (per-slot experts) and 16 (grouped
    experts, the shared expert on the GEMM), a batch of three, graph and eager decode."""
    pytest.importorskip("cupy")
    from host_dispatch import patch
    from cukern.dmmv import DmmvDispatch
    from cukern.models.hybrid import HybridModel
    launches = patch(monkeypatch, array_methods=True)
    monkeypatch.setattr(DmmvDispatch, "check_errors", lambda self, reset=True: None)
    m = load_gguf(hybrid_moe[which])
    for kv, chunk in (("float16", 5), ("float32", 16)):
        lm = HybridModel(m, max_seqs=3, max_tokens=64, page_size=4, kv_dtype=kv, prefill_chunk=chunk)
        prompts = [list(range(5, 5 + n)) for n in (29, 3, 11)]
        lm.generate(prompts, 4)
        lm.generate(prompts[1:], 3, use_graph=False)
    names = {k.split("<")[0] for k in launches}
    assert {"router_matvec", "moe_dmmv", "moe_down", "moe_route_pack", "moe_dmmv_packed", "moe_weighted_sum",
            "conv1d_silu", "deltanet"} <= {n.removesuffix("_tiled") for n in names}, names
    assert any(k.startswith("softmax_topk") for k in launches), names
    assert any(k.startswith("shared_expert_accumulate") for k in launches), names


@pytest.mark.parametrize("which,chunk", [("m4", 5), ("m4", 16), ("m6", 7), ("m6", 12)])
def test_hybrid_moe_orchestration_on_numpy_fakes(hybrid_moe, which, chunk, rng, monkeypatch):
    """HybridModel's control flow with the real MoeBlock on NumPy fakes (tests/hybrid_fakes.py): three prompts of
    29, 3 and 11 tokens decode together through a replayed "graph" and every sequence's 9 greedy tokens equal the
    float64 reference's; chunks of up to 8 rows run the per-slot expert matvecs, longer ones the grouped ones;
    one sequence alone and eager decode give the same tokens."""
    pytest.importorskip("cupy")
    from hybrid_fakes import fake_hybrid
    m = load_gguf(hybrid_moe[which])
    t = fake_hybrid(m, monkeypatch, max_seqs=3, max_tokens=48, page_size=4, prefill_chunk=chunk)
    prompts = [rng.integers(0, m.config.vocab_size, size=n).tolist() for n in (29, 3, 11)]
    out, stats = t.generate(prompts, 9)
    assert stats.decode_tokens == 7 * 3 and t._dec["graph"].replays == 7
    calls = t.mm.calls
    assert calls.get("moe_dmmv", 0) > 0 and calls.get("moe_down", 0) > 0
    assert (calls.get("moe_dmmv_packed", 0) > 0) == (chunk > 8) == (calls.get("moe_route_pack", 0) > 0)
    for p, o in zip(prompts, out):
        assert o == _ref(m).generate(p, 9), p
    assert t.generate([prompts[2]], 9, use_graph=False)[0][0] == out[2]


def test_routing_error_is_raised_after_generate(hybrid_moe, monkeypatch):
    """An expert id out of range (the router's ids overwritten) sets the flag; generate raises MoeRoutingError
    naming the file, and the next generate runs clean."""
    pytest.importorskip("cupy")
    from hybrid_fakes import fake_hybrid
    from cukern.models.moe_transformer import MoeRoutingError
    m = load_gguf(hybrid_moe["m4"])
    t = fake_hybrid(m, monkeypatch, max_seqs=1, max_tokens=32, page_size=4, prefill_chunk=8)
    real = t.ew.softmax_topk

    def bad(logits, ids, weights, **kw):
        real(logits, ids, weights, **kw)
        ids[0, 0] = m.config.n_experts + 3
    t.ew.softmax_topk = bad
    with pytest.raises(MoeRoutingError, match=r"m4\.gguf: a MoE kernel met an expert id outside"):
        t.generate([[5, 6, 7]], 3)
    t.ew.softmax_topk = real
    assert len(t.generate([[5, 6, 7]], 3)[0][0]) == 3


# ----------------------------------------------------------------------------------------------- GPU

@gpu
@pytest.mark.parametrize("which", list(SPECS))
@pytest.mark.parametrize("kv_dtype,chunk,bound", [("float32", 5, 1e-8), ("float32", 16, 1e-5), ("float16", 64, 1e-5)])
def test_gpu_moe_prefill_and_decode_logits_match_reference(hybrid_moe, which, kv_dtype, chunk, bound, rng):
    """b1: a 37-token prompt (chunks of 5 rows: per-slot experts, f32 activations; of 16 and 64: grouped
    experts, the attention and shared-expert GEMMs on f16-rounded activations) then 6 one-token prefills (the
    decode shape), the last token's logits after each against the float64 reference; the error flag clear."""
    import cupy
    m = load_gguf(hybrid_moe[which])
    lm = _gpu_model(hybrid_moe[which], max_seqs=2, max_tokens=96, page_size=4, kv_dtype=kv_dtype, prefill_chunk=chunk)
    r = _ref(m)
    toks = rng.integers(0, m.config.vocab_size, size=43).tolist()
    slot = lm.cache.add(0)
    logits = cupy.full(m.config.vocab_size, np.nan, cupy.float32)
    for part in (toks[:37], *([t] for t in toks[37:])):
        lm.prefill(part, slot, logits)
        lm.check_errors()
        e = nmse(logits.get(), r.forward(part, last_only=True))
        assert e < bound, (len(part), e)


@gpu
@pytest.mark.parametrize("which", list(SPECS))
def test_gpu_moe_greedy_continuations_b1_and_b8_match_reference(hybrid_moe, which, rng):
    """Eight prompts (1 ... 40 tokens) decode together (8 rows: the per-slot experts of 8 tokens in a launch, a
    captured step replayed); every sequence's greedy tokens follow the float64 reference, alone (b1) as in the
    batch; eager decode of a batch gives the graph's tokens; the decode logits of each step match (NMSE)."""
    m = load_gguf(hybrid_moe[which])
    lm = _gpu_model(hybrid_moe[which], max_seqs=8, max_tokens=80, page_size=4, kv_dtype="float32", prefill_chunk=16)
    lens = (1, 2, 3, 7, 13, 17, 29, 40)
    prompts = [rng.integers(0, m.config.vocab_size, size=n).tolist() for n in lens]
    steps = []
    out, stats = lm.generate(prompts, 10, on_token=lambda s, ids: steps.append((np.array(ids),
                                                                                lm._dec["logits"].get())))
    assert stats.graph and stats.decode_tokens == 8 * 8 and lm._dec["graph"] is not None
    for b, (p, o) in enumerate(zip(prompts, out)):
        assert len(o) == 10
        _check_greedy(m, p, o)
        r = _ref(m)
        want = r.forward(p, last_only=True)
        for s, (ids, got) in enumerate(steps):
            assert nmse(got[b], want) < 1e-5, (b, s)
            want = r.forward([int(ids[b])], last_only=True)
    for b in (0, 6):
        _check_greedy(m, prompts[b], lm.generate([prompts[b]], 10)[0][0])
    graph, _ = lm.generate(prompts[2:5], 10)
    assert lm.generate(prompts[2:5], 10, use_graph=False)[0] == graph


@gpu
def test_gpu_moe_routing_error_flag(hybrid_moe):
    """Expert ids out of range (written over the router's) reach the kernels: generate raises MoeRoutingError
    naming the file, and the next generate runs clean."""
    from cukern.models.moe_transformer import MoeRoutingError
    m = load_gguf(hybrid_moe["m4"])
    lm = _gpu_model(hybrid_moe["m4"], max_seqs=1, max_tokens=32, page_size=4, prefill_chunk=8)
    real = lm.ew.softmax_topk

    def bad(logits, ids, weights, **kw):
        real(logits, ids, weights, **kw)
        with kw["stream"]:
            ids.fill(m.config.n_experts + 3)
    lm.ew.softmax_topk = bad
    with pytest.raises(MoeRoutingError, match=r"m4\.gguf: a MoE kernel met an expert id outside"):
        lm.generate([[5, 6, 7]], 3, use_graph=False)
    lm.ew.softmax_topk = real
    assert len(lm.generate([[5, 6, 7]], 3)[0][0]) == 3
