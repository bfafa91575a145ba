"""cukern: CuPy/CUDA raw kernels for LLM inference.

Families and their dispatch classes (imported lazily, so ``import cukern``
needs neither CuPy nor a GPU):

* ``cukern.elementwise.ElementwiseDispatch`` - norms, activations, RoPE, ...

See docs/ARCHITECTURE.md for the layers and README.md for how to run things.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# family name -> module that defines FAMILY (a runtime.FamilySpec) and its Dispatch class
FAMILY_MODULES = {
    "elementwise": "cukern.elementwise", "elementwise_rope": "cukern.elementwise",  # two units: elementwise.FAMILIES
    "tokens": "cukern.tokens",
    "dmmv": "cukern.dmmv", "dmmv_glu": "cukern.dmmv", "dmmv_moe": "cukern.dmmv", "dmmv_moe_packed": "cukern.dmmv",
    "dmmv_q8x": "cukern.dmmv", "dmmv_two": "cukern.dmmv",  # units: dmmv.FAMILIES
    **{name: "cukern.matmul" for name in ("matmul", "matmul_f16_q4_0", "matmul_f16_q5_0", "matmul_f16_q8_0",
                                          "matmul_f16_q4_k", "matmul_f16_q5_k", "matmul_f16_q6_k",
                                          "matmul_i8_q4_0", "matmul_i8_q5_0", "matmul_i8_q8_0",
                                          "matmul_i8_q4_k", "matmul_i8_q5_k", "matmul_i8_q6_k")},  # matmul.FAMILIES
    # the attention family is seven units (FamilySpecs) of one module, listed in its FAMILIES
    **{name: "cukern.attention" for name in ("attention", "attention_bf16", "attention_f32",
                                             "attention_prefill_f16", "attention_prefill_bf16",
                                             "attention_prefill_wg_f16", "attention_prefill_wg_bf16")},
}

_LAZY = {
    "ElementwiseDispatch": "cukern.elementwise",
    "TokensDispatch": "cukern.tokens",
    "DmmvDispatch": "cukern.dmmv",
    "MatmulDispatch": "cukern.matmul",
    "AttentionDispatch": "cukern.attention", "PagedKVCache": "cukern.attention", "DecodeOverrides": "cukern.attention",
}


def families():
    """Every family's FamilySpec, in a stable order (imports the family modules)."""
    return [_spec(name, mod) for name, mod in FAMILY_MODULES.items()]


def _spec(name: str, mod: str):
    """The FamilySpec ``name`` of module ``mod``: its FAMILIES[name] when it has several units, else FAMILY."""
    m = importlib.import_module(mod)
    return getattr(m, "FAMILIES", {}).get(name, m.FAMILY)


def family(name: str):
    from cukern.runtime import UnknownKernelError
    if name not in FAMILY_MODULES:
        raise UnknownKernelError(f"unknown family {name!r} (known: {', '.join(FAMILY_MODULES)})")
    return _spec(name, FAMILY_MODULES[name])


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cukern' has no attribute {name!r}")
