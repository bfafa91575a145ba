"""Small pieces the attention dispatch's modules share: the C types and unit suffixes per KV dtype, dtype
kinds and their checks, host integer lists, and the logit fields (scale, softcap, window) of a params struct.
"""

from __future__ import annotations

import math

import cupy
import numpy as np

from cukern.attention.cache import BF16
from cukern.dispatch import check_array, check_int

_CTYPE = {"float16": "__half", BF16: "__nv_bfloat16", "float32": "float"}
_SHORT = {"float16": "f16", BF16: "bf16", "float32": "f32"}
_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
_DECODE_THREADS = 128


def _page_shift(page_size: int) -> int:
    return page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1


def _kind(a) -> str:
    """'float16', 'bfloat16' (uint16 bits or ml_dtypes) or 'float32'; anything else 'other'."""
    dt = a.dtype
    if dt == np.float16:
        return "float16"
    if dt == np.float32:
        return "float32"
    if dt == np.uint16 or str(dt) == BF16:
        return BF16
    return "other"


def _check_kind(name: str, a, kinds: tuple[str, ...]) -> str:
    check_array(name, a)
    k = _kind(a)
    if k not in kinds:
        raise TypeError(f"{name} must be {' or '.join(kinds)} (bfloat16 as uint16 bits), got {a.dtype}")
    return k


def _int_list(name: str, values) -> np.ndarray:
    if isinstance(values, cupy.ndarray):
        raise TypeError(f"{name} must be host integers (a list or NumPy array): plans validate them on the host")
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a non-empty 1-D sequence of integers, got {values!r}")
    return arr.astype(np.int64)


def _scale_fields(scale: float, head_dim: int, softcap: float, window_left: int) -> dict:
    if not math.isfinite(scale) or scale < 0:
        raise ValueError(f"scale must be finite and >= 0 (0: 1/sqrt(head_dim)), got {scale}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0: off), got {softcap}")
    if not isinstance(window_left, (int, np.integer)):
        raise TypeError(f"window_left must be an int (< 0: no window), got {type(window_left).__name__}")
    s = scale if scale > 0 else 1.0 / math.sqrt(head_dim)
    return dict(scale_log2=s * math.log2(math.e), softcap=softcap, inv_softcap=1.0 / softcap if softcap else 0.0,
                window_left=max(int(window_left), -1))


def _sink_fields(sinks, sink_offset, n_heads: int) -> dict:
    """has_sinks / sink_offset of a params struct: ``sinks`` None, or a 1-D f32 buffer (every layer's heads, NaN
    for a head without a sink) of which heads ``0 .. n_heads-1`` read ``sinks[sink_offset + h]``."""
    sink_offset = check_int("sink_offset", sink_offset, 0)
    if sinks is None:
        if sink_offset:
            raise ValueError(f"sink_offset {sink_offset} given without sinks")
        return dict(has_sinks=0, sink_offset=0)
    check_array("sinks", sinks, dtype=_F32, ndim=1)
    if sink_offset + n_heads > sinks.shape[0]:
        raise ValueError(f"sinks holds {sinks.shape[0]} entries; heads 0 ... {n_heads - 1} at sink_offset "
                         f"{sink_offset} need {sink_offset + n_heads}")
    return dict(has_sinks=1, sink_offset=sink_offset)


CAUSAL_VARIANTS = {"lower_right": 1, "upper_left": 2}  # the params' causal field (params.cuh)


def _causal_field(causal, causal_variant) -> int:
    """The params' ``causal``: 0 (off), 1 (``"lower_right"``: FlashAttention's alignment of the last query with the
    last key, torch's ``CausalVariant.LOWER_RIGHT``) or 2 (``"upper_left"``: the first query with the first key,
    torch's ``is_causal`` / ``CausalVariant.UPPER_LEFT``). A torch ``CausalVariant`` is taken by its name."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    name = getattr(causal_variant, "name", causal_variant)
    if not isinstance(name, str) or name.lower() not in CAUSAL_VARIANTS:
        raise ValueError(f"causal_variant must be one of {tuple(CAUSAL_VARIANTS)}, got {causal_variant!r}")
    return CAUSAL_VARIANTS[name.lower()] if causal else 0


def _kv_strides(cache) -> dict:
    """row_stride / head_stride (elements) of a cache's K/V rows: token-major pages ``[.., page_size, n_kv_heads,
    head_dim]``, or head-major ``[.., n_kv_heads, page_size, head_dim]`` where the view says so."""
    d = cache.head_dim
    if getattr(cache, "head_major", False):
        return dict(row_stride=d, head_stride=cache.page_size * d)
    return dict(row_stride=cache.n_kv_heads * d, head_stride=d)
