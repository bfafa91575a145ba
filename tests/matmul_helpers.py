"""Shared helpers of the matmul tests (test_matmul*.py): weights, activations and checks, built on
gguf's own dequantization of random valid GGUF blocks (cukern/reference/matmul.py).

Tolerances (f16 tensor-core path; W and B are rounded to f16, products accumulate in f32):
* against the exact float64 product: |out - ref| <= 2e-3 * rms(ref) + 2e-3 * |ref| (the issue's
  2e-3 relative; the rms floor covers outputs that cancel to near zero, where f16 input rounding,
  ~2.4e-4 * rms per output, dominates any element-wise relative bound); 4e-3 * rms for the fused
  act(gate) * up, where the rounding noise of both products adds up;
* against the float64 product of the f16-rounded operands (kernel error alone):
  |out - ref| <= 1e-4 * rms(ref) + 1e-4 * |ref|. One wrong nibble or scale is ~1e-2 * rms. For
  gemm_wgr the f16 weights are those of its f16 arithmetic (``ref.wgr_values``: the K-quants with
  one rounding more than dequantize_f16, element for element).
Quantizers: int8 values agree exactly with the f32 re-computation of the kernel's arithmetic; d
and s to their f16 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.dmmv import QWeight  # noqa: E402
from cukern.matmul import common as M  # noqa: E402 (the family's constants and operand helpers)
from cukern.reference import matmul as ref  # noqa: E402
from cukern.reference import dmmv as dmmv_ref  # noqa: E402
from cukern.testing import assert_close  # noqa: E402


TYPES = list(M.GEMM_QTYPES)
NAMES = {q: ref.TYPES[q][0] for q in TYPES}


def _k(q, mult=3):
    """A valid k with several stages and, for the 32-blocks, not a multiple of 256."""
    return 256 * mult if ref.TYPES[q][1] == 256 else 32 * (8 * mult + 3)


def _rms(a):
    return float(np.sqrt(np.mean(np.square(a)))) + 1e-30


def _check(out, want, tight, name="d", loose=2e-3):
    assert_close(out, want, atol=loose * _rms(want), rtol=2e-3, name=name)
    assert_close(out, tight, atol=1e-4 * _rms(tight), rtol=1e-4, name=name + " (f16 inputs)")


def _act_slope(g, act):
    """act'(g) in float64, analytically (a difference quotient cancels in GELU's far tail)."""
    if act == "swiglu":
        s = 1.0 / (1.0 + np.exp(-g))
        return s * (1.0 + g * (1.0 - s))
    c = np.sqrt(2.0 / np.pi)
    t = np.tanh(c * (g + 0.044715 * g ** 3))
    return 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * g * g)


def _check_glu(out, w_gate, w_up, b, act, tight, name="d", loose=2e-3):
    """act(g) * u (g = W_gate b, u = W_up b) against float64, each product's error bounded as
    _check bounds one product (loose * (rms + |value|)) and carried to first order element by
    element: |d(act(g) u)| <= loose * (|act'(g) u| (rms(g) + |g|) + |act(g)| (rms(u) + |u|)), plus
    a floor of loose / 100 * rms(act(g) u) for the f32 evaluation. A bound relative to
    rms(act(g) u) alone does not hold where |u| is large and act(g) small (near g = 0 the error is
    act'(0) u dg = u dg / 2). Then the tight check against the kernel's f16 inputs."""
    g, u = ref.gemm(w_gate, b), ref.gemm(w_up, b)
    a = dmmv_ref.silu(g) if act == "swiglu" else dmmv_ref.gelu_tanh(g)
    want = a * u
    sens = (np.abs(_act_slope(g, act) * u) * (_rms(g) + np.abs(g)) + np.abs(a) * (_rms(u) + np.abs(u))
            + 1e-2 * _rms(want))
    assert_close(out / sens, want / sens, atol=loose, rtol=0, name=name + " / sensitivity")
    assert_close(out, tight, atol=1e-4 * _rms(tight), rtol=1e-4, name=name + " (f16 inputs)")


def _weight(q, m, k, rng, *, pad_front=0):
    raw = ref.random_weight(q, m, k, rng)
    dense = ref.dequantize(raw, q, m, k)
    buf = np.concatenate([rng.integers(0, 256, pad_front, dtype=np.uint8), raw.ravel(),
                          rng.integers(0, 256, 5, dtype=np.uint8)])
    return QWeight(cupy.asarray(buf), q, m, k, offset=pad_front), dense


def _b(rng, n, k, dtype):
    return rng.standard_normal((n, k)).astype(dtype)


def _q8_1(mm, b):
    """Q8_1 rows of b quantized on the GPU, and their (d, s, qs) read back."""
    n, k = b.shape
    q = cupy.empty((n, k // 32 * ref.Q8_1_BYTES), cupy.uint8)
    mm.quantize_q8_1(cupy.asarray(b), q)
    return q, ref.unpack_q8(q.get(), k, "q8_1")
