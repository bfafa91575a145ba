"""Float64 references for the elementwise family (cukern/elementwise.py)."""

from __future__ import annotations

import numpy as np


def rms_norm(x, w, *, eps: float = 1e-6, weight_offset: float = 0.0) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (w + weight_offset)


def residual_rms_norm(x, residual, w, *, eps: float = 1e-6, weight_offset: float = 0.0):
    """Returns (out, new_residual)."""
    r = np.asarray(residual, dtype=np.float64) + np.asarray(x, dtype=np.float64)
    return rms_norm(r, w, eps=eps, weight_offset=weight_offset), r


def add_scaled(a, b, *, alpha: float = 1.0) -> np.ndarray:
    return np.asarray(a, dtype=np.float64) + alpha * np.asarray(b, dtype=np.float64)


def scale(a, *, alpha: float) -> np.ndarray:
    return alpha * np.asarray(a, dtype=np.float64)
