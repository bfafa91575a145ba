"""The mixture-of-experts architectures' GGUF metadata: :class:`MoeConfig` and :func:`config`.

llama.cpp's keys and tensor names, per architecture (``{arch}`` the ``general.architecture``):

* every arch: ``{arch}.expert_count``, ``.expert_used_count``, ``.expert_feed_forward_length``;
  per layer ``ffn_gate_inp`` (the router, F32 [n_experts, d_model]) and ``ffn_{gate,up,down}_exps``
  ([n_experts, d_ff_exp, d_model], down [n_experts, d_model, d_ff_exp]);
* ``qwen3moe``: Q/K norm; softmax over every expert, top-k, the k weights renormalised to sum to 1;
* ``qwen2moe``: Q/K/V biases; softmax, top-k, no renormalisation;
* a shared expert (``qwen2moe``; ``qwen3moe`` files that carry one): ``ffn_{gate,up,down}_shexp``
  ([``.expert_shared_feed_forward_length``, d_model] ...) and its gate ``ffn_gate_inp_shexp``
  ([d_model] F32): ``+ sigmoid(h . g) * shared(h)``;
* ``gpt-oss``: the FFN norm is ``post_attention_norm``; Q/K/V/O biases; ``attn_sinks`` [n_heads];
  sliding-window attention (``.attention.sliding_window``) on every other layer, the first one
  included (``.attention.sliding_window_pattern``, where a file has it: an int period or a bool per
  layer); YaRN RoPE (``.rope.scaling.type == "yarn"``, ``.factor``, ``.original_context_length``);
  router and expert biases (``ffn_gate_inp.bias``, ``ffn_{gate,up,down}_exps.bias``); experts
  gated by ``swiglu_oai`` (alpha 1.702, limit 7); routing: top-k of the logits, then a softmax over
  the k selected (what ``softmax_topk(renorm=True)`` computes).

:func:`config` is what :func:`cukern.models.gguf_loader.load_gguf` calls for these architectures;
every error is a ``GGUFError`` naming the file and the key or tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from cukern.models.gguf_loader import SUPPORTED_TYPES, ModelConfig
from cukern.models.gguf_parse import _INT32_MAX, GGUFError, read_key

__all__ = ["MoeConfig", "config", "read_experts", "MOE_ARCHS", "EXPERT_TYPES", "yarn_inv_freq"]

MOE_ARCHS = ("qwen3moe", "qwen2moe", "gpt-oss")
# expert tensors: the dense types and MXFP4 (gpt-oss); routers, gates, sinks and biases F32
EXPERT_TYPES = (*SUPPORTED_TYPES, QT.MXFP4)
_MAX_EXPERTS = 1023  # DmmvDispatch.plan_moe_route
_MAX_TOP_K = 32      # ElementwiseDispatch.softmax_topk


def yarn_inv_freq(head_dim: int, base: float, factor: float, original_context: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, ext_factor: float = 1.0, attn_factor: float = 1.0):
    """YaRN as ggml's rope computes it, float64: (inverse frequency per pair [head_dim / 2], mscale).

    Pair i's extrapolated angle per position is ``base**(-2i/d)``, its interpolated one that over
    ``factor``; a ramp over the pair index, 1 below ``low`` and 0 above ``high`` (the pairs whose
    wavelength fits ``beta_fast`` / ``beta_slow`` turns in ``original_context``), mixes them (times
    ``ext_factor``); every rotated value is scaled by ``mscale = attn_factor * (1 + 0.1 ln factor)``."""
    d = head_dim
    i = np.arange(d // 2, dtype=np.float64)
    extrap = base ** (-2.0 * i / d)

    def corr_dim(turns):
        return d * math.log(original_context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(0.0, math.floor(corr_dim(beta_fast))), min(d - 1.0, math.ceil(corr_dim(beta_slow)))
    ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)
    mix = ramp * ext_factor
    inv = extrap / factor * (1.0 - mix) + extrap * mix
    mscale = attn_factor * (1.0 + 0.1 * math.log(factor)) if ext_factor != 0.0 else attn_factor
    return inv, mscale


@dataclass(frozen=True)
class MoeConfig(ModelConfig):
    """A :class:`ModelConfig` with experts; ``d_ff`` is the experts' feed-forward length."""

    n_experts: int = 0
    n_experts_used: int = 0
    d_ff_shexp: int = 0            # 0: no shared expert
    norm_topk: bool = True         # renormalise the k routing weights (softmax_topk's renorm)
    gpt_oss: bool = False          # router / expert / o biases, sinks, swiglu_oai, post_attention_norm as FFN norm
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    yarn: tuple = ()               # (factor, original_context, beta_fast, beta_slow, ext_factor, attn_factor)

    @property
    def shared_expert(self) -> bool:
        return self.d_ff_shexp > 0

    @property
    def ffn_norm_name(self) -> str:
        return "post_attention_norm.weight" if self.gpt_oss else "ffn_norm.weight"

    def rope_is_plain(self, local: bool) -> bool:
        return not self.yarn

    def rope_inv_freq(self, local: bool, factors=None) -> np.ndarray:
        if not self.yarn:
            return super().rope_inv_freq(local, factors)
        return yarn_inv_freq(self.head_dim, self.rope_base, *self._yarn_args())[0]

    @property
    def rope_mscale(self) -> float:
        """The factor YaRN multiplies the rotated Q and K by (1 without YaRN)."""
        return yarn_inv_freq(self.head_dim, self.rope_base, *self._yarn_args())[1] if self.yarn else 1.0

    def _yarn_args(self):
        factor, orig, fast, slow, ext, attn = self.yarn
        return factor, orig, fast, slow, ext, attn

    def yarn_kwargs(self) -> dict:
        """``cukern.elementwise.rope.yarn_freqs``'s keyword arguments."""
        factor, orig, fast, slow, ext, attn = self.yarn
        return dict(base=self.rope_base, factor=factor, original_context=orig, beta_fast=fast, beta_slow=slow,
                    ext_factor=ext, attn_factor=attn)

    def allowed_types(self, name: str):
        """The block types tensor ``name`` may have: the routers, the shared expert's gate and the
        expert biases are read as f32 (router_matvec, bias matrices)."""
        if name.endswith(("ffn_gate_inp.weight", "_exps.bias")):
            return (QT.F32,)
        return EXPERT_TYPES if name.endswith("_exps.weight") else SUPPORTED_TYPES

    def required_tensors(self) -> dict[str, tuple[int, ...]]:
        d, q, kv, hd, e, ff = self.d_model, self.q_dim, self.kv_dim, self.head_dim, self.n_experts, self.d_ff
        need = {"token_embd.weight": (self.vocab_size, d), "output_norm.weight": (d,)}
        if not self.tied_output:
            need["output.weight"] = (self.vocab_size, d)
        for i in range(self.n_layers):
            b = f"blk.{i}."
            need.update({b + "attn_norm.weight": (d,), b + "attn_q.weight": (q, d), b + "attn_k.weight": (kv, d),
                         b + "attn_v.weight": (kv, d), b + "attn_output.weight": (d, q), b + self.ffn_norm_name: (d,),
                         b + "ffn_gate_inp.weight": (e, d), b + "ffn_gate_exps.weight": (e, ff, d),
                         b + "ffn_up_exps.weight": (e, ff, d), b + "ffn_down_exps.weight": (e, d, ff)})
            if self.qk_norm:
                need.update({b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)})
            if self.qkv_bias:
                need.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
            if self.gpt_oss:
                need.update({b + "attn_output.bias": (d,), b + "attn_sinks.weight": (self.n_heads,),
                             b + "ffn_gate_inp.bias": (e,), b + "ffn_gate_exps.bias": (e, ff),
                             b + "ffn_up_exps.bias": (e, ff), b + "ffn_down_exps.bias": (e, d)})
            if self.shared_expert:
                fs = self.d_ff_shexp
                need.update({b + "ffn_gate_inp_shexp.weight": (d,), b + "ffn_gate_shexp.weight": (fs, d),
                             b + "ffn_up_shexp.weight": (fs, d), b + "ffn_down_shexp.weight": (d, fs)})
        return need


def _window_layers(reader, path: str, arch: str, n_layers: int, window: int) -> tuple[bool, ...]:
    """gpt-oss: sliding-window layers 0, 2, 4, ... unless the file says otherwise (a period p: layer i
    is local when i % p < p - 1; or one bool per layer)."""
    key = f"{arch}.attention.sliding_window_pattern"
    field = reader.fields.get(key)
    if field is None:
        return tuple(i % 2 == 0 for i in range(n_layers))
    if field.types and field.types[0] == VT.ARRAY:
        value = read_key(reader, key, "array of bool", path)
        if len(value) != n_layers:
            raise GGUFError(f"{path}: metadata key {key!r} has {len(value)} entries, the model has {n_layers} "
                            f"layers ({arch}.block_count)")
        return tuple(bool(v) for v in value)
    p = read_key(reader, key, "int", path, lo=0, hi=_INT32_MAX)
    if p > n_layers:
        raise GGUFError(f"{path}: metadata key {key!r} is {p}, beyond the model's {n_layers} layers")
    return tuple(p > 0 and i % p < p - 1 for i in range(n_layers)) if window else (False,) * n_layers


def read_experts(reader, path: str, arch: str, *, shared: bool, d_ff: int = 0) -> dict:
    """``{arch}.expert_count``, ``.expert_used_count``, ``.expert_feed_forward_length`` and (``shared``)
    ``.expert_shared_feed_forward_length`` as :class:`MoeConfig`'s ``n_experts``, ``n_experts_used``,
    ``d_ff`` and ``d_ff_shexp`` (0 without a shared expert), in the bounds the MoE kernels take. ``d_ff``:
    a dense ``feed_forward_length`` the two lengths default to (llama.cpp's qwen3next: ``d_ff / top_k``
    and ``d_ff``); 0: both keys are required."""
    def dim(key, default, hi=_INT32_MAX, note=""):
        args = () if not default else (default,)
        return read_key(reader, f"{arch}.{key}", "int", path, *args, lo=1, hi=hi, note=note)

    n_experts = dim("expert_count", 0, _MAX_EXPERTS, f" (cukern routes over at most {_MAX_EXPERTS} experts)")
    top_k = dim("expert_used_count", 0, min(n_experts, _MAX_TOP_K),
                f" (at most {arch}.expert_count = {n_experts} and {_MAX_TOP_K})")
    return dict(n_experts=n_experts, n_experts_used=top_k, d_ff=dim("expert_feed_forward_length", d_ff // top_k),
                d_ff_shexp=dim("expert_shared_feed_forward_length", d_ff) if shared else 0)


def config(reader, path: str, tensors: dict) -> MoeConfig:
    """The :class:`MoeConfig` of a ``qwen3moe`` / ``qwen2moe`` / ``gpt-oss`` file (load_gguf's hook)."""
    arch = read_key(reader, "general.architecture", "str", path)

    def dim(key, default=..., lo=1, hi=_INT32_MAX, note=""):
        args = () if default is ... else (default,)
        return read_key(reader, f"{arch}.{key}", "int", path, *args, lo=lo, hi=hi, note=note)

    n_layers = dim("block_count", hi=max(1, len(tensors) // 9),
                   note=f" (the file has {len(tensors)} tensors, a layer at least 9)")
    d_model, n_heads = dim("embedding_length"), dim("attention.head_count")
    n_kv_heads = dim("attention.head_count_kv", n_heads)
    head_dim = dim("attention.key_length", max(1, d_model // n_heads))
    if dim("attention.value_length", head_dim) != head_dim:
        raise GGUFError(f"{path}: value_length != key_length is not supported")
    if n_heads % n_kv_heads or head_dim % 2:
        raise GGUFError(f"{path}: {arch}.attention.head_count ({n_heads}) must be a multiple of head_count_kv "
                        f"({n_kv_heads}) and key_length ({head_dim}) even")
    gpt_oss = arch == "gpt-oss"
    shexp = arch == "qwen2moe" or "blk.0.ffn_gate_inp_shexp.weight" in tensors
    experts = read_experts(reader, path, arch, shared=shexp)
    n_experts, top_k, d_ff, d_ff_shexp = (experts[k] for k in ("n_experts", "n_experts_used", "d_ff", "d_ff_shexp"))
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise GGUFError(f"{path}: missing tensor 'token_embd.weight'")
    vocab = int(emb.shape[0])
    eps = read_key(reader, f"{arch}.attention.layer_norm_rms_epsilon", "float", path, above=0.0, hi=1.0)
    rope_base = read_key(reader, f"{arch}.rope.freq_base", "float", path, 10000.0, above=0.0)
    context = dim("context_length", 2048)
    scaling = read_key(reader, f"{arch}.rope.scaling.type", "str", path, "none") or "none"
    yarn = ()
    if scaling == "yarn":
        def f(key, default):
            return read_key(reader, f"{arch}.rope.scaling.{key}", "float", path, default, above=0.0)
        ext = read_key(reader, f"{arch}.rope.scaling.yarn_ext_factor", "float", path, 1.0, lo=0.0)
        yarn = (f("factor", 1.0), dim("rope.scaling.original_context_length", context), f("yarn_beta_fast", 32.0),
                f("yarn_beta_slow", 1.0), ext, 1.0)
    elif scaling != "none":
        raise GGUFError(f"{path}: RoPE scaling {scaling!r} is not supported for {arch} (cukern runs none and yarn)")
    window = dim("attention.sliding_window", lo=0) if gpt_oss else 0
    local = _window_layers(reader, path, arch, n_layers, window) if gpt_oss else (False,) * n_layers
    return MoeConfig(
        arch=arch, n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        d_ff=d_ff, vocab_size=vocab, context_length=context, rms_eps=eps, rope_base=rope_base,
        rope_base_local=rope_base, rope_neox=True, rope_scale=1.0, rope_freq_factors=False, sliding_window=window,
        local_layers=local, qk_norm=arch == "qwen3moe", qkv_bias=arch in ("qwen2moe", "gpt-oss"), post_norms=False,
        activation="silu", embed_scale=1.0, attn_scale=1.0 / math.sqrt(head_dim),
        tied_output="output.weight" not in tensors, n_experts=n_experts, n_experts_used=top_k, d_ff_shexp=d_ff_shexp,
        norm_topk=arch != "qwen2moe", gpt_oss=gpt_oss, yarn=yarn)
