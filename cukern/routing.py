"""Routing arrays shared by the MoE consumers of the elementwise and dmmv families: :class:`RouteSlot`,
one buffer holding a layer's expert ids and routing weights side by side, and ``route_rows``, the check
of a [n_tokens, top_k] routing array whose rows may sit a stride apart (a slice of a wider buffer).
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from cukern.dispatch import check_array

_SLOT_TYPES = (np.dtype(np.uint32), np.dtype(np.int32), np.dtype(np.float32))


@dataclass(frozen=True, eq=False)
class RouteSlot:
    """A packed route slot: ``buf`` [n_tokens, 2 * top_k] of 4-byte words (uint32, int32 or float32), C-contiguous;
    per token the top_k expert ids (int32) and then the top_k f32 routing weights' bits. Wherever a MoE
    method takes ``ids`` (and ``weights``) it takes a RouteSlot instead; ``softmax_topk(slot=)`` writes one."""

    buf: cupy.ndarray
    top_k: int

    def __post_init__(self):
        check_array("RouteSlot.buf", self.buf, dtype=_SLOT_TYPES, ndim=2)
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 1 or self.buf.shape[1] != 2 * self.top_k:
            raise ValueError(f"RouteSlot: buf must be [n_tokens, 2 * top_k] with top_k >= 1, got {self.buf.shape} "
                             f"and top_k={self.top_k!r}")

    @property
    def ids(self) -> cupy.ndarray:
        """[n_tokens, top_k] int32 view (rows 2 * top_k entries apart)."""
        return self.buf.view(cupy.int32)[:, :self.top_k]

    @property
    def weights(self) -> cupy.ndarray:
        """[n_tokens, top_k] float32 view (rows 2 * top_k entries apart)."""
        return self.buf.view(cupy.float32)[:, self.top_k:]


def route_rows(name: str, a, dtype, *, shape=None) -> tuple[cupy.ndarray, int]:
    """Check a [n_tokens, top_k] routing array of ``dtype`` whose entries within a row are contiguous and
    whose rows are a whole number of entries apart, at least top_k (a slice of a wider buffer: a
    :class:`RouteSlot` half, one layer of a [n_tokens, n_layers, top_k] capture). Returns (a, row
    stride in entries)."""
    check_array(name, a, dtype=dtype, ndim=2, shape=shape, contiguous=False)
    n, top_k = a.shape
    s0, s1 = a.strides
    item = a.itemsize
    if n < 1 or top_k < 1:
        raise ValueError(f"{name} must be [n_tokens, top_k] with both >= 1, got {a.shape}")
    if (top_k > 1 and s1 != item) or (n > 1 and (s0 % item or s0 < top_k * item)):
        raise ValueError(f"{name}: the entries of a row must be contiguous and the rows at least top_k entries "
                         f"apart (strides {a.strides}, shape {a.shape})")
    stride = s0 // item if n > 1 else top_k
    if stride > 2**32 - 1:
        raise ValueError(f"{name}: row stride {stride} entries exceeds 32 bits")
    return a, stride
