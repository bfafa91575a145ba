"""cukern's main operators as torch custom operators (``torch.ops.cukern.*``), for code that runs under
``torch.compile`` or records CUDA graphs: each is registered with ``torch.library.custom_op`` and a fake
implementation (shapes and dtypes only), so that a compiled graph keeps it as one opaque call.

    import cukern.torch                      # imports torch; registers the operators once
    y = torch.ops.cukern.rms_norm(x, w, 1e-6)
    o = torch.ops.cukern.flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, None, True, -1, 0.0)

The operators run cukern's dispatch methods on the tensors' device (one dispatch per device, made on
first use), on torch's current stream, and return new tensors (they never alias an input). Importing
this module is the only place cukern imports torch.
"""

from __future__ import annotations

import torch

from cukern.attention import flash_attn_varlen_func
from cukern.elementwise import ElementwiseDispatch

__all__ = ["rms_norm", "swiglu", "geglu", "flash_attn_varlen"]

_ELEMENTWISE: dict[int, ElementwiseDispatch] = {}


def _ew(t: torch.Tensor) -> ElementwiseDispatch:
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    d = _ELEMENTWISE.get(index)
    if d is None:
        d = _ELEMENTWISE[index] = ElementwiseDispatch(index)
    return d


@torch.library.custom_op("cukern::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, weight_offset: float = 0.0) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * (w + weight_offset)`` over the last axis: x f32, f16 or bf16
    (the output's dtype), w f32 (ElementwiseDispatch.rms_norm)."""
    return _ew(x).rms_norm(x, w, eps=eps, weight_offset=weight_offset)


@rms_norm.register_fake
def _(x, w, eps=1e-6, weight_offset=0.0):
    return torch.empty_like(x)


def _glu(name: str):
    """The custom operator ``cukern::<name>``: ElementwiseDispatch.<name>(gate, up) on [n_rows, n_ff] of one
    dtype (swiglu: silu(gate) * up; geglu: gelu_tanh(gate) * up)."""

    @torch.library.custom_op(f"cukern::{name}", mutates_args=())
    def op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return getattr(_ew(gate), name)(gate, up)

    op.register_fake(lambda gate, up: torch.empty_like(gate))
    return op


swiglu = _glu("swiglu")
geglu = _glu("geglu")


@torch.library.custom_op("cukern::flash_attn_varlen", mutates_args=())
def flash_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                      softmax_scale: float | None = None, causal: bool = False, window_left: int = -1,
                      softcap: float = 0.0) -> torch.Tensor:
    """Packed variable-length attention (cukern.attention.flash_attn_varlen_func, FlashAttention's
    conventions): q [total_q, n_heads, head_dim], k, v [total_k, n_kv_heads, head_dim], f16 or bf16."""
    with torch.cuda.device(q.device):
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=softmax_scale, causal=causal, window_size=(window_left, -1),
                                      softcap=softcap)


@flash_attn_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False,
      window_left=-1, softcap=0.0):
    return torch.empty_like(q)
