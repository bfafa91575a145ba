"""GGUF model files: parse, validate, and upload the raw weight blocks to the GPU.

:func:`load_gguf` parses a file itself (memory-mapped, no copy; the byte-level
parser is :mod:`cukern.models.gguf_parse`) as strictly as llama.cpp: every count
and length is bounded by the file's size before it is used, and every tensor's
data lies exactly where the layout puts it. It checks that the architecture is
one cukern runs, that every hyperparameter and tensor the forward pass needs is
there with the right shape and a supported type, and returns a
:class:`GGUFModel`: the metadata, a :class:`ModelConfig` and one :class:`Tensor`
per weight. :meth:`GGUFModel.upload` copies every tensor's raw bytes (still
quantized) into one device arena; parsing and validation need no GPU, so they
are tested on the CPU.

Every error is a :class:`GGUFError` that names the file and, where there is
one, the tensor or key.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from cukern.models.gguf_parse import _INT32_MAX, _REQUIRED, GGUFError, _Reader, read_key

__all__ = ["GGUFError", "ModelConfig", "Tensor", "GGUFModel", "load_gguf", "SUPPORTED_ARCHS",
           "SUPPORTED_TYPES", "required_tensors"]

# arch -> the module whose ``config(reader, path, tensors)`` reads it (its config class says which tensors
# the forward needs and of which types: ``required_tensors()``, ``allowed_types(name)``)
ARCH_MODULES = {"qwen3moe": "cukern.models.moe_config", "qwen2moe": "cukern.models.moe_config",
                "gpt-oss": "cukern.models.moe_config", "qwen3next": "cukern.models.hybrid_config"}
SUPPORTED_ARCHS = ("gemma3", "llama", "qwen2", "qwen3", *ARCH_MODULES)
# raw block formats the forward pass accepts for weights (norm vectors and biases must be F32)
SUPPORTED_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K)
_ARENA_ALIGN = 256  # bytes: every tensor starts 256-byte aligned in the device arena


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
    if hasattr(cfg, "required_tensors"):
        return cfg.required_tensors()
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


def _config(reader, path: str, tensors: dict[str, "Tensor"]) -> ModelConfig:
    arch = read_key(reader, "general.architecture", "str", path)
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"{path}: unsupported architecture {arch!r} (cukern runs {', '.join(SUPPORTED_ARCHS)})")
    if arch in ARCH_MODULES:
        return importlib.import_module(ARCH_MODULES[arch]).config(reader, path, tensors)

    def dim(key, default=_REQUIRED, hi=_INT32_MAX, note=""):
        return read_key(reader, f"{arch}.{key}", "int", path, default, lo=1, hi=hi, note=note)

    # every layer has at least 9 tensors: a count beyond what the file holds is corrupt, caught before
    # any per-layer work
    n_layers = dim("block_count", hi=max(1, len(tensors) // 9),
                   note=f" (the file has {len(tensors)} tensors, a layer at least 9)")
    d_model, d_ff, n_heads = dim("embedding_length"), dim("feed_forward_length"), dim("attention.head_count")
    n_kv_heads = dim("attention.head_count_kv", n_heads)
    head_dim = dim("attention.key_length", max(1, d_model // n_heads))
    v_dim = dim("attention.value_length", head_dim)
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
    if tokens is not None and len(tokens) != vocab:
        raise GGUFError(f"{path}: the vocabulary has {len(tokens)} tokens but token_embd.weight has "
                        f"{vocab} rows")
    eps = read_key(reader, f"{arch}.attention.layer_norm_rms_epsilon", "float", path, above=0.0, hi=1.0)
    rope_base = read_key(reader, f"{arch}.rope.freq_base", "float", path, 10000.0, above=0.0)
    gemma = arch == "gemma3"
    window = read_key(reader, f"{arch}.attention.sliding_window", "int", path, 0, lo=0, hi=_INT32_MAX) if gemma else 0
    # llama.cpp's convention for Gemma 3: every 6th layer (5, 11, ...) is global unless the file says otherwise
    pattern = read_key(reader, f"{arch}.attention.sliding_window_pattern", "int", path, 6, lo=0,
                       hi=_INT32_MAX) if gemma else 0
    local = tuple(bool(window) and pattern > 0 and (i + 1) % pattern != 0 for i in range(n_layers))
    qk_norm = arch in ("gemma3", "qwen3")
    scaling = read_key(reader, f"{arch}.rope.scaling.type", "str", path, "none") or "none"
    if scaling not in ("none", "linear"):
        raise GGUFError(f"{path}: RoPE scaling {scaling!r} is not supported (cukern runs none and linear)")
    rope_scale = read_key(reader, f"{arch}.rope.scaling.factor", "float", path, 1.0, above=0.0) \
        if scaling == "linear" else 1.0
    context = read_key(reader, f"{arch}.context_length", "int", path, 2048, lo=1, hi=_INT32_MAX)
    return ModelConfig(
        arch=arch, n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        d_ff=d_ff, vocab_size=vocab, context_length=context,
        rms_eps=eps, rope_base=rope_base, rope_base_local=10000.0 if gemma else rope_base,
        rope_neox=arch != "llama", rope_scale=rope_scale, rope_freq_factors="rope_freqs.weight" in tensors,
        sliding_window=window, local_layers=local, qk_norm=qk_norm,
        qkv_bias=arch == "qwen2", post_norms=gemma, activation="gelu_tanh" if gemma else "silu",
        embed_scale=float(np.sqrt(d_model)) if gemma else 1.0, attn_scale=1.0 / float(np.sqrt(head_dim)),
        tied_output=gemma or "output.weight" not in tensors)


class _Metadata(Mapping):
    """Every metadata key but the tokenizer's big arrays (read those through ``reader.fields``), each
    value decoded when it is read: an array of millions of items costs nothing until asked for."""

    _TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                         "tokenizer.ggml.merges")

    def __init__(self, fields: dict):
        self._fields = {k: f for k, f in fields.items() if k not in self._TOKENIZER_ARRAYS}

    def __getitem__(self, key: str):
        return self._fields[key].contents()

    def __iter__(self):
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


@dataclass
class GGUFModel:
    """A parsed, validated GGUF model. ``device`` holds the uploaded weights after :meth:`upload`."""

    path: str
    config: ModelConfig
    metadata: Mapping           # key -> value, decoded on access (the tokenizer's arrays left out)
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
    except OSError as e:
        raise GGUFError(f"{path}: cannot read the file ({e.strerror or e})") from None
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
        allowed = cfg.allowed_types(name) if hasattr(cfg, "allowed_types") else SUPPORTED_TYPES
        if t.qtype not in allowed:
            raise GGUFError(f"{path}: tensor {name!r} has unsupported type {t.qtype.name} "
                            f"(supported: {', '.join(q.name for q in allowed)})")
    if cfg.rope_freq_factors:
        f = tensors["rope_freqs.weight"].data
        if not (np.isfinite(f) & (f > 0)).all():
            bad = f[~(np.isfinite(f) & (f > 0))][0]
            raise GGUFError(f"{path}: tensor 'rope_freqs.weight' must hold finite values > 0 (each divides a "
                            f"RoPE frequency), got {bad}")
    model = GGUFModel(path=path, config=cfg, metadata=_Metadata(reader.fields), tensors=tensors, reader=reader)
    if upload:
        model.upload(progress=progress)
    return model
