"""GGUF model files: parse, validate, and upload the raw weight blocks to the GPU.

:func:`load_gguf` reads a file with ``gguf.GGUFReader`` (memory-mapped, no copy),
checks that the architecture is one cukern runs, that every hyperparameter and
tensor the forward pass needs is there with the right shape and a supported
type, and returns a :class:`GGUFModel`: the metadata, a :class:`ModelConfig`
and one :class:`Tensor` per weight. :meth:`GGUFModel.upload` copies every
tensor's raw bytes (still quantized) into one device arena; parsing and
validation need no GPU, so they are tested on the CPU.

Every error is a :class:`GGUFError` that names the file and, where there is
one, the tensor or key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

__all__ = ["GGUFError", "ModelConfig", "Tensor", "GGUFModel", "load_gguf", "SUPPORTED_ARCHS",
           "SUPPORTED_TYPES", "required_tensors"]

SUPPORTED_ARCHS = ("gemma3", "llama", "qwen2", "qwen3")
# raw block formats the forward pass accepts for weights (norm vectors and biases must be F32)
SUPPORTED_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K)
_ARENA_ALIGN = 256  # bytes: every tensor starts 256-byte aligned in the device arena


class GGUFError(ValueError):
    """A GGUF file cukern cannot run: corrupt, truncated, unsupported, or missing something."""


@dataclass(frozen=True)
class ModelConfig:
    """The hyperparameters of a decoder-only transformer, read from GGUF metadata."""

    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float            # global layers
    rope_base_local: float      # sliding-window layers (Gemma 3); == rope_base otherwise
    rope_neox: bool             # rotate halves (NeoX/Gemma/Qwen) rather than adjacent pairs (Llama GGUF)
    rope_scale: float           # linear RoPE scaling: positions divided by it (Gemma 3: global layers only)
    rope_freq_factors: bool     # tensor rope_freqs.weight [head_dim/2] divides each pair's frequency (Llama 3.1+)
    sliding_window: int         # 0: none; else a key j is visible to query i when i - window < j <= i
    local_layers: tuple[bool, ...]  # per layer: True where attention is sliding-window
    qk_norm: bool               # per-head RMS norm of Q and K (Gemma 3, Qwen3)
    qkv_bias: bool              # Qwen2
    post_norms: bool            # Gemma: RMS norm after attention and after the MLP, before the residual add
    activation: str             # "gelu_tanh" (GEGLU) or "silu" (SwiGLU)
    embed_scale: float          # Gemma multiplies the embedding by sqrt(d_model)
    attn_scale: float           # softmax scale of q.k
    tied_output: bool           # output head = token embedding

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def rope_inv_freq(self, local: bool, factors=None) -> np.ndarray:
        """Angle per position of each rotated pair, [head_dim / 2] float64:
        ``base**(-2i/head_dim) / scale / factors[i]`` (local layers: their base, no scaling)."""
        d = self.head_dim
        base = self.rope_base_local if local else self.rope_base
        inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        if not local or self.arch != "gemma3":
            inv = inv / self.rope_scale
        if factors is not None:
            inv = inv / np.asarray(factors, dtype=np.float64)
        return inv

    def rope_is_plain(self, local: bool) -> bool:
        """True when the angles are the plain ``base**(-2i/d)`` (the kernels compute them in place)."""
        scaled = self.rope_scale != 1.0 and not (local and self.arch == "gemma3")
        return not scaled and not self.rope_freq_factors


@dataclass(frozen=True)
class Tensor:
    """One weight: its GGUF type, its logical shape (rows, cols) with cols contiguous, its bytes."""

    name: str
    qtype: QT
    shape: tuple[int, ...]      # PyTorch order: shape[-1] is the contiguous dimension
    data: np.ndarray            # the file's bytes as GGUFReader maps them (typed for float types)

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        """Float copy with ``shape`` (``gguf.quants.dequantize``, the reference of record)."""
        if self.qtype == QT.BF16:
            raw = np.ascontiguousarray(self.data).view(np.uint16).astype(np.uint32) << 16
            return raw.view(np.float32).reshape(self.shape).astype(dtype)
        return gguf.quants.dequantize(np.asarray(self.data), self.qtype).reshape(self.shape).astype(dtype)


def required_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward pass of ``cfg.arch`` reads, with its shape (PyTorch order)."""
    d, q, kv, ff, hd = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.d_ff, cfg.head_dim
    need = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if not cfg.tied_output:
        need["output.weight"] = (cfg.vocab_size, d)
    if cfg.rope_freq_factors:
        need["rope_freqs.weight"] = (hd // 2,)
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        need.update({b + "attn_norm.weight": (d,), b + "attn_q.weight": (q, d), b + "attn_k.weight": (kv, d),
                     b + "attn_v.weight": (kv, d), b + "attn_output.weight": (d, q), b + "ffn_norm.weight": (d,),
                     b + "ffn_gate.weight": (ff, d), b + "ffn_up.weight": (ff, d), b + "ffn_down.weight": (d, ff)})
        if cfg.qk_norm:
            need.update({b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)})
        if cfg.qkv_bias:
            need.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
        if cfg.post_norms:
            need.update({b + "post_attention_norm.weight": (d,), b + "post_ffw_norm.weight": (d,)})
    return need


class _Reader(gguf.GGUFReader):
    """GGUFReader that names the tensor when the file ends before that tensor's data does, and
    parses through a plain ndarray view of its memory map: np.memmap's per-slice bookkeeping is
    most of the time of reading a 262k-token vocabulary (about 2x faster this way)."""

    def _build_fields(self, offs, count):
        if isinstance(self.data, np.memmap):
            self.data = self.data.view(np.ndarray)   # same mapping (kept alive as the view's base)
        return super()._build_fields(offs, count)

    def _build_tensors(self, start_offs, fields):
        size = len(self.data)
        for f in fields:
            _, name, _, dims, raw_type, offset = f.parts
            name = bytes(name).decode("utf-8", "replace")
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[QT(int(raw_type[0]))]
            except (ValueError, KeyError):
                raise GGUFError(f"tensor {name!r} has unknown GGML type {int(raw_type[0])}") from None
            n_elem = int(np.prod(dims.astype(np.int64)))
            if n_elem % block:
                raise GGUFError(f"tensor {name!r}: {n_elem} elements is not a whole number of "
                                f"{QT(int(raw_type[0])).name} blocks of {block}")
            end = int(start_offs + offset[0]) + n_elem // block * type_size
            if end > size:
                raise GGUFError(f"tensor {name!r} ends at byte {end}, past the end of the file ({size} bytes): "
                                f"the file is truncated")
        super()._build_tensors(start_offs, fields)


def _field(reader, key: str, path: str, *, required: bool = True, default=None):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise GGUFError(f"{path}: missing metadata key {key!r}")
        return default
    try:
        return f.contents()
    except Exception as e:  # a malformed value is the file's fault: say which key
        raise GGUFError(f"{path}: cannot read metadata key {key!r} ({e})") from None


def _config(reader, path: str, tensors: dict[str, "Tensor"]) -> ModelConfig:
    arch = _field(reader, "general.architecture", path)
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"{path}: unsupported architecture {arch!r} (cukern runs {', '.join(SUPPORTED_ARCHS)})")

    def get(key, default=None, required=True):
        return _field(reader, f"{arch}.{key}", path, required=required and default is None, default=default)

    n_layers, d_model, d_ff = int(get("block_count")), int(get("embedding_length")), int(get("feed_forward_length"))
    n_heads = int(get("attention.head_count"))
    n_kv_heads = int(get("attention.head_count_kv", n_heads))
    head_dim = int(get("attention.key_length", d_model // n_heads if n_heads else 0))
    v_dim = int(get("attention.value_length", head_dim))
    for name, v in (("block_count", n_layers), ("embedding_length", d_model), ("feed_forward_length", d_ff),
                    ("attention.head_count", n_heads), ("attention.head_count_kv", n_kv_heads),
                    ("attention.key_length", head_dim)):
        if v <= 0:
            raise GGUFError(f"{path}: {arch}.{name} must be positive, got {v}")
    if n_heads % n_kv_heads:
        raise GGUFError(f"{path}: {arch}.attention.head_count ({n_heads}) is not a multiple of "
                        f"head_count_kv ({n_kv_heads})")
    if v_dim != head_dim:
        raise GGUFError(f"{path}: value_length {v_dim} != key_length {head_dim} is not supported")
    if head_dim % 2:
        raise GGUFError(f"{path}: key_length {head_dim} must be even for RoPE")
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise GGUFError(f"{path}: missing tensor 'token_embd.weight'")
    vocab = int(emb.shape[0])
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens.data) != vocab:
        raise GGUFError(f"{path}: the vocabulary has {len(tokens.data)} tokens but token_embd.weight has "
                        f"{vocab} rows")
    eps = float(get("attention.layer_norm_rms_epsilon"))
    rope_base = float(get("rope.freq_base", 10000.0))
    gemma = arch == "gemma3"
    window = int(get("attention.sliding_window", 0, required=False) or 0) if gemma else 0
    # llama.cpp's convention for Gemma 3: every 6th layer (5, 11, ...) is global unless the file says otherwise
    pattern = int(get("attention.sliding_window_pattern", 6, required=False)) if gemma else 0
    local = tuple(bool(window) and pattern > 0 and (i + 1) % pattern != 0 for i in range(n_layers))
    qk_norm = arch in ("gemma3", "qwen3")
    scaling = get("rope.scaling.type", "none", required=False) or "none"
    if scaling not in ("none", "linear"):
        raise GGUFError(f"{path}: RoPE scaling {scaling!r} is not supported (cukern runs none and linear)")
    rope_scale = float(get("rope.scaling.factor", 1.0, required=False) or 1.0) if scaling == "linear" else 1.0
    if not rope_scale > 0:
        raise GGUFError(f"{path}: {arch}.rope.scaling.factor must be > 0, got {rope_scale}")
    return ModelConfig(
        arch=arch, n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        d_ff=d_ff, vocab_size=vocab, context_length=int(get("context_length", 2048, required=False)),
        rms_eps=eps, rope_base=rope_base, rope_base_local=10000.0 if gemma else rope_base,
        rope_neox=arch != "llama", rope_scale=rope_scale, rope_freq_factors="rope_freqs.weight" in tensors,
        sliding_window=window, local_layers=local, qk_norm=qk_norm,
        qkv_bias=arch == "qwen2", post_norms=gemma, activation="gelu_tanh" if gemma else "silu",
        embed_scale=float(np.sqrt(d_model)) if gemma else 1.0, attn_scale=1.0 / float(np.sqrt(head_dim)),
        tied_output=gemma or "output.weight" not in tensors)


@dataclass
class GGUFModel:
    """A parsed, validated GGUF model. ``device`` holds the uploaded weights after :meth:`upload`."""

    path: str
    config: ModelConfig
    metadata: dict
    tensors: dict[str, Tensor]
    reader: object = field(repr=False)
    device: dict = field(default_factory=dict, repr=False)   # name -> typed cupy view over the arena
    raw: dict = field(default_factory=dict, repr=False)      # name -> uint8 [rows, row_bytes] view (raw blocks)
    arena: object = field(default=None, repr=False)

    def __getitem__(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: missing tensor {name!r}") from None

    @property
    def n_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors.values())

    def upload(self, *, progress: bool | None = None, stream=None) -> dict:
        """Copy every needed tensor's raw bytes into one device arena (256-byte aligned slices).

        ``device[name]``: float tensors as typed arrays of their shape (F32 -> float32, F16 -> float16,
        BF16 -> uint16 bits), quantized ones uint8 ``[rows, bytes_per_row]``; ``raw[name]``: every
        tensor as uint8 ``[rows, bytes_per_row]`` (what the matvec and embedding kernels read). Synchronises once at the end
        (loading is not part of a captured step). ``progress``: tqdm bar (default: files over 64 MiB)."""
        import cupy
        names = list(required_tensors(self.config))
        offsets, total = [], 0
        for n in names:
            offsets.append(total)
            total += -(-self.tensors[n].n_bytes // _ARENA_ALIGN) * _ARENA_ALIGN
        arena = cupy.empty(max(total, 1), dtype=cupy.uint8)
        bar = None
        if progress or (progress is None and total > 64 << 20):
            try:
                from tqdm import tqdm
                bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"upload {os.path.basename(self.path)}")
            except ImportError:
                bar = None
        device, raw = {}, {}
        for n, off in zip(names, offsets):
            t = self.tensors[n]
            host = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
            dst = arena[off:off + host.size]
            dst.set(host, stream=stream)
            if t.qtype == QT.F32:
                arr = dst.view(cupy.float32).reshape(t.shape)
            elif t.qtype == QT.F16:
                arr = dst.view(cupy.float16).reshape(t.shape)
            elif t.qtype == QT.BF16:
                arr = dst.view(cupy.uint16).reshape(t.shape)
            else:
                arr = dst.reshape(t.shape[0], -1)
            device[n] = arr
            raw[n] = dst.reshape(t.shape[0] if len(t.shape) > 1 else 1, -1)
            if bar is not None:
                bar.update(-(-host.size // _ARENA_ALIGN) * _ARENA_ALIGN)
        if bar is not None:
            bar.close()
        (stream or cupy.cuda.get_current_stream()).synchronize()
        self.arena, self.device, self.raw = arena, device, raw
        return device


def load_gguf(path, *, upload: bool = False, progress: bool | None = None) -> GGUFModel:
    """Parse and validate a GGUF model; with ``upload=True`` also copy its weights to the GPU."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such file")
    try:
        reader = _Reader(path)
    except GGUFError as e:
        raise GGUFError(f"{path}: {e}") from None
    except Exception as e:  # the gguf package raises ValueError/IndexError/... on corrupt headers
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        tensors[t.name] = Tensor(t.name, t.tensor_type, shape, t.data)
    cfg = _config(reader, path, tensors)
    for name, shape in required_tensors(cfg).items():
        t = tensors.get(name)
        if t is None:
            raise GGUFError(f"{path}: missing tensor {name!r} (needed by the {cfg.arch} forward pass)")
        if t.shape != shape:
            raise GGUFError(f"{path}: tensor {name!r} has shape {t.shape}, expected {shape}")
        vector = len(shape) == 1
        if vector and t.qtype != QT.F32:
            raise GGUFError(f"{path}: tensor {name!r} has type {t.qtype.name}; norm weights and biases must be F32")
        if t.qtype not in SUPPORTED_TYPES:
            raise GGUFError(f"{path}: tensor {name!r} has unsupported type {t.qtype.name} "
                            f"(supported: {', '.join(q.name for q in SUPPORTED_TYPES)})")
    metadata = {}
    for key in reader.fields:
        if key.startswith("GGUF.") or key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                                               "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
            continue
        metadata[key] = _field(reader, key, path)
    model = GGUFModel(path=path, config=cfg, metadata=metadata, tensors=tensors, reader=reader)
    if upload:
        model.upload(progress=progress)
    return model
