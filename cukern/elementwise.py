"""ElementwiseDispatch: norms, vector arithmetic and fused decode-loop kernels.

Kernels: ``cuda_src/elementwise/``; float64 references:
``cukern/reference/elementwise.py``; tests: ``tests/test_elementwise.py``.
All activations are f32, row-major, C-contiguous.
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.dispatch import Dispatch, check_array
from cukern.runtime import FamilySpec, KernelSpec

__all__ = ["ElementwiseDispatch", "FAMILY"]

_F32 = np.dtype(np.float32)
_ROW_BLOCK = 256  # threads per row for the row-wise norms
_FLAT_BLOCK = 256
_MAX_FLAT = 2**31 - 1  # kernels index with uint32 and a grid stride: stay clear of wrap-around


def _row_kernels(name: str, params: str) -> list[KernelSpec]:
    return [KernelSpec(f"{name}<{_ROW_BLOCK}, {v}>", params) for v in ("true", "false")]


FAMILY = FamilySpec(
    name="elementwise",
    kernels=tuple(
        _row_kernels("rms_norm", "RmsNormParams")
        + _row_kernels("residual_rms_norm", "RmsNormParams")
        + [KernelSpec(f"add_scaled<{v}>", "AxpyParams") for v in ("true", "false")]
        + [KernelSpec(f"scale<{v}>", "AxpyParams") for v in ("true", "false")]
    ),
)


def _vec4(n: int, *arrays: cupy.ndarray) -> str:
    """'true' when every array can be read as float4 (n % 4 == 0, 16-byte aligned)."""
    ok = n % 4 == 0 and all(a.data.ptr % 16 == 0 for a in arrays)
    return "true" if ok else "false"


_FLAT_MAX_BLOCKS = 4096  # enough to fill any current GPU several times over; kernels grid-stride beyond


def _flat_grid(n: int) -> int:
    return max(1, min(-(-n // _FLAT_BLOCK), _FLAT_MAX_BLOCKS))


class ElementwiseDispatch(Dispatch):
    """Records elementwise kernels into a stream. Every method takes ``stream=``
    (None: CuPy's current stream) and validates its arguments before launching."""

    family = FAMILY

    def _norm_args(self, x, w, out, eps: float, weight_offset: float, what: str):
        check_array("x", x, dtype=_F32, ndim=2)
        n_rows, n_cols = x.shape
        if n_rows == 0 or n_cols == 0:
            raise ValueError(f"{what}: x must be non-empty, got shape {x.shape}")
        check_array("w", w, dtype=_F32, shape=(n_cols,))
        check_array("out", out, dtype=_F32, shape=(n_rows, n_cols))
        if not eps >= 0:
            raise ValueError(f"{what}: eps must be >= 0, got {eps}")
        params = self.struct("RmsNormParams").pack(n_rows=n_rows, n_cols=n_cols, eps=eps,
                                                   weight_offset=weight_offset)
        return n_rows, n_cols, params

    def rms_norm(self, x: cupy.ndarray, w: cupy.ndarray, out: cupy.ndarray, *, eps: float = 1e-6,
                 weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """``out = x * rsqrt(mean(x**2, axis=-1) + eps) * (w + weight_offset)``.

        x: [n_rows, n_cols] f32; w: [n_cols] f32; out: [n_rows, n_cols] f32 (may be x)."""
        n_rows, n_cols, params = self._norm_args(x, w, out, eps, weight_offset, "rms_norm")
        v = _vec4(n_cols, x, w, out)
        self._launch(f"rms_norm<{_ROW_BLOCK}, {v}>", n_rows, _ROW_BLOCK, (out, x, w), params, stream=stream)
        return out

    def residual_rms_norm(self, x: cupy.ndarray, residual: cupy.ndarray, w: cupy.ndarray, out: cupy.ndarray, *,
                          eps: float = 1e-6, weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """``residual += x; out = rms_norm(residual) * (w + weight_offset)``.

        x, residual, out: [n_rows, n_cols] f32 (residual updated in place; out must not alias it)."""
        n_rows, n_cols, params = self._norm_args(x, w, out, eps, weight_offset, "residual_rms_norm")
        check_array("residual", residual, dtype=_F32, shape=(n_rows, n_cols))
        if out.data.ptr == residual.data.ptr:
            raise ValueError("residual_rms_norm: out must not alias residual")
        v = _vec4(n_cols, x, residual, w, out)
        self._launch(f"residual_rms_norm<{_ROW_BLOCK}, {v}>", n_rows, _ROW_BLOCK, (out, residual, x, w), params,
                     stream=stream)
        return out

    def _flat_args(self, out, *arrays):
        check_array("out", out, dtype=_F32)
        n = out.size
        if not 0 < n <= _MAX_FLAT:
            raise ValueError(f"out must have 1 to {_MAX_FLAT} elements, got {n}")
        for name, a in arrays:
            check_array(name, a, dtype=_F32, shape=out.shape)
        return n

    def add_scaled(self, a: cupy.ndarray, b: cupy.ndarray, out: cupy.ndarray, *, alpha: float = 1.0,
                   stream=None) -> cupy.ndarray:
        """``out = a + alpha * b`` elementwise, f32, any shape (out may be a: ``a += alpha * b``)."""
        n = self._flat_args(out, ("a", a), ("b", b))
        params = self.struct("AxpyParams").pack(n=n, alpha=alpha)
        self._launch(f"add_scaled<{_vec4(n, out, a, b)}>", _flat_grid(n), _FLAT_BLOCK, (out, a, b), params,
                     stream=stream)
        return out

    def scale(self, a: cupy.ndarray, out: cupy.ndarray, *, alpha: float, stream=None) -> cupy.ndarray:
        """``out = alpha * a`` elementwise, f32, any shape (out may be a)."""
        n = self._flat_args(out, ("a", a))
        params = self.struct("AxpyParams").pack(n=n, alpha=alpha)
        self._launch(f"scale<{_vec4(n, out, a)}>", _flat_grid(n), _FLAT_BLOCK, (out, a), params, stream=stream)
        return out
