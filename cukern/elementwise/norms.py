"""RMS norms (plain, residual, post-norm, accumulate, Q8_1-emitting), per-head and group norms: the
kernels of ``cuda_src/elementwise/norms.cuh``.
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.dispatch import check_array
from cukern.elementwise.common import _F32, _MAX_U32, _aligned, _check_disjoint, _check_distinct, _check_eps, _vec
from cukern.interop import like, tensors

Q8_1_BLOCK = 32         # values per Q8_1 block (cuda_src/common/q8_1.cuh)
Q8_1_BLOCK_BYTES = 36   # bytes per block: half d, half s, int8 qs[32]
# Row-norm register kernels: (threads, float4s per thread); a row of n_cols fits when
# n_cols <= 4 * threads * items. The host takes the first that fits (fewest idle threads).
_REG_CONFIGS = ((64, 4), (128, 4), (256, 4), (512, 4), (1024, 4), (1024, 8))
# Few rows (decode): one float4 per thread and more threads, for a shorter dependent chain per thread.
_REG_CONFIGS_FEW_ROWS = ((64, 1), (128, 1), (256, 1), (512, 1), (1024, 1))
_FEW_ROWS = 132  # fewer rows than this: the GPU is far from full anyway
_LOOP_BLOCK = 256
_REG_KERNELS = ("rms_norm", "residual_rms_norm", "post_norm_residual_rms_norm", "rms_norm_accumulate",
                "residual_rms_norm_q8_1")
_LOOP_KERNELS = ("rms_norm", "residual_rms_norm", "post_norm_residual_rms_norm", "rms_norm_accumulate")
_RESIDENT_GROUP_BLOCKS = 16  # 128-thread group_norm_reg blocks per SM
_QUANT_UNROLL = 4  # QUANT_UNROLL in norms.cuh
_GROUP_VPL = (1, 2, 8)  # float4s per lane of group_norm_reg: group_size <= 128 * VPL
_GROUPS_PER_BLOCK = 8  # 4 warps x GROUPS_PER_WARP (norms.cuh)


def _q8_1_shape(a):
    """The Q8_1 rows of x (interop.like)."""
    x = a("x")
    return x.shape[0], x.shape[1] // Q8_1_BLOCK * Q8_1_BLOCK_BYTES


class Norms:
    """ElementwiseDispatch's norms methods (a mixin: launches through the dispatch's ``_launch``)."""

    def _rows(self, x, name="x"):
        check_array(name, x, dtype=_F32, ndim=2)
        n_rows, n_cols = x.shape
        if n_rows == 0 or n_cols == 0:
            raise ValueError(f"{name} must be non-empty, got shape {x.shape}")
        if n_rows > 2**31 - 1:
            raise ValueError(f"{name}: at most 2**31 - 1 rows, got {n_rows}")
        return n_rows, n_cols

    def _norm_params(self, n_rows, n_cols, eps, weight_offset, what):
        _check_eps(eps, what)
        return self.struct("RmsNormParams").pack(n_rows=n_rows, n_cols=n_cols, eps=eps, weight_offset=weight_offset)

    @staticmethod
    def _reg_config(n_rows: int, n_cols: int, arrays) -> tuple[int, int] | None:
        """(threads, items) of the register kernel for this row width, or None for the loop fallback."""
        if n_cols % 4 or not _aligned(*arrays):
            return None
        n4 = n_cols // 4
        configs = (_REG_CONFIGS_FEW_ROWS + _REG_CONFIGS) if n_rows < _FEW_ROWS else _REG_CONFIGS
        for block, items in configs:
            if n4 <= block * items:
                return block, items
        return None

    def _row_norm(self, name, n_rows, n_cols, arrays, params, stream, q8=False):
        cfg = self._reg_config(n_rows, n_cols, arrays)
        if cfg is None:
            if q8:
                raise ValueError(f"{name}: needs n_cols % 4 == 0, 16-byte aligned arrays and n_cols <= "
                                 f"{4 * _REG_CONFIGS[-1][0] * _REG_CONFIGS[-1][1]}, got n_cols={n_cols}")
            self._launch(f"{name}_loop<{_LOOP_BLOCK}>", n_rows, _LOOP_BLOCK, arrays, params, stream=stream)
        else:
            block, items = cfg
            self._launch(f"{name}_reg<{block}, {items}>", n_rows, block, arrays, params, stream=stream)

    @tensors(out=like("x"))
    def rms_norm(self, x: cupy.ndarray, w: cupy.ndarray, out: cupy.ndarray | None = None, *, eps: float = 1e-6,
                 weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """``out = x * rsqrt(mean(x**2, axis=-1) + eps) * (w + weight_offset)``.

        x: [n_rows, n_cols] f32; w: [n_cols] f32; out: [n_rows, n_cols] f32 (may be x)."""
        n_rows, n_cols = self._rows(x)
        check_array("w", w, dtype=_F32, shape=(n_cols,))
        check_array("out", out, dtype=_F32, shape=(n_rows, n_cols))
        params = self._norm_params(n_rows, n_cols, eps, weight_offset, "rms_norm")
        self._row_norm("rms_norm", n_rows, n_cols, (out, x, w), params, stream)
        return out

    @tensors(out=like("x"))
    def residual_rms_norm(self, x: cupy.ndarray, residual: cupy.ndarray, w: cupy.ndarray,
                          out: cupy.ndarray | None = None, *, eps: float = 1e-6, weight_offset: float = 0.0,
                          stream=None) -> cupy.ndarray:
        """``residual += x; out = rms_norm(residual) * (w + weight_offset)``.

        x, residual, out: [n_rows, n_cols] f32 (residual updated in place; out must not overlap it)."""
        n_rows, n_cols = self._rows(x)
        check_array("residual", residual, dtype=_F32, shape=(n_rows, n_cols))
        check_array("w", w, dtype=_F32, shape=(n_cols,))
        check_array("out", out, dtype=_F32, shape=(n_rows, n_cols))
        _check_distinct("residual_rms_norm", out=out, residual=residual)
        params = self._norm_params(n_rows, n_cols, eps, weight_offset, "residual_rms_norm")
        self._row_norm("residual_rms_norm", n_rows, n_cols, (out, residual, x, w), params, stream)
        return out

    @tensors(out=like("x"))
    def post_norm_residual_rms_norm(self, x: cupy.ndarray, residual: cupy.ndarray, w_post: cupy.ndarray,
                                    w: cupy.ndarray, out: cupy.ndarray | None = None, *, eps: float = 1e-6,
                                    weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """Gemma's post-attention chain: ``residual += rms_norm(x) * (w_post + off)``, then
        ``out = rms_norm(residual) * (w + off)``.

        x, residual, out: [n_rows, n_cols] f32; w_post, w: [n_cols] f32; out must not overlap residual."""
        n_rows, n_cols = self._rows(x)
        check_array("residual", residual, dtype=_F32, shape=(n_rows, n_cols))
        check_array("w_post", w_post, dtype=_F32, shape=(n_cols,))
        check_array("w", w, dtype=_F32, shape=(n_cols,))
        check_array("out", out, dtype=_F32, shape=(n_rows, n_cols))
        _check_distinct("post_norm_residual_rms_norm", out=out, residual=residual)
        params = self._norm_params(n_rows, n_cols, eps, weight_offset, "post_norm_residual_rms_norm")
        self._row_norm("post_norm_residual_rms_norm", n_rows, n_cols, (out, residual, x, w_post, w), params, stream)
        return out

    @tensors
    def rms_norm_accumulate(self, src: cupy.ndarray, w: cupy.ndarray, hidden: cupy.ndarray, *, eps: float = 1e-6,
                            weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """``hidden += rms_norm(src) * (w + weight_offset)`` (post-FFN norm fused with the residual add).

        src, hidden: [n_rows, n_cols] f32 (must not overlap); w: [n_cols] f32."""
        n_rows, n_cols = self._rows(src, "src")
        check_array("w", w, dtype=_F32, shape=(n_cols,))
        check_array("hidden", hidden, dtype=_F32, shape=(n_rows, n_cols))
        _check_distinct("rms_norm_accumulate", src=src, hidden=hidden)
        params = self._norm_params(n_rows, n_cols, eps, weight_offset, "rms_norm_accumulate")
        self._row_norm("rms_norm_accumulate", n_rows, n_cols, (hidden, src, w), params, stream)
        return hidden

    @tensors(q=like("x", shape=_q8_1_shape, dtype=np.uint8))
    def residual_rms_norm_q8_1(self, x: cupy.ndarray, residual: cupy.ndarray, w: cupy.ndarray,
                               q: cupy.ndarray | None = None, *, eps: float = 1e-6, weight_offset: float = 0.0,
                               stream=None) -> cupy.ndarray:
        """``residual += x`` and ``q = Q8_1(rms_norm(residual) * (w + weight_offset))``.

        x, residual: [n_rows, n_cols] f32, n_cols % 32 == 0; q: [n_rows, n_cols // 32 * 36] uint8, GGUF
        block_q8_1 rows (half d, half s = d * sum(qs), int8 qs[32]; cuda_src/common/q8_1.cuh)."""
        n_rows, n_cols = self._rows(x)
        if n_cols % Q8_1_BLOCK:
            raise ValueError(f"residual_rms_norm_q8_1: n_cols must be a multiple of {Q8_1_BLOCK}, got {n_cols}")
        check_array("residual", residual, dtype=_F32, shape=(n_rows, n_cols))
        check_array("w", w, dtype=_F32, shape=(n_cols,))
        check_array("q", q, dtype=np.uint8, shape=(n_rows, n_cols // Q8_1_BLOCK * Q8_1_BLOCK_BYTES), align=4)
        _check_distinct("residual_rms_norm_q8_1", q=q, residual=residual)
        params = self._norm_params(n_rows, n_cols, eps, weight_offset, "residual_rms_norm_q8_1")
        self._row_norm("residual_rms_norm_q8_1", n_rows, n_cols, (q, residual, x, w), params, stream, q8=True)
        return q

    @tensors(q=like("x", shape=_q8_1_shape, dtype=np.uint8))
    def quantize_q8_1(self, x: cupy.ndarray, q: cupy.ndarray | None = None, *, stream=None) -> cupy.ndarray:
        """``q = Q8_1(x)`` row by row: x [n_rows, n_cols] f32 (n_cols % 32 == 0, 16-byte aligned);
        q [n_rows, n_cols // 32 * 36] uint8 as :meth:`residual_rms_norm_q8_1` writes it."""
        n_rows, n_cols = self._rows(x)
        if n_cols % Q8_1_BLOCK:
            raise ValueError(f"quantize_q8_1: n_cols must be a multiple of {Q8_1_BLOCK}, got {n_cols}")
        check_array("x", x, align=16)
        check_array("q", q, dtype=np.uint8, shape=(n_rows, n_cols // Q8_1_BLOCK * Q8_1_BLOCK_BYTES), align=4)
        _check_disjoint("quantize_q8_1", dict(q=q), dict(x=x))
        blocks = -(-(x.size // 4) // (256 * _QUANT_UNROLL))
        if blocks > 2**31 - 1:
            raise ValueError("quantize_q8_1: too many values")
        params = self.struct("QuantizeParams").pack(n_values=x.size)
        self._launch("quantize_q8_1", blocks, 256, (q, x), params, stream=stream)
        return q

    def _group_norm(self, what, x, out, w, z, group_size, l2, eps, weight_offset, stream):
        check_array("x", x, dtype=_F32)
        if x.size == 0:
            raise ValueError(f"{what}: x must be non-empty")
        if not isinstance(group_size, (int, np.integer)) or group_size < 1 or x.shape[-1] % group_size:
            raise ValueError(f"{what}: group_size must be a positive divisor of x.shape[-1] "
                             f"({x.shape[-1]}), got {group_size}")
        check_array("out", out, dtype=_F32, shape=x.shape)
        if w is not None:
            check_array("w", w, dtype=_F32, shape=(group_size,))
        if z is not None:
            check_array("z", z, dtype=_F32, shape=x.shape)
        _check_eps(eps, what)
        n_groups = x.size // group_size
        if n_groups > _MAX_U32:
            raise ValueError(f"{what}: too many groups ({n_groups})")
        params = self.struct("GroupNormParams").pack(n_groups=n_groups, group_size=int(group_size),
                                                     has_weight=int(w is not None), l2=int(l2), eps=eps,
                                                     weight_offset=weight_offset)
        ptrs = (out, x, w if w is not None else x, z if z is not None else x)
        vpl = next((v for v in _GROUP_VPL if group_size <= 128 * v), None)
        if vpl is not None and group_size % 4 == 0 and _aligned(*ptrs):
            grid = min(-(-n_groups // _GROUPS_PER_BLOCK), self.sm_count() * _RESIDENT_GROUP_BLOCKS)
            self._launch(f"group_norm_reg<{_vec(z is not None)}, {vpl}>", grid, 128, ptrs, params, stream=stream)
        else:
            self._launch(f"group_norm<{_vec(z is not None)}>", -(-n_groups // 4), 128, ptrs, params, stream=stream)
        return out

    @tensors(out=like("x"))
    def head_rms_norm(self, x: cupy.ndarray, w: cupy.ndarray, out: cupy.ndarray | None = None, *, eps: float = 1e-6,
                      weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """Per-head Q/K RMS norm: every row of the last axis (head_dim) is normed and scaled by
        ``w + weight_offset``. x, out: [..., head_dim] f32 (out may be x); w: [head_dim] f32."""
        check_array("x", x, dtype=_F32)
        if x.ndim < 1:
            raise ValueError("head_rms_norm: x must have at least one dimension")
        return self._group_norm("head_rms_norm", x, out, w, None, x.shape[-1], False, eps, weight_offset, stream)

    @tensors(out=like("x"))
    def group_norm(self, x: cupy.ndarray, out: cupy.ndarray | None = None, *, group_size: int,
                   w: cupy.ndarray | None = None, l2: bool = False, eps: float = 1e-6, weight_offset: float = 0.0,
                   stream=None) -> cupy.ndarray:
        """Norm of every contiguous group of ``group_size`` elements (DeltaNet's grouped Q/K norm):
        RMS (``rsqrt(mean(x**2) + eps)``) or, with ``l2``, L2 (``rsqrt(sum(x**2) + eps)``); times
        ``w + weight_offset`` when w ([group_size]) is given. x, out: same shape, f32 (out may be x)."""
        return self._group_norm("group_norm", x, out, w, None, group_size, l2, eps, weight_offset, stream)

    @tensors(out=like("y"))
    def gated_rms_norm(self, y: cupy.ndarray, z: cupy.ndarray, w: cupy.ndarray, out: cupy.ndarray | None = None, *,
                       group_size: int, eps: float = 1e-6, weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """``out = rms_norm(y) * (w + weight_offset) * silu(z)`` per group of ``group_size`` (the gated
        RMS norm of DeltaNet's output). y, z, out: same shape f32; w: [group_size] f32."""
        check_array("y", y, dtype=_F32)
        return self._group_norm("gated_rms_norm", y, out, w, z, group_size, False, eps, weight_offset, stream)
