"""KV-cache writes and the Q/gate deinterleave: the kernels of ``cuda_src/elementwise/kv.cuh``.
"""

from __future__ import annotations

import cupy

from cukern.dispatch import check_array
from cukern.elementwise.common import (_F32, _FLAT_BLOCK, _I32, _KV_TYPES, _MAX_U32, _POS_MODES, _aligned,
                                       _check_disjoint, _flat_grid, _half_heads, _vec)
from cukern.interop import like, tensors

_KV_UNROLL = 4  # KV_UNROLL in kv.cuh


def contiguous_page_table(n_seqs: int) -> cupy.ndarray:
    """The page table that makes a contiguous cache ``[n_seqs, capacity, n_kv_heads, head_dim]`` a
    paged one (page_size = capacity, page_table[s] = [s]). Allocates: build it once, at plan time."""
    return cupy.arange(n_seqs, dtype=cupy.int32).reshape(n_seqs, 1)


class KvWrites:
    """ElementwiseDispatch's kv methods (a mixin: launches through the dispatch's ``_launch``)."""

    def _kv_target(self, what, cache, page_table, n_kv_heads, head_dim, name="cache"):
        check_array(name, cache, ndim=4)
        if cache.dtype not in _KV_TYPES:
            raise TypeError(f"{what}: {name} dtype must be float16, bfloat16 (uint16 bits) or float32, "
                            f"got {cache.dtype}")
        n_pages, page_size, h, d = cache.shape
        if (h, d) != (n_kv_heads, head_dim):
            raise ValueError(f"{what}: {name} must be [n_pages, page_size, {n_kv_heads}, {head_dim}], got {cache.shape}")
        check_array("page_table", page_table, dtype=_I32, ndim=2)
        if page_table.shape[0] == 0 or page_table.shape[1] == 0 or n_pages == 0 or page_size == 0:
            raise ValueError(f"{what}: empty cache or page table")
        return page_size, page_table.shape[1]

    def _seq_positions(self, what, positions, seq_ids, pos_mode, n_tokens):
        if pos_mode not in ("consecutive", "per_token"):
            raise ValueError(f"{what}: pos_mode must be 'consecutive' or 'per_token', got {pos_mode!r}")
        n = n_tokens if pos_mode == "per_token" else None
        check_array("positions", positions, dtype=_I32, shape=(n,))
        check_array("seq_ids", seq_ids, dtype=_I32, shape=(n,))
        if positions.shape[0] == 0 or seq_ids.shape[0] == 0:
            raise ValueError(f"{what}: positions and seq_ids must not be empty")
        return _POS_MODES[pos_mode]

    @tensors
    def kv_write(self, src: cupy.ndarray, cache: cupy.ndarray, page_table: cupy.ndarray, positions: cupy.ndarray,
                 seq_ids: cupy.ndarray, *, pos_mode: str = "consecutive", stream=None) -> cupy.ndarray:
        """Write src: [n_tokens, n_kv_heads, head_dim] f32 into a paged K or V cache
        [n_pages, page_size, n_kv_heads, head_dim] (float16, bfloat16 as uint16 bits, or float32;
        common/kv_cache.cuh's layout; values rounded once)
        with page_table: [n_seqs, max_pages] int32. Token t goes to sequence seq_ids[0] at position
        positions[0] + t ("consecutive"), or to seq_ids[t] at positions[t] ("per_token": a decode batch).
        A contiguous cache [n_seqs, capacity, ...] is the case page_table = contiguous_page_table(n_seqs)."""
        check_array("src", src, dtype=_F32, ndim=3)
        n_tokens, n_kv, head_dim = src.shape
        if src.size == 0:
            raise ValueError("kv_write: src must be non-empty")
        page_size, max_pages = self._kv_target("kv_write", cache, page_table, n_kv, head_dim)
        mode = self._seq_positions("kv_write", positions, seq_ids, pos_mode, n_tokens)
        row_elems = n_kv * head_dim
        vec = row_elems % 4 == 0 and _aligned(cache, src)
        units = n_tokens * row_elems // (4 if vec else 1)
        if units + 256 * _KV_UNROLL > _MAX_U32:
            raise ValueError(f"kv_write: at most 2**32 - 1025 {'float4s' if vec else 'elements'} per call, got {units}")
        params = self.struct("KvWriteParams").pack(n_tokens=n_tokens, row_elems=row_elems, page_size=page_size,
                                                   max_pages=max_pages, pos_mode=mode)
        self._launch(f"kv_write<{_KV_TYPES[cache.dtype]}, {_vec(vec)}>", -(-units // (256 * _KV_UNROLL)), 256,
                     (cache, src, positions, seq_ids, page_table), params, stream=stream)
        return cache

    @tensors
    def kv_write_contiguous(self, src: cupy.ndarray, cache: cupy.ndarray, page_table: cupy.ndarray,
                            positions: cupy.ndarray, seq_ids: cupy.ndarray, *, pos_mode: str = "consecutive",
                            stream=None) -> cupy.ndarray:
        """:meth:`kv_write` into a contiguous cache [n_seqs, capacity, n_kv_heads, head_dim]; page_table is
        ``contiguous_page_table(n_seqs)`` (made once, at plan time)."""
        check_array("cache", cache, ndim=4)
        n_seqs = cache.shape[0]
        check_array("page_table", page_table, dtype=_I32, shape=(n_seqs, 1))
        self.kv_write(src, cache, page_table, positions, seq_ids, pos_mode=pos_mode, stream=stream)
        return cache

    @tensors(q=like("x", shape=_half_heads), gate=like("x", shape=_half_heads))
    def deinterleave(self, x: cupy.ndarray, q: cupy.ndarray | None = None, gate: cupy.ndarray | None = None, *,
                     stream=None):
        """Split per-head interleaved [Q | gate]: x [n_tokens, n_heads, 2 * head_dim] f32 into
        q, gate [n_tokens, n_heads, head_dim] f32. Returns (q, gate)."""
        check_array("x", x, dtype=_F32, ndim=3)
        n_tokens, n_heads, two_d = x.shape
        if x.size == 0 or two_d % 2:
            raise ValueError(f"deinterleave: x must be non-empty [n_tokens, n_heads, 2 * head_dim], got {x.shape}")
        d = two_d // 2
        check_array("q", q, dtype=_F32, shape=(n_tokens, n_heads, d))
        check_array("gate", gate, dtype=_F32, shape=(n_tokens, n_heads, d))
        _check_disjoint("deinterleave", dict(q=q, gate=gate), dict(x=x))
        n_rows = n_tokens * n_heads
        if n_rows > _MAX_U32:
            raise ValueError("deinterleave: too many rows")
        vec = d % 4 == 0 and _aligned(x, q, gate)
        units = n_rows * d // (4 if vec else 1)
        params = self.struct("DeinterleaveParams").pack(n_rows=n_rows, head_dim=d)
        self._launch(f"deinterleave<{'float4' if vec else 'float'}>", _flat_grid(units), _FLAT_BLOCK, (q, gate, x),
                     params, stream=stream)
        return q, gate
