"""The dmmv family's operands: the GGML block types it reads (:data:`QTYPES`, :data:`Q8_TYPES`), a
GGUF weight on the device (:class:`QWeight`), Q8_0 weights split for streaming (:class:`SplitQ8`),
the inputs the matvecs take in place of an f32 x (:class:`NormedX`, :class:`QuantizedX`) and the
MoE routing buffers (:class:`MoeRoute`). Each is validated on construction, so the matvecs check
only the activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from cukern.dispatch import check_array
from cukern.interop import as_cupy
from cukern.params import check_real
from cukern.qtypes import GGMLType

_F32 = np.dtype(np.float32)

# GGML type -> (name, elements per block, bytes per block, byte alignment the kernels need)
QTYPES = {t: (t.name, be, bb, align) for t, be, bb, align in (
    (GGMLType.F32, 1, 4, 16),
    (GGMLType.F16, 1, 2, 8),
    (GGMLType.BF16, 1, 2, 8),
    (GGMLType.Q4_0, 32, 18, 2),
    (GGMLType.Q5_0, 32, 22, 2),
    (GGMLType.Q8_0, 32, 34, 2),
    (GGMLType.MXFP4, 32, 17, 1),
    (GGMLType.Q4_K, 256, 144, 16),
    (GGMLType.Q5_K, 256, 176, 16),
    (GGMLType.Q6_K, 256, 210, 2),
)}
_BY_NAME = {v[0]: int(k) for k, v in QTYPES.items()}

# The int8 path (cuda_src/dmmv/q8.cuh): x quantized per block to Q8_1-style int8, __dp4a dot products.
# It serves dmmv (every column count, every epilogue), dmmv_pair, dmmv_glu (dmmv_q8_two) and moe_dmmv
# (moe_dmmv_q8, with GLU moe_dmmv_q8_glu) and moe_down (moe_down_q8, top_k <= 16) for these types; the
# f32 path serves the float types and packed MoE. Accuracy: exact W . x^ with x^ = x rounded per 32
# elements to 8 bits (cukern.reference.dmmv.quantize_q8), NMSE ~3e-5 against x.
Q8_TYPES = (GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.MXFP4, GGMLType.Q4_K, GGMLType.Q5_K,
            GGMLType.Q6_K)


def _q8x_col_bytes(k: int) -> int:
    """Bytes of one pre-quantized column (q8::x_col_bytes): k int8, k / 32 XInfo of 8 bytes, 16-byte rounded."""
    return (k + k // 4 + 15) // 16 * 16


def qtype_id(qtype) -> int:
    """GGML type id from an int, a ``gguf.GGMLQuantizationType`` or a name ("Q4_K")."""
    if isinstance(qtype, str):
        if qtype.upper() not in _BY_NAME:
            raise ValueError(f"unsupported weight type {qtype!r} (supported: {', '.join(_BY_NAME)})")
        return _BY_NAME[qtype.upper()]
    try:
        t = int(qtype)
    except (TypeError, ValueError):
        raise TypeError(f"weight type must be a GGML type id, enum or name, got {qtype!r}") from None
    if t not in QTYPES:
        name = getattr(qtype, "name", str(t))
        raise ValueError(f"unsupported weight type {name} (supported: {', '.join(_BY_NAME)})")
    return t


def row_bytes(qtype, k: int) -> int:
    """Bytes of one row of k elements of a GGML type."""
    _, be, bb, _ = QTYPES[qtype_id(qtype)]
    return k // be * bb


@dataclass(frozen=True, eq=False)
class QWeight:
    """A GGUF weight on the device: ``m`` rows of ``k`` elements of type ``qtype``, stored as raw
    GGUF bytes in ``buf`` (a C-contiguous cupy uint8 array) from byte ``offset`` on. ``row_stride``:
    bytes from one row to the next (default ``row_bytes``, the row's own: the GGUF layout; more for
    rows padded to 16-byte multiples, :meth:`cukern.matmul.MatmulDispatch.pad_rows`, which the tiled
    GEMMs take and the matvecs do not). With ``n_experts``, an expert tensor [n_experts, m, k]: expert
    e starts ``expert_stride`` bytes (default m * row_bytes) after expert e - 1. Validated on
    construction (no launch)."""

    buf: cupy.ndarray
    qtype: int
    m: int
    k: int
    offset: int = 0
    n_experts: int = 0
    expert_stride: int = 0
    row_stride: int = 0

    def __post_init__(self):
        t = qtype_id(self.qtype)
        object.__setattr__(self, "qtype", t)
        name, be, bb, align = QTYPES[t]
        object.__setattr__(self, "buf", as_cupy(self.buf, "buf"))  # a torch uint8 tensor: a view that keeps it
        check_array("buf", self.buf, dtype=np.uint8)
        for f in ("m", "k", "offset", "n_experts", "expert_stride", "row_stride"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise TypeError(f"QWeight.{f} must be a non-negative int, got {v!r}")
        if self.m < 1 or self.k < 1:
            raise ValueError(f"QWeight: m and k must be >= 1, got m={self.m}, k={self.k}")
        if self.m >= 2**31 or self.k >= 2**31:
            raise ValueError(f"QWeight: m and k must be < 2**31, got m={self.m}, k={self.k}")
        if self.k % be:
            raise ValueError(f"QWeight: k={self.k} is not a multiple of the {name} block size {be}")
        if be == 1 and self.k % 4:
            raise ValueError(f"QWeight: {name} rows are read 4 elements at a time: k={self.k} must be a multiple of 4")
        if (self.buf.data.ptr + self.offset) % align:
            raise ValueError(f"QWeight: {name} data must start {align}-byte aligned; offset {self.offset} "
                             f"into a buffer at {self.buf.data.ptr:#x} is not")
        rb = self.k // be * bb
        object.__setattr__(self, "row_bytes", rb)
        stride = self.row_stride or rb
        if stride < rb or stride % align:
            raise ValueError(f"QWeight: row_stride {stride} must be >= {rb} (the row's bytes) and a multiple of {align}")
        if stride != rb and self.n_experts:
            raise ValueError("QWeight: padded rows (row_stride) are for single matrices, not expert tensors")
        object.__setattr__(self, "row_stride", stride)
        nbytes = (self.m - 1) * stride + rb
        if self.n_experts:
            stride = self.expert_stride or nbytes
            if stride < nbytes or stride % align:
                raise ValueError(f"QWeight: expert_stride {stride} must be >= {nbytes} (m * row bytes) and "
                                 f"a multiple of {align}")
            object.__setattr__(self, "expert_stride", stride)
            nbytes = stride * (self.n_experts - 1) + nbytes
        elif self.expert_stride:
            raise ValueError("QWeight: expert_stride needs n_experts")
        if self.offset + nbytes > self.buf.nbytes:
            raise ValueError(f"QWeight: {self.m}x{self.k} {name}"
                             + (f" x {self.n_experts} experts" if self.n_experts else "")
                             + f" needs {nbytes} bytes from offset {self.offset}, the buffer has {self.buf.nbytes}")

    @property
    def name(self) -> str:
        return QTYPES[self.qtype][0]

    @property
    def nbytes(self) -> int:
        """Bytes of one matrix (one expert)."""
        return self.m * self.row_bytes



@dataclass(frozen=True, eq=False)
class SplitQ8:
    """Q8_0 weights split for streaming (:meth:`DmmvDispatch.split_q8_0`): ``quants`` int8 [m, k]
    and ``scales`` f16 [m, k / 32] on the device, W[i, j] = scales[i, j // 32] * quants[i, j]. The
    same values and the same bytes as the GGUF blocks (2 + 32 per 32 elements), laid out so that a
    lane of :meth:`DmmvDispatch.dmmv` loads 16 quants at once: a GGUF Q8_0 row's 34-byte blocks are
    read 2 bytes at a time. For a matrix streamed every step from HBM (an LM head of 262144 rows);
    matvecs that small rows keep latency-bound gain nothing from it. Validated on construction."""

    quants: cupy.ndarray
    scales: cupy.ndarray

    def __post_init__(self):
        check_array("SplitQ8.quants", self.quants, dtype=np.int8, ndim=2, align=16)
        m, k = self.quants.shape
        if m < 1 or k < 32 or k % 32 or m >= 2**31 or k >= 2**31:
            raise ValueError(f"SplitQ8: quants must be [m, k] with m >= 1 and k a positive multiple of 32 "
                             f"(< 2**31), got {self.quants.shape}")
        check_array("SplitQ8.scales", self.scales, dtype=np.float16, shape=(m, k // 32))

    @property
    def m(self) -> int:
        return self.quants.shape[0]

    @property
    def k(self) -> int:
        return self.quants.shape[1]

    @property
    def name(self) -> str:
        return "Q8_0 (split)"

    @property
    def nbytes(self) -> int:
        """Bytes of weights a matvec reads: k quants and k / 32 scales per row."""
        return self.quants.nbytes + self.scales.nbytes


@dataclass(frozen=True, eq=False)
class NormedX:
    """The input of a matvec made from the previous sub-layer's output by each of the matvec's
    blocks (:meth:`DmmvDispatch.dmmv`, :meth:`~DmmvDispatch.dmmv_pair`, :meth:`~DmmvDispatch.dmmv_glu`
    take one in place of x), which folds the residual add and norm between two matvecs of a decoder
    layer into the second::

        r = residual                                       (proj None)
          = residual + proj                                (w_post None)
          = residual + rms_norm(proj) * (w_post + weight_offset)
        x = rms_norm(r) * (w + weight_offset),   rms_norm(v) = v / sqrt(mean(v**2) + eps)

    and, with ``residual_out``, the first block writes r there (the next residual; it may not
    overlap ``residual`` or ``proj``, which the other blocks are reading). The same values as
    ElementwiseDispatch's ``post_norm_residual_rms_norm`` / ``residual_rms_norm`` / ``rms_norm``
    followed by the matvec, in f32.

    residual, proj, residual_out: [k] or [n, k] f32, C-contiguous, 16-byte aligned, one shape;
    w, w_post: [k] f32, 16-byte aligned. Every block keeps x in shared memory: n * k * 4 bytes
    (per launch of up to 8 columns) must fit. Runs on the f32 path."""

    residual: cupy.ndarray
    w: cupy.ndarray
    proj: cupy.ndarray | None = None
    w_post: cupy.ndarray | None = None
    residual_out: cupy.ndarray | None = None
    eps: float = 1e-6
    weight_offset: float = 0.0

    def __post_init__(self):
        for f in ("residual", "w", "proj", "w_post", "residual_out"):  # torch tensors: views that keep them
            object.__setattr__(self, f, as_cupy(getattr(self, f), f"NormedX.{f}"))
        check_array("NormedX.residual", self.residual, dtype=_F32, align=16)
        if self.residual.ndim not in (1, 2) or self.residual.size == 0:
            raise ValueError(f"NormedX.residual must be [k] or [n, k], got shape {self.residual.shape}")
        k = self.residual.shape[-1]
        if k % 4:
            raise ValueError(f"NormedX: k={k} must be a multiple of 4 (the norms read float4s)")
        check_array("NormedX.w", self.w, dtype=_F32, shape=(k,), align=16)
        if self.proj is not None:
            check_array("NormedX.proj", self.proj, dtype=_F32, shape=self.residual.shape, align=16)
        if self.w_post is not None:
            if self.proj is None:
                raise ValueError("NormedX: w_post (the post-norm of proj) needs proj")
            check_array("NormedX.w_post", self.w_post, dtype=_F32, shape=(k,), align=16)
        if self.residual_out is not None:
            check_array("NormedX.residual_out", self.residual_out, dtype=_F32, shape=self.residual.shape, align=16)
            for name in ("residual", "proj"):
                other = getattr(self, name)
                if other is not None and _overlap(self.residual_out, other):
                    raise ValueError(f"NormedX.residual_out overlaps NormedX.{name}, which other blocks are "
                                     "still reading: write the new residual to another buffer")
        eps = check_real("NormedX.eps", self.eps)
        if not 0 <= eps < float("inf"):
            raise ValueError(f"NormedX.eps must be finite and >= 0, got {eps}")
        object.__setattr__(self, "eps", eps)
        object.__setattr__(self, "weight_offset", check_real("NormedX.weight_offset", self.weight_offset))

    @property
    def shape(self) -> tuple:
        return self.residual.shape

    @property
    def k(self) -> int:
        return self.residual.shape[-1]

    @property
    def post(self) -> int:
        """DmmvNormParams.post: 0 no proj, 1 proj added, 2 proj post-normed and added."""
        return 0 if self.proj is None else (1 if self.w_post is None else 2)

    def columns(self, c0: int) -> tuple:
        """(residual, proj, w_post, w, residual_out) from column c0 on (a launch's first column): the kernel's
        pointers (the unused ones: residual)."""
        two = self.residual.ndim == 2

        def pick(a):
            a = self.residual if a is None else a
            return a[c0:] if two else a

        return (pick(self.residual), pick(self.proj), self.residual if self.w_post is None else self.w_post, self.w,
                pick(self.residual_out))


@dataclass(frozen=True, eq=False)
class MergedX:
    """The input of a matvec made from split attention states by each of the matvec's blocks
    (:meth:`DmmvDispatch.dmmv` takes one in place of x), which folds the merge of a split-KV decode
    into the output projection after it (``AttentionDispatch.flash_attn_decode_partials`` leaves the
    states)::

        x[h * D + j] = sum_s e[s, h] * o_part[s, h, j] / (sum_s e[s, h] + exp(sink_h - M_h))
        e[s, h] = exp(lse_part[s, h] - M_h),   M_h = max(max_s lse_part[s, h], sink_h)

    the sink term only with ``sinks``, sink_h = sinks[sink_offset + h] (one buffer of every layer's
    sinks, as flash_attn_decode takes them), a NaN sink meaning none; a state with LSE -inf weighs nothing, and a head with no
    keys and no sink gives x = 0 (AttentionDispatch.merge_states' rule). One column (a decode step
    of one sequence).

    o_part: [S, H, D] or [1, S, H, D] f32, C-contiguous, 16-byte aligned, D a multiple of 4;
    lse_part: [S, H] or [1, S, H] f32 (natural log); sinks: [>= sink_offset + H] f32 natural-log logits. Every
    block keeps x in shared memory ((H * D + 2 * H) * 4 bytes)."""

    o_part: cupy.ndarray
    lse_part: cupy.ndarray
    sinks: cupy.ndarray | None = None
    sink_offset: int = 0

    def __post_init__(self):
        for f in ("o_part", "lse_part", "sinks"):  # torch tensors (or other frameworks'): CuPy views
            object.__setattr__(self, f, as_cupy(getattr(self, f), f"MergedX.{f}"))
        o = check_array("MergedX.o_part", self.o_part, dtype=_F32, align=16)
        if o.ndim == 4 and o.shape[0] == 1:
            o = o.reshape(o.shape[1:])
        if o.ndim != 3 or o.size == 0:
            raise ValueError(f"MergedX.o_part must be [S, H, D] (or [1, S, H, D]), got shape {self.o_part.shape}")
        s, h, d = o.shape
        if d % 4:
            raise ValueError(f"MergedX: head_dim={d} must be a multiple of 4 (the merge reads float4s)")
        if s > 65535:
            raise ValueError(f"MergedX: at most 65535 states, got {s}")
        lse = check_array("MergedX.lse_part", self.lse_part, dtype=_F32)
        if lse.shape not in ((s, h), (1, s, h)):
            raise ValueError(f"MergedX.lse_part must have shape ({s}, {h}) (or (1, {s}, {h})), got {lse.shape}")
        off = self.sink_offset
        if isinstance(off, bool) or not isinstance(off, (int, np.integer)) or not 0 <= off < 2**32 - h:
            raise ValueError(f"MergedX.sink_offset must be an int in [0, 2^32 - {h}), got {off!r}")
        object.__setattr__(self, "sink_offset", int(off))
        if self.sinks is not None:
            sk = check_array("MergedX.sinks", self.sinks, dtype=_F32)
            if sk.ndim != 1 or sk.shape[0] < off + h:
                raise ValueError(f"MergedX.sinks must be 1-D with at least sink_offset + n_heads = {off + h} "
                                 f"entries, got shape {sk.shape}")

    @property
    def shape(self) -> tuple:
        """The shape of the x it stands for: [k], or [1, k] from 4-D states."""
        return (self.k,) if self.o_part.ndim == 3 else (1, self.k)

    @property
    def n_states(self) -> int:
        return self.o_part.shape[-3]

    @property
    def n_heads(self) -> int:
        return self.o_part.shape[-2]

    @property
    def head_dim(self) -> int:
        return self.o_part.shape[-1]

    @property
    def k(self) -> int:
        return self.n_heads * self.head_dim


def _overlap(a: cupy.ndarray, b: cupy.ndarray) -> bool:
    return a.data.ptr < b.data.ptr + b.nbytes and b.data.ptr < a.data.ptr + a.nbytes


@dataclass(frozen=True, eq=False)
class QuantizedX:
    """x quantized once for the int8 matvec path (:meth:`DmmvDispatch.quantize_x`; or the FFN's
    act(gate) * up, :meth:`DmmvDispatch.quantize_glu`), so that the matvecs sharing an input (q, k
    and v; gate and up) or the down projection each copy 1.25 bytes per element into their
    thread blocks instead of each block quantizing the f32 x itself. Per 32 elements it holds
    d = max|x| * (1/127) in f32, q = x * (1/d) rounded to the nearest integer (ties to even, in
    [-127, 127]) and the sums of q over each half: the x^ the f32-x int8 path computes, so
    :meth:`DmmvDispatch.dmmv` returns the same bits from a QuantizedX as from the x it was made
    of. (Where x of that many columns does not fit a thread block's shared memory, k of some tens
    of thousands, the f32-x call falls back to the f32 path and the QuantizedX call raises.)

    buf: [n, col_bytes] uint8 on the device, column c at byte c * col_bytes (layout:
    ``q8::load_x`` in cuda_src/dmmv/q8.cuh); shape: the shape of the x it holds, (k,) or (n, k);
    interleaved: MXFP4's element order. A QuantizedX made for MXFP4 weights serves only MXFP4,
    one made for another int8-path type serves every other int8-path type (:meth:`serves`).
    Allocate with :meth:`empty` (outside a captured graph)."""

    buf: cupy.ndarray
    shape: tuple
    interleaved: bool

    def __post_init__(self):
        shape = tuple(int(v) for v in self.shape) if isinstance(self.shape, (tuple, list)) else None
        if not shape or len(shape) > 2 or min(shape) < 1:
            raise ValueError(f"QuantizedX.shape must be (k,) or (n, k) with n, k >= 1, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "buf", as_cupy(self.buf, "QuantizedX.buf"))
        k = shape[-1]
        if k % 32 or k >= 2**31:
            raise ValueError(f"QuantizedX: k={k} must be a multiple of 32 (the int8 path's block) and < 2**31")
        check_array("QuantizedX.buf", self.buf, dtype=np.uint8, shape=(self.n, _q8x_col_bytes(k)), align=16)
        object.__setattr__(self, "interleaved", bool(self.interleaved))

    @classmethod
    def empty(cls, shape, qtype) -> QuantizedX:
        """Room for x of ``shape`` ((k,) or (n, k)) quantized for ``qtype`` weights, on the current device."""
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if not shape or len(shape) > 2:
            raise ValueError(f"QuantizedX.empty: shape must be (k,) or (n, k), got {shape!r}")
        qt = qtype_id(qtype)
        if qt not in Q8_TYPES:
            raise ValueError(f"QuantizedX: {QTYPES[qt][0]} weights take f32 x (the int8 path serves "
                             f"{', '.join(QTYPES[q][0] for q in Q8_TYPES)})")
        n = shape[0] if len(shape) == 2 else 1
        k = shape[-1]
        if k < 32 or k % 32:
            raise ValueError(f"QuantizedX: k={k} must be a positive multiple of 32")
        return cls(cupy.empty((n, _q8x_col_bytes(k)), cupy.uint8), shape, qt == GGMLType.MXFP4)

    @property
    def k(self) -> int:
        return self.shape[-1]

    @property
    def n(self) -> int:
        return self.shape[0] if len(self.shape) == 2 else 1

    def serves(self, qtype) -> bool:
        """Whether matvecs of ``qtype`` weights can read this x (an int8-path type of its layout)."""
        qt = qtype_id(qtype)
        return qt in Q8_TYPES and (qt == GGMLType.MXFP4) == self.interleaved


@dataclass(frozen=True, eq=False)
class MoeRoute:
    """Device buffers of a packed routing (see :meth:`DmmvDispatch.plan_moe_route`)."""

    n_slots: int
    n_experts: int
    max_items: int
    counts: cupy.ndarray   # [n_experts] int32: slots per expert
    offsets: cupy.ndarray  # [n_experts + 1] int32: first packed position per expert; last = valid slots
    packed: cupy.ndarray   # [n_slots] int32: slot ids grouped by expert
    items: cupy.ndarray    # [max_items, 3] int32: (expert or -1, first packed position, count)
    n_items: cupy.ndarray  # [1] int32
