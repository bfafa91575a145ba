"""GGUF metadata and tensor list of the DeltaNet hybrid (llama.cpp's ``qwen3next`` architecture).

Qwen3-Next interleaves gated DeltaNet layers (linear attention with a recurrent state) with full-attention
layers: layer i is full attention where ``(i + 1) % full_attention_interval == 0``, DeltaNet elsewhere.
:func:`load_gguf` reaches this module through ``gguf_loader.ARCH_MODULES``; it needs no GPU.

Keys (``qwen3next.`` prefix) beside the usual ones: ``ssm.conv_kernel`` (taps of the causal conv1d),
``ssm.state_size`` (key head dim dk), ``ssm.group_count`` (key heads), ``ssm.time_step_rank`` (value heads),
``ssm.inner_size`` (value heads x value head dim), ``full_attention_interval`` (default 4),
``rope.dimension_count`` (rotated leading dims of an attention head).

Tensors of a DeltaNet layer (PyTorch order): ``attn_qkv.weight`` [2 n_k dk + n_v dv, d] (q of every key head,
then k, then v; the conv1d's channels in that order) and ``attn_gate.weight`` [n_v dv, d] (z, the output
gate), or the legacy ``ssm_in.weight`` [2 n_k dk + 2 n_v dv, d] (per key head q, k, v, z: rows regrouped at
load); ``ssm_ba.weight`` [2 n_v, d] (per key head its value heads' b logits, then their alphas),
``ssm_conv1d.weight`` [channels, conv_kernel] F32, ``ssm_a`` [n_v] (-exp(A_log)), ``ssm_dt.bias`` [n_v],
``ssm_norm.weight`` [dv], ``ssm_out.weight`` [d, n_v dv]. A full-attention layer: ``attn_q.weight``
[2 n_heads head_dim, d] (per head the query, then its output gate), ``attn_k`` / ``attn_v``, ``attn_output``,
``attn_q_norm`` / ``attn_k_norm``. Every layer: ``attn_norm`` and ``post_attention_norm`` (the FFN's input
norm), then its FFN: dense ``ffn_gate`` / ``ffn_up`` / ``ffn_down``, or (a file with ``expert_count``: the
files Qwen3-Next ships) the MoE block of :mod:`cukern.models.moe_config`'s layouts with a shared expert and
its sigmoid gate; routing is a softmax over every expert, the top ``expert_used_count``, their weights
renormalised to sum to 1 (llama.cpp's qwen3next). :attr:`HybridConfig.moe` is the block's MoeConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import numpy as np

from cukern.models.gguf_loader import ModelConfig
from cukern.models.gguf_parse import _INT32_MAX, GGUFError, read_key
from cukern.models.moe_config import MoeConfig, read_experts

__all__ = ["HybridConfig", "config", "required_tensors", "legacy_rows", "CONV_KERNELS", "ARCH"]

ARCH = "qwen3next"
CONV_KERNELS = (2, 3, 4)  # taps the conv1d_silu kernel has instances for


@dataclass(frozen=True)
class HybridConfig(ModelConfig):
    """ModelConfig plus the DeltaNet hybrid's layer pattern, recurrent dimensions and FFN kind."""

    full_attention_interval: int
    recurrent: tuple[bool, ...]   # per layer: True for a DeltaNet layer
    conv_kernel: int              # conv1d taps (its state keeps conv_kernel - 1 inputs)
    ssm_k_heads: int              # DeltaNet key (and query) heads
    ssm_v_heads: int              # DeltaNet value heads (state matrices); a multiple of ssm_k_heads
    ssm_dk: int                   # key head dim (state rows)
    ssm_dv: int                   # value head dim (state columns)
    rope_dim: int                 # rotated leading dims of an attention head (partial RoPE)
    ffn: str                      # "dense" (SwiGLU) or "moe" (routed experts + a gated shared expert)
    ssm_in_legacy: bool           # the in-projection is one ssm_in tensor (per key head q, k, v, z)
    n_experts: int = 0            # the MoE FFN's (ffn "moe"); d_ff stays the file's feed_forward_length
    n_experts_used: int = 0
    d_ff_exp: int = 0
    d_ff_shexp: int = 0
    norm_topk: bool = True        # the k routing weights renormalised (llama.cpp's qwen3next: always)

    allowed_types = MoeConfig.allowed_types   # F32 routers, the expert types for the 3-D expert tensors

    @cached_property
    def moe(self) -> MoeConfig:
        """The :class:`MoeConfig` the MoE block and its reference read (``d_ff`` the experts' length)."""
        base = {f.name: getattr(self, f.name) for f in fields(ModelConfig)}
        return MoeConfig(**{**base, "d_ff": self.d_ff_exp}, n_experts=self.n_experts,
                         n_experts_used=self.n_experts_used, d_ff_shexp=self.d_ff_shexp, norm_topk=self.norm_topk)

    @property
    def qk_channels(self) -> int:
        """Elements of q (and of k) per token: n_k * dk."""
        return self.ssm_k_heads * self.ssm_dk

    @property
    def v_channels(self) -> int:
        """Elements of v (and of z, and of the DeltaNet output) per token: n_v * dv."""
        return self.ssm_v_heads * self.ssm_dv

    @property
    def conv_channels(self) -> int:
        return 2 * self.qk_channels + self.v_channels

    @property
    def attn_layers(self) -> tuple[int, ...]:
        """The full-attention layers, in order (their K/V cache layers are 0, 1, ...)."""
        return tuple(i for i, r in enumerate(self.recurrent) if not r)

    def required_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the hybrid forward reads (gguf_loader's per-architecture hook): :func:`required_tensors`."""
        return required_tensors(self)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """One sequence's recurrent state per DeltaNet layer: the conv1d's last inputs of q, k and v
        (oldest first) and the delta rule's matrices."""
        k1 = self.conv_kernel - 1
        return {"conv_q": (k1, self.qk_channels), "conv_k": (k1, self.qk_channels), "conv_v": (k1, self.v_channels),
                "ssm": (self.ssm_v_heads, self.ssm_dk, self.ssm_dv)}


def config(reader, path: str, tensors: dict) -> HybridConfig:
    """The HybridConfig of a ``qwen3next`` file; every bad value a GGUFError naming the file and key."""
    a = ARCH

    def dim(key, default=..., hi=_INT32_MAX, lo=1):
        kw = {} if default is ... else {"default": default}
        return read_key(reader, f"{a}.{key}", "int", path, lo=lo, hi=hi, **kw)

    n_layers = dim("block_count", hi=max(1, len(tensors) // 9))
    d_model, d_ff, n_heads = dim("embedding_length"), dim("feed_forward_length", 0, lo=0), dim("attention.head_count")
    n_kv = dim("attention.head_count_kv", n_heads)
    head_dim = dim("attention.key_length", max(1, d_model // n_heads))
    if dim("attention.value_length", head_dim) != head_dim:
        raise GGUFError(f"{path}: {a}.attention.value_length != key_length is not supported")
    if n_heads % n_kv:
        raise GGUFError(f"{path}: {a}.attention.head_count ({n_heads}) is not a multiple of head_count_kv ({n_kv})")
    rope_dim = dim("rope.dimension_count", head_dim, hi=head_dim)
    if rope_dim % 2:
        raise GGUFError(f"{path}: {a}.rope.dimension_count ({rope_dim}) must be even")
    interval = dim("full_attention_interval", 4)
    if interval > n_layers or n_layers % interval:
        raise GGUFError(f"{path}: {a}.full_attention_interval ({interval}) must divide {a}.block_count ({n_layers}): "
                        f"every {interval}th layer is full attention and the last layer must be one")
    recurrent = tuple((i + 1) % interval != 0 for i in range(n_layers))
    if f"{a}.attention.recurrent_layers" in reader.fields:
        raise GGUFError(f"{path}: metadata key '{a}.attention.recurrent_layers' (a per-layer pattern) is not "
                        f"supported: cukern takes the layer pattern from {a}.full_attention_interval")
    conv = dim("ssm.conv_kernel")
    if conv not in CONV_KERNELS:
        raise GGUFError(f"{path}: {a}.ssm.conv_kernel ({conv}) must be one of {CONV_KERNELS}")
    dk, n_k = dim("ssm.state_size"), dim("ssm.group_count")
    n_v, inner = dim("ssm.time_step_rank"), dim("ssm.inner_size")
    if n_v % n_k:
        raise GGUFError(f"{path}: {a}.ssm.time_step_rank ({n_v} value heads) is not a multiple of "
                        f"{a}.ssm.group_count ({n_k} key heads)")
    if inner % n_v:
        raise GGUFError(f"{path}: {a}.ssm.inner_size ({inner}) is not a multiple of {a}.ssm.time_step_rank ({n_v})")
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise GGUFError(f"{path}: missing tensor 'token_embd.weight'")
    vocab = int(emb.shape[0])
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != vocab:
        raise GGUFError(f"{path}: the vocabulary has {len(tokens)} tokens but token_embd.weight has {vocab} rows")
    first = next((i for i, r in enumerate(recurrent) if r), None)
    legacy = first is not None and f"blk.{first}.ssm_in.weight" in tensors \
        and f"blk.{first}.attn_qkv.weight" not in tensors
    moe = f"{a}.expert_count" in reader.fields or any(n.endswith(("ffn_gate_inp.weight", "_exps.weight"))
                                                      for n in tensors)
    experts = {}
    if moe:   # the shared expert is part of every Qwen3-Next layer (llama.cpp requires its tensors)
        e = read_experts(reader, path, a, shared=True, d_ff=d_ff)
        experts = dict(n_experts=e["n_experts"], n_experts_used=e["n_experts_used"], d_ff_exp=e["d_ff"],
                       d_ff_shexp=e["d_ff_shexp"])
    elif d_ff < 1:
        raise GGUFError(f"{path}: {a}.feed_forward_length must be >= 1 for the dense FFN, got {d_ff}")
    eps = read_key(reader, f"{a}.attention.layer_norm_rms_epsilon", "float", path, above=0.0, hi=1.0)
    scale = read_key(reader, f"{a}.attention.scale", "float", path, 0.0, lo=0.0)
    base = read_key(reader, f"{a}.rope.freq_base", "float", path, 10000.0, above=0.0)
    return HybridConfig(
        arch=a, n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, d_ff=d_ff,
        vocab_size=vocab, context_length=read_key(reader, f"{a}.context_length", "int", path, 2048, lo=1,
                                                  hi=_INT32_MAX),
        rms_eps=eps, rope_base=base, rope_base_local=base, rope_neox=True, rope_scale=1.0, rope_freq_factors=False,
        sliding_window=0, local_layers=(False,) * n_layers, qk_norm=True, qkv_bias=False, post_norms=False,
        activation="silu", embed_scale=1.0, attn_scale=scale or 1.0 / float(np.sqrt(head_dim)),
        tied_output="output.weight" not in tensors,
        full_attention_interval=interval, recurrent=recurrent, conv_kernel=conv, ssm_k_heads=n_k, ssm_v_heads=n_v,
        ssm_dk=dk, ssm_dv=inner // n_v, rope_dim=rope_dim, ffn="moe" if moe else "dense", ssm_in_legacy=legacy,
        **experts)


def required_tensors(cfg: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the hybrid forward reads, with its shape (PyTorch order)."""
    d, hd = cfg.d_model, cfg.head_dim
    need = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if not cfg.tied_output:
        need["output.weight"] = (cfg.vocab_size, d)
    qk, v, n_v = cfg.qk_channels, cfg.v_channels, cfg.ssm_v_heads
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        need.update({b + "attn_norm.weight": (d,), b + "post_attention_norm.weight": (d,)})
        if cfg.recurrent[i]:
            if cfg.ssm_in_legacy:
                need[b + "ssm_in.weight"] = (2 * qk + 2 * v, d)
            else:
                need.update({b + "attn_qkv.weight": (2 * qk + v, d), b + "attn_gate.weight": (v, d)})
            need.update({b + "ssm_ba.weight": (2 * n_v, d),
                         b + "ssm_conv1d.weight": (cfg.conv_channels, cfg.conv_kernel),
                         b + "ssm_a": (n_v,), b + "ssm_dt.bias": (n_v,), b + "ssm_norm.weight": (cfg.ssm_dv,),
                         b + "ssm_out.weight": (d, v)})
        else:
            need.update({b + "attn_q.weight": (2 * cfg.q_dim, d), b + "attn_k.weight": (cfg.kv_dim, d),
                         b + "attn_v.weight": (cfg.kv_dim, d), b + "attn_output.weight": (d, cfg.q_dim),
                         b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)})
        if cfg.ffn == "dense":
            need.update({b + "ffn_gate.weight": (cfg.d_ff, d), b + "ffn_up.weight": (cfg.d_ff, d),
                         b + "ffn_down.weight": (d, cfg.d_ff)})
        else:
            e, fe, fs = cfg.n_experts, cfg.d_ff_exp, cfg.d_ff_shexp
            need.update({b + "ffn_gate_inp.weight": (e, d), b + "ffn_gate_exps.weight": (e, fe, d),
                         b + "ffn_up_exps.weight": (e, fe, d), b + "ffn_down_exps.weight": (e, d, fe),
                         b + "ffn_gate_inp_shexp.weight": (d,), b + "ffn_gate_shexp.weight": (fs, d),
                         b + "ffn_up_shexp.weight": (fs, d), b + "ffn_down_shexp.weight": (d, fs)})
    return need


def legacy_rows(cfg: HybridConfig) -> tuple[np.ndarray, np.ndarray]:
    """Row indices into a legacy ``ssm_in`` [per key head: q (dk), k (dk), v (group dv), z (group dv)] that
    make ``attn_qkv``'s rows (every q, then every k, then every v) and ``attn_gate``'s (every z)."""
    dk, dv, n_k = cfg.ssm_dk, cfg.ssm_dv, cfg.ssm_k_heads
    gv = cfg.ssm_v_heads // n_k * dv
    per = 2 * dk + 2 * gv
    base = np.arange(n_k)[:, None] * per
    q = (base + np.arange(dk)).reshape(-1)
    k = (base + dk + np.arange(dk)).reshape(-1)
    v = (base + 2 * dk + np.arange(gv)).reshape(-1)
    z = (base + 2 * dk + gv + np.arange(gv)).reshape(-1)
    return np.concatenate([q, k, v]), z
