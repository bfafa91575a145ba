"""DmmvDispatch: the family's ten compilation units and the dispatch class, assembled from one mixin
per kernel source (:class:`~cukern.dmmv.dense.Dense`, :class:`~cukern.dmmv.q8.Int8Path`,
:class:`~cukern.dmmv.moe.Moe`) over the checks and parameter packing they share.
"""

from __future__ import annotations

import cupy

from cukern.dispatch import Dispatch, Unit, check_array, repeatable
from cukern.dmmv.common import _ACTS, _COLS, _F32, _STEP
from cukern.dmmv.dense import (_SPLIT_TC_COLS, THREE_TYPES, Dense, _kernel, _mx_kernel, _nx_kernel, _split_kernel,
                               _split_tc_kernel, _three_kernel)
from cukern.dmmv.moe import Moe
from cukern.dmmv.q8 import Int8Path, _q8_down_kernel, _q8_kernel, _q8_moe_glu_kernel, _q8_two_kernel
from cukern.dmmv.weights import Q8_TYPES, QTYPES, QWeight
from cukern.runtime import FamilySpec, KernelSpec

FAMILY = FamilySpec(
    name="dmmv",
    kernels=tuple([KernelSpec(_kernel(q, n), "DmmvParams") for q in QTYPES for n in _COLS]
                  + [KernelSpec(_q8_kernel(q, n), "DmmvParams") for q in Q8_TYPES for n in _COLS]
                  + [KernelSpec(_split_kernel(n), "DmmvParams") for n in _COLS]
                  + [KernelSpec(f"dequantize<{q}>", "DequantParams") for q in QTYPES]),
)
GLU_FAMILY = FamilySpec(
    name="dmmv_glu", source="dmmv/dmmv.cu", params_header="dmmv/params.cuh",
    kernels=tuple(KernelSpec(f"dmmv_glu<{q}, {n}>", "DmmvParams") for q in QTYPES for n in _COLS),
)
MOE_FAMILY = FamilySpec(
    name="dmmv_moe", source="dmmv/moe.cu", params_header="dmmv/params.cuh",
    kernels=tuple(
        [KernelSpec(f"moe_dmmv<{q}, {g}>", "MoeParams") for q in QTYPES for g in ("false", "true")]
        + [KernelSpec(_q8_kernel(q, None), "MoeParams") for q in Q8_TYPES]
        + [KernelSpec(_q8_moe_glu_kernel(q), "MoeParams") for q in Q8_TYPES]
        + [KernelSpec(_q8_down_kernel(q), "MoeParams") for q in Q8_TYPES]
        + [KernelSpec(f"moe_down<{q}>", "MoeParams") for q in QTYPES]
        + [KernelSpec("moe_route_pack", "RouteParams"), KernelSpec("moe_count_experts", "RouteParams")]
    ),
)
PACKED_FAMILY = FamilySpec(
    name="dmmv_moe_packed", source="dmmv/moe_packed.cu", params_header="dmmv/params.cuh",
    kernels=tuple(KernelSpec(f"moe_dmmv_packed<{q}, {g}>", "MoeParams") for q in QTYPES for g in ("false", "true")),
)
Q8X_FAMILY = FamilySpec(  # the int8 path on pre-quantized x: compiled only by a process that uses it
    name="dmmv_q8x", source="dmmv/dmmv.cu", params_header="dmmv/params.cuh",
    kernels=tuple([KernelSpec(_q8_kernel(q, n, pq=True), "DmmvParams") for q in Q8_TYPES for n in _COLS]
                  + [KernelSpec(f"quantize_x<{il}>", "QuantizeXParams") for il in ("false", "true")]
                  + [KernelSpec(f"quantize_glu<{il}, {a}>", "QuantizeXParams")
                     for il in ("false", "true") for a in sorted(set(_ACTS.values()))]),
)
TWO_FAMILY = FamilySpec(  # dmmv_pair and dmmv_glu on the int8 path: compiled only by a process that uses them
    name="dmmv_two", source="dmmv/dmmv.cu", params_header="dmmv/params.cuh",
    kernels=tuple(KernelSpec(_q8_two_kernel(q, n, g), "DmmvParams") for q in Q8_TYPES for n in _COLS
                  for g in (False, True)),
)
NX_FAMILY = FamilySpec(  # dmmv, dmmv_pair and dmmv_glu on a NormedX: compiled only by a process that uses them
    name="dmmv_nx", source="dmmv/dmmv.cu", params_header="dmmv/params.cuh",
    kernels=tuple([KernelSpec(_nx_kernel(q, n), "DmmvNormParams") for q in QTYPES for n in _COLS]
                  + [KernelSpec(f"dmmv_glu_nx<{q}, {n}>", "DmmvNormParams") for q in QTYPES for n in _COLS]),
)
THREE_FAMILY = FamilySpec(  # dmmv_three: compiled only by a process that uses it
    name="dmmv_three", source="dmmv/dmmv.cu", params_header="dmmv/params.cuh",
    kernels=tuple(KernelSpec(_three_kernel(q, q3), "DmmvNormParams") for q, q3 in THREE_TYPES),
)
MX_FAMILY = FamilySpec(  # dmmv on a MergedX: compiled only by a process that uses it
    name="dmmv_mx", source="dmmv/dmmv.cu", params_header="dmmv/params.cuh",
    kernels=tuple(KernelSpec(_mx_kernel(q), "DmmvMergeParams") for q in QTYPES),
)
SPLIT_TC_FAMILY = FamilySpec(  # dmmv on a SplitQ8 at 2-8 columns (tensor cores): compiled only by a process using it
    name="dmmv_split_tc", source="dmmv/dmmv.cu", params_header="dmmv/params.cuh",
    kernels=tuple(KernelSpec(_split_tc_kernel(n), "DmmvParams") for n in _SPLIT_TC_COLS),
)
FAMILIES = {f.name: f for f in (FAMILY, GLU_FAMILY, MOE_FAMILY, PACKED_FAMILY, Q8X_FAMILY, TWO_FAMILY, NX_FAMILY,
                                 THREE_FAMILY, MX_FAMILY, SPLIT_TC_FAMILY)}  # cukern.families() lists each unit


class DmmvDispatch(Dense, Int8Path, Moe, Dispatch):
    """Records quantized matvec kernels into a stream. Every method takes ``stream=`` (None:
    CuPy's current stream), validates its arguments before launching, and never synchronises,
    allocates or reads device memory (the MoE error flag is allocated on first use: make one MoE
    call before capturing a graph).

    ``int8`` (default True) sends ``dmmv``, ``dmmv_pair``, ``dmmv_glu``, ``moe_dmmv`` and ``moe_down``
    of the ``Q8_TYPES`` through the int8 path (x rounded to 8 bits per 32 elements, ``__dp4a``);
    False keeps every call on the f32 path (x exact, the error only the f32 rounding of the sums).
    The attribute may be changed between calls.

    ``pdl`` (default False; sm_90+) launches the matvecs with programmatic dependent launch (the
    f32 path's kernels wait for the previous kernel first thing; the int8 path's as follows):
    its blocks start while the previous kernel in the stream finishes and stream their first weight
    chunks before waiting for it (``pdl_wait`` in common/pdl.cuh), which hides the launch gap and
    the ramp-up of a decode loop's back-to-back matvecs. x, gate and y are touched only after the
    wait; the weights are read before it, so they must not be written by a kernel still in flight
    (model weights uploaded once never are).

    Matvecs that share an input (q, k and v; gate and up) can share its quantization too:
    ``qx = d.quantize_x(x, QuantizedX.empty(x.shape, qtype))`` once, then ``d.dmmv(w, qx, y)`` for
    each w (same bits as from x; see :class:`QuantizedX`). The FFN's down projection can take its
    input quantized by :meth:`quantize_glu` (act(gate) * up, in place of the elementwise SwiGLU)."""

    family = FAMILY

    def __init__(self, device: int | None = None, *, int8: bool = True, pdl: bool = False):
        super().__init__(device)
        self.int8 = bool(int8)
        self.pdl = bool(pdl)
        self._glu = Unit(GLU_FAMILY, device)
        self._moe = Unit(MOE_FAMILY, device)
        self._packed = Unit(PACKED_FAMILY, device)
        self._q8x = Unit(Q8X_FAMILY, device)
        self._two = Unit(TWO_FAMILY, device)
        self._nx = Unit(NX_FAMILY, device)
        self._three = Unit(THREE_FAMILY, device)
        self._mx = Unit(MX_FAMILY, device)
        self._split_tc = Unit(SPLIT_TC_FAMILY, device)
        self._split_tc_arch: int | None = None  # the device's compute capability, read on the first SplitQ8 call
        self._err = None
        self._resident: dict[tuple, tuple] = {}  # (unit, kernel, k[, m, slots]) -> _q8_plan / _q8_plan_dots

    def _repeat_state(self):
        return self.pdl, self.int8

    # ------------------------------------------------------------------ validation helpers
    @staticmethod
    def _check_weight(name: str, w, experts: bool = False) -> QWeight:
        if not isinstance(w, QWeight):
            raise TypeError(f"{name} must be a QWeight (raw GGUF bytes + type + shape), got {type(w).__name__}")
        if experts and not w.n_experts:
            raise ValueError(f"{name} must be an expert tensor (QWeight with n_experts)")
        if not experts and w.n_experts:
            raise ValueError(f"{name} is an expert tensor: use the moe_* methods")
        if w.row_stride != w.row_bytes:
            raise ValueError(f"{name}: the matvecs read GGUF rows as stored (row_stride == row_bytes, "
                             f"{w.row_bytes}), got row_stride {w.row_stride}: padded rows are the tiled GEMMs'")
        return w

    @staticmethod
    def _cols(name: str, a, k: int) -> tuple[cupy.ndarray, int]:
        """x or y as [n, k] (a 1-D array is one column); f32, contiguous, 16-byte aligned."""
        check_array(name, a, dtype=_F32)
        if a.ndim == 1:
            n = 1
        elif a.ndim == 2:
            n = a.shape[0]
        else:
            raise ValueError(f"{name} must be [{k}] or [n, {k}], got shape {a.shape}")
        if a.shape[-1] != k or n < 1:
            raise ValueError(f"{name} must be [{k}] or [n, {k}] with n >= 1, got shape {a.shape}")
        if a.data.ptr % 16:
            raise ValueError(f"{name} must be 16-byte aligned (data pointer {a.data.ptr:#x})")
        return a, n

    def _params(self, w: QWeight, *, w2: QWeight | None = None, m2: int = 0, blocks1: int = 0,
                mode: int = 0, act: int = 0, alpha: float = 1.0, y_stride: int = 0, y2_stride: int = 0,
                x_stride: int | None = None, l2_items: int = 0):
        return self.struct("DmmvParams").pack(
            w_offset=w.offset, w2_offset=w2.offset if w2 is not None else 0, row_bytes=w.row_bytes,
            m=w.m, m2=m2, k=w.k, n_full=w.k // _STEP, tail=w.k % _STEP, blocks1=blocks1,
            x_stride=w.k if x_stride is None else x_stride, y_stride=y_stride, y2_stride=y2_stride, mode=mode,
            act=act, alpha=float(alpha), l2_items=l2_items, pad0=0)

    @staticmethod
    def _mode(accumulate: bool, gate) -> int:
        if gate is not None:
            return 2
        return 1 if accumulate else 0

    def _check_gate(self, gate, n: int):
        if gate is not None:
            check_array("gate", gate, dtype=_F32, shape=(n,))

    @staticmethod
    def _chunks(n: int):
        """Split n columns into launches of 8, 4, 2, 1: (first column, width)."""
        c = 0
        for width in (8, 4, 2, 1):
            while n - c >= width:
                yield c, width
                c += width


# The matvecs are functions of their arguments (weights and inputs by their fields and arrays) and of
# the dispatch's pdl and int8: a call repeated with equal ones replays the first one's launches.
# split_q8_0 and plan_moe_route allocate what they return, check_errors reads the device: not these.
for _name in ("dequantize", "dmmv", "dmmv_three", "dmmv_scale_acc", "dmmv_gated_acc", "dmmv_pair", "dmmv_glu",
              "quantize_x", "quantize_glu", "moe_dmmv", "moe_route_pack", "moe_count_experts", "moe_dmmv_packed",
              "moe_down"):
    setattr(DmmvDispatch, _name, repeatable(getattr(DmmvDispatch, _name)))
