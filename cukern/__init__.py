"""cukern: CuPy/CUDA raw kernels for LLM inference.

Families and their dispatch classes (imported lazily, so ``import cukern``
needs neither CuPy nor a GPU):

* ``cukern.elementwise.ElementwiseDispatch`` - norms, activations, RoPE, ...

See docs/ARCHITECTURE.md for the layers and README.md for how to run things.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# the family modules, in a stable order; each declares its compilation units (runtime.FamilySpec) in FAMILIES,
# or a single one in FAMILY
_FAMILY_PACKAGES = ("cukern.elementwise", "cukern.tokens", "cukern.dmmv", "cukern.matmul", "cukern.attention")
_family_modules: dict[str, str] | None = None

_LAZY = {
    "ElementwiseDispatch": "cukern.elementwise",
    "TokensDispatch": "cukern.tokens",
    "DmmvDispatch": "cukern.dmmv",
    "MatmulDispatch": "cukern.matmul",
    "AttentionDispatch": "cukern.attention", "PagedKVCache": "cukern.attention", "DecodeOverrides": "cukern.attention",
    "flash_attn_varlen_func": "cukern.attention", "flash_attn_with_kvcache": "cukern.attention",
    "BatchDecodeWithPagedKVCacheWrapper": "cukern.attention", "BatchPrefillWithPagedKVCacheWrapper": "cukern.attention",
}


def _units() -> dict[str, str]:
    """Unit name -> module that declares it (``cukern.FAMILY_MODULES``): read from each family module's
    FAMILIES (or FAMILY) on first use, so ``import cukern`` imports none of them."""
    global _family_modules
    if _family_modules is None:
        units = {}
        for mod in _FAMILY_PACKAGES:
            m = importlib.import_module(mod)
            units.update({name: mod for name in getattr(m, "FAMILIES", None) or {m.FAMILY.name: m.FAMILY}})
        _family_modules = units
    return _family_modules


def families():
    """Every family's FamilySpec, in a stable order (imports the family modules)."""
    return [_spec(name, mod) for name, mod in _units().items()]


def _spec(name: str, mod: str):
    """The FamilySpec ``name`` of module ``mod``: its FAMILIES[name] when it has several units, else FAMILY."""
    m = importlib.import_module(mod)
    return getattr(m, "FAMILIES", {}).get(name, m.FAMILY)


def family(name: str):
    from cukern.runtime import UnknownKernelError
    units = _units()
    if name not in units:
        raise UnknownKernelError(f"unknown family {name!r} (known: {', '.join(units)})")
    return _spec(name, units[name])


def __getattr__(name):
    if name == "FAMILY_MODULES":
        return dict(_units())
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cukern' has no attribute {name!r}")
