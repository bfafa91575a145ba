"""cukern.models: NumPy reference forward, GPU forward, the generate CLI and the orchestration on NumPy fakes.

CPU tests write tiny random-weight GGUF files with gguf.GGUFWriter (cukern.models.tiny).
Tests of the real model (Gemma 3 270M Q4_K_M) skip unless the ``model`` extra is installed;
comparisons with Hugging Face skip unless ``transformers`` is importable.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from cukern.models.gguf_loader import load_gguf
from cukern.models.tiny import TinySpec, write_tiny_gguf
from cukern.models.tokenizer import Tokenizer
from cukern.reference.models import ReferenceModel
from models_helpers import ARCHS, ROPE_VARIANTS, real_model_path


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
    ref.reset()
    np.testing.assert_allclose(ref.forward(tokens, last=3), full[-3:], rtol=1e-12, atol=1e-12)


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
    identical = 0
    for text in PROMPTS + [long_prompt()]:
        ids = tok.encode(text)
        out = model.generate([ids], 16)[0][0]
        ref.reset()
        logits = ref.forward(ids + out[:-1], last=len(out))
        for step, t in enumerate(out):
            gap = logits[step].max() - logits[step, t]
            assert gap <= 2e-3 * np.abs(logits[step]).max(), (text[:30], step, gap)
        err = nmse(model._dec["logits"][0].get(), logits[-1])
        assert err < 1e-4
        same = out == [int(np.argmax(row)) for row in logits]
        identical += same
        print(f"{len(ids):4d} tokens: nmse {err:.1e}, identical {same}: {tok.decode(out)!r}", flush=True)
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
