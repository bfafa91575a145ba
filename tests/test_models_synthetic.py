"""Synthetic full-shape MoE files (cukern/models/synthetic.py): the presets' values, scaled files of both
presets through cukern's loader (config, every tensor's type and shape, valid blocks, the vocabulary),
the CLI and bad preset names; on the GPU, a 2-layer scaled file through the MoE forward."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from cukern.models.gguf_loader import load_gguf, required_tensors
from cukern.models.synthetic import (PRESETS, fast_blocks, file_bytes, main, preset, scaled, synthetic_vocab,
                                     tensor_plan, write_synthetic_gguf)

NAMES = tuple(PRESETS)
# 2 layers, few experts and a small vocabulary: the real per-matrix shapes in ~190 MB (gpt-oss) / 80 MB
SMALL = {"gpt-oss-20b": dict(layers=2, experts=4, vocab=4096), "qwen3-30b-a3b": dict(layers=2, experts=8, vocab=4096)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("synthetic")
    return {n: write_synthetic_gguf(d / f"{n}.gguf", scaled(PRESETS[n], **SMALL[n]), seed=3) for n in NAMES}


def test_preset_values():
    g, q = PRESETS["gpt-oss-20b"], PRESETS["qwen3-30b-a3b"]
    assert (g.arch, g.n_layers, g.d_model, g.n_heads, g.n_kv_heads, g.head_dim) == ("gpt-oss", 24, 2880, 64, 8, 64)
    assert (g.n_experts, g.top_k, g.d_ff_exp, g.vocab, g.sliding_window, g.yarn) == (32, 4, 2880, 201088, 128,
                                                                                      (32.0, 4096))
    assert (g.rope_base, g.rms_eps, g.bos, g.eos) == (150000.0, 1e-5, 199998, 200002)
    assert (q.arch, q.n_layers, q.d_model, q.n_heads, q.n_kv_heads, q.head_dim) == ("qwen3moe", 48, 2048, 32, 4, 128)
    assert (q.n_experts, q.top_k, q.d_ff_exp, q.vocab, q.sliding_window, q.yarn) == (128, 8, 768, 151936, 0, ())
    assert (q.rope_base, q.rms_eps, q.bos, q.eos) == (1e6, 1e-6, 151643, 151645)
    # the public files' sizes: gpt-oss-20b-mxfp4.gguf 12.1 GB, Qwen3-30B-A3B Q4_K_M 18.6 GB
    assert file_bytes(g) / 1e9 == pytest.approx(12.1, abs=0.05)
    assert file_bytes(q) / 1e9 == pytest.approx(18.6, abs=0.1)


def test_q4_k_m_layer_types():
    """llama.cpp's Q4_K_M: attn_v and ffn_down_exps Q6_K on 24 of the 48 layers (0-5, 42-47, every third
    between from 8), the LM head Q6_K, the rest Q4_K; gpt-oss: MXFP4 experts, Q8_0 elsewhere."""
    types = {n: t for n, _, t, _ in tensor_plan(PRESETS["qwen3-30b-a3b"])}
    more = [i for i in range(48) if types[f"blk.{i}.ffn_down_exps.weight"] == QT.Q6_K]
    assert more == [*range(6), *range(8, 42, 3), *range(42, 48)] and len(more) == 24
    assert all(types[f"blk.{i}.attn_v.weight"] == (QT.Q6_K if i in more else QT.Q4_K) for i in range(48))
    assert types["output.weight"] == QT.Q6_K and types["token_embd.weight"] == QT.Q4_K
    assert types["blk.7.ffn_gate_exps.weight"] == types["blk.7.attn_q.weight"] == QT.Q4_K
    g = {n: t for n, _, t, _ in tensor_plan(PRESETS["gpt-oss-20b"])}
    assert g["blk.3.ffn_up_exps.weight"] == QT.MXFP4 and g["blk.3.attn_k.weight"] == g["output.weight"] == QT.Q8_0
    assert g["blk.3.ffn_gate_inp.weight"] == g["blk.3.attn_sinks.weight"] == QT.F32


@pytest.mark.parametrize("name", NAMES)
def test_scaled_file_loads(files, name):
    p = scaled(PRESETS[name], **SMALL[name])
    m = load_gguf(files[name])
    c = m.config
    assert (c.arch, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim) == \
        (p.arch, 2, p.d_model, p.n_heads, p.n_kv_heads, p.head_dim)
    assert (c.n_experts, c.n_experts_used, c.d_ff, c.vocab_size, c.rms_eps) == \
        (p.n_experts, p.top_k, p.d_ff_exp, 4096, pytest.approx(p.rms_eps))
    assert c.context_length == p.context and not c.tied_output and c.rope_base == p.rope_base
    if c.gpt_oss:
        assert c.sliding_window == 128 and c.local_layers == (True, False) and c.yarn[:2] == (32.0, 4096)
    else:
        assert c.qk_norm and not c.qkv_bias and not c.yarn and not c.shared_expert
    plan = {n: (shape, t) for n, shape, t, _ in tensor_plan(p)}
    assert set(m.tensors) == set(plan) and set(required_tensors(c)) == set(plan)
    for n, (shape, t) in plan.items():
        assert (m[n].shape, m[n].qtype) == (shape, t), n
    for n in ("token_embd.weight", "blk.1.attn_v.weight", "blk.1.ffn_down_exps.weight", "blk.0.ffn_gate_inp.weight"):
        x = m[n].dequantize()
        assert np.isfinite(x).all() and 0 < x.std() < 10, n
    assert m.metadata["tokenizer.ggml.model"] == "gpt2"
    assert m.metadata["tokenizer.ggml.bos_token_id"] == p.bos and m.metadata["tokenizer.ggml.eos_token_id"] == p.eos


def test_scaled_qwen_tokenizer_round_trips(files):
    from cukern.models.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(load_gguf(files["qwen3-30b-a3b"]))
    ids = tok.encode("Synthetic weights, real shapes: 12 GB!")
    assert tok.decode(ids) == "Synthetic weights, real shapes: 12 GB!" and max(ids) < 4096


@pytest.mark.parametrize("name", NAMES)
def test_synthetic_vocab_is_well_formed(name):
    """Full size: unique tokens, the control tokens at their ids, a merge for every multi-character token."""
    p = PRESETS[name]
    tokens, types, merges = synthetic_vocab(p)
    assert len(tokens) == len(set(tokens)) == len(types) == p.vocab
    assert all(tokens[i] == t and types[i] == 3 for i, t in p.specials.items())
    assert len(merges) == p.vocab - 256 - len(p.specials)
    ids = set(tokens)
    assert all(a in ids and b in ids and a + b in ids for a, b in (m.split(" ") for m in merges[::997]))


@pytest.mark.parametrize("qtype,cols", [(QT.Q8_0, 2880), (QT.MXFP4, 2880), (QT.Q4_K, 2048), (QT.Q6_K, 768)])
def test_fast_blocks_have_the_scale_asked(qtype, cols, rng):
    import gguf
    x = gguf.quants.dequantize(fast_blocks(rng, 37, cols, qtype, 1 / np.sqrt(cols)), qtype)
    assert x.shape == (37, cols) and np.isfinite(x).all()
    assert 0.3 < x.std() * np.sqrt(cols) < 2.0


def test_bad_preset_names_and_scales(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown synthetic preset 'gpt-oss-120b'.*gpt-oss-20b"):
        preset("gpt-oss-120b")
    with pytest.raises(ValueError, match="no room for the byte tokens"):
        scaled(PRESETS["gpt-oss-20b"], vocab=1000)
    with pytest.raises(SystemExit):
        main(["llama-7b", str(tmp_path / "x.gguf")])
    assert "unknown synthetic preset" in capsys.readouterr().err and not (tmp_path / "x.gguf").exists()


def test_cli_writes_a_scaled_file(tmp_path):
    path = tmp_path / "q.gguf"
    assert main(["qwen3-30b-a3b", str(path), "--layers", "1", "--experts", "8", "--vocab", "2048"]) == 0
    m = load_gguf(path)
    assert (m.config.n_layers, m.config.n_experts, m.config.vocab_size) == (1, 8, 2048)
    assert m["blk.0.ffn_down_exps.weight"].qtype == QT.Q6_K   # layer 0 of 1 gets more bits


@pytest.mark.parametrize("name", NAMES)
def test_scaled_file_passes_every_dispatch_check_without_gpu(files, name, monkeypatch):
    """The real MoeTransformer on host-backed arrays with launches recorded (tests/host_dispatch.py): the
    full-size matrices (d_model 2880 / 2048, MXFP4 / Q4_K / Q6_K experts, head dims 64 / 128) pass every
    family's checks for 16-row prompt chunks (grouped experts, GEMM projections), a 5-row prompt and
    batch-2 graph decode."""
    from host_dispatch import patch
    from test_models_moe import _host_yarn

    from cukern.dmmv import DmmvDispatch
    from cukern.models.transformer import Transformer
    launches = patch(monkeypatch)
    monkeypatch.setattr(DmmvDispatch, "check_errors", lambda self, reset=True: None)
    m = load_gguf(files[name])
    if m.config.yarn:
        _host_yarn(monkeypatch)
    lm = Transformer(m, max_seqs=2, max_tokens=64, prefill_chunk=16)
    lm.generate([list(range(3, 40)), list(range(3, 8))], 2)
    names = {k.split("<")[0] for k in launches}
    assert {"router_matvec", "moe_dmmv", "moe_down", "moe_route_pack"} <= names
    assert "moe_dmmv_packed" in names or "moe_gemm_f16" in names   # a chunk's experts: matvecs or grouped GEMMs


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_gpu_scaled_file_runs_the_moe_forward(files, name, rng):
    """A 2-layer scaled file through MoeTransformer: a prompt's last logits and four greedy decode steps,
    finite, no routing error flagged."""
    import cupy

    from cukern.models.moe_transformer import MoeTransformer
    from cukern.models.transformer import Transformer
    m = load_gguf(files[name])
    m.upload(progress=False)
    lm = Transformer(m, max_seqs=2, max_tokens=256, prefill_chunk=64)
    assert isinstance(lm, MoeTransformer)
    prompt = rng.integers(0, m.config.vocab_size, size=40).tolist()
    logits = cupy.full(m.config.vocab_size, np.nan, cupy.float32)
    lm.prefill(prompt, lm.cache.add(0), logits)
    lm.check_errors()
    assert bool(cupy.isfinite(logits).all())
    for s in lm.cache.alloc.active_slots():
        lm.cache.free(s)
    out, stats = lm.generate([prompt, prompt[:7]], 4)
    assert [len(o) for o in out] == [4, 4] and all(0 <= t < m.config.vocab_size for o in out for t in o)
    assert bool(cupy.isfinite(lm._dec["logits"]).all())


# ----------------------------------------------------------------------------- profiling/bench_models.py

def _bench_models():
    import importlib.util

    from cukern import workbench
    path = workbench.bench_scripts(["models"])["models"]
    spec = importlib.util.spec_from_file_location("cukern_profiling_bench_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_counts_the_active_experts_bytes():
    """A step reads the dense matrices once and, of each expert tensor, the share of the experts its batch
    routes to: k/E at batch 1, E (1 - (1 - k/E)^B) / E at batch B."""
    from types import SimpleNamespace as NS
    bm = _bench_models()
    assert bm.expected_experts(32, 4, 1) == pytest.approx(4) and bm.expected_experts(32, 4, 8) == pytest.approx(
        32 * (1 - 0.875 ** 8))
    assert bm.expected_experts(128, 8, 10_000) == pytest.approx(128)

    def w(n):
        return NS(nbytes=n)

    moe = NS(router=w(7), gate=w(3200), up=w(3200), down=w(1600), gate_bias=None, up_bias=None, down_bias=w(320))
    layer = NS(wq=w(10), wk=w(20), wv=w(30), wo=w(40), moe=moe)
    lm = NS(cfg=NS(n_experts=32, n_experts_used=4), head=w(1000), layers=[layer, layer])
    dense = 1000 + 2 * (100 + 7)
    assert bm.active_weight_bytes(lm, 1) == dense + round(2 * 8320 * 4 / 32)
    assert bm.active_weight_bytes(lm, 8) == dense + round(2 * 8320 * bm.expected_experts(32, 4, 8) / 32)


def test_bench_synthetic_option(tmp_path):
    """--synthetic names are checked before anything runs; a file already written is reused."""
    bm = _bench_models()
    assert bm._names("gpt-oss-20b,qwen3-30b-a3b") == ("gpt-oss-20b", "qwen3-30b-a3b") and bm._names(None) == ()
    with pytest.raises(ValueError, match="unknown synthetic preset"):
        bm._names("gpt-oss-20b,qwen3-235b")
    (tmp_path / "gpt-oss-20b.gguf").write_bytes(b"kept")
    assert bm.synthetic_file("gpt-oss-20b", str(tmp_path)) == str(tmp_path / "gpt-oss-20b.gguf")
    assert (tmp_path / "gpt-oss-20b.gguf").read_bytes() == b"kept"
