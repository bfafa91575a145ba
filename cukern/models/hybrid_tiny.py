"""Tiny random-weight ``qwen3next`` (DeltaNet hybrid) GGUF files (:func:`cukern.models.tiny.write_tiny_gguf` of a
:class:`HybridSpec`).

:class:`HybridSpec` adds the hybrid's dimensions to :class:`cukern.models.tiny.TinySpec`; the writer keeps the
layouts llama.cpp reads (module docstring of :mod:`cukern.models.hybrid_config`), quantizes the projections
to the spec's block types (Q8_0 unless told) and keeps the conv taps, ``ssm_a``, ``ssm_dt.bias`` and norms
F32. The gates are drawn so that the DeltaNet state decays slowly enough to carry several tokens.
``legacy=True`` writes the in-projection as one ``ssm_in`` tensor (per key head q, k, v, z) with the very
rows the split layout would hold, so both files run the same model. ``n_experts > 0`` writes Qwen3-Next's
MoE FFN instead of the dense one (:mod:`cukern.models.tiny_moe`'s keys and tensors: an F32 router, 3-D
experts, Q4_K gate and up and Q8_0 down unless told, a shared expert and its F32 gate).
"""

from __future__ import annotations

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from cukern.models.tiny import TinySpec, _add_bpe_tokenizer, add_shape, random_blocks
from cukern.models.tiny_moe import EXPERT_TYPES, add_expert_keys, add_experts, add_shared_expert

__all__ = ["HybridSpec", "write_tiny"]


class HybridSpec(TinySpec):
    """A tiny DeltaNet hybrid: ``n_layers`` layers, every ``interval``-th full attention (partial RoPE over
    ``rope_dim`` dims); DeltaNet layers with ``ssm_k_heads`` key heads of ``ssm_dk`` and ``ssm_v_heads`` value
    heads of ``ssm_dv``, a conv1d of ``conv_kernel`` taps; a dense SwiGLU FFN of ``d_ff``, or (``n_experts``
    > 0) ``n_experts`` experts of ``d_ff_exp`` rows, ``top_k`` per token, a shared expert of ``d_ff_shexp``."""

    def __init__(self, *, n_layers: int = 4, interval: int = 2, d_model: int = 256, n_heads: int = 4,
                 n_kv_heads: int = 2, head_dim: int = 64, rope_dim: int = 16, d_ff: int = 512, ssm_k_heads: int = 2,
                 ssm_v_heads: int = 4, ssm_dk: int = 64, ssm_dv: int = 64, conv_kernel: int = 4,
                 weight_type: QT = QT.Q8_0, types: dict | None = None, legacy: bool = False, tied: bool = False,
                 interval_key: int | None = None, n_experts: int = 0, top_k: int = 0, d_ff_exp: int = 0,
                 d_ff_shexp: int = 0, router_scale: float = 1.0):
        super().__init__("qwen3next", n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
                         head_dim=head_dim, d_ff=d_ff, weight_type=weight_type, types=types)
        self.interval, self.rope_dim = interval, rope_dim
        self.interval_key = interval if interval_key is None else interval_key  # what the file says
        self.ssm_k_heads, self.ssm_v_heads, self.ssm_dk, self.ssm_dv = ssm_k_heads, ssm_v_heads, ssm_dk, ssm_dv
        self.conv_kernel, self.legacy, self.tied = conv_kernel, legacy, tied
        self.n_experts, self.top_k, self.d_ff_exp, self.d_ff_shexp = n_experts, top_k, d_ff_exp, d_ff_shexp
        self.router_scale = router_scale
        if n_experts:
            self.types = {**EXPERT_TYPES, **self.types}

    def recurrent(self, i: int) -> bool:
        return (i + 1) % self.interval != 0

    def write(self, path, *, seed: int = 0) -> str:
        """What :func:`cukern.models.tiny.write_tiny_gguf` calls for this spec: :func:`write_tiny`."""
        return write_tiny(path, self, seed=seed)


def write_tiny(path, spec: HybridSpec, *, seed: int = 0, skip: tuple[str, ...] = ()) -> str:
    """Write ``spec`` with random weights to ``path``; returns the path. ``skip``: tensor names left out (for
    the loader's error tests)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3next")
    tokens = _add_bpe_tokenizer(w)
    vocab, d, hd = len(tokens), spec.d_model, spec.head_dim
    q, kv = spec.n_heads * hd, spec.n_kv_heads * hd
    n_k, n_v, dk, dv = spec.ssm_k_heads, spec.ssm_v_heads, spec.ssm_dk, spec.ssm_dv
    qk, v, rep = n_k * dk, n_v * dv, n_v // n_k
    add_shape(w, spec, eps=1e-6, rope_base=1e6)
    w.add_rope_dimension_count(spec.rope_dim)
    w.add_ssm_conv_kernel(spec.conv_kernel)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(n_k)
    w.add_ssm_time_step_rank(n_v)
    w.add_ssm_inner_size(v)
    w.add_full_attention_interval(spec.interval_key)
    if spec.n_experts:
        add_expert_keys(w, spec.n_experts, spec.top_k, spec.d_ff_exp, spec.d_ff_shexp)

    def put(name, data, raw_type=None):
        if name.split("blk.")[-1].split(".", 1)[-1] in skip or name in skip:
            return
        w.add_tensor(name, data, raw_dtype=raw_type)

    def blocks(name, rows, cols, scale, t=None, experts=0):
        t = t if t is not None else spec.qtype(name)
        data = random_blocks(rng, rows * max(experts, 1), cols, t, scale)
        return data.reshape(experts, rows, -1) if experts else data, (None if t in (QT.F32, QT.F16) else t)

    def mat(name, rows, cols, scale, experts=0):
        put(name, *blocks(name, rows, cols, scale, experts=experts))

    def vec(name, n, centre, spread):
        put(name, (centre + spread * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", vocab, d, 1.0)
    vec("output_norm.weight", d, 1.0, 0.1)
    if not spec.tied:
        mat("output.weight", vocab, d, 1.0 / np.sqrt(d))
    for i in range(spec.n_layers):
        b = f"blk.{i}."
        vec(b + "attn_norm.weight", d, 1.0, 0.1)
        vec(b + "post_attention_norm.weight", d, 1.0, 0.1)
        if spec.recurrent(i):
            t = spec.qtype(b + "attn_qkv.weight")
            qkv, raw_t = blocks(b + "attn_qkv.weight", 2 * qk + v, d, 1.0 / np.sqrt(d), t)
            z, _ = blocks(b + "attn_gate.weight", v, d, 1.0 / np.sqrt(d), t)
            if spec.legacy:   # per key head: its q, its k, its value heads' v, their z
                parts = [np.concatenate([qkv[h * dk:(h + 1) * dk], qkv[qk + h * dk:qk + (h + 1) * dk],
                                         qkv[2 * qk + h * rep * dv:2 * qk + (h + 1) * rep * dv],
                                         z[h * rep * dv:(h + 1) * rep * dv]]) for h in range(n_k)]
                put(b + "ssm_in.weight", np.concatenate(parts), raw_t)
            else:
                put(b + "attn_qkv.weight", qkv, raw_t)
                put(b + "attn_gate.weight", z, raw_t)
            mat(b + "ssm_ba.weight", 2 * n_v, d, 1.0 / np.sqrt(d))
            put(b + "ssm_conv1d.weight", (0.5 * rng.standard_normal((2 * qk + v, spec.conv_kernel))).astype(np.float32))
            put(b + "ssm_a", -rng.uniform(0.5, 4.0, n_v).astype(np.float32))
            put(b + "ssm_dt.bias", rng.uniform(-4.0, -1.0, n_v).astype(np.float32))
            vec(b + "ssm_norm.weight", dv, 1.0, 0.1)
            mat(b + "ssm_out.weight", d, v, 1.0 / np.sqrt(v))
        else:
            mat(b + "attn_q.weight", 2 * q, d, 1.0 / np.sqrt(d))
            mat(b + "attn_k.weight", kv, d, 1.0 / np.sqrt(d))
            mat(b + "attn_v.weight", kv, d, 1.0 / np.sqrt(d))
            mat(b + "attn_output.weight", d, q, 1.0 / np.sqrt(q))
            vec(b + "attn_q_norm.weight", hd, 1.0, 0.1)
            vec(b + "attn_k_norm.weight", hd, 1.0, 0.1)
        if spec.n_experts:
            add_experts(mat, vec, b, d, spec.d_ff_exp, spec.n_experts, spec.router_scale)
            add_shared_expert(mat, vec, b, d, spec.d_ff_shexp)
        else:
            mat(b + "ffn_gate.weight", spec.d_ff, d, 1.0 / np.sqrt(d))
            mat(b + "ffn_up.weight", spec.d_ff, d, 1.0 / np.sqrt(d))
            mat(b + "ffn_down.weight", d, spec.d_ff, 1.0 / np.sqrt(spec.d_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
