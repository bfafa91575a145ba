"""DmmvDispatch: matrix-vector products over raw GGUF-quantized weights, their fusions, and the
mixture-of-experts matvecs driven by a device-side routing buffer.

Kernels: ``cuda_src/dmmv/`` (block formats in ``cuda_src/common/quants.cuh``); float64
references: ``cukern/reference/dmmv.py``; tests: ``tests/test_dmmv.py``; benchmark:
``profiling/bench_dmmv.py``.

A weight is described once by a :class:`QWeight` (buffer of raw GGUF bytes, type, rows, columns,
byte offset, and for MoE the expert count and stride); everything about it is validated there,
so the per-call checks are on the activations only. Activations are f32, C-contiguous, 16-byte
aligned. Six compilation units (each stays under ~10 s of NVRTC): ``dmmv`` (plain, batched,
pair, the epilogues, dequantize), ``dmmv_glu`` (gate + up + activation), ``dmmv_moe`` (expert
matvecs, down + weighted sum, routing), ``dmmv_moe_packed`` (token-batched experts),
``dmmv_q8x`` (x, or the FFN's act(gate) * up, quantized once into a :class:`QuantizedX`, and the
int8 matvecs that read it) and ``dmmv_two`` (pair and gate + up + activation on the int8 path).
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from cukern.dispatch import Dispatch, Unit, check_array
from cukern.params import check_real
from cukern.streams import resolve_stream
from cukern.runtime import FamilySpec, KernelSpec

__all__ = ["DmmvDispatch", "QWeight", "SplitQ8", "NormedX", "QuantizedX", "MoeRoute", "QTYPES", "Q8_TYPES", "FAMILY", "GLU_FAMILY",
           "MOE_FAMILY", "PACKED_FAMILY", "Q8X_FAMILY", "TWO_FAMILY", "NX_FAMILY", "THREE_FAMILY", "THREE_TYPES",
           "DeviceError"]

# GGML type id -> (name, elements per block, bytes per block, byte alignment the kernels need)
QTYPES = {
    0: ("F32", 1, 4, 16),
    1: ("F16", 1, 2, 8),
    30: ("BF16", 1, 2, 8),
    2: ("Q4_0", 32, 18, 2),
    6: ("Q5_0", 32, 22, 2),
    8: ("Q8_0", 32, 34, 2),
    39: ("MXFP4", 32, 17, 1),
    12: ("Q4_K", 256, 144, 16),
    13: ("Q5_K", 256, 176, 16),
    14: ("Q6_K", 256, 210, 2),
}
_BY_NAME = {v[0]: k for k, v in QTYPES.items()}
_Q8_0, _Q6_K = 8, 14
_COLS = (1, 2, 4, 8)  # columns per dmmv launch (wider batches are split)
_STEP = 256  # elements per warp step (cuda_src/dmmv/step.cuh)
_ROWS = 2  # weight rows per block of dmmv_glu and the MoE kernels (kRows in the .cu files)
_PACK_COLS = 4  # slots per work item of moe_dmmv_packed (kPackCols)
_MAX_EXPERTS = 1023  # moe_route_pack: one thread per bucket, 1024 threads
_ACTS = {"swiglu": 0, "silu": 0, "geglu": 1, "gelu": 1}
_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)

# (rows per block R, loop variant V) of dmmv<QT, NC, R, V> (cuda_src/dmmv/dmmv.cu, core.cuh row_dots), per
# type for one column, measured on an H100 (14336x4096 and 4096x14336; docs/notes/dmmv.md): 4-bit types gain
# from sharing each x load over 4 rows, the K-quants also from the pipelined loop; batches use (2, 0).
_ONE_COL = {0: (2, 1), 1: (2, 1), 30: (2, 1), 2: (4, 0), 6: (4, 0), 8: (2, 0), 39: (4, 0), 12: (4, 1), 13: (4, 1),
            14: (2, 0)}


# The int8 path (cuda_src/dmmv/q8.cuh): x quantized per block to Q8_1-style int8, __dp4a dot products.
# It serves dmmv (every column count, every epilogue), dmmv_pair, dmmv_glu (dmmv_q8_two) and moe_dmmv
# (moe_dmmv_q8, with GLU moe_dmmv_q8_glu) and moe_down (moe_down_q8, top_k <= 16) for these types; the
# f32 path serves the float types and packed MoE. Accuracy: exact W . x^ with x^ = x rounded per 32
# elements to 8 bits (cukern.reference.dmmv.quantize_q8), NMSE ~3e-5 against x.
Q8_TYPES = (2, 6, 8, 39, 12, 13, 14)
_Q8_MAX_WARPS = 32  # q8::kMaxWarps
_Q8_SPLIT_K = 8192  # k up to which the int8 path runs two blocks of 16 warps per SM (_q8_plan)
# (LU units per lane and iteration, ST ring slots per warp, BULK: Hopper bulk copies) of
# dmmv_q8<QT, NC, LU, ST, BULK> and moe_dmmv_q8<QT, LU, ST, BULK>, per type: under programmatic
# dependent launch two units per lane and three slots, MXFP4 four units and two slots (H100 sweeps
# at 14336x4096 and 4096x14336: docs/notes/dmmv.md).
_Q8_CONFIG = {2: (2, 3, 1), 6: (2, 3, 1), 8: (2, 3, 0), 39: (4, 2, 1), 12: (2, 3, 1), 13: (2, 3, 1), 14: (2, 3, 1)}




def _q8_slot(qt: int, lu: int) -> int:
    """Bytes of one ring slot (q8::Stream::kSlotBytes): 32 * lu units of 32 weights, +32, 16-byte rounded."""
    _, be, bb, _ = QTYPES[qt]
    iter_bytes = 32 * lu * 32 // be * bb
    return (iter_bytes + 32 + 15) // 16 * 16


def _q8_smem(qt: int, nw: int, nc: int, k: int, cfg=None) -> int:
    """Dynamic shared memory of dmmv_q8 / moe_dmmv_q8 (q8::smem_bytes): a header (mbarriers, partial
    row sums), the warps' rings, then int8 x + XInfo."""
    lu, st, _ = cfg or _Q8_CONFIG[qt]
    header = (nw * st * 8 + 2 * nw * nc * 4 + 15) // 16 * 16
    return header + nw * st * _q8_slot(qt, lu) + nc * (k + k // 32 * 8)


def _q8_stream_args(qt: int, cfg=None) -> str:
    """The "LU, ST, BULK" template arguments of an int8-path kernel (the type's _Q8_CONFIG)."""
    lu, st, bulk = cfg or _Q8_CONFIG[qt]
    return f"{lu}, {st}, {'true' if bulk else 'false'}"


def _q8_two_kernel(qt: int, nc: int, glu: bool) -> str:
    """dmmv_q8_two<...>: the int8 path of dmmv_pair (glu False) and dmmv_glu (True), nc columns."""
    return f"dmmv_q8_two<{qt}, {nc}, {_q8_stream_args(qt)}, {'true' if glu else 'false'}>"


def _q8_moe_glu_kernel(qt: int) -> str:
    """moe_dmmv_q8_glu<...>: moe_dmmv with GLU on the int8 path."""
    return f"moe_dmmv_q8_glu<{qt}, {_q8_stream_args(qt)}>"


def _q8_down_kernel(qt: int) -> str:
    """moe_down_q8<...>: moe_down on the int8 path."""
    return f"moe_down_q8<{qt}, {_q8_stream_args(qt)}>"


_Q8_MAX_TOP_K = 16  # moe_down_q8's kMaxTopK (more slots per token: the f32 path)


def _q8_kernel(qt: int, nc: int | None, cfg=None, *, pq: bool = False) -> str:
    """dmmv_q8<...> (nc columns; pq: on pre-quantized x) or, with nc None, moe_dmmv_q8<...>."""
    args = _q8_stream_args(qt, cfg)
    if nc is None:
        return f"moe_dmmv_q8<{qt}, {args}>"
    return f"dmmv_q8<{qt}, {nc}, {args}" + (", true>" if pq else ">")


def _q8x_col_bytes(k: int) -> int:
    """Bytes of one pre-quantized column (q8::x_col_bytes): k int8, k / 32 XInfo of 8 bytes, 16-byte rounded."""
    return (k + k // 4 + 15) // 16 * 16


_QX_CHUNK4 = 512  # float4s of a column per block of quantize_x (256 threads, two each)


def _q8_blocks(m: int, resident: int) -> int:
    """Blocks of an int8-path launch over m rows with up to ``resident`` blocks: the fewest that keep
    the most rows of any block at ceil(m / resident). Block shares differ by one row, and the blocks
    with one more set the time: 4096 rows over 132 blocks leave 4 blocks of 32 rows beside 128 of 31
    (3% over the mean), 128 blocks of 32 do the same in the same time with no tail."""
    per_block = -(-m // max(1, resident))
    return -(-m // per_block)


def _q8_pair_blocks(m1: int, m2: int, resident: int) -> tuple[int, int]:
    """(W1 blocks, W2 blocks) of a dmmv_q8_two pair launch within ``resident`` blocks: the split of the
    blocks near m1 : m2 whose fullest block has the fewest rows, each side then balanced by _q8_blocks."""
    near = round(resident * m1 / (m1 + m2))
    s1 = min((s for s in range(near - 2, near + 3) if 0 < s < resident),
             key=lambda s: max(-(-m1 // s), -(-m2 // (resident - s))))
    return _q8_blocks(m1, s1), _q8_blocks(m2, resident - s1)


def _config(qt: int, n: int) -> tuple[int, int]:
    return _ONE_COL[qt] if n == 1 else (2, 0)


def _kernel(qt: int, n: int) -> str:
    r, v = _config(qt, n)
    return f"dmmv<{qt}, {n}, {r}, {v}>"


_SPLIT_WARPS = 8  # warps per block of dmmv_split (kSplitWarps)
_SPLIT_ROWS, _SPLIT_UNROLL = 2, 2  # rows per warp R, chunks per lane loaded at once U of dmmv_split<NC, R, U>
_NORM_ITEMS = 4  # float4s of each input a thread of a NormedX prologue holds (kNormItems)


def _three_kernel(qt: int, qt3: int) -> str:
    """dmmv_nx3<QT, R, V, QT3, R3, V3>: each matrix at its type's one-column (R, V)."""
    return f"dmmv_nx3<{qt}, {_ONE_COL[qt][0]}, {_ONE_COL[qt][1]}, {qt3}, {_ONE_COL[qt3][0]}, {_ONE_COL[qt3][1]}>"


def _split_kernel(n: int) -> str:
    return f"dmmv_split<{n}, {_SPLIT_ROWS}, {_SPLIT_UNROLL}>"


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
    kernels=tuple([KernelSpec(_kernel(q, n).replace("dmmv<", "dmmv_nx<"), "DmmvNormParams") for q in QTYPES
                   for n in _COLS]
                  + [KernelSpec(f"dmmv_glu_nx<{q}, {n}>", "DmmvNormParams") for q in QTYPES for n in _COLS]),
)
# dmmv_three's (type of W1 and W2, type of W3): W3 of the same type, or Q8_0 or Q6_K (the v projection
# that GGUF mixes such as Q4_K_M and Gemma 3's Q5_0 files give more bits)
THREE_TYPES = tuple((q, q3) for q in QTYPES for q3 in sorted({q, _Q8_0, _Q6_K}))
THREE_FAMILY = FamilySpec(  # dmmv_three: compiled only by a process that uses it
    name="dmmv_three", source="dmmv/dmmv.cu", params_header="dmmv/params.cuh",
    kernels=tuple(KernelSpec(_three_kernel(q, q3), "DmmvNormParams") for q, q3 in THREE_TYPES),
)
FAMILIES = {f.name: f for f in (FAMILY, GLU_FAMILY, MOE_FAMILY, PACKED_FAMILY, Q8X_FAMILY, TWO_FAMILY, NX_FAMILY,
                                 THREE_FAMILY)}  # cukern.families() lists each unit


class DeviceError(RuntimeError):
    """A condition a kernel detected on the device (e.g. an expert id out of range)."""


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


_MXFP4 = 39


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


_POST = {None: 0, "add": 1, "norm": 2}


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

    def columns(self, c0: int, n: int) -> tuple:
        """(residual, proj, w_post, w, residual_out) for columns [c0, c0 + ...) of a launch: the kernel's pointers
        (the unused ones: residual)."""
        two = self.residual.ndim == 2
        pick = lambda a: (a[c0:] if two else a) if a is not None else (self.residual[c0:] if two else self.residual)  # noqa: E731
        return (pick(self.residual), pick(self.proj), self.residual if self.w_post is None else self.w_post, self.w,
                pick(self.residual_out))


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
        return cls(cupy.empty((n, _q8x_col_bytes(k)), cupy.uint8), shape, qt == _MXFP4)

    @property
    def k(self) -> int:
        return self.shape[-1]

    @property
    def n(self) -> int:
        return self.shape[0] if len(self.shape) == 2 else 1

    def serves(self, qtype) -> bool:
        """Whether matvecs of ``qtype`` weights can read this x (an int8-path type of its layout)."""
        qt = qtype_id(qtype)
        return qt in Q8_TYPES and (qt == _MXFP4) == self.interleaved


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


def _warps(k: int) -> int:
    """Warps per block: at least two 256-element steps per warp, at most 4 warps (the sweep's
    best for k = 4096 ... 14336 on an H100)."""
    steps = -(-k // _STEP)
    return max(1, min(4, steps // 2))


def _normed_warps(k: int) -> int:
    """Warps per block of a NormedX kernel: the matvec's, or enough that every thread of the prologue
    holds at most _NORM_ITEMS float4s of an input (one load each, all in flight together; past
    8 warps, k > 4096, the prologue loops)."""
    return max(_warps(k), min(8, -(-k // (4 * _NORM_ITEMS * 32))))


class DmmvDispatch(Dispatch):
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
        self._err = None
        self._resident: dict[tuple, tuple] = {}  # (unit, kernel, k[, m, slots]) -> _q8_plan / _q8_plan_dots

    # ------------------------------------------------------------------ errors
    @property
    def error_flag(self) -> cupy.ndarray:
        """[1] int32 on the device: bit 0 set by a MoE kernel that met an expert id out of range."""
        if self._err is None:
            with cupy.cuda.Device(self.device_id):
                self._err = cupy.zeros(1, cupy.int32)
        return self._err

    def check_errors(self, *, reset: bool = True) -> None:
        """Read the error flag (synchronises: call it outside the hot path); raise DeviceError
        if a kernel flagged bad input since the last check."""
        if self._err is None:
            return
        v = int(self._err.get()[0])
        if reset and v:
            self._err.fill(0)
        if v & 1:
            raise DeviceError("a MoE kernel met an expert id outside [0, n_experts): its outputs were "
                              "written as zeros (moe_down: its term was dropped)")

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

    def _l2_items(self, w: QWeight) -> int:
        """Items per warp that dmmv_q8 asks L2 for before pdl_wait, beyond its ring's first ST - 1
        (DmmvParams::l2_items): one for MXFP4 (two ring slots) at k >= 12288 under pdl, else none.
        Example (H100, pdl, weights evict-first): MXFP4 4096x14336 gains ~1.5 points of copy with one
        item and loses ~6 with two; one loses at 14336x4096 and for the three-slot types
        (docs/notes/dmmv.md)."""
        return int(self.pdl and w.qtype == _MXFP4 and w.k >= 12288)

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

    # ------------------------------------------------------------------ the int8 path
    def _int8(self, w: QWeight) -> bool:
        """Whether ``w`` goes through the int8 path."""
        return self.int8 and w.qtype in Q8_TYPES

    def _q8_plan(self, unit: Dispatch, kernel: str, qt: int, nc: int, k: int):
        """(warps per block, dynamic shared memory, blocks to launch) for an int8-path kernel, or
        None when its x does not fit in shared memory (then the f32 path runs). Blocks of 16 warps,
        two per SM, up to k = 8192; beyond, one block of 32 warps per SM, which quantizes the long x
        once instead of twice (fewer warps when NC columns of x crowd shared memory). Cached per
        (kernel, k). _q8_plan_dots with nothing kept per output."""
        return self._q8_plan_dots(unit, kernel, qt, nc, k, 0, per_output=0)

    def _q8_plan_dots(self, unit: Dispatch, kernel: str, qt: int, nc: int, k: int, m: int, slots: int = 1, *,
                      per_output: int | None = None, x_cols: int | None = None):
        """_q8_plan for the int8 kernels that keep their dot products in shared memory until the
        block's barrier (dmmv_q8_two's GLU, moe_dmmv_q8_glu: 2 nc floats per output; moe_down_q8:
        top_k, ``per_output``) and may hold more quantized x columns than nc (moe_down_q8: top_k,
        ``x_cols``): (warps, dynamic shared memory, resident blocks) with those included for the
        outputs of the fullest block (ceil(m / blocks per slot), the resident blocks shared by
        ``slots``), or None. Cached per (kernel, k), and m and slots where outputs are kept."""
        per_output = 2 * nc if per_output is None else per_output
        key = (unit.family.name, kernel, k) + ((m, slots) if per_output else ())
        got = self._resident.get(key)
        if got is not None:
            return got or None
        limit = self.max_shared_optin() - (128 if x_cols else 0)  # moe_down_q8's static slot list
        extra_x = ((x_cols or nc) - nc) * (k + k // 4)
        plan = ()
        # one block of 32 warps per SM once the x to quantize (all columns: moe_down_q8's top_k) is long
        first = _Q8_MAX_WARPS // 2 if k * (x_cols or 1) <= _Q8_SPLIT_K else _Q8_MAX_WARPS
        for nw in (first, first // 2, first // 4, first // 8):
            base = _q8_smem(qt, nw, nc, k) + extra_x
            for per_sm in range(min(_Q8_MAX_WARPS // nw, (limit + 1024) // (base + 1024)), 0, -1):
                resident = self.sm_count() * per_sm
                smem = base + (4 * per_output * -(-m // max(1, resident // slots)) + 15) // 16 * 16
                if smem <= limit and per_sm <= (limit + 1024) // (smem + 1024):
                    plan = (nw, smem, resident)
                    break
            if plan:
                unit._function(kernel, plan[1])
                break
        self._resident[key] = plan
        return plan or None

    # ------------------------------------------------------------------ dense matvecs
    def dequantize(self, w: QWeight, out: cupy.ndarray, *, stream=None) -> cupy.ndarray:
        """``out = W`` as f32 [m, k] (per-element path; for tests and dense fallbacks)."""
        w = self._check_weight("w", w)
        check_array("out", out, dtype=_F32, shape=(w.m, w.k))
        params = self.struct("DequantParams").pack(w_offset=w.offset, row_bytes=w.row_bytes, m=w.m, k=w.k)
        blocks = max(1, min(-(-(w.m * w.k) // 256), 4096))
        self._launch(f"dequantize<{w.qtype}>", blocks, 256, (out, w.buf), params, stream=stream)
        return out

    def split_q8_0(self, w: QWeight, *, stream=None) -> SplitQ8:
        """A :class:`SplitQ8` copy of Q8_0 weights ``w`` (GGUF rows or rows padded by
        ``MatmulDispatch.pad_rows``): new device arrays of ``w.m * w.k * 34 / 32`` bytes, made by CuPy
        copies on ``stream`` (allocates: call it at load time, outside a captured graph)."""
        if not isinstance(w, QWeight):
            raise TypeError(f"w must be a QWeight, got {type(w).__name__}")
        if w.qtype != _Q8_0 or w.n_experts:
            raise ValueError(f"split_q8_0 takes a single Q8_0 matrix, got {w.name}"
                             + (f" x {w.n_experts} experts" if w.n_experts else ""))
        with cupy.cuda.Device(self.device_id):
            quants = cupy.empty((w.m, w.k), cupy.int8)
            scales = cupy.empty((w.m, w.k // 32), cupy.float16)
            self._split_copy(w, quants, scales, resolve_stream(stream))
        return SplitQ8(quants, scales)

    @staticmethod
    def _split_copy(w: QWeight, quants: cupy.ndarray, scales: cupy.ndarray, stream) -> None:
        """quants, scales = the Q8_0 blocks of w, by two strided CuPy copies on ``stream``."""
        blocks = cupy.lib.stride_tricks.as_strided(w.buf[w.offset:], shape=(w.m, w.k // 32, 34),
                                                   strides=(w.row_stride, 34, 1))
        with stream:
            quants.reshape(w.m, w.k // 32, 32).view(cupy.uint8)[...] = blocks[:, :, 2:]
            scales.view(cupy.uint8).reshape(w.m, w.k // 32, 2)[...] = blocks[:, :, :2]

    def dmmv(self, w: QWeight | SplitQ8, x: cupy.ndarray | QuantizedX, y: cupy.ndarray, *,
             accumulate: bool = False, alpha: float = 1.0, gate: cupy.ndarray | None = None,
             stream=None) -> cupy.ndarray:
        """``y = alpha * W x``; with ``accumulate``, ``y += alpha * W x``; with ``gate``,
        ``y += alpha * sigmoid(gate[c]) * W x[c]`` (the shared-expert path).

        w: QWeight [m, k], or a :class:`SplitQ8` (f32 x only); x: [k] or [n, k] f32 (n columns:
        weights are read once per 8), a :class:`NormedX` of that shape (x made by every block from the
        residual stream: the f32 path, no gate), or a :class:`QuantizedX` of that shape made for w's
        type (int8 path only: the same result as from the f32 x it holds, without quantizing it
        again); y: [m] or [n, m] f32 (same leading shape as x); gate: [n] f32 logits on the device."""
        if isinstance(w, SplitQ8):
            return self._dmmv_split(w, x, y, accumulate=accumulate, alpha=alpha, gate=gate, stream=stream)
        w = self._check_weight("w", w)
        if isinstance(x, NormedX):
            if gate is not None:
                raise ValueError("dmmv on a NormedX: no gate epilogue (store or accumulate)")
            self._normed(w, None, x, (y,), mode=int(accumulate), alpha=alpha, stream=stream)
            return y
        if isinstance(x, QuantizedX):
            return self._dmmv_prequantized(w, x, y, accumulate=accumulate, alpha=alpha, gate=gate, stream=stream)
        x, n = self._cols("x", x, w.k)
        check_array("y", y, dtype=_F32, shape=x.shape[:-1] + (w.m,))
        self._check_gate(gate, n)
        mode = self._mode(accumulate, gate)
        nw = _warps(w.k)
        for c0, width in self._chunks(n):
            xs, ys = (x, y) if n == 1 else (x[c0:], y[c0:])
            g = ys if gate is None else gate[c0:]
            q8 = _q8_kernel(w.qtype, width) if self._int8(w) else ""
            plan = self._q8_plan(self, q8, w.qtype, width, w.k) if q8 else None
            if plan:
                self._launch_q8(self, q8, plan, w, ys, xs, g, mode=mode, alpha=alpha, x_stride=w.k, stream=stream)
                continue
            blocks = -(-w.m // _config(w.qtype, width)[0])
            params = self._params(w, blocks1=blocks, mode=mode, alpha=alpha, y_stride=w.m)
            self._launch(_kernel(w.qtype, width), blocks, nw * 32, (ys, ys, w.buf, w.buf, xs, g), params,
                         stream=stream, pdl=self.pdl)
        return y

    dmmv_batch = dmmv  # the engine's name for the multi-column form

    def _dmmv_split(self, w: SplitQ8, x, y, *, accumulate, alpha, gate, stream) -> cupy.ndarray:
        """dmmv on a SplitQ8: dmmv_split<NC, R>, blocks of 8 warps taking R rows each."""
        if isinstance(x, QuantizedX):
            raise TypeError("a SplitQ8 takes f32 x (its matvec multiplies the quants by x exactly)")
        x, n = self._cols("x", x, w.k)
        check_array("y", y, dtype=_F32, shape=x.shape[:-1] + (w.m,))
        self._check_gate(gate, n)
        mode = self._mode(accumulate, gate)
        for c0, width in self._chunks(n):
            xs, ys = (x, y) if n == 1 else (x[c0:], y[c0:])
            g = ys if gate is None else gate[c0:]
            blocks = -(-w.m // (_SPLIT_WARPS * _SPLIT_ROWS))
            params = self.struct("DmmvParams").pack(
                w_offset=0, w2_offset=0, row_bytes=w.k, m=w.m, m2=0, k=w.k, n_full=0, tail=0, blocks1=blocks,
                x_stride=w.k, y_stride=w.m, y2_stride=0, mode=mode, act=0, alpha=float(alpha), l2_items=0, pad0=0)
            self._launch(_split_kernel(width), blocks, _SPLIT_WARPS * 32, (ys, w.quants, w.scales, xs, g), params,
                         stream=stream, pdl=self.pdl)
        return y

    def quantize_x(self, x: cupy.ndarray, out: QuantizedX, *, stream=None) -> QuantizedX:
        """``out`` = x quantized for the int8 path (see :class:`QuantizedX`): one launch, 4 bytes
        read and 1.25 written per element; then ``dmmv(w, out, y)`` for every w that out serves.

        x: [k] or [n, k] f32, C-contiguous, 16-byte aligned, of ``out.shape``. Under ``pdl`` it
        reads x and writes out only after the previous kernel in the stream has completed."""
        if not isinstance(out, QuantizedX):
            raise TypeError(f"out must be a QuantizedX (QuantizedX.empty(shape, qtype)), got {type(out).__name__}")
        x, n = self._cols("x", x, out.k)
        if x.shape != out.shape:
            raise ValueError(f"x has shape {x.shape}, out holds {out.shape}")
        self._quantize_launch(f"quantize_x<{'true' if out.interleaved else 'false'}>", (out.buf, x), out, n, stream)
        return out

    def quantize_glu(self, gate: cupy.ndarray, up: cupy.ndarray, out: QuantizedX, *, act: str = "swiglu",
                     stream=None) -> QuantizedX:
        """``out`` = act(gate) * up quantized for the int8 path: the FFN's gated activation written
        straight into the down projection's :class:`QuantizedX` (act "swiglu": SiLU, "geglu": GELU in
        its tanh form, in f32 as :meth:`dmmv_glu` computes them). One launch in place of the elementwise
        SwiGLU/GEGLU before ``dmmv(w_down, out, y)``: 8 bytes read and 1.25 written per element.

        gate, up: [k] or [n, k] f32, C-contiguous, 16-byte aligned, of ``out.shape`` (e.g. the two
        outputs of :meth:`dmmv_pair`). Under ``pdl`` as :meth:`quantize_x`."""
        if not isinstance(out, QuantizedX):
            raise TypeError(f"out must be a QuantizedX (QuantizedX.empty(shape, qtype)), got {type(out).__name__}")
        if act not in _ACTS:
            raise ValueError(f"quantize_glu: act must be one of {', '.join(_ACTS)}, got {act!r}")
        gate, n = self._cols("gate", gate, out.k)
        up, _ = self._cols("up", up, out.k)
        if gate.shape != out.shape or up.shape != out.shape:
            raise ValueError(f"gate {gate.shape} and up {up.shape} must both have the shape out holds, {out.shape}")
        kernel = f"quantize_glu<{'true' if out.interleaved else 'false'}, {_ACTS[act]}>"
        self._quantize_launch(kernel, (out.buf, gate, up), out, n, stream)
        return out

    def _quantize_launch(self, kernel: str, args: tuple, out: QuantizedX, n: int, stream) -> None:
        """quantize_x / quantize_glu: grid (columns, 2048-element chunks of a column), 256 threads."""
        params = self.struct("QuantizeXParams").pack(k=out.k, x_stride=out.k, out_stride=out.buf.shape[1],
                                                     chunk4=_QX_CHUNK4)
        self._q8x._launch(kernel, (n, -(-(out.k // 4) // _QX_CHUNK4)), 256, args, params, stream=stream, pdl=self.pdl)

    def _dmmv_prequantized(self, w: QWeight, x: QuantizedX, y, *, accumulate, alpha, gate, stream):
        """dmmv on a QuantizedX: dmmv_q8<..., PQ = true> of the dmmv_q8x unit, whose blocks copy x."""
        if not self._int8(w):
            raise ValueError(f"a QuantizedX feeds the int8 path only: {w.name} weights on "
                             f"DmmvDispatch(int8={self.int8}) take f32 x")
        if not x.serves(w.qtype):
            raise ValueError(f"x was quantized for {'MXFP4' if x.interleaved else 'non-MXFP4'} weights (its "
                             f"element order), {w.name} needs {'MXFP4' if w.qtype == _MXFP4 else 'non-MXFP4'}'s: "
                             f"QuantizedX.empty(shape, {w.name!r})")
        if x.k != w.k:
            raise ValueError(f"x holds k={x.k} elements per column, w has k={w.k}")
        n = x.n
        check_array("y", y, dtype=_F32, shape=x.shape[:-1] + (w.m,))
        self._check_gate(gate, n)
        mode = self._mode(accumulate, gate)
        plans = []
        for c0, width in self._chunks(n):  # every plan before the first launch: nothing half-done
            kernel = _q8_kernel(w.qtype, width, pq=True)
            plan = self._q8_plan(self._q8x, kernel, w.qtype, width, w.k)
            if not plan:
                raise ValueError(f"k={w.k} with {width} columns does not fit the int8 path's shared memory: "
                                 f"pass the f32 x (the f32 path then runs)")
            plans.append((c0, kernel, plan))
        for c0, kernel, plan in plans:
            xs, ys = (x.buf, y) if n == 1 else (x.buf[c0:], y[c0:])
            g = ys if gate is None else gate[c0:]
            self._launch_q8(self._q8x, kernel, plan, w, ys, xs, g, mode=mode, alpha=alpha, x_stride=x.buf.shape[1],
                            stream=stream)
        return y

    def _launch_q8(self, unit: Dispatch, kernel: str, plan, w: QWeight, ys, xs, g, *, mode: int, alpha: float,
                   x_stride: int, stream) -> None:
        """One dmmv_q8 launch of ``unit`` on its _q8_plan: block b takes rows [b m / blocks, (b + 1) m / blocks)."""
        qw, smem, resident = plan
        blocks = _q8_blocks(w.m, resident)
        params = self._params(w, blocks1=blocks, mode=mode, alpha=alpha, y_stride=w.m, x_stride=x_stride,
                              l2_items=self._l2_items(w))
        unit._launch(kernel, blocks, qw * 32, (ys, w.buf, xs, g), params, stream=stream, shared_mem=smem, pdl=self.pdl)

    def _normed(self, w: QWeight, w2: QWeight | None, x: NormedX, ys: tuple, *, mode: int, alpha: float,
                glu: int | None = None, stream) -> None:
        """dmmv_nx (w2: the pair form) or, with ``glu`` (the activation id), dmmv_glu_nx on a NormedX.
        Every launch is planned and checked before the first."""
        if x.k != w.k:
            raise ValueError(f"x (a NormedX) has k={x.k}, w has k={w.k}")
        n = 1 if x.residual.ndim == 1 else x.residual.shape[0]
        for name, y, m in zip(("y", "y2"), ys, (w.m, w2.m if w2 is not None else 0)):
            check_array(name, y, dtype=_F32, shape=x.shape[:-1] + (m,))
        launches = []
        for c0, width in self._chunks(n):
            smem = width * w.k * 4
            if smem > self.max_shared_optin():
                raise ValueError(f"a NormedX of {width} columns of k={w.k} needs {smem} bytes of shared memory per "
                                 f"block, the device allows {self.max_shared_optin()}: pass fewer columns")
            if glu is None:
                kernel = _kernel(w.qtype, width).replace("dmmv<", "dmmv_nx<")
                rows = _config(w.qtype, width)[0]
                b1, b2 = -(-w.m // rows), (-(-w2.m // rows) if w2 is not None else 0)
            else:
                kernel, b1, b2 = f"dmmv_glu_nx<{w.qtype}, {width}>", -(-w.m // _ROWS), 0
            yy = tuple(y if n == 1 else y[c0:] for y in ys)
            launches.append((kernel, b1 + b2, b1, yy, x.columns(c0, width), smem))
        p = self.struct("DmmvNormParams")
        w2 = w2 if w2 is not None else w
        for kernel, blocks, b1, yy, (res, proj, w_post, w_norm, out), smem in launches:
            params = p.pack(w_offset=w.offset, w2_offset=w2.offset, row_bytes=w.row_bytes, m=w.m,
                            m2=w2.m if len(ys) == 2 and glu is None else 0, k=w.k, n_full=w.k // _STEP,
                            tail=w.k % _STEP, blocks1=b1, x_stride=w.k, y_stride=w.m,
                            y2_stride=w2.m if glu is None else 0, mode=mode, act=glu or 0, alpha=float(alpha),
                            eps=x.eps, weight_offset=x.weight_offset, post=x.post,
                            write_out=int(x.residual_out is not None), w3_offset=0, row_bytes3=0, m3=0,
                            blocks2=blocks)
            args = (yy[0], yy[-1], w.buf, w2.buf) if glu is None else (yy[0], w.buf, w2.buf)
            self._nx._launch(kernel, blocks, _normed_warps(w.k) * 32, args + (res, proj, w_post, w_norm, out),
                             params, stream=stream, shared_mem=smem, pdl=self.pdl)

    def dmmv_three(self, w1: QWeight, w2: QWeight, w3: QWeight, x: NormedX, y1, y2, y3, *,
                   stream=None) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]:
        """``y1, y2, y3 = W1 x, W2 x, W3 x`` in one launch on a :class:`NormedX` of one column: a decoder
        layer's q, k and v projections with the norm before them. w1, w2: one type; w3 of any type
        (Gemma 3's Q8_0 v beside Q5_0 q and k). Blocks of dmmv_nx3 take the rows of W1, then W2, then
        W3, each at its type's rows per block.

        w1: [m1, k], w2: [m2, k], w3: [m3, k]; x: NormedX of shape [k] or [1, k]; y_i: [m_i] or [1, m_i] f32."""
        w1, w2, w3 = (self._check_weight(n, w) for n, w in (("w1", w1), ("w2", w2), ("w3", w3)))
        if w1.qtype != w2.qtype or not w1.k == w2.k == w3.k:
            raise ValueError(f"dmmv_three: w1 ({w1.name}, k={w1.k}) and w2 ({w2.name}, k={w2.k}) must share a type, "
                             f"and w3 (k={w3.k}) their k")
        if (w1.qtype, w3.qtype) not in THREE_TYPES:
            raise ValueError(f"dmmv_three: W3 of {w3.name} beside {w1.name} is not built (dmmv.THREE_TYPES: W3 of "
                             "W1's type, Q8_0 or Q6_K): use dmmv_pair and dmmv")
        if not isinstance(x, NormedX):
            raise TypeError(f"dmmv_three takes a NormedX, got {type(x).__name__}")
        if x.k != w1.k or (x.residual.ndim == 2 and x.residual.shape[0] != 1):
            raise ValueError(f"dmmv_three: x must be one column of k={w1.k} ([k] or [1, k]), got {x.shape}")
        for name, y, w in (("y1", y1, w1), ("y2", y2, w2), ("y3", y3, w3)):
            check_array(name, y, dtype=_F32, shape=x.shape[:-1] + (w.m,))
        smem = w1.k * 4
        if smem > self.max_shared_optin():
            raise ValueError(f"a NormedX of k={w1.k} needs {smem} bytes of shared memory per block, the device "
                             f"allows {self.max_shared_optin()}")
        (r, v), (r3, v3) = _ONE_COL[w1.qtype], _ONE_COL[w3.qtype]
        b1, b2, b3 = -(-w1.m // r), -(-w2.m // r), -(-w3.m // r3)
        params = self.struct("DmmvNormParams").pack(
            w_offset=w1.offset, w2_offset=w2.offset, row_bytes=w1.row_bytes, m=w1.m, m2=w2.m, k=w1.k,
            n_full=w1.k // _STEP, tail=w1.k % _STEP, blocks1=b1, x_stride=w1.k, y_stride=w1.m, y2_stride=w2.m,
            mode=0, act=0, alpha=1.0, eps=x.eps, weight_offset=x.weight_offset, post=x.post,
            write_out=int(x.residual_out is not None), w3_offset=w3.offset, row_bytes3=w3.row_bytes, m3=w3.m,
            blocks2=b1 + b2)
        res, proj, w_post, w_norm, out = x.columns(0, 1)
        self._three._launch(_three_kernel(w1.qtype, w3.qtype), b1 + b2 + b3, _normed_warps(w1.k) * 32,
                         (y1, y2, y3, w1.buf, w2.buf, w3.buf, res, proj, w_post, w_norm, out), params,
                         stream=stream, shared_mem=smem, pdl=self.pdl)
        return y1, y2, y3

    def dmmv_scale_acc(self, w: QWeight, x, y, scale: float, *, stream=None) -> cupy.ndarray:
        """``y += scale * W x`` (fused scale-accumulate)."""
        return self.dmmv(w, x, y, accumulate=True, alpha=scale, stream=stream)

    def dmmv_gated_acc(self, w: QWeight, x, y, gate: cupy.ndarray, *, alpha: float = 1.0, stream=None):
        """``y[c] += alpha * sigmoid(gate[c]) * W x[c]`` (sigmoid-gated accumulate; gate on the device)."""
        return self.dmmv(w, x, y, gate=gate, alpha=alpha, stream=stream)

    def dmmv_pair(self, w1: QWeight, w2: QWeight, x, y1, y2, *, stream=None) -> tuple[cupy.ndarray, cupy.ndarray]:
        """``y1 = W1 x; y2 = W2 x`` in one launch (two matrices of one type sharing the input). On the
        int8 path one block quantizes x for rows of one matrix; the resident blocks are split
        between the matrices by their rows (``_q8_pair_blocks``).

        w1: [m1, k], w2: [m2, k] of the same type; x: [k] or [n, k] f32, or a :class:`NormedX`;
        y1: [.., m1]; y2: [.., m2]."""
        w1 = self._check_weight("w1", w1)
        w2 = self._check_weight("w2", w2)
        if w1.qtype != w2.qtype or w1.k != w2.k:
            raise ValueError(f"dmmv_pair: w1 ({w1.name}, k={w1.k}) and w2 ({w2.name}, k={w2.k}) must have "
                             "the same type and k")
        if isinstance(x, NormedX):
            self._normed(w1, w2, x, (y1, y2), mode=0, alpha=1.0, stream=stream)
            return y1, y2
        x, n = self._cols("x", x, w1.k)
        check_array("y1", y1, dtype=_F32, shape=x.shape[:-1] + (w1.m,))
        check_array("y2", y2, dtype=_F32, shape=x.shape[:-1] + (w2.m,))
        nw = _warps(w1.k)
        for c0, width in self._chunks(n):
            xs, ya, yb = (x, y1, y2) if n == 1 else (x[c0:], y1[c0:], y2[c0:])
            q8 = _q8_two_kernel(w1.qtype, width, False) if self._int8(w1) else ""
            plan = self._q8_plan(self._two, q8, w1.qtype, width, w1.k) if q8 else None
            if plan:  # the resident blocks split by the matrices' rows, each matrix's share balanced
                qw, smem, resident = plan
                b1, b2 = _q8_pair_blocks(w1.m, w2.m, resident)
                blocks = b1 + b2
                params = self._params(w1, w2=w2, m2=w2.m, blocks1=b1, y_stride=w1.m, y2_stride=w2.m)
                self._two._launch(q8, blocks, qw * 32, (ya, yb, w1.buf, w2.buf, xs), params, stream=stream,
                                  shared_mem=smem, pdl=self.pdl)
                continue
            rows = _config(w1.qtype, width)[0]
            b1, b2 = -(-w1.m // rows), -(-w2.m // rows)
            params = self._params(w1, w2=w2, m2=w2.m, blocks1=b1, y_stride=w1.m, y2_stride=w2.m)
            self._launch(_kernel(w1.qtype, width), b1 + b2, nw * 32, (ya, yb, w1.buf, w2.buf, xs, ya), params,
                         stream=stream, pdl=self.pdl)
        return y1, y2

    def dmmv_glu(self, w_gate: QWeight, w_up: QWeight, x, y, *, act: str = "swiglu", accumulate: bool = False,
                 alpha: float = 1.0, stream=None) -> cupy.ndarray:
        """``y = alpha * act(W_gate x) * (W_up x)`` (``accumulate``: ``y +=``): act "swiglu" (SiLU)
        or "geglu" (GELU, tanh form). On the int8 path (dmmv_q8_two) a block streams the gate and up
        rows of its outputs as one sequence and combines each pair's dot products in shared memory:
        H100, Q4_K 2x14336x4096, 28.0 us (25.1 us with ``pdl``, 89% of copy) where the f32 path's
        fused kernel takes 52.7 us.

        w_gate, w_up: [m, k] of one type; x: [k] or [n, k] f32, or a :class:`NormedX`; y: [m] or [n, m]."""
        wg = self._check_weight("w_gate", w_gate)
        wu = self._check_weight("w_up", w_up)
        if (wg.qtype, wg.m, wg.k) != (wu.qtype, wu.m, wu.k):
            raise ValueError(f"dmmv_glu: w_gate ({wg.name} {wg.m}x{wg.k}) and w_up ({wu.name} {wu.m}x{wu.k}) "
                             "must have the same type and shape")
        if act not in _ACTS:
            raise ValueError(f"dmmv_glu: act must be one of {', '.join(_ACTS)}, got {act!r}")
        if isinstance(x, NormedX):
            self._normed(wg, wu, x, (y,), mode=int(accumulate), alpha=alpha, glu=_ACTS[act], stream=stream)
            return y
        x, n = self._cols("x", x, wg.k)
        check_array("y", y, dtype=_F32, shape=x.shape[:-1] + (wg.m,))
        nw = _warps(wg.k)
        blocks = -(-wg.m // _ROWS)
        for c0, width in self._chunks(n):
            xs, ys = (x, y) if n == 1 else (x[c0:], y[c0:])
            q8 = _q8_two_kernel(wg.qtype, width, True) if self._int8(wg) else ""
            plan = self._q8_plan_dots(self._two, q8, wg.qtype, width, wg.k, wg.m) if q8 else None
            if plan:
                qw, smem, resident = plan
                grid = _q8_blocks(wg.m, resident)
                params = self._params(wg, w2=wu, mode=1 if accumulate else 0, act=_ACTS[act], alpha=alpha,
                                      y_stride=wg.m, blocks1=grid)
                self._two._launch(q8, grid, qw * 32, (ys, ys, wg.buf, wu.buf, xs), params, stream=stream,
                                  shared_mem=smem, pdl=self.pdl)
                continue
            params = self._params(wg, w2=wu, mode=1 if accumulate else 0, act=_ACTS[act], alpha=alpha,
                                  y_stride=wg.m, blocks1=blocks)
            self._glu._launch(f"dmmv_glu<{wg.qtype}, {width}>", blocks, nw * 32, (ys, wg.buf, wu.buf, xs, ys),
                              params, stream=stream, pdl=self.pdl)
        return y

    # ------------------------------------------------------------------ mixture of experts
    def _moe_params(self, w: QWeight, *, w2: QWeight | None = None, top_k: int, n_slots: int, x_per_slot: bool,
                    act: int = 0, mode: int = 0, alpha: float = 1.0, max_items: int = 0):
        return self.struct("MoeParams").pack(
            w_offset=w.offset, w2_offset=w2.offset if w2 is not None else 0, row_bytes=w.row_bytes,
            expert_bytes=w.expert_stride, m=w.m, k=w.k, n_full=w.k // _STEP, tail=w.k % _STEP,
            n_experts=w.n_experts, top_k=top_k, n_slots=n_slots, x_per_slot=int(x_per_slot),
            max_items=max_items, act=act, mode=mode, alpha=float(alpha))

    def _moe_inputs(self, w: QWeight, w_up, x, ids, act: str):
        w = self._check_weight("w", w, experts=True)
        if w_up is not None:
            wu = self._check_weight("w_up", w_up, experts=True)
            if (wu.qtype, wu.m, wu.k, wu.n_experts, wu.expert_stride) != (w.qtype, w.m, w.k, w.n_experts,
                                                                         w.expert_stride):
                raise ValueError("w_up must match w (type, shape, experts, stride)")
        if act not in _ACTS:
            raise ValueError(f"act must be one of {', '.join(_ACTS)}, got {act!r}")
        check_array("ids", ids, dtype=_I32, ndim=2)
        n_tokens, top_k = ids.shape
        if n_tokens < 1 or top_k < 1:
            raise ValueError(f"ids must be [n_tokens, top_k] with both >= 1, got {ids.shape}")
        check_array("x", x, dtype=_F32)
        if x.shape == (n_tokens, w.k):
            per_slot = False
        elif x.shape == (n_tokens, top_k, w.k):
            per_slot = True
        else:
            raise ValueError(f"x must be [{n_tokens}, {w.k}] (one input per token) or [{n_tokens}, {top_k}, {w.k}] "
                             f"(one per slot), got {x.shape}")
        if x.data.ptr % 16:
            raise ValueError(f"x must be 16-byte aligned (data pointer {x.data.ptr:#x})")
        return w, n_tokens, top_k, per_slot

    def moe_dmmv(self, w: QWeight, x: cupy.ndarray, ids: cupy.ndarray, y: cupy.ndarray, *,
                 w_up: QWeight | None = None, act: str = "swiglu", alpha: float = 1.0, stream=None) -> cupy.ndarray:
        """For every token t and slot j: ``y[t, j] = alpha * W[ids[t, j]] x[t]`` (x [n_tokens, k]) or
        ``... x[t, j]`` (x [n_tokens, top_k, k]); with ``w_up``, ``act(Wg x) * (Wu x)``. All slots in one
        launch; expert ids are read on the device (out of range: zeros and the error flag). On the
        int8 path a block quantizes its slot's x and streams rows of the slot's expert (with GLU its
        outputs' gate and up rows as one sequence, as :meth:`dmmv_glu`; H100, top-8 of 128 Q4_K
        experts of 2x2048x7168: 52.9 us, 84% of copy, where the f32 path takes 111.9 us).

        w (, w_up): expert QWeight [n_experts, m, k]; ids: [n_tokens, top_k] int32; y: [n_tokens, top_k, m]."""
        w, n_tokens, top_k, per_slot = self._moe_inputs(w, w_up, x, ids, act)
        check_array("y", y, dtype=_F32, shape=(n_tokens, top_k, w.m))
        n_slots = n_tokens * top_k
        if n_slots > 65535:
            raise ValueError(f"moe_dmmv: at most 65535 slots per launch, got {n_slots} (use moe_dmmv_packed)")
        params = self._moe_params(w, w2=w_up, top_k=top_k, n_slots=n_slots, x_per_slot=per_slot,
                                  act=_ACTS[act], alpha=alpha)
        if self._int8(w) and w_up is None:
            q8 = _q8_kernel(w.qtype, None)
            plan = self._q8_plan(self._moe, q8, w.qtype, 1, w.k)
            args = (y, self.error_flag, w.buf, x, ids)
        elif self._int8(w):
            q8 = _q8_moe_glu_kernel(w.qtype)
            plan = self._q8_plan_dots(self._moe, q8, w.qtype, 1, w.k, w.m, n_slots)
            args = (y, self.error_flag, w.buf, w_up.buf, x, ids)
        else:
            plan = None
        if plan:
            qw, smem, resident = plan
            per_slot_blocks = _q8_blocks(w.m, resident // n_slots)
            self._moe._launch(q8, (per_slot_blocks, n_slots), qw * 32, args, params, stream=stream, shared_mem=smem)
            return y
        glu = "true" if w_up is not None else "false"
        self._moe._launch(f"moe_dmmv<{w.qtype}, {glu}>", (-(-w.m // _ROWS), n_slots), _warps(w.k) * 32,
                          (y, self.error_flag, w.buf, (w_up or w).buf, x, ids), params, stream=stream)
        return y

    @staticmethod
    def _max_items(n_slots: int, n_experts: int) -> int:
        # sum over buckets of ceil(count / cols) <= n_slots / cols + (non-empty buckets)
        return n_slots // _PACK_COLS + min(n_slots, n_experts + 1)

    def plan_moe_route(self, n_tokens: int, top_k: int, n_experts: int) -> MoeRoute:
        """Allocate the buffers moe_route_pack fills (host work, outside any graph)."""
        for name, v in (("n_tokens", n_tokens), ("top_k", top_k), ("n_experts", n_experts)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"plan_moe_route: {name} must be an int >= 1, got {v!r}")
        if n_experts > _MAX_EXPERTS:
            raise ValueError(f"plan_moe_route: at most {_MAX_EXPERTS} experts, got {n_experts}")
        n_slots = n_tokens * top_k
        max_items = self._max_items(n_slots, n_experts)
        if max_items > 65535:
            raise ValueError(f"plan_moe_route: {n_slots} slots need up to {max_items} work items (limit 65535)")
        with cupy.cuda.Device(self.device_id):
            z = lambda *s: cupy.zeros(s, cupy.int32)  # noqa: E731
            return MoeRoute(n_slots, n_experts, max_items, z(n_experts), z(n_experts + 1), z(n_slots),
                            z(max_items, 3), z(1))

    def moe_route_pack(self, ids: cupy.ndarray, route: MoeRoute, *, stream=None) -> MoeRoute:
        """Group the slots of ``ids`` [n_tokens, top_k] int32 by expert into ``route`` (device only)."""
        if not isinstance(route, MoeRoute):
            raise TypeError(f"route must be a MoeRoute from plan_moe_route, got {type(route).__name__}")
        check_array("ids", ids, dtype=_I32, ndim=2)
        if ids.size != route.n_slots:
            raise ValueError(f"ids has {ids.size} slots, the route was planned for {route.n_slots}")
        params = self.struct("RouteParams").pack(n_slots=route.n_slots, n_experts=route.n_experts,
                                                 cols=_PACK_COLS, max_items=route.max_items)
        self._moe._launch("moe_route_pack", 1, 1024, (route.counts, route.offsets, route.packed, route.items,
                                                     route.n_items, self.error_flag, ids), params, stream=stream)
        return route

    def moe_count_experts(self, ids: cupy.ndarray, counts: cupy.ndarray, *, stream=None) -> cupy.ndarray:
        """``counts[e]`` = slots of ``ids`` [n_tokens, top_k] int32 routed to expert e; counts: [n_experts] int32."""
        check_array("ids", ids, dtype=_I32, ndim=2)
        check_array("counts", counts, dtype=_I32, ndim=1)
        if not 1 <= counts.size <= _MAX_EXPERTS:
            raise ValueError(f"counts must have 1 to {_MAX_EXPERTS} entries, got {counts.size}")
        if ids.size < 1:
            raise ValueError("ids must not be empty")
        params = self.struct("RouteParams").pack(n_slots=ids.size, n_experts=counts.size, cols=_PACK_COLS,
                                                 max_items=0)
        self._moe._launch("moe_count_experts", 1, 1024, (counts, self.error_flag, ids), params, stream=stream)
        return counts

    def moe_dmmv_packed(self, w: QWeight, x: cupy.ndarray, ids: cupy.ndarray, route: MoeRoute, y: cupy.ndarray, *,
                        w_up: QWeight | None = None, act: str = "swiglu", alpha: float = 1.0,
                        stream=None) -> cupy.ndarray:
        """As :meth:`moe_dmmv`, token-batched: each expert's weights are read once per 4 of its slots,
        using a ``route`` filled by :meth:`moe_route_pack` from the same ``ids``. The grid is sized for
        the worst case; blocks past the device-side item count exit."""
        w, n_tokens, top_k, per_slot = self._moe_inputs(w, w_up, x, ids, act)
        if not isinstance(route, MoeRoute) or route.n_slots != n_tokens * top_k or route.n_experts != w.n_experts:
            raise ValueError("route must be a MoeRoute planned for these ids and w.n_experts")
        check_array("y", y, dtype=_F32, shape=(n_tokens, top_k, w.m))
        params = self._moe_params(w, w2=w_up, top_k=top_k, n_slots=route.n_slots, x_per_slot=per_slot,
                                  act=_ACTS[act], alpha=alpha, max_items=route.max_items)
        glu = "true" if w_up is not None else "false"
        self._packed._launch(f"moe_dmmv_packed<{w.qtype}, {glu}>", (-(-w.m // _ROWS), route.max_items),
                          _warps(w.k) * 32, (y, w.buf, (w_up or w).buf, x, route.packed, route.items, route.n_items),
                          params, stream=stream)
        return y

    def moe_down(self, w: QWeight, h: cupy.ndarray, ids: cupy.ndarray, weights: cupy.ndarray, y: cupy.ndarray, *,
                 accumulate: bool = False, alpha: float = 1.0, stream=None) -> cupy.ndarray:
        """``y[t] (+)= alpha * sum_j weights[t, j] * W[ids[t, j]] h[t, j]``: the MoE down projection and the
        weighted sum over each token's experts in one launch (no atomics; an out-of-range id drops its term
        and sets the error flag). On the int8 path (top_k <= 16) a block quantizes the h of each of its
        token's slots, streams its outputs' rows of every slot's expert as one sequence and sums the
        dot products over the slots in slot order (H100, top-8 of 128 Q4_K experts of 2048x7168:
        39.5 us, 57% of copy, where the f32 path takes 79.7 us; every block quantizes all top_k h).

        w: expert QWeight [n_experts, m, k]; h: [n_tokens, top_k, k]; ids: [n_tokens, top_k] int32;
        weights: [n_tokens, top_k] f32; y: [n_tokens, m]."""
        w = self._check_weight("w", w, experts=True)
        check_array("ids", ids, dtype=_I32, ndim=2)
        n_tokens, top_k = ids.shape
        if n_tokens < 1 or top_k < 1 or n_tokens > 65535:
            raise ValueError(f"ids must be [n_tokens, top_k], 1 <= n_tokens <= 65535, top_k >= 1; got {ids.shape}")
        check_array("h", h, dtype=_F32, shape=(n_tokens, top_k, w.k), align=16)
        check_array("weights", weights, dtype=_F32, shape=(n_tokens, top_k))
        check_array("y", y, dtype=_F32, shape=(n_tokens, w.m))
        params = self._moe_params(w, top_k=top_k, n_slots=n_tokens * top_k, x_per_slot=True,
                                  mode=1 if accumulate else 0, alpha=alpha)
        if self._int8(w) and top_k <= _Q8_MAX_TOP_K:
            q8 = _q8_down_kernel(w.qtype)
            plan = self._q8_plan_dots(self._moe, q8, w.qtype, 1, w.k, w.m, n_tokens, per_output=top_k, x_cols=top_k)
            if plan:
                qw, smem, resident = plan
                self._moe._launch(q8, (_q8_blocks(w.m, resident // n_tokens), n_tokens), qw * 32,
                                  (y, self.error_flag, w.buf, h, ids, weights), params, stream=stream, shared_mem=smem)
                return y
        self._moe._launch(f"moe_down<{w.qtype}>", (-(-w.m // _ROWS), n_tokens), _warps(w.k) * 32,
                          (y, self.error_flag, w.buf, h, ids, weights), params, stream=stream)
        return y
