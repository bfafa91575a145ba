"""RMS norms (plain, residual, post-norm, accumulate, Q8_1-emitting), per-head and group norms: the
kernels of ``cuda_src/elementwise/norms.cuh``.
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.dispatch import check_array
from cukern.elementwise.common import (_F32, _MAX_U32, _act_type, _aligned, _check_disjoint, _check_distinct,
                                      _check_eps, _targ, _vec)
from cukern.interop import like, tensors

Q8_1_BLOCK = 32         # values per Q8_1 block (cuda_src/common/q8_1.cuh)
Q8_1_BLOCK_BYTES = 36   # bytes per block: half d, half s, int8 qs[32]
# Row-norm register kernels: (threads, 16-byte units per thread); a row of n_cols elements of itemsize bytes
# fits when n_cols <= (16 / itemsize) * threads * items. The host takes the first that fits (fewest idle
# threads). Instantiated for f32, f16 and bf16 (the Q8_1 one for f32 only).
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
# 16-byte units per lane of group_norm_reg (group_size <= 32 * (16 / itemsize) * VPL), by itemsize: the
# 16-bit types' VPL keep the f32 ones' register budgets (8 and 32 values a lane per group), not all three
_GROUP_VPL = {4: (1, 2, 8), 2: (1, 4)}
_GROUPS_PER_BLOCK = 8  # 4 warps x GROUPS_PER_WARP (norms.cuh)


def _q8_1_shape(a):
    """The Q8_1 rows of x (interop.like)."""
    x = a("x")
    return x.shape[0], x.shape[1] // Q8_1_BLOCK * Q8_1_BLOCK_BYTES


class Norms:
    """ElementwiseDispatch's norms methods (a mixin: launches through the dispatch's ``_launch``)."""

    def _rows(self, x, name="x", act=False):
        """(n_rows, n_cols) of a 2-D activation array: f32, or with ``act`` f32 / f16 / bf16 (uint16 bits)."""
        check_array(name, x, dtype=None if act else _F32, ndim=2)
        if act:
            _act_type(name, x)
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
    def _reg_config(n_rows: int, n_cols: int, arrays, itemsize: int = 4) -> tuple[int, int] | None:
        """(threads, items) of the register kernel for this row width, or None for the loop fallback: it needs
        whole 16-byte units (n_cols % (16 / itemsize) == 0) and 16-byte aligned arrays."""
        per_unit = 16 // itemsize
        if n_cols % per_unit or not _aligned(*arrays):
            return None
        units = n_cols // per_unit
        configs = (_REG_CONFIGS_FEW_ROWS + _REG_CONFIGS) if n_rows < _FEW_ROWS else _REG_CONFIGS
        for block, items in configs:
            if units <= block * items:
                return block, items
        return None

    def _row_norm(self, name, n_rows, n_cols, arrays, params, stream, q8=False):
        """Launch the register or loop version of a row norm; arrays[0] (the output) gives the type T."""
        ctype = _act_type("out", arrays[0]) if not q8 else "float"
        cfg = self._reg_config(n_rows, n_cols, arrays, 4 if q8 else arrays[0].itemsize)
        if cfg is None:
            if q8:
                raise ValueError(f"{name}: needs n_cols % 4 == 0, 16-byte aligned arrays and n_cols <= "
                                 f"{4 * _REG_CONFIGS[-1][0] * _REG_CONFIGS[-1][1]}, got n_cols={n_cols}")
            self._launch(f"{name}_loop<{_LOOP_BLOCK}{_targ(ctype)}>", n_rows, _LOOP_BLOCK, arrays, params,
                         stream=stream)
        else:
            block, items = cfg
            self._launch(f"{name}_reg<{block}, {items}{_targ(ctype)}>", n_rows, block, arrays, params, stream=stream)

    @tensors(out=like("x"))
    def rms_norm(self, x: cupy.ndarray, w: cupy.ndarray, out: cupy.ndarray | None = None, *, eps: float = 1e-6,
                 weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """``out = x * rsqrt(mean(x**2, axis=-1) + eps) * (w + weight_offset)``.

        x: [n_rows, n_cols] f32, f16 or bf16 (uint16 bits); w: [n_cols] f32; out: [n_rows, n_cols] of x's
        dtype (may be x). Computed in f32, out rounded once."""
        n_rows, n_cols = self._rows(x, act=True)
        check_array("w", w, dtype=_F32, shape=(n_cols,))
        check_array("out", out, dtype=x.dtype, shape=(n_rows, n_cols))
        params = self._norm_params(n_rows, n_cols, eps, weight_offset, "rms_norm")
        self._row_norm("rms_norm", n_rows, n_cols, (out, x, w), params, stream)
        return out

    @tensors(out=like("x"))
    def residual_rms_norm(self, x: cupy.ndarray, residual: cupy.ndarray, w: cupy.ndarray,
                          out: cupy.ndarray | None = None, *, eps: float = 1e-6, weight_offset: float = 0.0,
                          stream=None) -> cupy.ndarray:
        """``residual += x; out = rms_norm(residual) * (w + weight_offset)``.

        x, residual, out: [n_rows, n_cols], one dtype of f32, f16, bf16 (residual updated in place; out must not
        overlap it); w: [n_cols] f32. The norm reads the f32 sum; residual stores it rounded."""
        n_rows, n_cols = self._rows(x, act=True)
        check_array("residual", residual, dtype=x.dtype, shape=(n_rows, n_cols))
        check_array("w", w, dtype=_F32, shape=(n_cols,))
        check_array("out", out, dtype=x.dtype, shape=(n_rows, n_cols))
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

        x, residual, out: [n_rows, n_cols], one dtype of f32, f16, bf16; w_post, w: [n_cols] f32; out must not
        overlap residual."""
        n_rows, n_cols = self._rows(x, act=True)
        check_array("residual", residual, dtype=x.dtype, shape=(n_rows, n_cols))
        check_array("w_post", w_post, dtype=_F32, shape=(n_cols,))
        check_array("w", w, dtype=_F32, shape=(n_cols,))
        check_array("out", out, dtype=x.dtype, shape=(n_rows, n_cols))
        _check_distinct("post_norm_residual_rms_norm", out=out, residual=residual)
        params = self._norm_params(n_rows, n_cols, eps, weight_offset, "post_norm_residual_rms_norm")
        self._row_norm("post_norm_residual_rms_norm", n_rows, n_cols, (out, residual, x, w_post, w), params, stream)
        return out

    @tensors
    def rms_norm_accumulate(self, src: cupy.ndarray, w: cupy.ndarray, hidden: cupy.ndarray, *, eps: float = 1e-6,
                            weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """``hidden += rms_norm(src) * (w + weight_offset)`` (post-FFN norm fused with the residual add).

        src, hidden: [n_rows, n_cols], one dtype of f32, f16, bf16 (must not overlap); w: [n_cols] f32."""
        n_rows, n_cols = self._rows(src, "src", act=True)
        check_array("w", w, dtype=_F32, shape=(n_cols,))
        check_array("hidden", hidden, dtype=src.dtype, shape=(n_rows, n_cols))
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
        check_array("x", x)
        ctype = _act_type("x", x)
        if x.size == 0:
            raise ValueError(f"{what}: x must be non-empty")
        if not isinstance(group_size, (int, np.integer)) or group_size < 1 or x.shape[-1] % group_size:
            raise ValueError(f"{what}: group_size must be a positive divisor of x.shape[-1] "
                             f"({x.shape[-1]}), got {group_size}")
        check_array("out", out, dtype=x.dtype, shape=x.shape)
        if w is not None:
            check_array("w", w, dtype=_F32, shape=(group_size,))
        if z is not None:
            check_array("z", z, dtype=x.dtype, shape=x.shape)
        _check_eps(eps, what)
        n_groups = x.size // group_size
        if n_groups > _MAX_U32:
            raise ValueError(f"{what}: too many groups ({n_groups})")
        params = self.struct("GroupNormParams").pack(n_groups=n_groups, group_size=int(group_size),
                                                     has_weight=int(w is not None), l2=int(l2), eps=eps,
                                                     weight_offset=weight_offset)
        ptrs = (out, x, w if w is not None else x, z if z is not None else x)
        per_unit = 16 // x.itemsize  # elements per 16-byte unit
        vpl = next((v for v in _GROUP_VPL[x.itemsize] if group_size <= 32 * per_unit * v), None)
        gate, t = _vec(z is not None), _targ(ctype)
        if vpl is not None and group_size % per_unit == 0 and _aligned(*ptrs):
            grid = min(-(-n_groups // _GROUPS_PER_BLOCK), self.sm_count() * _RESIDENT_GROUP_BLOCKS)
            self._launch(f"group_norm_reg<{gate}, {vpl}{t}>", grid, 128, ptrs, params, stream=stream)
        else:
            self._launch(f"group_norm<{gate}{t}>", -(-n_groups // 4), 128, ptrs, params, stream=stream)
        return out

    @tensors(out=like("x"))
    def head_rms_norm(self, x: cupy.ndarray, w: cupy.ndarray, out: cupy.ndarray | None = None, *, eps: float = 1e-6,
                      weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """Per-head Q/K RMS norm: every row of the last axis (head_dim) is normed and scaled by
        ``w + weight_offset``. x, out: [..., head_dim] f32, f16 or bf16, one dtype (out may be x); w:
        [head_dim] f32."""
        check_array("x", x)
        if x.ndim < 1:
            raise ValueError("head_rms_norm: x must have at least one dimension")
        return self._group_norm("head_rms_norm", x, out, w, None, x.shape[-1], False, eps, weight_offset, stream)

    @tensors(out=like("x"))
    def group_norm(self, x: cupy.ndarray, out: cupy.ndarray | None = None, *, group_size: int,
                   w: cupy.ndarray | None = None, l2: bool = False, eps: float = 1e-6, weight_offset: float = 0.0,
                   stream=None) -> cupy.ndarray:
        """Norm of every contiguous group of ``group_size`` elements (DeltaNet's grouped Q/K norm):
        RMS (``rsqrt(mean(x**2) + eps)``) or, with ``l2``, L2 (``rsqrt(sum(x**2) + eps)``); times
        ``w + weight_offset`` when w ([group_size] f32) is given. x, out: same shape and dtype, f32, f16 or bf16
        (out may be x)."""
        return self._group_norm("group_norm", x, out, w, None, group_size, l2, eps, weight_offset, stream)

    @tensors(out=like("y"))
    def gated_rms_norm(self, y: cupy.ndarray, z: cupy.ndarray, w: cupy.ndarray, out: cupy.ndarray | None = None, *,
                       group_size: int, eps: float = 1e-6, weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """``out = rms_norm(y) * (w + weight_offset) * silu(z)`` per group of ``group_size`` (the gated
        RMS norm of DeltaNet's output). y, z, out: same shape and dtype, f32, f16 or bf16; w: [group_size] f32."""
        check_array("y", y)
        return self._group_norm("gated_rms_norm", y, out, w, z, group_size, False, eps, weight_offset, stream)
