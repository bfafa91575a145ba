"""Tiny random-weight GGUF models, written with ``gguf.GGUFWriter``.

For every architecture cukern runs there is no small public model to test
against, so the tests write one: a few layers, random weights quantized to the
requested block types, and a small vocabulary of the matching tokenizer kind
(SentencePiece for ``gemma3``/``llama``, byte-level BPE for ``qwen2``/``qwen3``).
The NumPy reference (cukern/reference/models.py) and the GPU forward both read them.
"""

from __future__ import annotations

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

__all__ = ["TinySpec", "PRESETS", "write_tiny_gguf", "random_blocks"]

_QK_K = 256


def random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: QT, scale: float) -> np.ndarray:
    """Raw GGUF blocks ``uint8 [rows, bytes_per_row]`` of ``qtype`` whose values are about ``scale``.

    Formats the gguf package can quantize are quantized from Gaussian values; for Q4_K and
    Q5_K (dequantize only) the quant bits are random and the f16 super-block scales set so
    that the dequantized values have roughly the requested magnitude."""
    if qtype in (QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.MXFP4):
        x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        return gguf.quants.quantize(x, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if qtype in (QT.Q4_K, QT.Q5_K):
        # d (f16), dmin (f16), 12 bytes of 6-bit scales/mins: w = d*sc*q - dmin*m, q in [0, 15] or [0, 31]
        qmax = 15 if qtype == QT.Q4_K else 31
        d = (rng.uniform(0.5, 1.0, n) * 2 * scale / (63 * qmax)).astype(np.float16)
        dmin = (d.astype(np.float32) * qmax / 2).astype(np.float16)    # centres q around 0
        b[:, 0:2] = d.view(np.uint8).reshape(n, 2)
        b[:, 2:4] = dmin.view(np.uint8).reshape(n, 2)
        # every 6-bit scale and min 63 (sc == m), so that w = d*63*(q - qmax/2)
        b[:, 4:16] = 0xFF
    elif qtype == QT.Q6_K:
        # ql[128], qh[64], int8 scales[16], d (f16): w = d * sc * (q - 32)
        b[:, 192:208] = rng.integers(16, 64, size=(n, 16), dtype=np.int8).view(np.uint8)
        d = (rng.uniform(0.5, 1.0, n) * scale / (40 * 32)).astype(np.float16)
        b[:, 208:210] = d.view(np.uint8).reshape(n, 2)
    else:
        raise ValueError(f"no random-block generator for {qtype.name}")
    return b.reshape(rows, -1)


class TinySpec:
    """Shape of a tiny model; defaults fit every kernel's block sizes (d_model a multiple of 256)."""

    def __init__(self, arch: str, *, n_layers: int = 2, d_model: int = 256, n_heads: int = 4, n_kv_heads: int = 2,
                 head_dim: int = 64, d_ff: int = 512, sliding_window: int = 8, swa_pattern: int = 2,
                 weight_type: QT = QT.Q8_0, types: dict | None = None, rope_scale: float = 1.0,
                 rope_freqs: bool = False):
        self.arch, self.n_layers, self.d_model, self.n_heads = arch, n_layers, d_model, n_heads
        self.n_kv_heads, self.head_dim, self.d_ff = n_kv_heads, head_dim, d_ff
        self.sliding_window, self.swa_pattern = sliding_window, swa_pattern
        self.weight_type = weight_type
        self.rope_scale, self.rope_freqs = rope_scale, rope_freqs   # linear scaling; Llama-3 frequency factors
        self.types = dict(types or {})   # tensor-name suffix ("ffn_down.weight") -> type

    def qtype(self, name: str) -> QT:
        for suffix, t in self.types.items():
            if name.endswith(suffix):
                return t
        return self.weight_type


# Random-weight stand-ins with a real model's shapes and block types (the vocabulary stays tiny, so
# the LM head is not a real one's size): for profiling a decode step without the model file.
PRESETS = {
    # Gemma 3 270M as its Q4_K_M GGUF stores it
    "gemma3-270m": lambda: TinySpec(
        "gemma3", n_layers=18, d_model=640, n_heads=4, n_kv_heads=1, head_dim=256, d_ff=2048,
        sliding_window=512, swa_pattern=6, weight_type=QT.Q5_0,
        types={"attn_v.weight": QT.Q8_0, "attn_output.weight": QT.Q4_K, "ffn_down.weight": QT.Q6_K,
               "token_embd.weight": QT.Q8_0}),
}


def _spm_vocab():
    """A small SentencePiece vocabulary: control tokens, 256 byte tokens, letters and common pieces."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n", "\n\n"]
    types = [3, 3, 3, 2, 3, 3, 4, 4]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'") + ["\u2581"]
    words = ["the", "and", "he", "in", "er", "an", "on", "at", "en", "is", "it", "re", "ing", "hel", "ll", "lo",
             "hello", "world", "wor", "or", "ld", "th", "ion", "at", "GPU", "ker", "ne", "nel", "kernel"]
    pieces += words + ["\u2581" + w for w in words] + ["\u2581\u2581", "\u2581a", "\u2581t", "\u2581w", "\u2581h"]
    seen, uniq = set(tokens), []
    for p in pieces:
        if p not in seen:
            seen.add(p)
            uniq.append(p)
    tokens += uniq
    types += [1] * len(uniq)
    # control tokens -1000, byte tokens 0; normal pieces: longer ones score higher than the pieces they
    # merge from, as in a trained model, and the id breaks ties
    scores = [-1000.0] * 8 + [0.0] * 256 + [-50.0 / len(p) - 0.001 * (264 + i) for i, p in enumerate(uniq)]
    return tokens, types, scores


def _bpe_vocab():
    """A small byte-level BPE vocabulary: 256 byte characters, merges of common pairs, control tokens."""
    from cukern.models.tokenizer import _bytes_to_unicode
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    sp = b2u[ord(" ")]
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), (sp, "w"), ("o", "r"), (sp + "w", "or"),
              ("l", "d"), (sp + "wor", "ld"), ("i", "n"), (sp, "t"), (sp + "t", "he"), ("in", "g"), (sp, "a"),
              ("e", "r"), ("k", "er"), ("n", "e"), ("ne", "l"), ("ker", "nel"), (sp, "kernel")]
    merged = []
    for a, b in merges:
        if a + b not in tokens:
            tokens.append(a + b)
        merged.append(f"{a} {b}")
    merges_ok = [m for m in merged if all(p in tokens for p in m.split(" "))]
    types = [1] * len(tokens)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types += [3, 3, 3]
    return tokens, types, merges_ok


def add_shape(w, spec, *, eps: float, rope_base: float) -> None:
    """The header keys every tiny decoder writes: sizes from ``spec`` (n_layers, d_model, d_ff, n_heads,
    n_kv_heads, head_dim), a 4096-token context, the RMS eps and the RoPE base."""
    w.add_context_length(4096)
    w.add_embedding_length(spec.d_model)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(spec.d_ff)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(rope_base)


def add_attention(mat, b: str, d: int, q: int, kv: int) -> None:
    """Layer ``b``'s q, k, v and output projections through ``mat(name, rows, cols, scale)``, each scaled by
    1 / sqrt(its input width)."""
    mat(b + "attn_q.weight", q, d, 1.0 / np.sqrt(d))
    mat(b + "attn_k.weight", kv, d, 1.0 / np.sqrt(d))
    mat(b + "attn_v.weight", kv, d, 1.0 / np.sqrt(d))
    mat(b + "attn_output.weight", d, q, 1.0 / np.sqrt(q))


def _add_bpe_tokenizer(w: gguf.GGUFWriter, pre: str = "qwen2") -> list[str]:
    """The byte-level BPE vocabulary (Qwen's tokenizer kind; ``pre``: its tokenizer.ggml.pre) written into
    ``w``; returns its tokens."""
    tokens, types, merges = _bpe_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(False)
    return tokens


def write_tiny_gguf(path, spec: TinySpec, *, seed: int = 0) -> str:
    """Write a random-weight ``spec.arch`` model with its tokenizer to ``path``; returns the path. A spec
    with a ``write`` method of its own (:class:`cukern.models.tiny_moe.MoeTinySpec`) writes itself."""
    if hasattr(spec, "write"):
        return spec.write(path, seed=seed)
    arch = spec.arch
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    if arch in ("gemma3", "llama"):
        tokens, types, scores = _spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(arch == "llama")
    else:
        tokens = _add_bpe_tokenizer(w)
    vocab = len(tokens)
    d, hd, ff = spec.d_model, spec.head_dim, spec.d_ff
    q, kv = spec.n_heads * hd, spec.n_kv_heads * hd
    add_shape(w, spec, eps=1e-6, rope_base=10000.0 if arch == "llama" else 1e6)
    if spec.rope_scale != 1.0:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec.rope_scale)
    if arch == "gemma3":
        w.add_sliding_window(spec.sliding_window)
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", spec.swa_pattern)

    def mat(name, rows, cols, scale):
        t = spec.qtype(name)
        blocks = random_blocks(rng, rows, cols, t, scale)
        w.add_tensor(name, blocks, raw_dtype=None if t in (QT.F32, QT.F16) else t)

    def vec(name, n, centre, spread):
        w.add_tensor(name, (centre + spread * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", vocab, d, 1.0)
    if spec.rope_freqs:
        w.add_tensor("rope_freqs.weight", rng.uniform(1.0, 8.0, hd // 2).astype(np.float32))
    vec("output_norm.weight", d, 1.0, 0.1)
    if arch != "gemma3":
        mat("output.weight", vocab, d, 1.0 / np.sqrt(d))
    for i in range(spec.n_layers):
        b = f"blk.{i}."
        vec(b + "attn_norm.weight", d, 1.0, 0.1)
        add_attention(mat, b, d, q, kv)
        vec(b + "ffn_norm.weight", d, 1.0, 0.1)
        mat(b + "ffn_gate.weight", ff, d, 1.0 / np.sqrt(d))
        mat(b + "ffn_up.weight", ff, d, 1.0 / np.sqrt(d))
        mat(b + "ffn_down.weight", d, ff, 1.0 / np.sqrt(ff))
        if arch in ("gemma3", "qwen3"):
            vec(b + "attn_q_norm.weight", hd, 1.0, 0.1)
            vec(b + "attn_k_norm.weight", hd, 1.0, 0.1)
        if arch == "qwen2":
            vec(b + "attn_q.bias", q, 0.0, 0.1)
            vec(b + "attn_k.bias", kv, 0.0, 0.1)
            vec(b + "attn_v.bias", kv, 0.0, 0.1)
        if arch == "gemma3":
            vec(b + "post_attention_norm.weight", d, 1.0, 0.1)
            vec(b + "post_ffw_norm.weight", d, 1.0, 0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
