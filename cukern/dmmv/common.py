"""Constants the dmmv family's modules share: the column widths of a launch, the warp step, the rows
per block of the GLU and MoE kernels, the activation ids, and the warps per block of the f32 path.
"""

from __future__ import annotations

import numpy as np

_COLS = (1, 2, 4, 8)  # columns per dmmv launch (wider batches are split)
_STEP = 256  # elements per warp step (cuda_src/dmmv/step.cuh)
_ROWS = 2  # weight rows per block of dmmv_glu and the MoE kernels (kRows in the .cu files)
_ACTS = {"swiglu": 0, "silu": 0, "geglu": 1, "gelu": 1}
_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)


def _y_shape(w: str):
    """The shape of y for weight argument ``w`` and input x ([k] or [n, k], an array or a NormedX /
    QuantizedX): interop.like's shape function."""
    return lambda a: (*a("x").shape[:-1], a(w).m)


def _warps(k: int) -> int:
    """Warps per block: at least two 256-element steps per warp, at most 4 warps (the sweep's
    best for k = 4096 ... 14336 on an H100)."""
    steps = -(-k // _STEP)
    return max(1, min(4, steps // 2))
