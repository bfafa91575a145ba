"""The matmul family's shared pieces: weight types, the kernels' tiling constants and their
shared-memory sizes as the host mirrors them, :class:`PackedWeight`, the compilation units, and the
operand checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from cukern.dispatch import check_array
from cukern.dmmv import QTYPES, QWeight
from cukern.qtypes import GGMLType as T
from cukern.runtime import FamilySpec, KernelSpec

# weight types of the tiled GEMMs: GGML id -> short name (unit suffix)
GEMM_QTYPES = {T.Q4_0: "q4_0", T.Q5_0: "q5_0", T.Q8_0: "q8_0", T.Q4_K: "q4_k", T.Q5_K: "q5_k", T.Q6_K: "q6_k"}
Q8_1_BYTES, Q8_0_BYTES = 36, 34  # bytes per 32-value activation block

# Tiling of gemm_f16 / gemm_q8 (cuda_src/matmul/gemm.cuh: kThreads, kRows, BK, SUPER, Cfg<BT>)
_THREADS = 256
_TOKEN_TILES = (16, 32, 64, 128)  # BT: the smallest that holds N, 128 beyond
_I8_MAX_TILE = 128  # gemm_q8 at 128 tokens: one CTA per SM, up to 255 registers (CfgQ8 in gemm_i8.cuh)
_ROW_TILE = 128  # weight rows per CTA; the GLU GEMMs take 64 rows of each matrix
_ROW_TILE_GLU = 64
_BK = 64  # K elements per stage
_D_BOX = 32  # gemm_wgr tensor stores of d: boxes of 32 rows (128 bytes of f32, the swizzle span) x the token tile
_SUPER = 256  # K elements per raw super-stage; K splits are multiples of it
_W_ALIGN = {T.Q4_0: 2, T.Q5_0: 2, T.Q8_0: 2, T.Q4_K: 16, T.Q5_K: 16, T.Q6_K: 2, T.MXFP4: 2}  # bytes: K4/K5 quants are read as uint4
# gemm_wgr's packed layouts (packed_wgr.cuh, MatmulDispatch.pack): GGUF type -> (bytes per row and 256
# elements, shared row stride = the tile-major row stride); kernel type code 100 + GGUF type
PACKED_LAYOUTS = {T.Q4_0: (272, 320), T.Q5_0: (272, 320), T.Q8_0: (272, 320), T.Q4_K: (160, 160), T.Q5_K: (288, 320),
                  T.Q6_K: (288, 320)}
# gemm_wgr (Hopper wgmma, gemm_wgr.cuh): 128 weight rows (GLU: 64 of each matrix) x 128 or 256 tokens,
# three warpgroups
_WG_TILES = (128, 256)
_WGR_THREADS = 384
_WGR_MAX_STAGES, _WGR_SMEM_LIMIT, _WGR_MAX_RING = 6, 227 * 1024, 128 * 1024  # kWgrMaxStages, -SmemLimit, -MaxRingBytes

_B_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "__half"}
_ACTS = {"swiglu": 2, "silu": 2, "geglu": 3, "gelu": 3}  # GemmParams.mode
_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)
_Q_THREADS = 256  # quantize_q8 / dequantize_f16 block size
_MAX_BLOCKS = 8192  # the flat kernels grid-stride beyond


def _raw_stride(qt: int) -> int:
    """Shared bytes per weight row of a raw super-stage (Raw<QT>::kStride in gemm.cuh)."""
    _, be, bb, _ = QTYPES[qt]
    nbytes = _SUPER // be * bb
    return -(-(nbytes + (14 if nbytes % 16 else 0)) // 16) * 16  # room for copy_raw's lead (Q6_K)


def _smem(bt: int, b_itemsize: int, qt: int) -> int:
    """Dynamic shared memory of gemm_f16 (gemm_smem_bytes in gemm.cuh; the kernel traps if short)."""
    lds = _BK + 8
    return (2 * (_ROW_TILE + bt) * lds * 2 + (bt * _BK * 4 if b_itemsize == 4 else 0)
            + _ROW_TILE * _raw_stride(qt))


def _smem_q8(bt: int, qt: int) -> int:
    """Dynamic shared memory of gemm_q8 (gemm_q8_smem_bytes in gemm_i8.cuh; the kernel traps if short)."""
    a_stages, raw_bufs = (4, 2) if bt >= 128 else (2, 1)  # CfgQ8<BT>
    return (2 * _ROW_TILE * (_BK + 16) + a_stages * bt * (_BK + 16 + 8) + 2 * _ROW_TILE * 6 * 4
            + raw_bufs * _ROW_TILE * _raw_stride(qt))


def _smem_wgr(bt: int, qt: int, packed: bool = False) -> int:
    """Dynamic shared memory of gemm_wgr (gemm_wgr_smem_bytes with gemm_wgr_stages slots in
    gemm_wgr.cuh; the kernel traps if short); ``packed``: on qt's packed layout."""
    if packed:
        raw = PACKED_LAYOUTS[qt][1]
    else:
        raw = _raw_stride(qt)
        raw += 0 if (raw // 16) % 2 else 16  # RawWgr<QT>::kStride
    size = lambda s: 1024 + s * bt * _BK * 2 + 2 * _ROW_TILE * raw + 2 * (s + 2) * 8  # noqa: E731
    stages = next(s for s in range(_WGR_MAX_STAGES, 1, -1)
                  if s == 2 or (size(s) <= _WGR_SMEM_LIMIT and s * bt * _BK * 2 <= _WGR_MAX_RING))
    return size(stages)


def _k_slice(k: int, split: int, unit: int = _SUPER) -> int:
    """Elements of K per slice when K is cut into ``split`` slices: ceil(k / split) rounded up to
    ``unit`` (a raw super-stage), so that every slice but the last is whole super-stages."""
    return -(-(-(-k // split)) // unit) * unit


def _split_arg(split_k) -> int | None:
    """``split_k`` as given (None: chosen per call), validated: an int >= 1."""
    if split_k is not None and (not isinstance(split_k, (int, np.integer)) or isinstance(split_k, bool)
                                or split_k < 1):
        raise ValueError(f"split_k must be an int >= 1, got {split_k!r}")
    return None if split_k is None else int(split_k)


def _raw16(*weights: QWeight) -> int:
    """1 when every row of these weights starts 16-byte aligned (raw super-stages go by cp.async)."""
    return int(all((w.buf.data.ptr + w.offset) % 16 == 0 and w.row_stride % 16 == 0 for w in weights))


@dataclass(frozen=True)
class PackedWeight:
    """A GGUF weight repacked once (:meth:`MatmulDispatch.pack`) into gemm_wgr's layout: per 128-row tile
    and 256-element super-block one contiguous chunk of 128 rows x ``stride`` bytes (each lane's quants of
    a 64-element stage contiguous, the scales as f16: packed_wgr.cuh), moved into shared memory by one
    bulk copy. Hopper only (gemm_wgr); a separate buffer beside the GGUF bytes, which the matvec path
    keeps reading. ``glu`` (:meth:`MatmulDispatch.pack_glu`): the gate and up matrices of a gated MLP,
    64 rows of each per tile, for :meth:`MatmulDispatch.gemm_glu`."""

    buf: cupy.ndarray  # the tile-major bytes
    qtype: int  # the GGUF type it was packed from
    m: int  # rows (glu: of each matrix)
    k: int
    offset: int = 0  # (the GEMM's parameter; a packed buffer starts at 0)
    n_experts: int = 0
    glu: bool = False

    def __post_init__(self):  # a hand-made one is checked as QWeight checks its fields: no launch reads past buf
        check_array("buf", self.buf, dtype=np.uint8, align=16)
        if self.qtype not in PACKED_LAYOUTS:
            raise ValueError(f"PackedWeight: no packed layout for type {self.qtype}")
        for f in ("m", "k"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not 1 <= v < 2**31:
                raise ValueError(f"PackedWeight.{f} must be an int in [1, 2**31), got {v!r}")
        if self.k % _SUPER or self.offset or self.n_experts:
            raise ValueError(f"PackedWeight: k={self.k} must be a multiple of {_SUPER}; offset and n_experts 0")
        if not isinstance(self.glu, bool):
            raise ValueError(f"PackedWeight.glu must be a bool, got {self.glu!r}")
        need = self.nbytes_for(self.m, self.k, self.qtype, self.glu)
        if self.buf.nbytes < need:
            raise ValueError(f"PackedWeight: buf holds {self.buf.nbytes} bytes, {'2x' if self.glu else ''}"
                             f"{self.m}x{self.k} needs {need}")

    @property
    def code(self) -> int:
        """gemm_wgr's type code of the layout (packed_wgr.cuh's QT_*_WGR)."""
        return 100 + self.qtype

    @property
    def row_bytes(self) -> int:
        return self.k // _SUPER * PACKED_LAYOUTS[self.qtype][0]

    row_stride = row_bytes  # what the kernels take as the row pitch (QWeight's name for it)

    @staticmethod
    def nbytes_for(m: int, k: int, qtype: int, glu: bool = False) -> int:
        tiles = -(-m // (_ROW_TILE_GLU if glu else _ROW_TILE))
        return tiles * (k // _SUPER) * _ROW_TILE * PACKED_LAYOUTS[qtype][1]


def _check_act(act) -> None:
    if act not in _ACTS:
        raise ValueError(f"act must be one of {', '.join(_ACTS)}, got {act!r}")


def q8_1_row_bytes(n_cols: int) -> int:
    """Bytes of one row of n_cols values quantized to Q8_1 (n_cols % 32 == 0)."""
    return n_cols // 32 * Q8_1_BYTES


def q8_0_row_bytes(n_cols: int) -> int:
    """Bytes of one row of n_cols values quantized to Q8_0 (n_cols % 32 == 0)."""
    return n_cols // 32 * Q8_0_BYTES


def _gemm_unit(qt: int) -> FamilySpec:
    kernels = [KernelSpec(f"gemm_f16<{qt}, {bt}, {glu}, {tb}>", "GemmParams")
               for bt in _TOKEN_TILES for glu in ("false", "true") for tb in _B_TYPES.values()]
    kernels += [KernelSpec(f"gemm_wgr<{qt}, {bt}, {glu}>", "GemmParams")
                for bt in _WG_TILES for glu in ("false", "true")]
    if qt in PACKED_LAYOUTS:
        kernels += [KernelSpec(f"gemm_wgr<{100 + qt}, {bt}, {glu}>", "GemmParams")
                    for bt in _WG_TILES for glu in ("false", "true")]
        kernels.append(KernelSpec(f"pack_wgr<{qt}>", "PackParams"))
    return FamilySpec(f"matmul_f16_{GEMM_QTYPES[qt]}", tuple(kernels), source="matmul/gemm.cu",
                      params_header="matmul/params.cuh")


def _i8_unit(qt: int) -> FamilySpec:
    kernels = [KernelSpec(f"gemm_q8<{qt}, {bt}, {epi}>", "GemmParams")
               for bt in _TOKEN_TILES if bt <= _I8_MAX_TILE for epi in range(4)]
    return FamilySpec(f"matmul_i8_{GEMM_QTYPES[qt]}", tuple(kernels), source="matmul/gemm_i8.cu",
                      params_header="matmul/params.cuh")


FAMILY = FamilySpec(
    name="matmul",
    kernels=tuple([KernelSpec(f"quantize_q8<{f}>", "QuantizeParams") for f in (0, 1)]
                  + [KernelSpec(f"dequantize_f16<{q}>", "DequantParams") for q in GEMM_QTYPES]),
)
# One RawModule per unit: the quantizers; the f16 GEMM and the int8 GEMM per weight type (5-7 s of NVRTC each).
# grouped expert GEMMs (moe_gemm.cuh): the tiled types and MXFP4 (gpt-oss's experts); token tiles
MOE_QTYPES = {**GEMM_QTYPES, T.MXFP4: "mxfp4"}
_MOE_TILES = (32, 64, 128)


def _moe_unit(qt: int) -> FamilySpec:
    kernels = [KernelSpec(f"moe_gemm_f16<{qt}, {bt}, {glu}, {tb}>", "MoeGemmParams")
               for bt in _MOE_TILES for glu in ("false", "true") for tb in _B_TYPES.values()]
    return FamilySpec(f"matmul_moe_{MOE_QTYPES[qt]}", tuple(kernels), source="matmul/moe_gemm.cu",
                      params_header="matmul/params.cuh")


FAMILIES = {f.name: f for f in [FAMILY] + [_gemm_unit(q) for q in GEMM_QTYPES] + [_i8_unit(q) for q in GEMM_QTYPES]
            + [_moe_unit(q) for q in MOE_QTYPES]}


def _cols(name: str, a, dtypes, k: int) -> int:
    """Validate a [n, k] row-strided view (unit stride along rows); returns its row stride in elements."""
    check_array(name, a, dtype=dtypes, ndim=2, contiguous=False)
    n, kk = a.shape
    if kk != k:
        raise ValueError(f"{name} must be [n, {k}], got shape {a.shape}")
    if n < 1:
        raise ValueError(f"{name} must have at least one column (token), got shape {a.shape}")
    isz = a.itemsize
    if a.strides[1] != isz or a.strides[0] % isz or (n > 1 and a.strides[0] < k * isz):
        raise ValueError(f"{name} must have unit stride along its rows and non-overlapping rows, "
                         f"got strides {a.strides}")
    return a.strides[0] // isz if n > 1 else k


def _d_shape(w: str, b: str = "b"):
    """d [n, m] for weight argument ``w`` and activations ``b`` [n, ...]: interop.like's shape function."""
    return lambda a: (a(b).shape[0], a(w).m)


def _q_rows(block_bytes: int):
    """The quantized rows of x [n_rows, n_cols] at ``block_bytes`` per 32 values: interop.like's shape function."""
    return lambda a: (a("x").shape[0], a("x").shape[1] // 32 * block_bytes)


def _extent(a) -> tuple[int, int]:
    """[first, last + 1) bytes that a 2-D row-strided view spans."""
    return a.data.ptr, a.data.ptr + (a.shape[0] - 1) * a.strides[0] + a.shape[1] * a.itemsize


def _overlap(a, b) -> bool:
    (lo1, hi1), (lo2, hi2) = _extent(a), _extent(b)
    return lo1 < hi2 and lo2 < hi1
