"""Shared pieces of the elementwise family's modules: dtypes, grid limits and the argument checks
every group uses.
"""

from __future__ import annotations

import numpy as np

_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
# KV-cache element types: f16, f32, and bf16 as uint16 bit patterns (PagedKVCache's bf16 storage)
_KV_TYPES = {np.dtype(np.float16): "__half", np.dtype(np.uint16): "__nv_bfloat16", np.dtype(np.float32): "float"}
_FLAT_BLOCK = 256
_FLAT_MAX_BLOCKS = 4096  # kernels grid-stride beyond
_MAX_GRID_Y = 65535
_MAX_U32 = 2**32 - 1
_POS_MODES = {"consecutive": 0, "per_token": 1, "mrope": 2, "imrope": 3}
# Activation storage types of the kernels templated on T (cuda_src/elementwise/convert.cuh): f32, f16, and
# bf16 as uint16 bit patterns (the package's bf16 convention; an ml_dtypes bfloat16 array is taken too).
_ACT_TYPES = {"float32": "float", "float16": "__half", "uint16": "__nv_bfloat16", "bfloat16": "__nv_bfloat16"}


# Output shapes for interop.like, from the call's argument getter ``a``.
def _glu_shape(a):
    gate = a("gate")
    return gate.shape if a("up") is not None else (gate.shape[0], gate.shape[1] // 2)


def _half_heads(a):
    x = a("x")
    return (*x.shape[:-1], x.shape[-1] // 2)


def _topk_shape(a):
    return None if a("slot") is not None else (a("logits").shape[0], a("k"))  # None: nothing allocated


def _router_shape(a):
    return a("x").shape[0], a("W").shape[0]


def _aligned(*arrays, align: int = 16) -> bool:
    return all(a.data.ptr % align == 0 for a in arrays)


def _act_type(name: str, a) -> str:
    """C storage type of an activation array (float, __half or __nv_bfloat16), or TypeError."""
    ctype = _ACT_TYPES.get(str(a.dtype))
    if ctype is None:
        raise TypeError(f"{name} must be float32, float16 or bfloat16 (uint16 bits), got {a.dtype}")
    return ctype


def _targ(ctype: str) -> str:
    """The trailing template argument of a kernel templated on the activation type T (default float)."""
    return "" if ctype == "float" else f", {ctype}"


def _vec(ok: bool) -> str:
    return "true" if ok else "false"


def _flat_grid(units: int) -> int:
    return max(1, min(-(-units // _FLAT_BLOCK), _FLAT_MAX_BLOCKS))


def _check_eps(eps, what):
    if not eps >= 0:
        raise ValueError(f"{what}: eps must be >= 0, got {eps}")


def _check_disjoint(what, writes: dict, reads: dict) -> None:
    """Raise when an array the kernel writes overlaps another written or read one (reads may alias)."""
    w = [(n, a) for n, a in writes.items() if a is not None]
    r = [(n, a) for n, a in reads.items() if a is not None]
    for i, (n1, a1) in enumerate(w):
        for n2, a2 in w[i + 1:] + r:
            if a1.data.ptr < a2.data.ptr + a2.nbytes and a2.data.ptr < a1.data.ptr + a1.nbytes:
                raise ValueError(f"{what}: {n1} and {n2} must not overlap")


def _check_distinct(what, **arrays):
    """Raise when two named arrays share memory that the kernel reads and writes separately."""
    items = [(n, a) for n, a in arrays.items() if a is not None]
    for i, (n1, a1) in enumerate(items):
        lo1, hi1 = a1.data.ptr, a1.data.ptr + a1.nbytes
        for n2, a2 in items[i + 1:]:
            lo2, hi2 = a2.data.ptr, a2.data.ptr + a2.nbytes
            if lo1 < hi2 and lo2 < hi1:
                raise ValueError(f"{what}: {n1} and {n2} must not overlap")
