"""The MoE models (qwen3moe, its shared-expert variant, qwen2moe, gpt-oss): GGUF metadata and bad files,
the float64 reference, the forward's orchestration on NumPy fakes and through the real dispatch checks
(CPU), and the GPU forward against the reference.

gpt-oss on the GPU needs the RoPE methods' YaRN arguments (``freqs``, ``attn_scale``) and
``cukern.elementwise.rope.yarn_freqs``: its GPU tests skip, saying so, where those are missing.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from cukern.models.gguf_loader import GGUFError, load_gguf, required_tensors
from cukern.models.moe_config import yarn_inv_freq
from cukern.models.tiny import write_tiny_gguf
from cukern.models.tiny_moe import MOE_PRESETS, MoeTinySpec
from cukern.reference.models import ReferenceModel
from cukern.reference.models_moe import MoeReferenceModel, route

MOE = tuple(MOE_PRESETS)
gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_moe")
    return {k: write_tiny_gguf(d / f"{k}.gguf", make(), seed=20 + i) for i, (k, make) in enumerate(MOE_PRESETS.items())}


# ----------------------------------------------------------------------------- metadata

@pytest.mark.parametrize("name", MOE)
def test_loader_reads_moe_config(tiny_moe, name):
    m = load_gguf(tiny_moe[name])
    c = m.config
    spec = MOE_PRESETS[name]()
    assert (c.n_experts, c.n_experts_used, c.d_ff, c.d_ff_shexp) == (spec.n_experts, spec.top_k, 256, spec.d_ff_shexp)
    assert c.shared_expert == (spec.d_ff_shexp > 0) and c.norm_topk == (c.arch != "qwen2moe")
    assert c.qk_norm == (c.arch == "qwen3moe") and c.qkv_bias == (c.arch != "qwen3moe")
    assert set(required_tensors(c)) <= set(m.tensors)
    gate = m["blk.1.ffn_gate_exps.weight"]
    assert gate.shape == (c.n_experts, 256, 256) and m["blk.1.ffn_down_exps.weight"].shape == (c.n_experts, 256, 256)
    assert gate.qtype == (QT.MXFP4 if c.gpt_oss else QT.Q4_K)
    assert m["blk.0.ffn_down_exps.weight"].qtype == (QT.MXFP4 if c.gpt_oss else QT.Q8_0)
    assert np.isfinite(gate.dequantize()).all()
    if c.gpt_oss:
        assert c.sliding_window == 8 and c.local_layers == (True, False) and c.q_dim == 512 != c.d_model
        assert c.yarn[:2] == (32.0, 4096) and c.rope_mscale == pytest.approx(1 + 0.1 * np.log(32))
        assert m["blk.0.attn_sinks.weight"].shape == (8,) and m["blk.0.ffn_down_exps.bias"].shape == (32, 256)
    else:
        assert c.sliding_window == 0 and not any(c.local_layers) and not c.yarn


def test_yarn_angles_follow_ggml():
    """Without scaling (factor 1) the angles are base**(-2i/d); with it the fast pairs keep theirs, the
    slow ones are divided by the factor, a ramp mixes those between, and mscale is 1 + 0.1 ln factor."""
    d, base = 64, 150000.0
    plain = base ** (-np.arange(0, d, 2) / d)
    inv, mscale = yarn_inv_freq(d, base, 1.0, 4096)
    np.testing.assert_allclose(inv, plain) and mscale == 1.0
    inv, mscale = yarn_inv_freq(d, base, 32.0, 4096)
    assert inv[0] == plain[0] and inv[-1] == pytest.approx(plain[-1] / 32)
    ratio = inv / plain
    assert (np.diff(ratio) <= 1e-15).all() and mscale == pytest.approx(1.3465735902799727)
    assert yarn_inv_freq(d, base, 32.0, 4096, ext_factor=0.0)[1] == 1.0


def test_window_pattern_from_the_file(tmp_path):
    p = write_tiny_gguf(tmp_path / "p.gguf", MOE_PRESETS["gpt-oss"](n_layers=3, window_pattern=[False, True, True]))
    assert load_gguf(p).config.local_layers == (False, True, True)
    p = write_tiny_gguf(tmp_path / "p3.gguf", MOE_PRESETS["gpt-oss"](n_layers=3, window_pattern=3))
    assert load_gguf(p).config.local_layers == (True, True, False)


# ----------------------------------------------------------------------------- bad files

def _rewrite(src, dst, *, drop_key=None, set_key=None, drop=None, retype=None):
    """Copy a GGUF without key ``drop_key`` / tensor ``drop``, with ``set_key = (key, value, type)``, or
    with tensor ``retype`` stored as Q8_0."""
    import gguf
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k in ("general.architecture", drop_key) or (set_key and k == set_key[0]):
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(k, f.contents())
        else:
            w.add_key_value(k, f.contents(), f.types[0])
    if set_key:
        w.add_key_value(*set_key)
    for t in r.tensors:
        if t.name == drop:
            continue
        raw = None if t.tensor_type in (QT.F32, QT.F16) else t.tensor_type
        data = np.asarray(t.data)
        if t.name == retype:
            data, raw = gguf.quants.quantize(np.asarray(t.data, np.float32), QT.Q8_0), QT.Q8_0
        w.add_tensor(t.name, data, raw_dtype=raw)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return dst


def test_rejects_missing_or_bad_expert_counts(tiny_moe, tmp_path):
    import gguf
    u32 = gguf.GGUFValueType.UINT32
    p = _rewrite(tiny_moe["qwen3moe"], tmp_path / "nocount.gguf", drop_key="qwen3moe.expert_count")
    with pytest.raises(GGUFError, match=r"nocount\.gguf: missing metadata key 'qwen3moe\.expert_count'"):
        load_gguf(p)
    p = _rewrite(tiny_moe["qwen3moe"], tmp_path / "many.gguf", set_key=("qwen3moe.expert_count", 5000, u32))
    with pytest.raises(GGUFError, match=r"many\.gguf: metadata key 'qwen3moe\.expert_count'.*5000.*at most 1023"):
        load_gguf(p)
    p = _rewrite(tiny_moe["gpt-oss"], tmp_path / "used.gguf", set_key=("gpt-oss.expert_used_count", 33, u32))
    with pytest.raises(GGUFError, match=r"used\.gguf: metadata key 'gpt-oss\.expert_used_count'.*expert_count = 32"):
        load_gguf(p)
    p = _rewrite(tiny_moe["qwen2moe"], tmp_path / "noshff.gguf", drop_key="qwen2moe.expert_shared_feed_forward_length")
    with pytest.raises(GGUFError, match=r"noshff\.gguf: missing metadata key 'qwen2moe\.expert_shared_feed_forward"):
        load_gguf(p)


@pytest.mark.parametrize("name,tensor", [("qwen3moe", "blk.1.ffn_gate_inp.weight"),
                                         ("qwen3moe", "blk.0.ffn_down_exps.weight"),
                                         ("gpt-oss", "blk.1.ffn_up_exps.bias"), ("gpt-oss", "blk.0.attn_sinks.weight"),
                                         ("qwen2moe", "blk.1.ffn_up_shexp.weight")])
def test_rejects_missing_router_or_expert_tensor(tiny_moe, tmp_path, name, tensor):
    p = _rewrite(tiny_moe[name], tmp_path / "hole.gguf", drop=tensor)
    with pytest.raises(GGUFError, match=rf"hole\.gguf: missing tensor '{tensor}'"):
        load_gguf(p)


def test_rejects_quantized_router_and_wrong_expert_shape(tiny_moe, tmp_path):
    p = _rewrite(tiny_moe["qwen3moe"], tmp_path / "qrouter.gguf", retype="blk.0.ffn_gate_inp.weight")
    with pytest.raises(GGUFError, match=r"qrouter\.gguf: tensor 'blk\.0\.ffn_gate_inp\.weight' has unsupported "
                                        r"type Q8_0 \(supported: F32\)"):
        load_gguf(p)
    p = write_tiny_gguf(tmp_path / "shape.gguf", MOE_PRESETS["qwen3moe"](), seed=1)
    import gguf
    p2 = _rewrite(p, tmp_path / "shape2.gguf", set_key=("qwen3moe.expert_count", 8, gguf.GGUFValueType.UINT32))
    with pytest.raises(GGUFError, match=r"shape2\.gguf: tensor 'blk\.0\.ffn_gate_inp\.weight' has shape \(16, 256\), "
                                        r"expected \(8, 256\)"):
        load_gguf(p2)


def test_rejects_window_pattern_not_matching_layers(tmp_path):
    p = write_tiny_gguf(tmp_path / "pat.gguf", MOE_PRESETS["gpt-oss"](window_pattern=[True, False, True]))
    with pytest.raises(GGUFError, match=r"pat\.gguf: metadata key 'gpt-oss\.attention\.sliding_window_pattern' has "
                                        r"3 entries, the model has 2 layers"):
        load_gguf(p)
    p = write_tiny_gguf(tmp_path / "pat5.gguf", MOE_PRESETS["gpt-oss"](window_pattern=5))
    with pytest.raises(GGUFError, match=r"pat5\.gguf: .*sliding_window_pattern' is 5, beyond the model's 2 layers"):
        load_gguf(p)


# ----------------------------------------------------------------------------- reference

@pytest.mark.parametrize("name", MOE)
def test_reference_decode_matches_prefill(tiny_moe, name, rng):
    """Token-by-token decode through the KV cache gives one whole-prompt pass's logits (the dense models' test)."""
    from test_models import test_reference_decode_matches_prefill as dense_test
    m = load_gguf(tiny_moe[name])
    assert isinstance(ReferenceModel(m.config, m.tensors), MoeReferenceModel)
    dense_test(tiny_moe, name, rng)


def test_reference_routing():
    """softmax -> top-k (ties: lower id) -> renormalised equals a softmax over the k selected logits."""
    logits = np.array([[0.5, 2.0, 2.0, -1.0, 1.0]])
    ids, w = route(logits, 3, renorm=True)
    assert ids.tolist() == [[1, 2, 4]]
    sel = np.exp(logits[0, [1, 2, 4]])
    np.testing.assert_allclose(w[0], sel / sel.sum())
    _, w = route(logits, 3, renorm=False)
    np.testing.assert_allclose(w[0], sel / np.exp(logits[0]).sum())


def test_reference_gpt_oss_window_and_sinks(tmp_path, rng):
    """gpt-oss with every layer local: a token before every query's window changes nothing after it."""
    p = write_tiny_gguf(tmp_path / "local.gguf", MOE_PRESETS["gpt-oss"](n_layers=1, window_pattern=[True]), seed=4)
    m = load_gguf(p)
    ref = ReferenceModel(m.config, m.tensors)
    a = rng.integers(0, m.config.vocab_size, size=14)
    b = a.copy()
    b[2] = (a[2] + 1) % m.config.vocab_size
    la, lb = ref.forward(a), (ref.reset(), ref.forward(b))[1]
    np.testing.assert_allclose(la[10:], lb[10:], rtol=1e-12, atol=1e-12)
    assert np.abs(la[2:10] - lb[2:10]).max() > 1e-3


# ----------------------------------------------------------------------------- orchestration (CPU)

@pytest.mark.parametrize("name,chunk", [(n, c) for n in MOE for c in (5, 16)])
def test_moe_orchestration_on_numpy_fakes(tiny_moe, name, chunk, rng, monkeypatch):
    """MoeTransformer's control flow on NumPy fakes (tests/model_fakes_moe.py): three prompts of 29, 3 and
    11 tokens decode together through a replayed "graph" and give the float64 reference's greedy tokens;
    chunks of 5 rows run the per-slot expert matvecs, of 16 the expert-grouped ones over a route packed
    from the same ids; decode steps run per slot."""
    from model_fakes_moe import fake_moe_transformer
    m = load_gguf(tiny_moe[name])
    t = fake_moe_transformer(m, monkeypatch, max_seqs=3, max_tokens=48, page_size=4, prefill_chunk=chunk)
    prompts = [rng.integers(0, m.config.vocab_size, size=n).tolist() for n in (29, 3, 11)]
    out, stats = t.generate(prompts, 7)
    assert stats.decode_tokens == 5 * 3 and t._dec["graph"].replays == 5
    calls = t.mm.calls
    assert calls.get("moe_dmmv", 0) > 0 and calls.get("moe_down", 0) > 0
    assert (calls.get("moe_dmmv_packed", 0) > 0) == (chunk > 8) == (calls.get("moe_route_pack", 0) > 0)
    ref = ReferenceModel(m.config, m.tensors)
    for p, o in zip(prompts, out):
        assert o == ref.generate(p, 7)


def test_moe_routing_error_is_raised_after_generate(tiny_moe, monkeypatch):
    """An expert id out of range (the router's ids overwritten) sets the flag; generate raises MoeRoutingError
    naming the file (models_helpers.check_routing_error)."""
    from model_fakes_moe import fake_moe_transformer
    from models_helpers import check_routing_error
    m = load_gguf(tiny_moe["qwen3moe"])
    t = fake_moe_transformer(m, monkeypatch, max_seqs=1, max_tokens=32, page_size=4, prefill_chunk=8)
    check_routing_error(t, m.config.n_experts, r"qwen3moe\.gguf")


def _host_yarn(monkeypatch):
    """Stand-ins for the RoPE methods' YaRN arguments where this tree lacks them (host checks only)."""
    import cukern.elementwise.rope as rope
    from cukern.elementwise import ElementwiseDispatch
    if not hasattr(rope, "yarn_freqs"):
        monkeypatch.setattr(rope, "yarn_freqs", lambda d, **kw: (yarn_inv_freq(d, **kw)[0].astype(np.float32),
                                                                 yarn_inv_freq(d, **kw)[1]), raising=False)
    real = ElementwiseDispatch.qk_norm_rope_kv_write
    if "attn_scale" not in inspect.signature(real).parameters:
        def drop(self, *a, attn_scale=1.0, **kw):
            assert isinstance(attn_scale, float) and attn_scale > 1.0
            return real(self, *a, **kw)
        monkeypatch.setattr(ElementwiseDispatch, "qk_norm_rope_kv_write", drop)


@pytest.mark.parametrize("name", MOE)
def test_moe_forward_passes_every_dispatch_check_without_gpu(tiny_moe, name, monkeypatch):
    """The real MoeTransformer on host-backed arrays with launches recorded (tests/host_dispatch.py): every
    dispatch it makes passes its family's validation for chunks through the per-slot and the grouped
    expert paths, both KV dtypes, a batch of three, eager and graph decode."""
    from host_dispatch import patch
    from cukern.dmmv import DmmvDispatch
    from cukern.models.moe_transformer import MoeTransformer
    from cukern.models.transformer import Transformer
    launches = patch(monkeypatch)
    monkeypatch.setattr(DmmvDispatch, "check_errors", lambda self, reset=True: None)
    m = load_gguf(tiny_moe[name])
    if m.config.yarn:
        _host_yarn(monkeypatch)   # the other archs must run without the YaRN arguments
    for kv, chunk in (("float16", 5), ("float32", 16), ("float16", 16)):
        lm = Transformer(m, max_seqs=3, max_tokens=64, page_size=4, kv_dtype=kv, prefill_chunk=chunk)
        assert isinstance(lm, MoeTransformer)
        prompts = [list(range(5, 5 + n)) for n in (29, 3, 11)]
        lm.generate(prompts, 4)
        lm.generate(prompts[1:], 3, use_graph=False)
    names = {k.split("<")[0] for k in launches}
    assert {"router_matvec", "moe_dmmv", "moe_down", "moe_route_pack", "moe_dmmv_packed", "moe_weighted_sum"} <= names
    assert any(k.startswith("softmax_topk") for k in launches), names
    c = m.config
    if c.gpt_oss:   # MXFP4 gate and up apart (the biases between), the F32 bias matrices
        assert {"moe_dmmv<39, false>", "moe_dmmv_packed<39, false>", "moe_down<39>", "moe_dmmv<0, false>",
                "moe_down<0>"} <= set(launches)
    else:           # Q4_K gate and up fused with SiLU, Q8_0 down
        assert {"moe_dmmv<12, true>", "moe_dmmv_packed<12, true>", "moe_down<8>", "moe_dmmv_packed<8, false>"} \
            <= set(launches)
    if c.shared_expert:
        assert any(k.startswith("shared_expert_accumulate") for k in launches), names


# ----------------------------------------------------------------------------- GPU

def _needs_yarn(name):
    """gpt-oss runs YaRN through the RoPE methods' freqs / attn_scale and rope.yarn_freqs."""
    if MOE_PRESETS[name]().arch != "gpt-oss":
        return
    import cukern.elementwise.rope as rope
    from cukern.elementwise import ElementwiseDispatch
    if not hasattr(rope, "yarn_freqs") or \
            "attn_scale" not in inspect.signature(ElementwiseDispatch.qk_norm_rope_kv_write).parameters:
        pytest.skip("gpt-oss needs cukern.elementwise.rope.yarn_freqs and the RoPE methods' attn_scale (YaRN)")


def _model(path, **kw):
    from test_models import _transformer   # the dense models' GPU helpers (tests/ is on sys.path)
    return _transformer(path, **{"max_seqs": 8, **kw})


def _teacher_forced(m, prompt, got, last_logits, tol=1e-3):
    from test_models import _check_greedy_against_reference
    return _check_greedy_against_reference(m, prompt, got, last_logits, tol=tol)


@gpu
@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("kv_dtype,chunk,bound", [("float32", 5, 1e-9), ("float16", 5, 1e-5), ("float32", 16, 1e-3)])
def test_gpu_moe_forward_matches_reference(tiny_moe, name, kv_dtype, chunk, bound, rng):
    """Prefill of 29 tokens (past gpt-oss's window of 8) in chunks, then 10 greedy decode steps (steps
    2... graph replays), against the float64 reference: last-prompt-token logits NMSE and the teacher-
    forced continuation. Chunks of 5 rows: per-slot expert matvecs (f32 activations); of 16: the grouped
    expert GEMMs and the attention GEMMs (activations rounded to f16). Rounding there can flip a near-tied
    top-k expert of a token, which moves the logits by ~1e-4 NMSE (gpt-oss's tiny model: 1.4e-4 on the one
    prompt of 17 whose closest k-th / (k+1)-th router logits differ by 2.5e-4; 1.3e-7 to 3e-7 on the
    others); a wrong kernel moves them by > 1e-2."""
    import cupy
    from cukern.testing import nmse
    _needs_yarn(name)
    m, model = _model(tiny_moe[name], kv_dtype=kv_dtype, prefill_chunk=chunk)
    prompt = rng.integers(0, m.config.vocab_size, size=29).tolist()
    slot = model.cache.add(0)
    logits = cupy.full(m.config.vocab_size, np.nan, cupy.float32)
    model.prefill(prompt, slot, logits)
    model.check_errors()
    assert nmse(logits, ReferenceModel(m.config, m.tensors).forward(prompt)[-1]) < bound
    model.cache.free(slot)
    out, stats = model.generate([prompt], 10)
    assert len(out[0]) == 10 and stats.graph and stats.decode_tokens == 8
    assert _teacher_forced(m, prompt, out[0], model._dec["logits"][0].get()) < bound


@gpu
@pytest.mark.parametrize("name", MOE)
def test_gpu_moe_batch8_matches_reference(tiny_moe, name, rng):
    """Eight sequences of different lengths decode together (8 rows: the per-slot expert path with 8
    tokens' slots in one launch); each continuation is the reference's, teacher-forced; graph and eager
    decode give the same tokens."""
    _needs_yarn(name)
    m, model = _model(tiny_moe[name], prefill_chunk=8)
    prompts = [rng.integers(0, m.config.vocab_size, size=n).tolist() for n in (3, 11, 6, 17, 1, 9, 12, 5)]
    batch, stats = model.generate(prompts, 8)
    assert stats.decode_tokens == 6 * 8
    last = model._dec["logits"].get()
    for b, (p, out) in enumerate(zip(prompts, batch)):
        assert _teacher_forced(m, p, out, last[b]) < 1e-5
    assert model.generate(prompts, 8, use_graph=False)[0] == batch


@gpu
def test_gpu_moe_grouped_and_slot_paths_agree(tiny_moe, rng):
    """One 24-token prompt as a single chunk (grouped experts over the route; the attention projections on
    the GEMM, activations rounded to f16) and as chunks of 8 (per-slot experts, every matvec in f32):
    the same last logits up to that rounding (f32 cache both times)."""
    import cupy
    from cukern.testing import nmse
    m = load_gguf(tiny_moe["qwen3moe-shexp"])
    prompt = rng.integers(0, m.config.vocab_size, size=24).tolist()
    got = []
    for chunk in (24, 8):
        _, model = _model(tiny_moe["qwen3moe-shexp"], kv_dtype="float32", prefill_chunk=chunk)
        out = cupy.full(m.config.vocab_size, np.nan, cupy.float32)
        model.prefill(prompt, model.cache.add(0), out)
        got.append(out.get())
    assert nmse(got[0], got[1]) < 1e-4


@gpu
def test_gpu_moe_routing_error_flag(tiny_moe):
    """Expert ids out of range (written over the router's) reach the kernels: generate raises
    MoeRoutingError naming the file, and the next generate runs clean."""
    from models_helpers import check_routing_error
    m, model = _model(tiny_moe["qwen3moe"], max_seqs=1)
    check_routing_error(model, m.config.n_experts, r"qwen3moe\.gguf")
