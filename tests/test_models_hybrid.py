"""The DeltaNet hybrid (qwen3next), with the dense FFN and with Qwen3-Next's MoE FFN: tiny GGUF files, metadata,
the float64 reference, bad files (CPU); the real forward's dispatches on host-backed arrays, its orchestration on
NumPy fakes and the MoE routing flag (CPU); the GPU forward against the reference (prefill, graph decode, b1 and
a batch of ragged prompts, the routing flag).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from cukern.models import GGUFError, load_gguf
from cukern.models.hybrid_config import legacy_rows
from cukern.models.hybrid_tiny import HybridSpec
from cukern.models.tiny import write_tiny_gguf
from cukern.reference.models import silu
from cukern.reference.models_hybrid import FFN_REFERENCES, HybridReference
from cukern.testing import nmse
from models_helpers import check_routing_error

gpu = pytest.mark.gpu

# Mixed block types over the hybrid's projections (Q4_K / Q6_K rows need d_model % 256 == 0)
MIXED = {"attn_qkv.weight": QT.Q8_0, "attn_gate.weight": QT.Q8_0, "ssm_out.weight": QT.Q4_K, "ssm_ba.weight": QT.F16,
         "ffn_down.weight": QT.Q6_K, "attn_output.weight": QT.Q5_0, "attn_q.weight": QT.Q4_0}
SPECS = {
    "h4": HybridSpec(types=MIXED),                                   # DN, attn, DN, attn; dk 64 (tiled deltanet)
    "h6": HybridSpec(n_layers=6, interval=3, ssm_k_heads=1, ssm_v_heads=2, ssm_dk=32, ssm_dv=48, conv_kernel=3,
                     head_dim=128, rope_dim=32, n_kv_heads=1, tied=True),   # baseline deltanet, group 2, K = 3
    "legacy": HybridSpec(legacy=True),
    "moe4": HybridSpec(n_experts=16, top_k=5, d_ff_exp=96, d_ff_shexp=160),  # Qwen3-Next's FFN: 16 experts, top 5
    "moe6": HybridSpec(n_layers=6, interval=3, ssm_k_heads=1, ssm_v_heads=2, ssm_dk=32, ssm_dv=48, conv_kernel=3,
                       head_dim=128, rope_dim=32, n_kv_heads=1, tied=True, n_experts=24, top_k=10, d_ff_exp=64,
                       d_ff_shexp=224, types={"ffn_up_shexp.weight": QT.Q4_K, "ffn_down_exps.weight": QT.Q5_0}),
}
MOE = {k: getattr(SPECS["moe4"], k) for k in ("n_experts", "top_k", "d_ff_exp", "d_ff_shexp")}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid")
    return {k: write_tiny_gguf(d / f"{k}.gguf", s, seed=i) for i, (k, s) in enumerate(SPECS.items())}


def _ref(m):
    return HybridReference(m.config, m)


# ----------------------------------------------------------------------------------------------- CPU

def test_tiny_file_loads_and_metadata_parses(hybrid):
    c = load_gguf(hybrid["h4"]).config
    assert (c.arch, c.n_layers, c.full_attention_interval, c.recurrent) == ("qwen3next", 4, 2, (True, False) * 2)
    assert (c.ssm_k_heads, c.ssm_v_heads, c.ssm_dk, c.ssm_dv, c.conv_kernel) == (2, 4, 64, 64, 4)
    assert (c.rope_dim, c.head_dim, c.attn_layers, c.ffn, c.ssm_in_legacy) == (16, 64, (1, 3), "dense", False)
    assert c.conv_channels == 2 * 128 + 256 and c.state_shapes()["ssm"] == (4, 64, 64)
    c6 = load_gguf(hybrid["h6"]).config
    assert c6.recurrent == (True, True, False) * 2 and c6.tied_output and c6.attn_layers == (2, 5)
    assert load_gguf(hybrid["legacy"]).config.ssm_in_legacy


def test_moe_file_loads_and_metadata_parses(hybrid):
    m = load_gguf(hybrid["moe4"])
    c = m.config
    assert (c.ffn, c.n_experts, c.n_experts_used, c.d_ff_exp, c.d_ff_shexp, c.norm_topk) == \
        ("moe", 16, 5, 96, 160, True)
    e = c.moe   # what the MoE block and its reference read
    assert (e.d_ff, e.n_experts, e.n_experts_used, e.d_ff_shexp, e.shared_expert, e.gpt_oss, e.d_model) == \
        (96, 16, 5, 160, True, False, c.d_model)
    t = {n: (m[f"blk.1.{n}"].shape, m[f"blk.1.{n}"].qtype) for n in
         ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
          "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_down_shexp.weight")}
    assert t == {"ffn_gate_inp.weight": ((16, 256), QT.F32), "ffn_gate_exps.weight": ((16, 96, 256), QT.Q4_K),
                 "ffn_up_exps.weight": ((16, 96, 256), QT.Q4_K), "ffn_down_exps.weight": ((16, 256, 96), QT.Q8_0),
                 "ffn_gate_inp_shexp.weight": ((256,), QT.F32), "ffn_gate_shexp.weight": ((160, 256), QT.Q8_0),
                 "ffn_down_shexp.weight": ((256, 160), QT.Q8_0)}
    assert "blk.0.ffn_gate.weight" not in m.tensors
    c6 = load_gguf(hybrid["moe6"]).config
    assert (c6.n_experts_used, c6.moe.d_ff, c6.d_ff_shexp, c6.recurrent) == (10, 64, 224, (True, True, False) * 2)


def test_reference_moe_ffn_by_hand(hybrid, rng):
    """The hybrid reference's MoE FFN of a layer, written out per row: a softmax over all 16 experts, the top 5
    renormalised to sum to 1, each a SwiGLU, plus the shared expert times sigmoid(ffn_gate_inp_shexp . h)."""
    m = load_gguf(hybrid["moe4"])
    r = _ref(m)
    h = rng.standard_normal((3, m.config.d_model))
    got = FFN_REFERENCES["moe"](r, 2, h)

    def glu(prefix, suffix, x):
        w = [r.w(f"blk.2.ffn_{n}{suffix}.weight") for n in ("gate", "up", "down")]
        w = [a[prefix] for a in w] if prefix is not None else w
        return w[2] @ (silu(w[0] @ x) * (w[1] @ x))
    for t in range(3):
        p = np.exp(r.w("blk.2.ffn_gate_inp.weight") @ h[t])
        top = np.argsort(-p)[:5]
        want = sum(p[e] / p[top].sum() * glu(e, "_exps", h[t]) for e in top)
        want = want + glu(None, "_shexp", h[t]) / (1.0 + np.exp(-(r.w("blk.2.ffn_gate_inp_shexp.weight") @ h[t])))
        assert np.abs(got[t] - want).max() < 1e-10


def test_legacy_rows_regroup_per_key_head():
    from cukern.models.hybrid_config import HybridConfig
    cfg = HybridConfig.__new__(HybridConfig)
    for k, v in dict(ssm_dk=2, ssm_dv=3, ssm_k_heads=2, ssm_v_heads=4).items():
        object.__setattr__(cfg, k, v)
    qkv, z = legacy_rows(cfg)   # per key head: q 2, k 2, v 6, z 6 rows (16)
    assert qkv.tolist() == [0, 1, 16, 17, 2, 3, 18, 19, *range(4, 10), *range(20, 26)]
    assert z.tolist() == [*range(10, 16), *range(26, 32)]


@pytest.mark.parametrize("which", list(SPECS))
def test_reference_decode_matches_prefill_and_state_carries(hybrid, which, rng):
    m = load_gguf(hybrid[which])
    r = _ref(m)
    toks = rng.integers(0, m.config.vocab_size, size=13).tolist()
    full = r.forward(toks)
    assert np.isfinite(full).all() and full.std() > 0.1
    r.reset()
    steps = np.concatenate([r.forward(toks[:5]), *(r.forward([t]) for t in toks[5:])])
    assert np.abs(steps - full).max() < 1e-9
    # the DeltaNet layers' state carries the first token to the last (the attention layers would too: drop them)
    r.reset()
    other = r.forward([(toks[0] + 1) % m.config.vocab_size] + toks[1:])
    assert np.abs(other[-1] - full[-1]).max() > 1e-6


def test_legacy_in_projection_runs_the_same_model(hybrid, tmp_path, rng):
    """The legacy file holds the split twin's very rows (same seed), regrouped per key head."""
    a = _ref(load_gguf(hybrid["legacy"]))
    b = _ref(load_gguf(write_tiny_gguf(tmp_path / "split_twin.gguf", HybridSpec(), seed=2)))
    toks = rng.integers(0, 200, size=9).tolist()
    assert np.array_equal(a.forward(toks), b.forward(toks))


def test_reference_deltanet_layer_matches_elementwise_references(hybrid, rng):
    """The model reference's DeltaNet layer against the kernels' own references chained by hand."""
    from cukern.reference import elementwise as E
    m = load_gguf(hybrid["h4"])
    c, r = m.config, _ref(m)
    h = rng.standard_normal((6, c.d_model))
    got = r._deltanet(0, h)
    w = r.w
    qkv, z, ba = h @ w("blk.0.attn_qkv.weight").T, h @ w("blk.0.attn_gate.weight").T, h @ w("blk.0.ssm_ba.weight").T
    g, beta = E.deltanet_gates(ba, w("blk.0.ssm_a"), w("blk.0.ssm_dt.bias"), group=c.ssm_v_heads // c.ssm_k_heads)
    y, _ = E.conv1d_silu(qkv, np.zeros((c.conv_kernel - 1, c.conv_channels)), w("blk.0.ssm_conv1d.weight"))
    qk = c.qk_channels
    q = E.group_norm(y[:, :qk], group_size=c.ssm_dk, l2=True, eps=c.rms_eps).reshape(6, c.ssm_k_heads, c.ssm_dk)
    k = E.group_norm(y[:, qk:2 * qk], group_size=c.ssm_dk, l2=True, eps=c.rms_eps).reshape(q.shape)
    o, _ = E.deltanet(q, k, y[:, 2 * qk:].reshape(6, c.ssm_v_heads, c.ssm_dv), g, beta,
                      np.zeros(c.state_shapes()["ssm"]))
    o = E.group_norm(o.reshape(6, -1), group_size=c.ssm_dv, w=w("blk.0.ssm_norm.weight"), z=z, eps=c.rms_eps)
    assert np.abs(got - o @ w("blk.0.ssm_out.weight").T).max() < 1e-10


# --------------------------------------------------------------------------------------- bad files

def _set_keys(path, values: dict) -> None:
    """Rewrite scalar metadata values of a GGUF file in place."""
    import gguf
    r = gguf.GGUFReader(path, "r+")
    for k, v in values.items():
        f = r.fields[k]
        f.parts[f.data[0]][...] = v
    r.data.flush()
    del r


def _bad(tmp_path, name, **kw):
    skip = kw.pop("skip", ())
    from cukern.models.hybrid_tiny import write_tiny
    return write_tiny(tmp_path / f"{name}.gguf", HybridSpec(**kw), skip=skip)


@pytest.mark.parametrize("skip,tensor", [(("ssm_conv1d.weight",), "blk.0.ssm_conv1d.weight"),
                                         (("ssm_a",), "blk.0.ssm_a"), (("ssm_dt.bias",), "blk.0.ssm_dt.bias"),
                                         (("ssm_norm.weight",), "blk.0.ssm_norm.weight"),
                                         (("ssm_out.weight",), "blk.0.ssm_out.weight"),
                                         (("ssm_ba.weight",), "blk.0.ssm_ba.weight"),
                                         (("attn_qkv.weight",), "blk.0.attn_qkv.weight"),
                                         (("attn_gate.weight",), "blk.0.attn_gate.weight"),
                                         (("blk.2.ssm_conv1d.weight",), "blk.2.ssm_conv1d.weight")])
def test_missing_ssm_tensor_is_named(tmp_path, skip, tensor):
    p = _bad(tmp_path, "missing", skip=skip)
    with pytest.raises(GGUFError, match=rf"missing\.gguf: missing tensor '{tensor}'"):
        load_gguf(p)


@pytest.mark.parametrize("interval,match", [(3, r"interval \(3\) must divide qwen3next\.block_count \(4\)"),
                                            (8, r"full_attention_interval \(8\) must divide"),
                                            (0, r"full_attention_interval' must be in \[1, ")])
def test_full_attention_interval_must_divide_the_layers(tmp_path, interval, match):
    p = _bad(tmp_path, "interval", interval_key=interval)
    with pytest.raises(GGUFError, match=r"interval\.gguf: .*" + match):
        load_gguf(p)


def test_interval_that_moves_the_attention_layers_names_the_tensor(tmp_path):
    """The file's layers follow interval 2, its key says 4: layer 1 must be DeltaNet and has no ssm tensors."""
    p = _bad(tmp_path, "moved", interval_key=4)
    with pytest.raises(GGUFError, match=r"moved\.gguf: missing tensor 'blk\.1\.(attn_qkv|ssm_in)\.weight'"):
        load_gguf(p)


@pytest.mark.parametrize("kw,match", [
    # the conv state holds conv_kernel - 1 inputs: taps of another length do not fit it
    (dict(conv_kernel=3), r"'blk\.0\.ssm_conv1d\.weight' has shape \(512, 3\), expected \(512, 4\)"),
    # the delta-rule state is [n_v, dk, dv]: a value head dim other than inner_size / time_step_rank
    (dict(ssm_dv=32), r"'blk\.0\.attn_qkv\.weight' has shape \(384, 256\), expected \(512, 256\)"),
])
def test_state_shapes_that_do_not_match_name_the_tensor(tmp_path, kw, match):
    """A file whose tensors disagree with the state dims its metadata gives (the metadata rewritten)."""
    good = HybridSpec()
    p = _bad(tmp_path, "state", **kw)
    # the metadata rewritten to the good spec's dims; the tensors keep the bad shapes
    _set_keys(p, {"qwen3next.ssm.conv_kernel": good.conv_kernel,
                  "qwen3next.ssm.inner_size": good.ssm_v_heads * good.ssm_dv})
    with pytest.raises(GGUFError, match=r"state\.gguf: tensor " + match):
        load_gguf(p)


@pytest.mark.parametrize("key,value,match", [
    ("qwen3next.ssm.conv_kernel", 5, r"ssm\.conv_kernel \(5\) must be one of \(2, 3, 4\)"),
    ("qwen3next.ssm.time_step_rank", 3, r"time_step_rank \(3 value heads\) is not a multiple of .*group_count \(2"),
    ("qwen3next.ssm.inner_size", 250, r"inner_size \(250\) is not a multiple of .*time_step_rank \(4\)"),
    # a MoE file's expert keys: out of the kernels' bounds, or disagreeing with the tensors (the first one named)
    ("qwen3next.expert_count", 12,
     r"tensor 'blk\.0\.ffn_gate_inp\.weight' has shape \(16, 256\), expected \(12, 256\)"),
    ("qwen3next.expert_count", 5000, r"metadata key 'qwen3next\.expert_count'.*5000.*at most 1023"),
    ("qwen3next.expert_count", 0, r"metadata key 'qwen3next\.expert_count'"),
    ("qwen3next.expert_used_count", 17, r"metadata key 'qwen3next\.expert_used_count'.*expert_count = 16"),
    ("qwen3next.expert_feed_forward_length", 128,
     r"tensor 'blk\.0\.ffn_gate_exps\.weight' has shape \(16, 96, 256\), expected \(16, 128, 256\)"),
    ("qwen3next.expert_shared_feed_forward_length", 64,
     r"tensor 'blk\.0\.ffn_gate_shexp\.weight' has shape \(160, 256\), expected \(64, 256\)"),
])
def test_bad_metadata_is_named(tmp_path, key, value, match):
    p = _bad(tmp_path, "meta", **(MOE if "expert" in key else {}))
    _set_keys(p, {key: value})
    with pytest.raises(GGUFError, match=r"meta\.gguf: .*" + match):
        load_gguf(p)


@pytest.mark.parametrize("tensor", ["blk.0.ffn_gate_inp.weight", "blk.3.ffn_gate_inp.weight",
                                    "blk.0.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight",
                                    "blk.2.ffn_down_exps.weight", "blk.0.ffn_gate_inp_shexp.weight",
                                    "blk.1.ffn_gate_shexp.weight", "blk.2.ffn_up_shexp.weight",
                                    "blk.3.ffn_down_shexp.weight"])
def test_missing_moe_tensor_is_named(tmp_path, tensor):
    p = _bad(tmp_path, "hole", skip=(tensor,), **MOE)
    with pytest.raises(GGUFError, match=rf"hole\.gguf: missing tensor '{tensor}'"):
        load_gguf(p)


@pytest.mark.parametrize("change,match", [
    (dict(drop_key="qwen3next.expert_count"), r"missing metadata key 'qwen3next\.expert_count'"),
    (dict(retype="blk.1.ffn_gate_inp.weight"), r"tensor 'blk\.1\.ffn_gate_inp\.weight' has unsupported type Q8_0"),
])
def test_experts_without_their_count_or_with_a_quantized_router(hybrid, tmp_path, change, match):
    from test_models_moe import _rewrite
    with pytest.raises(GGUFError, match=r"bad\.gguf: " + match):
        load_gguf(_rewrite(hybrid["moe4"], tmp_path / "bad.gguf", **change))


def test_unknown_ffn_kind_names_its_hooks(hybrid):
    """A config whose FFN kind has no block: the GPU model and the reference name where one plugs in."""
    import dataclasses
    pytest.importorskip("cupy")
    from cukern.models.hybrid import HybridModel
    m = load_gguf(hybrid["h4"])
    m.config = dataclasses.replace(m.config, ffn="other")
    with pytest.raises(NotImplementedError, match=r"FFN_BLOCKS\['other'\]"):
        HybridModel(m)
    with pytest.raises(NotImplementedError, match="FFN_REFERENCES"):
        HybridReference(m.config, m).forward([1, 2])


# ------------------------------------------------------------------------- the real forward on the CPU

@pytest.mark.parametrize("which", ["h4", "h6", "legacy", "moe4", "moe6"])
def test_forward_passes_every_dispatch_check_without_gpu(hybrid, which, monkeypatch):
    """The real HybridModel (what Transformer(model) builds for qwen3next) on host-backed arrays with launches
    recorded (tests/host_dispatch.py): every dispatch passes its family's validation for prompts through the
    matvec (chunks of 5) and the GEMM (16), a batch of three ragged prompts, graph and eager decode; the DeltaNet
    kernels are among the launches, and a MoE file's routing, per-slot and grouped expert and shared-expert
    kernels."""
    pytest.importorskip("cupy")
    from host_dispatch import patch
    from cukern.dmmv import DmmvDispatch
    from cukern.models.hybrid import HybridModel
    from cukern.models.transformer import Transformer
    launches = patch(monkeypatch, array_methods=True)
    monkeypatch.setattr(DmmvDispatch, "check_errors", lambda self, reset=True: None)
    m = load_gguf(hybrid[which])
    for kv, chunk in (("float16", 5), ("float32", 16)):
        lm = Transformer(m, max_seqs=3, max_tokens=64, page_size=4, kv_dtype=kv, prefill_chunk=chunk)
        assert type(lm) is HybridModel
        prompts = [list(range(5, 5 + n)) for n in (29, 3, 11)]
        lm.generate(prompts, 5)
        lm.generate(prompts[1:], 3, use_graph=False)
    names = {k.split("<")[0].removesuffix("_vec").removesuffix("_tiled").removesuffix("_reg") for k in launches}
    assert {"conv1d_silu", "deltanet", "deltanet_gates", "group_norm", "deinterleave", "binary_rows",
            "qk_norm_rope_kv", "dmmv", "embed_rows"} <= names, names
    if m.config.ffn == "moe":
        assert {"router_matvec", "softmax_topk", "moe_dmmv", "moe_down", "moe_route_pack", "moe_dmmv_packed",
                "moe_weighted_sum", "shared_expert_accumulate"} <= names, names


@pytest.mark.parametrize("which,chunk", [("h4", 5), ("h4", 16), ("h6", 7), ("legacy", 16), ("moe4", 5), ("moe4", 16),
                                         ("moe6", 12)])
def test_hybrid_orchestration_on_numpy_fakes(hybrid, which, chunk, rng, monkeypatch):
    """HybridModel's control flow with every dispatch a NumPy fake (tests/hybrid_fakes.py): three prompts of 29,
    3 and 11 tokens (pages of 4, chunks of ``chunk`` rows) decode together through a replayed "graph" and
    every sequence's 9 greedy tokens equal the float64 reference's; a slot's state is zeroed when it is
    added (NaN otherwise: a stale or unwritten state shows); a prompt chunk replayed for a length seen before
    runs on its own slot's state; one sequence alone and eager decode give the same tokens. The MoE FFN (the real
    MoeBlock on tests/model_fakes_moe.py's fakes): chunks of up to 8 rows take the per-slot expert matvecs,
    longer ones the grouped ones."""
    pytest.importorskip("cupy")
    from hybrid_fakes import fake_hybrid
    from model_fakes import FakeGraph
    m = load_gguf(hybrid[which])
    t = fake_hybrid(m, monkeypatch, max_seqs=3, max_tokens=48, page_size=4, prefill_chunk=chunk)
    prompts = [rng.integers(0, m.config.vocab_size, size=n).tolist() for n in (29, 3, 11)]
    out, stats = t.generate(prompts, 9)
    assert stats.decode_tokens == 7 * 3 and t._dec["graph"].replays == 7
    if m.config.ffn == "moe":
        calls = t.mm.calls
        assert calls.get("moe_dmmv", 0) > 0 and calls.get("moe_down", 0) > 0
        assert (calls.get("moe_dmmv_packed", 0) > 0) == (chunk > 8) == (calls.get("moe_route_pack", 0) > 0)
    for p, o in zip(prompts, out):
        assert o == _ref(m).generate(p, 9), p
    assert t.generate([prompts[2]], 9, use_graph=False)[0][0] == out[2]
    again, _ = t.generate(prompts[::-1], 9)   # other slots for the same prompts, chunk graphs per slot
    assert again == out[::-1]
    replays = sum(g.replays for st in t._chunks.values() for g in st.graphs.values() if isinstance(g, FakeGraph))
    assert (replays > 0) == (chunk < 29 // 2)   # a 29-token prompt repeats its chunk length
    assert t.cache.resets == 3 + 1 + 3


def test_moe_routing_error_is_raised_after_generate(hybrid, monkeypatch):
    pytest.importorskip("cupy")
    from hybrid_fakes import fake_hybrid
    m = load_gguf(hybrid["moe4"])
    check_routing_error(fake_hybrid(m, monkeypatch, max_seqs=1, max_tokens=32, page_size=4, prefill_chunk=8),
                        m.config.n_experts, r"moe4\.gguf")


# ----------------------------------------------------------------------------------------------- GPU

def _gpu_model(path, **kw):
    from cukern.models.hybrid import HybridModel
    return HybridModel.load(path, **kw)


def _check_greedy(m, prompt, got, tol=1e-3):
    """Every GPU token is the reference's argmax, or within tol (relative to the largest |logit|) of it, with
    the reference fed the GPU's tokens (a near-tie may flip between f32 and f64 without being wrong)."""
    r = _ref(m)
    logits = r.forward(prompt, last_only=True)
    for step, t in enumerate(got):
        gap = logits.max() - logits[t]
        assert gap <= tol * np.abs(logits).max(), f"step {step}: token {t} is {gap:.3g} below the argmax"
        logits = r.forward([t], last_only=True)


@gpu
@pytest.mark.parametrize("which", list(SPECS))
@pytest.mark.parametrize("kv_dtype,chunk,bound", [("float32", 5, 1e-8), ("float32", 64, 1e-5), ("float16", 16, 1e-5)])
def test_gpu_prefill_and_decode_logits_match_reference(hybrid, which, kv_dtype, chunk, bound, rng):
    """b1: a 37-token prompt (chunks of 5 rows through the matvec with f32 activations; of 16 and 64 through
    the GEMM, activations rounded to f16) then 6 one-token prefills (the decode shape), the last token's
    logits after each against the float64 reference."""
    import cupy
    m = load_gguf(hybrid[which])
    lm = _gpu_model(hybrid[which], max_seqs=2, max_tokens=96, page_size=4, kv_dtype=kv_dtype, prefill_chunk=chunk)
    r = _ref(m)
    toks = rng.integers(0, m.config.vocab_size, size=43).tolist()
    slot = lm.cache.add(0)
    logits = cupy.full(m.config.vocab_size, np.nan, cupy.float32)
    for part in (toks[:37], *([t] for t in toks[37:])):
        lm.prefill(part, slot, logits)
        lm.check_errors()   # the MoE routing flag (a read of the clear flag for the dense FFN)
        e = nmse(logits.get(), r.forward(part, last_only=True))
        assert e < bound, (len(part), e)


@gpu
@pytest.mark.parametrize("which", list(SPECS))
def test_gpu_greedy_continuations_b1_and_b8_match_reference(hybrid, which, rng):
    """Eight prompts of different lengths (1 ... 40 tokens) decode together: per-sequence DeltaNet state
    beside the paged cache, a captured step replayed. Every sequence's greedy tokens follow the float64
    reference (:func:`_check_greedy`), alone (b1) as in the batch; eager decode of a batch gives the graph's
    tokens."""
    m = load_gguf(hybrid[which])
    lm = _gpu_model(hybrid[which], max_seqs=8, max_tokens=80, page_size=4, kv_dtype="float32", prefill_chunk=16)
    lens = (1, 2, 3, 7, 13, 17, 29, 40)
    prompts = [rng.integers(0, m.config.vocab_size, size=n).tolist() for n in lens]
    out, stats = lm.generate(prompts, 10)
    assert stats.graph and stats.decode_tokens == 8 * 8 and lm._dec["graph"] is not None
    for p, o in zip(prompts, out):
        assert len(o) == 10
        _check_greedy(m, p, o)
    for b in (0, 6):
        _check_greedy(m, prompts[b], lm.generate([prompts[b]], 10)[0][0])
    graph, _ = lm.generate(prompts[2:5], 10)
    assert lm.generate(prompts[2:5], 10, use_graph=False)[0] == graph


@gpu
@pytest.mark.parametrize("which", ["h4", "moe4"])
def test_gpu_state_is_reset_per_sequence_and_decode_logits_match(hybrid, which, rng):
    """A slot reused after free starts from a zero state (its prompt's logits equal a fresh reference's), and
    the logits of every decode step of a batch of 3 ragged prompts (steps 2... graph replays) match the
    reference fed the GPU's tokens (NMSE)."""
    import cupy
    m = load_gguf(hybrid[which])
    lm = _gpu_model(hybrid[which], max_seqs=3, max_tokens=64, page_size=4, kv_dtype="float32", prefill_chunk=8)
    prompts = [rng.integers(0, m.config.vocab_size, size=n).tolist() for n in (11, 4, 19)]
    lm.generate(prompts, 4)                                   # leaves state behind in every slot
    lm.cache.free(1)
    slot = lm.cache.add(0)
    assert slot == 1
    logits = cupy.full(m.config.vocab_size, np.nan, cupy.float32)
    lm.prefill(prompts[2], slot, logits)
    assert nmse(logits.get(), _ref(m).forward(prompts[2], last_only=True)) < 1e-8
    steps = []
    lm.generate(prompts, 6, on_token=lambda step, ids: steps.append((np.array(ids), lm._dec["logits"].get())))
    assert len(steps) == 6
    for b, p in enumerate(prompts):
        r = _ref(m)
        want = r.forward(p, last_only=True)
        for s, (ids, got) in enumerate(steps):
            assert nmse(got[b], want) < 1e-8, (b, s)
            want = r.forward([int(ids[b])], last_only=True)


@gpu
def test_gpu_moe_routing_error_flag(hybrid):
    """Expert ids out of range (written over the router's) reach the MoE kernels: generate raises MoeRoutingError
    naming the file, and the next generate runs clean."""
    m = load_gguf(hybrid["moe4"])
    lm = _gpu_model(hybrid["moe4"], max_seqs=1, max_tokens=32, page_size=4, prefill_chunk=8)
    check_routing_error(lm, m.config.n_experts, r"moe4\.gguf")
