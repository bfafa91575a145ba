"""The GPU forward pass of the decoder-only models cukern runs, from cukern dispatches only.

:class:`Transformer` holds a model's weights (raw GGUF blocks in one device arena), a
:class:`cukern.attention.PagedKVCache`, and the dispatches of four families:

* ``tokens``: embedding gather by device-side ids, sampling, position advance;
* ``dmmv``: every projection of a decode step (quantized matvec, 1 to 8 columns);
* ``matmul``: the projections of a prompt chunk (tiled GEMM on tensor cores: weights dequantized
  to f16 in shared memory, activations rounded to f16, f32 accumulation), for chunks of more than
  8 rows and the block types it has (F32/F16/BF16 weights fall back to the batched matvec); with
  ``pack_prefill`` (Hopper), chunks of ``MatmulDispatch.WG_MIN_N`` rows or more on copies of the
  weights packed once at load (``MatmulDispatch.pack`` / ``pack_glu``);
* ``elementwise``: RMS norms and their residual fusions, per-head Q/K norm + RoPE + KV-cache
  write in one launch, GEGLU / SwiGLU, biases;
* ``attention``: batched causal attention over the paged cache (prefill) and split-KV decode.

One layer, in launch order (Gemma 3; Llama-family differences in brackets)::

    q, k, v   = Wq h, Wk h, Wv h                       dmmv (pair)       [+ bias: Qwen2]
    q', cache = rope(norm(q)), rope(norm(k)), v         qk_norm_rope_kv_write   [no norm: Llama, Qwen2]
    o         = attention(q', cache)                    flash_attn_batched / flash_attn_decode
    x, h      = x + norm(Wo o), norm(x)                 dmmv, post_norm_residual_rms_norm  [residual_rms_norm]
    a         = gelu(Wg h) * (Wu h)                     dmmv_glu          [silu]
    x, h      = x + norm(Wd a), norm_next(x)            dmmv, post_norm_residual_rms_norm  [residual_rms_norm]

A decode step of one sequence folds each ``x, h`` line into the matvecs after it (``NormedX``: every
block makes h from x and the sub-layer output, the first writes the new x into the other residual
buffer), runs q, k and v as one launch (``dmmv_three``) and reads the LM head from its split Q8_0
copy: seven launches a layer.

A decode step (embed, every layer, LM head, sample, advance) reads its token ids, positions and
sequence lengths from device buffers and writes the next ids back, so it is captured once as a
CUDA graph (:func:`cukern.streams.capture_graph`) and replayed per token with no host round trip.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import cupy
import numpy as np

from cukern.attention import PREFILL_HEAD_DIMS, AttentionDispatch, PagedKVCache
from cukern.dispatch import bounded_put, check_array, check_int
from cukern.dmmv import DmmvDispatch, QWeight
from cukern.elementwise import ROPE_VEC_HEAD_DIMS, ElementwiseDispatch
from cukern.matmul import GEMM_QTYPES, MatmulDispatch
from cukern.models.gguf_loader import GGUFModel, ModelConfig, load_gguf
from cukern.models.layers import Layers
from cukern.streams import capture_graph, resolve_stream
from cukern.tokens import MAX_TOP_K, SamplePlan, TokensDispatch, check_sampling

__all__ = ["Transformer", "GenerationStats"]


def _to_device(dst: cupy.ndarray, values: np.ndarray, stream) -> None:
    """The host-to-device copies of generate() (a sequence's length), on ``stream``."""
    dst.set(values, stream=stream)


def _address(a: cupy.ndarray) -> int:
    """The device address of a's data (what a captured graph holds on to)."""
    return a.data.ptr


def _to_host(a: cupy.ndarray, stream) -> np.ndarray:
    """The device-to-host reads of generate() (sampled ids): they synchronise ``stream``."""
    return a.get(stream=stream)


@dataclass
class _Layer:
    attn_norm: cupy.ndarray
    wq: QWeight
    wk: QWeight
    wv: QWeight
    wo: QWeight
    ffn_norm: cupy.ndarray
    wg: QWeight
    wu: QWeight
    wd: QWeight
    q_norm: cupy.ndarray | None = None
    k_norm: cupy.ndarray | None = None
    bq: cupy.ndarray | None = None
    bk: cupy.ndarray | None = None
    bv: cupy.ndarray | None = None
    post_attn_norm: cupy.ndarray | None = None
    post_ffn_norm: cupy.ndarray | None = None
    packed: dict = field(default_factory=dict)  # pack_prefill: "wq" ... "wd" -> PackedWeight, "glu" (gate + up)
    padded: dict = field(default_factory=dict)  # "wq" ... "wd" -> a copy with 16-byte rows for the prompt GEMMs

    @property
    def gate_up_alike(self) -> bool:
        """The gate and up matrices have one type and shape: the fused GLU kernels take them as a pair."""
        return (self.wg.qtype, self.wg.m, self.wg.k) == (self.wu.qtype, self.wu.m, self.wu.k)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    graph: bool = False

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


class _Buffers:
    """Activations of n rows (a prompt chunk, or one token per sequence of a decode batch); the rotated
    queries and the attention output in ``attn_dtype`` (f32, or a prompt chunk's f16 for the
    tensor-core prefill attention)."""

    def __init__(self, cfg: ModelConfig, n: int, attn_dtype=np.float32):
        f = cupy.float32
        self.n = n
        self.x = cupy.empty((n, cfg.d_model), f)         # residual stream
        self.x2 = cupy.empty((n, cfg.d_model), f)        # the matvec path's other residual buffer (NormedX)
        self.h = cupy.empty((n, cfg.d_model), f)         # normed input of the next projection
        self.q = cupy.empty((n, cfg.q_dim), f)
        self.k = cupy.empty((n, cfg.kv_dim), f)
        self.v = cupy.empty((n, cfg.kv_dim), f)
        self.q_rot = cupy.empty((n, cfg.n_heads, cfg.head_dim), attn_dtype)
        self.o = cupy.empty((n, cfg.n_heads, cfg.head_dim), attn_dtype)
        self.proj = cupy.empty((n, cfg.d_model), f)      # attention / FFN output before its norm
        self.gate = cupy.empty((n, cfg.d_ff), f)
        self.up = cupy.empty((n, cfg.d_ff), f)
        # the views the layers launch on, made once: q, k, v by head; the attention output as rows
        self.q3 = self.q.reshape(n, cfg.n_heads, cfg.head_dim)
        self.k3 = self.k.reshape(n, cfg.n_kv_heads, cfg.head_dim)
        self.v3 = self.v.reshape(n, cfg.n_kv_heads, cfg.head_dim)
        self.o2 = self.o.reshape(n, cfg.q_dim)
        self.normed = None  # Layers._normed_inputs: the NormedX inputs of every layer on these buffers


class _Chunk:
    """The device state of one prompt-chunk length n: its activations, an int32 upload ``args`` of
    [ids (n) | first position] and the attention plan of one sequence's n last tokens (whose slot is
    uploaded into the plan's ``seq_ids``), which every launch of the chunk reads; and per output (the
    LM head's ``logits_out`` on a prompt's last chunk, or none) the CUDA graph of the chunk's
    launches, captured the second time that output is asked for (the first run, eager, compiles and
    warms every kernel and the GEMMs' kept launches)."""

    def __init__(self, lm: "Transformer", n: int, slot: int):
        self.n = n
        self.buf = _Buffers(lm.cfg, n, lm._chunk_attn_dtype(n))
        self.args = cupy.empty(n + 1, cupy.int32)
        self.ids, self.pos = self.args[:n], self.args[n:]
        self.plan = lm.attn.plan_batched(lm.cache, [slot], [n])
        self.graphs: dict = {}  # logits_out pointer (or None) -> 1 after the eager run, then the Graph

    def run(self, lm: "Transformer", part: np.ndarray, pos0: int, slot: int, logits_out, stream) -> None:
        host = np.empty(self.n + 1, np.int32)
        host[:self.n], host[self.n] = part, pos0
        _to_device(self.args, host, stream)
        _to_device(self.plan.seq_ids, np.array([slot], np.int32), stream)
        key = None if logits_out is None else _address(logits_out)
        seen = self.graphs.get(key, 0)
        if seen == 0:
            self.graphs[key] = 1
            with stream:
                self.launch(lm, logits_out, stream)
            return
        if seen == 1:
            seen = self.graphs[key] = capture_graph(lambda s: self.launch(lm, logits_out, s), stream=stream)
        seen.replay(stream)

    def launch(self, lm: "Transformer", logits_out, stream) -> None:
        """The chunk's launches: embed, every layer, and the LM head on its last row where asked."""
        c, buf, n = lm.cfg, self.buf, self.n
        def attend(i, q_rot, o):
            lm.attn.flash_attn_batched(self.plan, i, q_rot, o, causal=True, scale=c.attn_scale,
                                       window_left=lm._window(i), stream=stream, **lm._attn_kwargs(i))

        lm._embed(self.ids, buf, stream)
        lm._layers(buf, attend, self.pos, self.plan.seq_ids, "consecutive", stream)
        if logits_out is not None:
            lm.mm.dmmv(lm._head(1), buf.h[n - 1:n], logits_out.reshape(1, -1), stream=stream)


class Transformer(Layers):
    """A GGUF model on the GPU. ``Transformer.load(path)`` parses, validates and uploads it.

    ``max_seqs`` sequences of up to ``max_tokens`` tokens each share a page pool of
    ``max_seqs * max_tokens`` positions (``page_size`` tokens per page, ``kv_dtype`` float16 or
    float32). Prompts run in chunks of at most ``prefill_chunk`` tokens. ``dmmv_int8`` picks the
    matvecs' path for the block types that have one (:class:`cukern.dmmv.DmmvDispatch`'s ``int8``:
    the activations rounded to 8 bits per 32 elements, ``__dp4a``) over the f32 path. Off by
    default: the int8 path's decode step is faster (its weights stream before each kernel's wait), but
    its rounded activations move Gemma 3 270M's logits past an NMSE of 1e-4 against the float32
    reference, which the f32 path keeps at ~1e-7 (docs/notes/models.md).

    ``pack_prefill`` (sm_90 only: ValueError elsewhere): every projection whose type has a packed
    layout and whose k is a multiple of 256 is also kept packed for gemm_wgr (the gate and up
    matrices as one ``pack_glu`` pair), and prompt chunks of ``MatmulDispatch.WG_MIN_N`` rows or more
    run on those copies (bench_matmul, H100: 1.05-1.6x dequantize + cuBLAS at N >= 512 where the GGUF
    bytes give 0.74-1.37x). The copies cost 1.1x (Q4_K) to 2.2x (Q4_0) the GGUF bytes of the packed
    weights, beside them (decode keeps reading the GGUF bytes)."""

    def _setup(self, model: GGUFModel, max_seqs: int, max_tokens: int, kv_dtype: str, prefill_chunk: int, *,
               dmmv_int8: bool, device: int | None) -> None:
        """Check the sizes, upload the weights and make the dispatches (every model class's first step)."""
        for name, v in (("max_seqs", max_seqs), ("max_tokens", max_tokens), ("prefill_chunk", prefill_chunk)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if kv_dtype not in ("float16", "float32"):
            raise ValueError(f"kv_dtype must be 'float16' or 'float32' (the fused RoPE + KV write), got {kv_dtype!r}")
        self.model, self.cfg = model, model.config
        if not model.device:
            model.upload()
        self.max_seqs, self.max_tokens, self.prefill_chunk = max_seqs, max_tokens, prefill_chunk
        # every kernel of a decode step launches with programmatic dependent launch (sm_90+; a plain launch
        # elsewhere): each one's launch and start-up overlap the kernel before it
        self.ew, self.attn, self.tok = (ElementwiseDispatch(device, pdl=True), AttentionDispatch(device, pdl=True),
                                        TokensDispatch(device, pdl=True))
        self.mm = DmmvDispatch(device, int8=dmmv_int8, pdl=True)
        self.gemm = MatmulDispatch(device)

    def __init__(self, model: GGUFModel, *, max_seqs: int = 1, max_tokens: int = 4096, page_size: int = 16,
                 kv_dtype: str = "float16", prefill_chunk: int = 1024, dmmv_int8: bool = False,
                 pack_prefill: bool = False, device: int | None = None):
        self._setup(model, max_seqs, max_tokens, kv_dtype, prefill_chunk, dmmv_int8=dmmv_int8, device=device)
        c = self.cfg
        if pack_prefill and not self.gemm._units[next(iter(GEMM_QTYPES))].is_sm90():
            raise ValueError("pack_prefill needs an sm_90 (Hopper) device: packed weights run on gemm_wgr only")
        pages_per_seq = -(-max_tokens // page_size)
        self.cache = PagedKVCache(c.n_layers, max_seqs * pages_per_seq, page_size, c.n_kv_heads, c.head_dim,
                                  max_seqs=max_seqs, max_pages_per_seq=pages_per_seq, dtype=kv_dtype, device=device)
        dev, raw = model.device, model.raw

        def qw(name) -> QWeight:
            t = model[name]
            return QWeight(raw[name].reshape(-1), int(t.qtype), t.shape[0], t.shape[1])

        self.layers = [self._load_layer(i, qw) for i in range(c.n_layers)]
        for L in self.layers:
            self._pad(L)
            if pack_prefill:
                self._pack(L)
        self.output_norm = dev["output_norm.weight"]
        # per-pair RoPE angles where they are not the plain base**(-2i/d) (linear scaling, Llama 3 factors)
        factors = model["rope_freqs.weight"].dequantize(np.float64) if c.rope_freq_factors else None
        self.rope_freqs = {local: None if c.rope_is_plain(local) else
                           cupy.asarray(c.rope_inv_freq(local, factors).astype(np.float32)) for local in (False, True)}
        emb = model["token_embd.weight"]
        self.embed_table, self.embed_qtype = raw["token_embd.weight"], int(emb.qtype)
        self.head = qw("token_embd.weight" if c.tied_output else "output.weight")
        # the LM head's matvec reads Q8_0 split into quants and scales (16-byte loads; a copy beside the
        # GGUF bytes, which the embedding gather and the prompt GEMMs keep reading)
        self.head_mv = self.mm.split_q8_0(self.head) if self.head.qtype == 8 else self.head
        self._dec = None  # decode state of the current batch (see _setup_decode)
        self._chunks: dict[int, _Chunk] = {}  # prompt-chunk length -> its buffers, uploads and graphs
        self._stream = None  # prefill's own stream where the caller's is the legacy default one

    def __new__(cls, model: GGUFModel | None = None, *args, **kwargs):
        """A model with experts (``cfg.n_experts``) builds a :class:`cukern.models.moe_transformer.MoeTransformer`,
        a ``qwen3next`` one a :class:`cukern.models.hybrid.HybridModel`."""
        cfg = getattr(model, "config", None)
        if cls is Transformer and getattr(cfg, "arch", None) == "qwen3next":
            from cukern.models.hybrid import HybridModel
            cls = HybridModel
        elif cls is Transformer and getattr(cfg, "n_experts", 0):
            from cukern.models.moe_transformer import MoeTransformer
            cls = MoeTransformer
        return super().__new__(cls)

    def _load_layer(self, i: int, qw) -> _Layer:
        """Layer i's weights: ``qw(name)`` makes a QWeight of a GGUF matrix, ``self.model.device`` holds the vectors."""
        dev, b = self.model.device, f"blk.{i}."
        return _Layer(
            attn_norm=dev[b + "attn_norm.weight"], wq=qw(b + "attn_q.weight"), wk=qw(b + "attn_k.weight"),
            wv=qw(b + "attn_v.weight"), wo=qw(b + "attn_output.weight"), ffn_norm=dev[b + "ffn_norm.weight"],
            wg=qw(b + "ffn_gate.weight"), wu=qw(b + "ffn_up.weight"), wd=qw(b + "ffn_down.weight"),
            q_norm=dev.get(b + "attn_q_norm.weight"), k_norm=dev.get(b + "attn_k_norm.weight"),
            bq=dev.get(b + "attn_q.bias"), bk=dev.get(b + "attn_k.bias"), bv=dev.get(b + "attn_v.bias"),
            post_attn_norm=dev.get(b + "post_attention_norm.weight"), post_ffn_norm=dev.get(b + "post_ffw_norm.weight"))

    @classmethod
    def load(cls, path, *, progress: bool | None = None, **kwargs) -> "Transformer":
        m = load_gguf(path)
        m.upload(progress=progress)
        return cls(m, **kwargs)

    # ------------------------------------------------------------------ prefill
    def prefill(self, tokens, slot: int, logits_out: cupy.ndarray, *, stream=None) -> cupy.ndarray:
        """Append ``tokens`` (host ints) to sequence ``slot`` of the cache and write the logits of the
        last one into ``logits_out [vocab]`` f32. The prompt runs in chunks of ``prefill_chunk`` rows:
        each chunk extends the sequence, writes its K/V and attends to everything cached before it.

        A chunk's launches read their token ids, first position and slot from two small uploads, so a
        chunk length seen before replays a CUDA graph of them (:class:`_Chunk`): a short prompt costs
        the uploads and one graph launch of host time instead of ~200 launches from Python. On the legacy
        default stream, which cannot be captured, the chunks run on a stream of the model's own,
        ordered after and before ``stream`` by events."""
        c = self.cfg
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise ValueError("prefill needs at least one token")
        if tokens.min() < 0 or tokens.max() >= c.vocab_size:
            raise ValueError(f"token ids must lie in [0, {c.vocab_size})")
        start = self.cache.length(slot)
        if start + tokens.size > self.cache.capacity_tokens():
            raise ValueError(f"sequence {slot}: {start} + {tokens.size} tokens exceed max_tokens "
                             f"({self.cache.capacity_tokens()})")
        check_array("logits_out", logits_out, dtype=np.float32, shape=(c.vocab_size,))
        stream = resolve_stream(stream)
        work = stream if stream.ptr else self._own_stream()
        if work is not stream:
            work.wait_event(stream.record())
        chunk = min(self.prefill_chunk, tokens.size)
        for c0 in range(0, tokens.size, chunk):
            part = tokens[c0:c0 + chunk]
            pos0 = self.cache.extend(slot, part.size, stream=work)
            last = c0 + part.size == tokens.size
            self._chunk(part.size, slot).run(self, part, pos0, slot, logits_out if last else None, work)
        if work is not stream:
            stream.wait_event(work.record())
        return logits_out

    def clear_prefill_graphs(self) -> None:
        """Drop the prompt chunks' buffers and graphs: the next prompt of each length runs eagerly (a
        profiler times its kernels one by one) and their memory goes back to the pool."""
        self._chunks.clear()

    def _own_stream(self):
        if self._stream is None:
            self._stream = cupy.cuda.Stream(non_blocking=True)
        return self._stream

    def _chunk(self, n: int, slot: int) -> "_Chunk":
        st = self._chunks.get(n)
        if st is None:
            st = bounded_put(self._chunks, n, _Chunk(self, n, slot), self._CHUNK_STATES)
        return st

    _CHUNK_STATES = 4  # prompt-chunk lengths whose buffers and graphs are kept (the oldest leaves first)

    def _chunk_attn_dtype(self, n: int):
        """The dtype of a prompt chunk's rotated Q and attention output: the f16 cache's where the chunk's
        attention can run on tensor cores and every output projection takes it (a GEMM, not the matvec,
        whose x is f32): the RoPE kernel rounds Q once, as the GEMM rounds its activations anyway. Else f32
        (the SIMT attention)."""
        c = self.cfg
        half = (self.cache.kind == "float16" and c.head_dim in PREFILL_HEAD_DIMS and c.head_dim in ROPE_VEC_HEAD_DIMS
                and all(self._gemm_ok(L.wo, n) for L in self.layers))
        return np.float16 if half else np.float32

    # ------------------------------------------------------------------ decode
    def _setup_decode(self, slots: list[int], positions: list[int], max_kv_len: int, sampling: bool,
                      history_len: int):
        c = self.cfg
        b = len(slots)
        d = {"slots": list(slots), "buf": _Buffers(c, b)}
        d["plan"] = self.attn.plan_decode(self.cache, slots, c.n_heads, max_kv_len=max_kv_len)
        d["positions"] = cupy.asarray(np.array(positions, np.int32))
        d["sample"] = SamplePlan(b, c.vocab_size, sampling=sampling, history_len=history_len)
        d["logits"] = cupy.empty((b, c.vocab_size), cupy.float32)
        d["graph"] = None
        self._dec = d
        return d

    def _decode_step(self, d, temperature: float, top_k: int, top_p: float, seed: int, stream):
        """One token for every sequence of the batch: reads d['sample'].next_ids and d['positions'],
        writes the next ids and advances positions and cache lengths. Graph-capturable."""
        c = self.cfg
        buf, plan, sp = d["buf"], d["plan"], d["sample"]

        def attend(i, q_rot, o):
            self.attn.flash_attn_decode(plan, i, q_rot, o, scale=c.attn_scale, window_left=self._window(i),
                                        stream=stream, **self._attn_kwargs(i))

        self._embed(sp.next_ids, buf, stream)
        self._layers(buf, attend, d["positions"], plan.seq_ids, "per_token", stream)
        self.mm.dmmv(self._head(buf.n), buf.h, d["logits"], stream=stream)
        self.tok.sample(sp, d["logits"], temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        stream=stream)
        self.tok.advance_positions(d["positions"], self.cache.lengths, plan.seq_ids, stream=stream)

    # ------------------------------------------------------------------ generation
    def _generate_args(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_ids):
        """Every argument of :meth:`generate` checked before it touches the cache, so that a bad one
        raises with the cache as it was: prompts of token ids in the vocabulary, ``max_new_tokens``
        within the cache, the sampling arguments (``tokens.check_sampling``), stop ids in the
        vocabulary. Returns them converted to Python ints and floats."""
        c = self.cfg
        if isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (int, np.integer)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        prompts = [[check_int("token ids of a prompt", t, 0, c.vocab_size - 1) for t in p] for p in prompts]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if len(prompts) > self.max_seqs:
            raise ValueError(f"{len(prompts)} prompts, the model was made for max_seqs={self.max_seqs}")
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
        longest = max(len(p) for p in prompts) + max_new_tokens
        if longest > self.cache.capacity_tokens():
            raise ValueError(f"prompt + {max_new_tokens} new tokens = {longest} exceeds max_tokens "
                             f"({self.cache.capacity_tokens()})")
        temperature, top_k, top_p, seed = check_sampling(temperature, top_k, top_p, seed)
        if isinstance(stop_ids, (str, bytes)) or not hasattr(stop_ids, "__iter__"):
            raise TypeError(f"stop_ids must be a sequence of token ids, got {type(stop_ids).__name__}")
        stop_ids = [check_int("stop id", i, 0, c.vocab_size - 1) for i in stop_ids]
        return prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_ids

    def generate(self, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = MAX_TOP_K,
                 top_p: float = 1.0, seed: int = 0, use_graph: bool = True, stop_ids=(), on_token=None,
                 stream=None):
        """Continue every prompt (lists of token ids) by ``max_new_tokens`` tokens (fewer once every
        sequence has produced a stop id). Returns (list of generated id lists, GenerationStats).

        The call owns the cache: it frees every sequence held in it first. Each prompt is prefilled on
        its own, then the sequences decode together, one token per step;
        with ``use_graph`` the first step runs eagerly (compiling and warming up every kernel) and is
        then captured as a CUDA graph that later steps replay. ``on_token(step, ids)`` (host ints of
        this step, one per sequence) makes every step synchronise to stream text; without it the
        steps run back to back and the tokens are read once at the end."""
        prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_ids = self._generate_args(
            prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_ids)
        longest = max(len(p) for p in prompts) + max_new_tokens
        stream = resolve_stream(stream) if stream is not None else cupy.cuda.Stream(non_blocking=True)
        stats = GenerationStats(prompt_tokens=sum(map(len, prompts)), graph=use_graph)
        for s in self.cache.alloc.active_slots():
            self.cache.free(s, stream=stream)
        slots = [self.cache.add(0, stream=stream) for _ in prompts]
        d = self._setup_decode(slots, [len(p) for p in prompts], longest, temperature > 0, max_new_tokens)
        sample = lambda: self.tok.sample(d["sample"], d["logits"], temperature=temperature, top_k=top_k,  # noqa
                                         top_p=top_p, seed=seed, stream=stream)
        stream.synchronize()
        t0 = time.perf_counter()
        for b, (p, s) in enumerate(zip(prompts, slots)):
            self.prefill(p, s, d["logits"][b], stream=stream)
        sample()                                     # the first new token of every sequence
        stream.synchronize()
        stats.prefill_s = time.perf_counter() - t0
        # pages for the whole generation now; the device lengths then grow one per step (advance_positions)
        for p, s in zip(prompts, slots):
            self.cache.extend(s, max_new_tokens, stream=stream)
            _to_device(self.cache.lengths[s:s + 1], np.array([len(p) + 1], np.int32), stream)
        out = [[] for _ in prompts]
        stops = set(int(i) for i in stop_ids)
        done = np.zeros(len(prompts), bool)

        def emit(step, ids):
            for b, t in enumerate(ids):
                if not done[b]:
                    out[b].append(int(t))
                    done[b] = int(t) in stops
            if on_token is not None:
                on_token(step, ids)

        step_fn = lambda s: self._decode_step(d, temperature, top_k, top_p, seed, s)  # noqa: E731
        emit(0, _to_host(d["sample"].next_ids, stream))
        steps, timed, t0 = 1, 0, None
        while steps < max_new_tokens and not done.all():
            if use_graph and steps >= 2:             # step 1 ran eagerly: every kernel is compiled and warm
                if d["graph"] is None:
                    d["graph"] = capture_graph(step_fn, stream=stream)
                if t0 is None:
                    stream.synchronize()
                    t0 = time.perf_counter()
                d["graph"].replay(stream)
            else:
                if not use_graph and t0 is None:
                    t0 = time.perf_counter()
                step_fn(stream)
            timed += t0 is not None
            if on_token is not None or not use_graph:
                emit(steps, _to_host(d["sample"].next_ids, stream))
            steps += 1
        stream.synchronize()
        stats.decode_s = time.perf_counter() - t0 if t0 is not None else 0.0
        stats.decode_tokens = timed * len(prompts)   # steady state: graph replays (or eager steps)
        if on_token is None and use_graph:         # steps 1... were not read yet: the history has them
            hist = _to_host(d["sample"].history, stream)
            for step in range(1, steps):
                emit(step, hist[:, step])
        return out, stats
