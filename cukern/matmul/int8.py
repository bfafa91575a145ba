"""The int8 path (``cuda_src/matmul/gemm_i8.cuh``: Q8_1 activations against int8 quants on mma.sync
s8 tensor cores) and the activation quantizers / whole-matrix dequantizer (``quantize.cuh``).
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.dispatch import check_array
from cukern.dmmv import QWeight
from cukern.interop import like, tensors
from cukern.matmul.common import (Q8_0_BYTES, Q8_1_BYTES, _ACTS, _F32, _I8_MAX_TILE, _MAX_BLOCKS, _Q_THREADS,
                                  _ROW_TILE_GLU, _THREADS, _U8, _cols, _d_shape, _overlap, _q_rows, _raw16,
                                  _smem_q8)


class Int8:
    """MatmulDispatch's int8 GEMMs, quantizers and dequantizer (a mixin)."""

    @tensors(d=like("a", shape=_d_shape("w", "a"), dtype=np.float32))
    def gemm_q8(self, w: QWeight, a: cupy.ndarray, d: cupy.ndarray | None = None, *, accumulate: bool = False,
                split_k: int | None = None, stream=None) -> cupy.ndarray:
        """``d = W a`` on int8 tensor cores, a holding Q8_1 activations (:meth:`quantize_q8_1`, or
        ``ElementwiseDispatch.residual_rms_norm_q8_1``); ``accumulate``: ``d += W a``.

        w: QWeight [m, k] (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K); a: uint8 [n, k / 32 * 36] Q8_1
        rows (a row-strided view is fine; rows 4-byte aligned); d: [n, m] f32. Per 32-element
        block the integer dot product is exact; scales apply in f32. ``split_k`` as :meth:`gemm`."""
        w = self._weight("w", w)
        n, a_stride = self._q8_act(a, w.k)
        d_stride = _cols("d", d, _F32, w.m)
        if d.shape[0] != n:
            raise ValueError(f"d must be [{n}, {w.m}] (one row per row of a), got shape {d.shape}")
        if _overlap(a, d):
            raise ValueError("a and d must not overlap")
        bt, grid, k_split = self._grid(n, w, split_k, "gemm_q8", _I8_MAX_TILE)
        params = self.struct_of(w.qtype).pack(
            w_offset=w.offset, w2_offset=0, row_bytes=w.row_stride, b_stride=a_stride, d_stride=d_stride,
            m=w.m, n=n, k=w.k, k_split=k_split, mode=1 if accumulate else 0, atomic=int(grid[2] > 1), raw16=_raw16(w),
            d_tma=0)
        self._zero_for_split(d, grid, accumulate, stream)
        self._units_i8[w.qtype]._launch(f"gemm_q8<{w.qtype}, {bt}, 0>", grid, _THREADS, (d, w.buf, w.buf, a), params,
                                        stream=stream, shared_mem=_smem_q8(bt, w.qtype))
        return d

    def _q8_act(self, a, k: int) -> tuple[int, int]:
        """Validate Q8_1 activations [n, k / 32 * 36]; returns (n, row stride in bytes)."""
        nb = k // 32 * Q8_1_BYTES
        check_array("a", a, dtype=_U8, ndim=2, contiguous=False)
        n = a.shape[0]
        if n < 1:
            raise ValueError(f"a must have at least one column (token), got shape {a.shape}")
        if a.shape[1] != nb or a.strides[1] != 1 or (n > 1 and a.strides[0] < nb):
            raise ValueError(f"a must be uint8 [n, {nb}] (Q8_1 rows of k = {k}) with contiguous rows, "
                             f"got shape {a.shape} strides {a.strides}")
        a_stride = a.strides[0] if n > 1 else nb
        if a.data.ptr % 4 or a_stride % 4:
            raise ValueError("a rows must start 4-byte aligned")
        return n, a_stride

    @tensors
    def gemm_q8_glu(self, w_gate: QWeight, w_up: QWeight, a: cupy.ndarray, out: cupy.ndarray, *,
                    act: str = "swiglu", out_format: str = "f32", stream=None) -> cupy.ndarray:
        """``h[c] = act(W_gate a[c]) * (W_up a[c])`` on int8 tensor cores, a holding Q8_1 rows; the
        two products never leave the CTA. ``out_format``: ``"f32"`` (out: f32 [n, m]), ``"q8_1"``
        (out: uint8 [n, m / 32 * 36], the input of the next :meth:`gemm_q8`) or ``"q8_0"``
        (out: uint8 [n, m / 32 * 34]); the Q8 forms need m % 32 == 0 and quantize exactly as
        :meth:`quantize_q8_1` / :meth:`quantize_q8_0` would quantize the f32 h."""
        w_gate, w_up = self._glu_weights(w_gate, w_up, act)
        epi = {"f32": 1, "q8_1": 2, "q8_0": 3}.get(out_format)
        if epi is None:
            raise ValueError(f"out_format must be 'f32', 'q8_1' or 'q8_0', got {out_format!r}")
        m = w_gate.m
        n, a_stride = self._q8_act(a, w_gate.k)
        if epi == 1:
            out_stride = _cols("out", out, _F32, m)
        else:
            if m % 32:
                raise ValueError(f"{out_format} output needs m % 32 == 0, got m = {m}")
            nb = m // 32 * (Q8_1_BYTES if epi == 2 else Q8_0_BYTES)
            check_array("out", out, dtype=_U8, ndim=2, contiguous=False)
            if out.shape[1:] != (nb,) or out.strides[1] != 1 or (out.shape[0] > 1 and out.strides[0] < nb):
                raise ValueError(f"out must be uint8 [n, {nb}] ({out_format} rows of m = {m}) with contiguous "
                                 f"rows, got shape {out.shape} strides {out.strides}")
            out_stride = out.strides[0] if out.shape[0] > 1 else nb
            align = 4 if epi == 2 else 2
            if out.data.ptr % align or out_stride % align:
                raise ValueError(f"out rows must start {align}-byte aligned")
        if out.shape[0] != n:
            raise ValueError(f"out must have one row per row of a ({n}), got shape {out.shape}")
        if _overlap(a, out):
            raise ValueError("a and out must not overlap")
        bt = min(self._tile(n), _I8_MAX_TILE)
        grid = (-(-n // bt), -(-m // _ROW_TILE_GLU), 1)
        if grid[0] > 2**31 - 1 or grid[1] > 65535:
            raise ValueError(f"gemm_q8_glu: {n} columns x {m} rows exceed the grid limits")
        params = self.struct_of(w_gate.qtype).pack(
            w_offset=w_gate.offset, w2_offset=w_up.offset, row_bytes=w_gate.row_stride, b_stride=a_stride,
            d_stride=out_stride, m=m, n=n, k=w_gate.k, k_split=w_gate.k, mode=_ACTS[act], atomic=0,
            raw16=_raw16(w_gate, w_up), d_tma=0)
        self._units_i8[w_gate.qtype]._launch(f"gemm_q8<{w_gate.qtype}, {bt}, {epi}>", grid, _THREADS,
                                             (out, w_gate.buf, w_up.buf, a), params, stream=stream,
                                             shared_mem=_smem_q8(bt, w_gate.qtype))
        return out

    def _quantize(self, fmt: int, x, q, stream):
        what = "quantize_q8_1" if fmt == 0 else "quantize_q8_0"
        check_array("x", x, dtype=_F32, ndim=2, contiguous=False)
        n_rows, n_cols = x.shape
        if n_rows < 1 or n_cols < 1 or n_cols % 32:
            raise ValueError(f"{what}: x must be [n_rows >= 1, n_cols] with n_cols a positive multiple of 32, "
                             f"got shape {x.shape}")
        if x.strides[1] != 4 or x.strides[0] % 16 or x.data.ptr % 16 or (n_rows > 1 and x.strides[0] < 4 * n_cols):
            raise ValueError(f"{what}: x rows must be contiguous and 16-byte aligned, got strides {x.strides}")
        nb = (Q8_1_BYTES if fmt == 0 else Q8_0_BYTES) * (n_cols // 32)
        check_array("q", q, dtype=_U8, ndim=2, contiguous=False)
        if q.shape != (n_rows, nb) or q.strides[1] != 1 or (n_rows > 1 and q.strides[0] < nb):
            raise ValueError(f"{what}: q must be uint8 [{n_rows}, {nb}] with contiguous rows, got shape "
                             f"{q.shape} strides {q.strides}")
        align = 4 if fmt == 0 else 2
        if q.data.ptr % align or q.strides[0] % align:
            raise ValueError(f"{what}: q rows must start {align}-byte aligned")
        if _overlap(x, q):
            raise ValueError(f"{what}: x and q must not overlap")
        params = self.struct("QuantizeParams").pack(
            x_stride=x.strides[0] // 4 if n_rows > 1 else n_cols, q_stride=q.strides[0] if n_rows > 1 else nb,
            n_rows=n_rows, n_cols=n_cols)
        blocks = max(1, min(-(-(n_rows * n_cols // 4) // _Q_THREADS), _MAX_BLOCKS))
        self._launch(f"quantize_q8<{fmt}>", blocks, _Q_THREADS, (q, x), params, stream=stream)
        return q

    @tensors(q=like("x", shape=_q_rows(36), dtype=np.uint8))
    def quantize_q8_1(self, x: cupy.ndarray, q: cupy.ndarray | None = None, *, stream=None) -> cupy.ndarray:
        """Quantize the rows of x (f32 [n_rows, n_cols], n_cols % 32 == 0) to Q8_1 blocks
        (``cuda_src/common/q8_1.cuh``) in q: uint8 [n_rows, n_cols / 32 * 36]. One pass."""
        return self._quantize(0, x, q, stream)

    @tensors(q=like("x", shape=_q_rows(34), dtype=np.uint8))
    def quantize_q8_0(self, x: cupy.ndarray, q: cupy.ndarray | None = None, *, stream=None) -> cupy.ndarray:
        """Quantize the rows of x to GGUF Q8_0 blocks (half d = absmax / 127, 32 int8 rounded half
        away from zero) in q: uint8 [n_rows, n_cols / 32 * 34]. One pass. No GEMM reads Q8_0: the int8
        chain runs on Q8_1 (:meth:`quantize_q8_1`, docs/ARCHITECTURE.md's matmul section)."""
        return self._quantize(1, x, q, stream)

    @tensors(out=like("w", shape=lambda a: (a("w").m, a("w").k), dtype=np.float16))
    def dequantize(self, w: QWeight, out: cupy.ndarray | None = None, *, stream=None) -> cupy.ndarray:
        """``out = W`` as f16 [m, k] (C-contiguous, 16-byte aligned): what a dequantize + cuBLAS
        pipeline runs first."""
        w = self._weight("w", w)
        check_array("out", out, dtype=np.float16, shape=(w.m, w.k), align=16)
        params = self.struct("DequantParams").pack(w_offset=w.offset, row_bytes=w.row_stride, m=w.m, k=w.k)
        units = w.m * (w.k // 32) * 2
        blocks = max(1, min(-(-units // _Q_THREADS), 4 * _MAX_BLOCKS))
        self._launch(f"dequantize_f16<{w.qtype}>", blocks, _Q_THREADS, (out, w.buf), params, stream=stream)
        return out
