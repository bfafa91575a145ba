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
    "elementwise": "cukern.elementwise",
}

_LAZY = {
    "ElementwiseDispatch": "cukern.elementwise",
}


def families():
    """Every family's FamilySpec, in a stable order (imports the family modules)."""
    return [importlib.import_module(mod).FAMILY for mod in FAMILY_MODULES.values()]


def family(name: str):
    from cukern.runtime import UnknownKernelError
    if name not in FAMILY_MODULES:
        raise UnknownKernelError(f"unknown family {name!r} (known: {', '.join(FAMILY_MODULES)})")
    return importlib.import_module(FAMILY_MODULES[name]).FAMILY


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cukern' has no attribute {name!r}")
