"""Row-wise binary ops and gated activations (add, scale, sigmoid gate, bias, SwiGLU, GeGLU): the
kernels of ``cuda_src/elementwise/activations.cuh``.

Every array of one call (the bias of :meth:`Activations.bias_add` included) has one dtype: float32,
float16 or bfloat16 (uint16 bits); the kernels compute in f32 and round the output once.
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.dispatch import check_array
from cukern.elementwise.common import (_FLAT_BLOCK, _MAX_GRID_Y, _act_type, _aligned, _check_distinct, _flat_grid,
                                      _glu_shape, _targ, _vec)
from cukern.interop import like, tensors

# binary_rows ops (cuda_src/elementwise/activations.cuh, EwOp)
_OP_AXPY, _OP_SCALE, _OP_SIGMOID_MUL, _OP_SWIGLU, _OP_SWIGLU_OAI, _OP_GEGLU = range(6)
_BINARY_UNROLL = 4  # units per thread and step in binary_rows (BINARY_UNROLL in activations.cuh)
_BINARY_BIG = 1 << 20  # units: from here a thread takes _BINARY_UNROLL units per step
_MAX_FLAT = 2**31 - 1  # flat kernels index with uint32 plus a grid stride


class Activations:
    """ElementwiseDispatch's activations methods (a mixin: launches through the dispatch's ``_launch``)."""

    def _binary(self, op, out, a, b, *, n_rows, n_cols, a_stride, b_stride, b_offset=0, alpha=1.0, limit=0.0,
                stream=None):
        """Launch binary_rows; the caller has validated shapes and dtypes. b None: unread (scale). The 16-byte
        units (vec) hold 16 / itemsize elements: n_cols, strides and offset must be multiples of that."""
        b = a if b is None else b
        per_unit = 16 // out.itemsize
        vec = (n_cols % per_unit == 0 and a_stride % per_unit == 0 and b_stride % per_unit == 0
               and b_offset % per_unit == 0 and _aligned(out, a, b))
        units = n_cols // per_unit if vec else n_cols
        params = self.struct("BinaryParams").pack(n_rows=n_rows, n_cols=n_cols, a_stride=a_stride,
                                                  b_stride=b_stride, out_stride=n_cols, b_offset=b_offset,
                                                  alpha=alpha, limit=limit)
        per_thread = _BINARY_UNROLL if n_rows * units >= _BINARY_BIG else 1
        grid = (_flat_grid(-(-units // per_thread)), min(n_rows, _MAX_GRID_Y))
        self._launch(f"binary_rows<{op}, {_vec(vec)}{_targ(_act_type('out', out))}>", grid, _FLAT_BLOCK,
                     (out, a, b), params, stream=stream)
        return out

    def _flat(self, out, *named):
        check_array("out", out)
        _act_type("out", out)
        n = out.size
        if not 0 < n <= _MAX_FLAT:
            raise ValueError(f"out must have 1 to {_MAX_FLAT} elements, got {n}")
        for name, a in named:
            check_array(name, a, dtype=out.dtype, shape=out.shape)
        return n

    @tensors(out=like("a"))
    def add_scaled(self, a: cupy.ndarray, b: cupy.ndarray, out: cupy.ndarray | None = None, *, alpha: float = 1.0,
                   stream=None) -> cupy.ndarray:
        """``out = a + alpha * b`` elementwise, any shape, f32, f16 or bf16 (out may be a: ``a += alpha * b``)."""
        n = self._flat(out, ("a", a), ("b", b))
        return self._binary(_OP_AXPY, out, a, b, n_rows=1, n_cols=n, a_stride=0, b_stride=0, alpha=alpha,
                            stream=stream)

    @tensors(out=like("a"))
    def add(self, a: cupy.ndarray, b: cupy.ndarray, out: cupy.ndarray | None = None, *, stream=None) -> cupy.ndarray:
        """``out = a + b`` elementwise, any shape and dtype as :meth:`add_scaled` (out may be a or b)."""
        return self.add_scaled(a, b, out, alpha=1.0, stream=stream)

    @tensors
    def scale_accumulate(self, a: cupy.ndarray, b: cupy.ndarray, s: float, *, stream=None) -> cupy.ndarray:
        """``a += s * b`` in place (vectorised), any shape and dtype as :meth:`add_scaled`."""
        return self.add_scaled(a, b, a, alpha=s, stream=stream)

    @tensors(out=like("a"))
    def scale(self, a: cupy.ndarray, out: cupy.ndarray | None = None, *, alpha: float, stream=None) -> cupy.ndarray:
        """``out = alpha * a`` elementwise, any shape and dtype as :meth:`add_scaled` (out may be a)."""
        n = self._flat(out, ("a", a))
        return self._binary(_OP_SCALE, out, a, None, n_rows=1, n_cols=n, a_stride=0, b_stride=0, alpha=alpha,
                            stream=stream)

    @tensors(out=like("x"))
    def sigmoid_mul(self, x: cupy.ndarray, g: cupy.ndarray, out: cupy.ndarray | None = None, *,
                    stream=None) -> cupy.ndarray:
        """``out = x * sigmoid(g)`` elementwise (gated attention output), any shape and dtype as
        :meth:`add_scaled` (out may be x)."""
        n = self._flat(out, ("x", x), ("g", g))
        return self._binary(_OP_SIGMOID_MUL, out, x, g, n_rows=1, n_cols=n, a_stride=0, b_stride=0, stream=stream)

    @tensors(out=like("x"))
    def bias_add(self, x: cupy.ndarray, bias: cupy.ndarray, out: cupy.ndarray | None = None, *, offset: int = 0,
                 stream=None) -> cupy.ndarray:
        """``out[r] = x[r] + bias[offset : offset + n_cols]`` for every row r.

        x, out: [n_rows, n_cols] f32, f16 or bf16 (out may be x); bias: [n] of x's dtype with offset + n_cols
        <= n (a slice of a fused bias, e.g. the K part of a QKV bias)."""
        n_rows, n_cols = self._rows(x, act=True)
        check_array("out", out, dtype=x.dtype, shape=(n_rows, n_cols))
        check_array("bias", bias, dtype=x.dtype, ndim=1)
        if not isinstance(offset, (int, np.integer)) or offset < 0 or offset + n_cols > bias.shape[0]:
            raise ValueError(f"bias_add: offset {offset} + n_cols {n_cols} exceeds bias length {bias.shape[0]}")
        return self._binary(_OP_AXPY, out, x, bias, n_rows=n_rows, n_cols=n_cols, a_stride=n_cols, b_stride=0,
                            b_offset=int(offset), alpha=1.0, stream=stream)

    def _glu(self, op, what, gate, up, out, alpha=1.0, limit=0.0, stream=None):
        if up is None:  # fused [n_rows, 2 * n_ff]: gate = first half, up = second half of each row
            check_array("gate_up", gate, ndim=2)
            _act_type("gate_up", gate)
            n_rows, two_ff = gate.shape
            if two_ff % 2 or n_rows == 0 or two_ff == 0:
                raise ValueError(f"{what}: fused gate_up must be [n_rows, 2 * n_ff], got {gate.shape}")
            n_ff = two_ff // 2
            check_array("out", out, dtype=gate.dtype, shape=(n_rows, n_ff))
            _check_distinct(what, out=out, gate_up=gate)
            a, b, stride = gate, gate[:, n_ff:], two_ff
        else:
            n_rows, n_ff = self._rows(gate, "gate", act=True)
            check_array("up", up, dtype=gate.dtype, shape=(n_rows, n_ff))
            check_array("out", out, dtype=gate.dtype, shape=(n_rows, n_ff))
            a, b, stride = gate, up, n_ff
        return self._binary(op, out, a, b, n_rows=n_rows, n_cols=n_ff, a_stride=stride, b_stride=stride,
                            alpha=alpha, limit=limit, stream=stream)

    @tensors(out=like("gate", shape=_glu_shape))
    def swiglu(self, gate: cupy.ndarray, up: cupy.ndarray | None, out: cupy.ndarray | None = None, *,
               stream=None) -> cupy.ndarray:
        """``out = silu(gate) * up``. gate, up, out: [n_rows, n_ff], one dtype of f32, f16, bf16 (out may be
        gate or up); or ``up=None`` and gate the fused [n_rows, 2 * n_ff] matmul output ([gate | up] per row)."""
        return self._glu(_OP_SWIGLU, "swiglu", gate, up, out, stream=stream)

    @tensors(out=like("gate", shape=_glu_shape))
    def swiglu_oai(self, gate: cupy.ndarray, up: cupy.ndarray | None, out: cupy.ndarray | None = None, *,
                   alpha: float = 1.702, limit: float = 7.0, stream=None) -> cupy.ndarray:
        """gpt-oss SwiGLU: ``g = min(gate, limit)``, ``u = clip(up, -limit, limit)``,
        ``out = g * sigmoid(alpha * g) * (u + 1)``. Shapes as :meth:`swiglu` (gpt-oss interleaves gate
        and up in its weights; de-interleave the weight rows once at load time to use this layout)."""
        if not limit > 0:
            raise ValueError(f"swiglu_oai: limit must be > 0, got {limit}")
        return self._glu(_OP_SWIGLU_OAI, "swiglu_oai", gate, up, out, alpha=alpha, limit=limit, stream=stream)

    @tensors(out=like("gate", shape=_glu_shape))
    def geglu(self, gate: cupy.ndarray, up: cupy.ndarray | None, out: cupy.ndarray | None = None, *,
              stream=None) -> cupy.ndarray:
        """``out = gelu_tanh(gate) * up`` (Gemma). Shapes as :meth:`swiglu`."""
        return self._glu(_OP_GEGLU, "geglu", gate, up, out, stream=stream)
