"""Tiny random-weight GGUF files of the mixture-of-experts architectures (``qwen3moe``, ``qwen2moe``,
``gpt-oss``), with llama.cpp's keys, tensor names and layouts (:mod:`cukern.models.moe_config`).

:class:`MoeTinySpec` extends :class:`cukern.models.tiny.TinySpec` with the expert shapes;
``write_tiny_gguf(path, MoeTinySpec(...))`` writes one (it calls :meth:`MoeTinySpec.write`). Expert
tensors are 3-D ([n_experts, rows, cols], each expert's rows one after the other), quantized per
``types`` (default: MXFP4 for gpt-oss, gate and up Q4_K and down Q8_0 otherwise); routers, the shared
expert's gate, sinks and biases F32.
"""

from __future__ import annotations

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from cukern.models.tiny import TinySpec, _add_bpe_tokenizer, add_attention, add_shape, random_blocks

__all__ = ["MoeTinySpec", "MOE_PRESETS", "add_expert_keys", "add_experts", "add_shared_expert", "EXPERT_TYPES"]

# the expert tensors' default block types (gpt-oss: MXFP4)
EXPERT_TYPES = {"ffn_gate_exps.weight": QT.Q4_K, "ffn_up_exps.weight": QT.Q4_K, "ffn_down_exps.weight": QT.Q8_0}


class MoeTinySpec(TinySpec):
    """A tiny MoE model: ``n_experts`` experts of ``d_ff`` rows, ``top_k`` used per token, a shared expert
    of ``d_ff_shexp`` rows where > 0. gpt-oss: ``sliding_window`` on layers 0, 2, ... (``window_pattern``:
    an int period or a list of bools written as ``attention.sliding_window_pattern``; None writes no key),
    YaRN ``yarn_factor`` over ``yarn_context`` positions."""

    def __init__(self, arch: str, *, n_experts: int = 16, top_k: int = 4, d_ff: int = 256, d_ff_shexp: int = 0,
                 yarn_factor: float = 32.0, yarn_context: int = 4096, window_pattern=None, router_scale: float = 1.0,
                 **kw):
        kw.setdefault("weight_type", QT.Q8_0)
        kw.setdefault("sliding_window", 8)
        super().__init__(arch, d_ff=d_ff, **kw)
        self.n_experts, self.top_k, self.d_ff_shexp = n_experts, top_k, d_ff_shexp
        self.yarn_factor, self.yarn_context, self.window_pattern = yarn_factor, yarn_context, window_pattern
        self.router_scale = router_scale
        default = {n: QT.MXFP4 for n in EXPERT_TYPES} if arch == "gpt-oss" else EXPERT_TYPES
        self.types = {**default, **self.types}

    def write(self, path, *, seed: int = 0) -> str:
        return _write(path, self, seed)


MOE_PRESETS = {
    "qwen3moe": lambda **kw: MoeTinySpec("qwen3moe", **{"n_experts": 16, "top_k": 8, **kw}),
    "qwen3moe-shexp": lambda **kw: MoeTinySpec("qwen3moe", **{"n_experts": 16, "top_k": 8, "d_ff_shexp": 512, **kw}),
    "qwen2moe": lambda **kw: MoeTinySpec("qwen2moe", **{"n_experts": 8, "top_k": 2, "d_ff_shexp": 512, **kw}),
    "gpt-oss": lambda **kw: MoeTinySpec("gpt-oss", **{"n_experts": 32, "top_k": 4, "n_heads": 8, **kw}),
}


def add_expert_keys(w, n_experts: int, top_k: int, d_ff: int, d_ff_shexp: int = 0) -> None:
    """The expert keys of ``w``'s architecture (the shared expert's length where > 0)."""
    w.add_expert_count(n_experts)
    w.add_expert_used_count(top_k)
    w.add_expert_feed_forward_length(d_ff)
    if d_ff_shexp:
        w.add_expert_shared_feed_forward_length(d_ff_shexp)


def add_experts(mat, f32, b: str, d: int, ff: int, e: int, router_scale: float = 1.0) -> None:
    """Layer prefix ``b``'s router (F32 [e, d]) and 3-D expert tensors through the writer's
    ``mat(name, rows, cols, scale, experts)`` and ``f32(name, shape, centre, spread)``."""
    f32(b + "ffn_gate_inp.weight", (e, d), 0.0, router_scale / np.sqrt(d))
    mat(b + "ffn_gate_exps.weight", ff, d, 1.0 / np.sqrt(d), e)
    mat(b + "ffn_up_exps.weight", ff, d, 1.0 / np.sqrt(d), e)
    mat(b + "ffn_down_exps.weight", d, ff, 1.0 / np.sqrt(ff), e)


def add_shared_expert(mat, f32, b: str, d: int, fs: int) -> None:
    """Layer prefix ``b``'s shared expert of ``fs`` rows and its gate (F32 [d]), as :func:`add_experts`."""
    f32(b + "ffn_gate_inp_shexp.weight", d, 0.0, 1.0 / np.sqrt(d))
    mat(b + "ffn_gate_shexp.weight", fs, d, 1.0 / np.sqrt(d))
    mat(b + "ffn_up_shexp.weight", fs, d, 1.0 / np.sqrt(d))
    mat(b + "ffn_down_shexp.weight", d, fs, 1.0 / np.sqrt(fs))


def _write(path, spec: MoeTinySpec, seed: int) -> str:
    arch, rng = spec.arch, np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    gpt_oss = arch == "gpt-oss"
    tokens = _add_bpe_tokenizer(w, "gpt-4o" if gpt_oss else "qwen2")  # gpt-oss's files: o200k's pre-tokenizer
    vocab, d, hd, ff, e = len(tokens), spec.d_model, spec.head_dim, spec.d_ff, spec.n_experts
    q, kv = spec.n_heads * hd, spec.n_kv_heads * hd
    add_shape(w, spec, eps=1e-5 if gpt_oss else 1e-6, rope_base=150000.0 if gpt_oss else 1e6)
    add_expert_keys(w, e, spec.top_k, ff, spec.d_ff_shexp)
    if gpt_oss:
        w.add_sliding_window(spec.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(spec.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(spec.yarn_context)
        if isinstance(spec.window_pattern, (list, tuple)):
            w.add_array(f"{arch}.attention.sliding_window_pattern", [bool(v) for v in spec.window_pattern])
        elif spec.window_pattern is not None:
            w.add_uint32(f"{arch}.attention.sliding_window_pattern", spec.window_pattern)

    def mat(name, rows, cols, scale, experts=0):
        t = spec.qtype(name)
        blocks = random_blocks(rng, rows * max(experts, 1), cols, t, scale)
        if experts:
            blocks = blocks.reshape(experts, rows, -1)
        w.add_tensor(name, blocks, raw_dtype=None if t in (QT.F32, QT.F16) else t)

    def f32(name, shape, centre, spread):
        w.add_tensor(name, (centre + spread * rng.standard_normal(shape)).astype(np.float32))

    mat("token_embd.weight", vocab, d, 1.0)
    f32("output_norm.weight", d, 1.0, 0.1)
    mat("output.weight", vocab, d, 1.0 / np.sqrt(d))
    for i in range(spec.n_layers):
        b = f"blk.{i}."
        f32(b + "attn_norm.weight", d, 1.0, 0.1)
        add_attention(mat, b, d, q, kv)
        f32(b + ("post_attention_norm.weight" if gpt_oss else "ffn_norm.weight"), d, 1.0, 0.1)
        add_experts(mat, f32, b, d, ff, e, spec.router_scale)
        if arch == "qwen3moe":
            f32(b + "attn_q_norm.weight", hd, 1.0, 0.1)
            f32(b + "attn_k_norm.weight", hd, 1.0, 0.1)
        if arch in ("qwen2moe", "gpt-oss"):
            f32(b + "attn_q.bias", q, 0.0, 0.1)
            f32(b + "attn_k.bias", kv, 0.0, 0.1)
            f32(b + "attn_v.bias", kv, 0.0, 0.1)
        if gpt_oss:
            f32(b + "attn_output.bias", d, 0.0, 0.1)
            f32(b + "attn_sinks.weight", spec.n_heads, 0.0, 1.0)
            f32(b + "ffn_gate_inp.bias", e, 0.0, 0.5)
            f32(b + "ffn_gate_exps.bias", (e, ff), 0.0, 0.1)
            f32(b + "ffn_up_exps.bias", (e, ff), 0.0, 0.1)
            f32(b + "ffn_down_exps.bias", (e, d), 0.0, 0.1)
        if spec.d_ff_shexp:
            add_shared_expert(mat, f32, b, d, spec.d_ff_shexp)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
