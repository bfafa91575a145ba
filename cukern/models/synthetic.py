"""Full-size random-weight GGUF files with real MoE models' shapes, keys and block types, written
streaming (a chunk of rows at a time), for benchmarking without downloading the models.

Presets (:data:`PRESETS`), each value checked against a public source:

* ``gpt-oss-20b`` (arch ``gpt-oss``): 24 layers, d_model 2880, 64 query / 8 KV heads of 64, 32
  experts of 2880 rows, top-4, vocab 201088, RMS eps 1e-5, RoPE base 150000 with YaRN (factor 32
  over 4096 positions), a 128-token window on layers 0, 2, ..., context 131072 (openai/gpt-oss-20b's
  config.json as keras-hub's ``gpt_oss_20b_en`` and the slime ``gpt-oss-20B.sh`` restate it; llama.cpp
  ``src/models/openai-moe.cpp``: window period 2 when the file has no pattern key, 24 layers = 20B).
  Types as ggml-org's ``gpt-oss-20b-mxfp4.gguf`` (12.1 GB): experts MXFP4, embedding, LM head and
  attention Q8_0, norms, sinks, router and biases F32 (12.10 GB). Tokenizer ``gpt2`` / pre ``gpt-4o``, bos
  199998, eos 200002, pad 199999.
* ``qwen3-30b-a3b`` (arch ``qwen3moe``): 48 layers, d_model 2048, 32 query / 4 KV heads of 128,
  Q/K norm, 128 experts of 768 rows, top-8, vocab 151936, RMS eps 1e-6, RoPE base 1e6, context
  40960, feed_forward_length 6144 (Qwen3MoeForCausalLM configs of that shape; MindSpeed-RL's
  ``qwen3_30b_a3b.yaml``; llama.cpp ``src/models/qwen3moe.cpp``: 48 layers = 30B.A3B). Types as
  llama.cpp's Q4_K_M rule (``src/llama-quant.cpp``): Q4_K everywhere except ``attn_v`` and
  ``ffn_down_exps`` Q6_K on the layers ``use_more_bits`` picks (the first and last eighth, every
  third between) and the LM head Q6_K (18.55 GB; public Q4_K_M files are 18.6 GB). Tokenizer
  ``gpt2`` / pre ``qwen2``, bos 151643, eos 151645.

Tensor names and shapes are those ``load_arch_tensors`` creates for ``LLM_ARCH_OPENAI_MOE`` /
``LLM_ARCH_QWEN3MOE`` (no extra tensor: llama.cpp refuses a file with unused ones) and
:meth:`cukern.models.moe_config.MoeConfig.required_tensors` asks for.

Weights: quant bits are random bytes; f16 block scales (Q8_0, K-quants) and e8m0 exponents
(MXFP4) are set so values are about 1 / sqrt(input width). The vocabulary is synthetic but
well-formed byte-level BPE: the 256 byte characters, then pairs and triples of them, each with its
merge, and the presets' control tokens at their real ids.

:func:`scaled` keeps every matrix's shape and shrinks the counts (layers, experts, vocabulary) for
tests. CLI::

    python -m cukern.models.synthetic gpt-oss-20b /tmp/gpt-oss-20b.gguf [--layers N] [--experts E]
        [--vocab V] [--seed S]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from cukern.models.tiny import random_blocks

__all__ = ["Preset", "PRESETS", "preset", "scaled", "tensor_plan", "file_bytes", "write_synthetic_gguf",
           "synthetic_vocab", "fast_blocks"]

_CHUNK_BYTES = 64 << 20   # rows generated and written per chunk: peak host memory is a few of these


@dataclass(frozen=True)
class Preset:
    """A model's hyperparameters and block types (``types(name, layer) -> QT`` for matrices)."""

    name: str
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    d_ff_exp: int
    d_ff: int                    # {arch}.feed_forward_length as the public file writes it
    vocab: int
    context: int
    rms_eps: float
    rope_base: float
    specials: dict = field(default_factory=dict)   # token id -> text (control tokens)
    bos: int = 0
    eos: int = 0
    pad: int | None = None
    tokenizer_pre: str = "default"
    sliding_window: int = 0
    yarn: tuple = ()             # (factor, original_context)
    types: object = None

    def qtype(self, name: str, layer: int) -> QT:
        return self.types(name, layer, self.n_layers)


def _gpt_oss_types(name: str, layer: int, n_layers: int) -> QT:
    return QT.MXFP4 if name.endswith("_exps.weight") else QT.Q8_0


def _use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's Q4_K_M choice of the layers whose attn_v and ffn_down get Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _q4_k_m_types(name: str, layer: int, n_layers: int) -> QT:
    if name == "output.weight":
        return QT.Q6_K
    if name.endswith(("attn_v.weight", "ffn_down_exps.weight")) and _use_more_bits(layer, n_layers):
        return QT.Q6_K
    return QT.Q4_K


PRESETS = {
    "gpt-oss-20b": Preset(
        "gpt-oss-20b", "gpt-oss", n_layers=24, d_model=2880, n_heads=64, n_kv_heads=8, head_dim=64, n_experts=32,
        top_k=4, d_ff_exp=2880, d_ff=2880, vocab=201088, context=131072, rms_eps=1e-5, rope_base=150000.0,
        specials={199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
                  200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>",
                  200012: "<|call|>"},
        bos=199998, eos=200002, pad=199999, tokenizer_pre="gpt-4o", sliding_window=128, yarn=(32.0, 4096),
        types=_gpt_oss_types),
    "qwen3-30b-a3b": Preset(
        "qwen3-30b-a3b", "qwen3moe", n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4, head_dim=128,
        n_experts=128, top_k=8, d_ff_exp=768, d_ff=6144, vocab=151936, context=40960, rms_eps=1e-6,
        rope_base=1e6, specials={151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"},
        bos=151643, eos=151645, pad=151643, tokenizer_pre="qwen2", types=_q4_k_m_types),
}


def preset(name: str) -> Preset:
    """The preset ``name``; ValueError naming the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown synthetic preset {name!r}; known: {', '.join(PRESETS)}") from None


def scaled(p: Preset, *, layers: int | None = None, experts: int | None = None, vocab: int | None = None) -> Preset:
    """``p`` with fewer layers, experts (top-k capped to them) or vocabulary entries; every matrix keeps
    its row and column widths. The control tokens keep their distance from the vocabulary's end."""
    layers, experts, vocab = layers or p.n_layers, experts or p.n_experts, vocab or p.vocab
    shift = p.vocab - vocab
    if min(p.specials) - shift < 256 + 2:
        raise ValueError(f"vocab {vocab} leaves no room for the byte tokens before {p.name}'s control tokens")
    if layers < 1 or experts < 1:
        raise ValueError("layers and experts must be >= 1")

    def move(i):
        return None if i is None else i - shift

    return dataclasses.replace(p, n_layers=layers, n_experts=experts, top_k=min(p.top_k, experts), vocab=vocab,
                               specials={i - shift: t for i, t in p.specials.items()}, bos=move(p.bos),
                               eos=move(p.eos), pad=move(p.pad))


def tensor_plan(p: Preset) -> list[tuple[str, tuple[int, ...], QT, float]]:
    """Every tensor in file order: (name, shape in PyTorch order, type, value scale). F32 vectors carry
    a negative scale: -1 marks a norm (values about 1), other values the spread of a bias about 0."""
    d, hd, e, ff, V = p.d_model, p.head_dim, p.n_experts, p.d_ff_exp, p.vocab
    q, kv = p.n_heads * hd, p.n_kv_heads * hd
    gpt_oss = p.arch == "gpt-oss"
    out = [("token_embd.weight", (V, d), p.qtype("token_embd.weight", 0), 1.0),
           ("output_norm.weight", (d,), QT.F32, -1.0),
           ("output.weight", (V, d), p.qtype("output.weight", 0), 1.0 / math.sqrt(d))]
    for i in range(p.n_layers):
        b = f"blk.{i}."

        def mat(name, shape, scale):
            out.append((b + name, shape, p.qtype(b + name, i), scale))

        def f32(name, shape, scale):
            out.append((b + name, shape, QT.F32, scale))

        f32("attn_norm.weight", (d,), -1.0)
        mat("attn_q.weight", (q, d), 1 / math.sqrt(d))
        mat("attn_k.weight", (kv, d), 1 / math.sqrt(d))
        mat("attn_v.weight", (kv, d), 1 / math.sqrt(d))
        mat("attn_output.weight", (d, q), 1 / math.sqrt(q))
        f32("post_attention_norm.weight" if gpt_oss else "ffn_norm.weight", (d,), -1.0)
        if gpt_oss:
            for name, n in (("attn_q.bias", q), ("attn_k.bias", kv), ("attn_v.bias", kv), ("attn_output.bias", d)):
                f32(name, (n,), -0.1)
            f32("attn_sinks.weight", (p.n_heads,), -1.0 / 2)
        else:
            f32("attn_q_norm.weight", (hd,), -1.0)
            f32("attn_k_norm.weight", (hd,), -1.0)
        out.append((b + "ffn_gate_inp.weight", (e, d), QT.F32, 1 / math.sqrt(d)))
        mat("ffn_gate_exps.weight", (e, ff, d), 1 / math.sqrt(d))
        mat("ffn_up_exps.weight", (e, ff, d), 1 / math.sqrt(d))
        mat("ffn_down_exps.weight", (e, d, ff), 1 / math.sqrt(ff))
        if gpt_oss:
            f32("ffn_gate_inp.bias", (e,), -0.5)
            f32("ffn_gate_exps.bias", (e, ff), -0.1)
            f32("ffn_up_exps.bias", (e, ff), -0.1)
            f32("ffn_down_exps.bias", (e, d), -0.1)
    return out


def _row_bytes(cols: int, qtype: QT) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{cols} columns are not whole {qtype.name} blocks of {block}")
    return cols // block * size


def tensor_bytes(shape: tuple[int, ...], qtype: QT) -> int:
    return math.prod(shape[:-1]) * _row_bytes(shape[-1], qtype)


def file_bytes(p: Preset) -> int:
    """The tensor data's size (the header and vocabulary add a few MB)."""
    return sum(tensor_bytes(shape, t) for _, shape, t, _ in tensor_plan(p))


def fast_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: QT, scale: float) -> np.ndarray:
    """``uint8 [rows, row bytes]`` of valid ``qtype`` blocks with values about ``scale``, from random bytes
    (Q8_0: f16 d; MXFP4: e8m0 exponent byte); the K-quants through :func:`cukern.models.tiny.random_blocks`."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    if qtype == QT.Q8_0:
        # d (f16) then 32 int8 quants, uniform in [-128, 127]: rms ~74
        b = np.frombuffer(rng.bytes(n * size), np.uint8).reshape(n, size).copy()
        d = (rng.uniform(0.75, 1.25, n) * scale / 74).astype(np.float16)
        b[:, 0:2] = d.view(np.uint8).reshape(n, 2)
    elif qtype == QT.MXFP4:
        # e8m0 exponent e then 16 bytes of 4-bit codes; w = kvalue * 2**(e - 128), kvalues' rms ~5.9
        b = np.frombuffer(rng.bytes(n * size), np.uint8).reshape(n, size).copy()
        e = 128 + round(math.log2(scale / 5.9))
        b[:, 0] = rng.integers(e - 1, e, n, dtype=np.uint8, endpoint=True)
    else:
        return random_blocks(rng, rows, cols, qtype, scale)
    return b.reshape(rows, -1)


def _f32(rng: np.random.Generator, shape, scale: float) -> np.ndarray:
    if scale == -1.0:                                      # a norm's weight
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    return (abs(scale) * rng.standard_normal(shape)).astype(np.float32)


def synthetic_vocab(p: Preset) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE vocabulary of ``p.vocab`` entries: the 256 byte
    characters, pairs of them, then pairs followed by one more, each with its merge; ``p.specials`` as
    control tokens (type 3) at their ids."""
    from cukern.models.tokenizer import _bytes_to_unicode
    chars = [_bytes_to_unicode()[b] for b in range(256)]
    n_free = p.vocab - 256 - sum(1 for i in p.specials if i >= 256)
    pieces, merges = [], []
    for a in chars:                       # pairs, then triples (pair + char), in rank order
        for b in chars:
            if len(pieces) == n_free:
                break
            pieces.append(a + b)
            merges.append(f"{a} {b}")
    for ab in list(pieces):
        for c in chars:
            if len(pieces) >= n_free:
                break
            pieces.append(ab + c)
            merges.append(f"{ab} {c}")
    it = iter(pieces)
    tokens = [p.specials[i] if i in p.specials else (chars[i] if i < 256 else next(it)) for i in range(p.vocab)]
    types = [3 if i in p.specials else 1 for i in range(p.vocab)]
    return tokens, types, merges


def _add_keys(w: gguf.GGUFWriter, p: Preset) -> None:
    w.add_name(f"{p.name} (synthetic random weights)")
    w.add_context_length(p.context)
    w.add_embedding_length(p.d_model)
    w.add_block_count(p.n_layers)
    w.add_feed_forward_length(p.d_ff)
    w.add_head_count(p.n_heads)
    w.add_head_count_kv(p.n_kv_heads)
    w.add_key_length(p.head_dim)
    w.add_value_length(p.head_dim)
    w.add_layer_norm_rms_eps(p.rms_eps)
    w.add_rope_freq_base(p.rope_base)
    w.add_expert_count(p.n_experts)
    w.add_expert_used_count(p.top_k)
    w.add_expert_feed_forward_length(p.d_ff_exp)
    if p.sliding_window:
        w.add_sliding_window(p.sliding_window)
    if p.yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(p.yarn[0])
        w.add_rope_scaling_orig_ctx_len(p.yarn[1])
    tokens, types, merges = synthetic_vocab(p)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(p.tokenizer_pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(p.bos)
    w.add_eos_token_id(p.eos)
    if p.pad is not None:
        w.add_pad_token_id(p.pad)
    w.add_add_bos_token(False)


def write_synthetic_gguf(path, p: Preset | str, *, seed: int = 0, progress: bool = False) -> str:
    """Write ``p`` (a :class:`Preset` or a preset name) with random weights to ``path``; returns the path.
    Tensors are generated and written ``_CHUNK_BYTES`` of rows at a time, into ``path + ".part"``, renamed
    to ``path`` when complete (an interrupted write never leaves a file at ``path``)."""
    p = preset(p) if isinstance(p, str) else p
    rng = np.random.default_rng(seed)
    plan = tensor_plan(p)
    part = f"{path}.part"
    w = gguf.GGUFWriter(part, p.arch)
    _add_keys(w, p)
    for name, shape, t, _ in plan:
        if t == QT.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), tensor_bytes(shape, t))
        else:
            byte_shape = (*shape[:-1], _row_bytes(shape[-1], t))
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), tensor_bytes(shape, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    w.write_padding(fout, fout.tell())
    total, done, t0 = file_bytes(p), 0, time.perf_counter()
    for name, shape, t, scale in plan:
        if t == QT.F32 and scale < 0 or len(shape) == 1:
            _f32(rng, shape, scale).tofile(fout)
        else:
            rows, cols = math.prod(shape[:-1]), shape[-1]
            step = max(1, _CHUNK_BYTES // _row_bytes(cols, t))
            for r0 in range(0, rows, step):
                n = min(step, rows - r0)
                (_f32(rng, (n, cols), scale) if t == QT.F32 else fast_blocks(rng, n, cols, t, scale)).tofile(fout)
        nbytes = tensor_bytes(shape, t)
        w.write_padding(fout, nbytes)
        done += nbytes
        if progress and name.endswith("ffn_down_exps.weight"):
            print(f"\r{part}: {done / 1e9:.1f} / {total / 1e9:.1f} GB, {time.perf_counter() - t0:.0f} s",
                  end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    w.close()
    os.replace(part, path)
    return str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cukern.models.synthetic", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", help=", ".join(PRESETS))
    ap.add_argument("path")
    ap.add_argument("--layers", type=int, help="fewer layers (same per-layer shapes)")
    ap.add_argument("--experts", type=int, help="fewer experts per layer (same expert shapes)")
    ap.add_argument("--vocab", type=int, help="a smaller vocabulary")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        p = scaled(preset(args.preset), layers=args.layers, experts=args.experts, vocab=args.vocab)
    except ValueError as e:
        ap.error(str(e))
    print(f"{args.path}: {p.name}, {p.n_layers} layers, {p.n_experts} experts, vocab {p.vocab}: "
          f"{file_bytes(p) / 1e9:.2f} GB", file=sys.stderr)
    t0 = time.perf_counter()
    write_synthetic_gguf(args.path, p, seed=args.seed, progress=True)
    print(f"wrote {os.path.getsize(args.path) / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
