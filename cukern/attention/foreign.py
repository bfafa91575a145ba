"""What the FlashAttention- and FlashInfer-style entry points (:mod:`~cukern.attention.flash_api`,
:mod:`~cukern.attention.flashinfer_api`) share: checks of K/V pools the caller owns, device index arrays made
once and kept, one dispatch per device, and the conversions between the two LSE bases.

cukern's kernels and FlashAttention write a log-sum-exp as a natural logarithm, FlashInfer as a base-2 one
(``log2(sum(exp2(logit * log2(e))))``): ``lse_2 = lse_e * log2(e)``, ``lse_e = lse_2 * ln(2)``.
"""

from __future__ import annotations

import math

import cupy
import numpy as np

from cukern.attention.cache import BF16
from cukern.attention.common import _check_kind
from cukern.attention.dispatch import AttentionDispatch
from cukern.dispatch import check_array

__all__ = ["lse_to_log2", "lse_to_natural"]

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
_I32 = np.dtype(np.int32)
_KINDS = ("float16", BF16, "float32")
_ARANGES: dict[tuple[int, int, int], cupy.ndarray] = {}
_DISPATCHES: dict[int, AttentionDispatch] = {}


def lse_to_log2(lse, out=None):
    """A natural-log LSE (cukern's and FlashAttention's) as FlashInfer's base 2: ``lse * log2(e)``.
    Works on CuPy and NumPy arrays alike (``out`` may be ``lse`` itself); -inf stays -inf."""
    return cupy.get_array_module(lse).multiply(lse, LOG2E, out=out)


def lse_to_natural(lse, out=None):
    """A base-2 LSE (FlashInfer's) as a natural logarithm (cukern's and FlashAttention's): ``lse * ln(2)``."""
    return cupy.get_array_module(lse).multiply(lse, LN2, out=out)


def scale_arg(name: str, value) -> float:
    """A softmax scale argument (None: ``1 / sqrt(head_dim)``) as the dispatch's ``scale`` (0 means that)."""
    if value is None:
        return 0.0
    s = float(value)
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"{name} must be None (1/sqrt(head_dim)) or finite and > 0, got {value!r}")
    return s


def softcap_arg(name: str, value) -> float:
    """A logit cap argument (None or 0: off) as the dispatch's ``softcap``."""
    s = 0.0 if value is None else float(value)
    if not (s >= 0 and math.isfinite(s)):
        raise ValueError(f"{name} must be None or finite and >= 0 (0: off), got {value!r}")
    return s


def dispatch_for(device: int) -> AttentionDispatch:
    """The entry points' dispatch on ``device``, made once. Without programmatic dependent launch: the
    caller's lengths and page table may be written by the kernel just before (pdl would read them early)."""
    d = _DISPATCHES.get(device)
    if d is None:
        d = _DISPATCHES[device] = AttentionDispatch(device)
    return d


def check_pools(names: tuple[str, str], k, v, device: int, *, ndim: int = 4) -> str:
    """The K and V pools' common kind ('float16', 'bfloat16' as uint16 bits, 'float32'): same dtype and shape,
    C-contiguous (the kernels step pages and rows by the shape's products), 16-byte aligned, on ``device``."""
    kind = _check_kind(names[0], k, _KINDS)
    if _check_kind(names[1], v, _KINDS) != kind:
        raise TypeError(f"{names[1]} must have {names[0]}'s dtype ({k.dtype}), got {v.dtype}")
    check_array(names[0], k, ndim=ndim, align=16, device=device)
    check_array(names[1], v, shape=k.shape, align=16, device=device)
    return kind


def device_arange(n: int, step: int, device: int, stream) -> cupy.ndarray:
    """``[0, step, 2 step, ...]`` ([n] int32) on ``device``, made on the first call of each (n, step) and kept,
    never written: calls that need it allocate nothing after that one. Making it copies from the host and
    waits for the copy, which a stream being captured into a CUDA graph cannot do: run one call of each
    shape before capturing."""
    key = (device, int(n), int(step))
    a = _ARANGES.get(key)
    if a is None:
        if n * max(step, 1) >= 2**31:
            raise ValueError(f"index array of {n} entries of step {step} overflows int32")
        capturing = getattr(stream, "is_capturing", None)
        if capturing is not None and capturing():
            raise RuntimeError(f"an index array of {n} entries is made on a call's first use, which a stream "
                               f"being captured cannot do: run one call of this shape before capturing")
        with stream:
            a = cupy.asarray((np.arange(n, dtype=np.int64) * step).astype(np.int32))
        stream.synchronize()  # later calls may read it from other streams
        _ARANGES[key] = a
    return a
