"""MatmulDispatch: quantized GEMMs for prefill (N token columns against raw GGUF weights), the fused
gate+up+activation GEMMs, one-pass activation quantizers and the whole-matrix dequantizer.

Kernels: ``cuda_src/matmul/`` (block formats in ``cuda_src/common/quants.cuh``, Q8_1 in
``cuda_src/common/q8_1.cuh``); float64 references: ``cukern/reference/matmul.py``; tests:
``tests/test_matmul.py``; benchmark: ``profiling/bench_matmul.py``; measurements and the designs
not kept: ``docs/notes/matmul.md``.

Layouts (the dmmv family's): a weight is a :class:`cukern.dmmv.QWeight` (raw GGUF bytes, type,
``m`` rows of ``k`` elements, byte offset). Activations ``b`` are ``[n, k]`` (one row per token),
outputs ``d`` are ``[n, m]``; both may be row-strided views (unit stride along the row). ``b`` is
f32 or f16; ``d`` is f32.

Paths (:meth:`MatmulDispatch.plan_path` is the rule, :meth:`MatmulDispatch.matmul` applies it,
``path=`` overrides it): ``"matvec"`` for N <= 8 (the dmmv family's batched matvec reads the
weights once per launch), ``"int8"`` only when the activations already are Q8_1 (it never beat the
f16 path), ``"f16"`` otherwise. The f16 path (:meth:`gemm`, :meth:`gemm_glu`) has two kernels:

* ``gemm_wgr`` (gemm_wgr.cuh; sm_90a, from ``WG_MIN_N`` = 256 columns, ``wgmma=`` overrides):
  ``wgmma`` with the weights dequantized straight into the A-operand registers, activations
  (an f32 b first rounded to f16 into a staging buffer) by the tensor copy engine. Token tile
  (128 or 256) and K split come from a stage-cost model over the waves of CTAs (``_wgr_plan``).
  On a :class:`PackedWeight` (:meth:`pack`, :meth:`pack_glu`: weights repacked tile-major once at
  load) the same kernel moves each super-stage by one bulk copy and runs at any N.
* ``gemm_f16`` (gemm.cuh; any arch): W dequantized to f16 tiles in shared memory,
  ``mma.sync.m16n8k16``; token tiles 16..128, K split across CTAs (atomics into a zeroed ``d``)
  when the tile grid cannot fill the GPU.

The int8 path (:meth:`gemm_q8`, :meth:`gemm_q8_glu`) runs Q8_1 activations against int8 quants on
``mma.sync`` s8 tensor cores with exact integer dot products per 32-block.

Every method validates its arguments before any launch; nothing here synchronises or reads device
values (graph-capturable), and nothing allocates device memory but :meth:`pack` / :meth:`pack_glu`
and the f16 staging buffer of f32 activations (one per (k, stream), regrown by a call with more rows:
run one call of each shape before capturing a graph). :meth:`gemm` and :meth:`gemm_glu` replay a
repeated call's checked launch (the last 256 distinct calls), so an eager prefill loop pays the
checks once per call site.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from cukern import runtime
from cukern.dispatch import Dispatch, bounded_put, check_array, tensor_map_2d
from cukern.dmmv import QTYPES, QWeight
from cukern.runtime import FamilySpec, KernelSpec
from cukern.streams import resolve_stream

__all__ = ["MatmulDispatch", "PackedWeight", "FAMILY", "FAMILIES", "GEMM_QTYPES", "PACKED_LAYOUTS", "q8_1_row_bytes",
           "q8_0_row_bytes"]

# weight types of the tiled GEMMs: GGML id -> short name (unit suffix)
GEMM_QTYPES = {2: "q4_0", 6: "q5_0", 8: "q8_0", 12: "q4_k", 13: "q5_k", 14: "q6_k"}
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
_W_ALIGN = {2: 2, 6: 2, 8: 2, 12: 16, 13: 16, 14: 2}  # bytes: the K4/K5 quants are read as uint4
# gemm_wgr's packed layouts (packed_wgr.cuh, MatmulDispatch.pack): GGUF type -> (bytes per row and 256
# elements, shared row stride = the tile-major row stride); kernel type code 100 + GGUF type
PACKED_LAYOUTS = {2: (272, 320), 6: (272, 320), 8: (272, 320), 12: (160, 160), 13: (288, 320), 14: (288, 320)}
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
FAMILIES = {f.name: f for f in [FAMILY] + [_gemm_unit(q) for q in GEMM_QTYPES] + [_i8_unit(q) for q in GEMM_QTYPES]}


class _Unit(Dispatch):
    """One more compilation unit of the family, launched through the same checks. ``sm90a``: on an
    sm_90 device the unit is built for sm_90a (wgmma), which CuPy's RawModule cannot be asked for."""

    def __init__(self, family: FamilySpec, device=None, sm90a: bool = False):
        self.family = family
        self.sm90a = sm90a
        self._sm90 = None
        super().__init__(device)

    def is_sm90(self) -> bool:
        if self._sm90 is None:
            with cupy.cuda.Device(self.device_id):
                self._sm90 = runtime.device_arch() == 90
        return self._sm90

    def load(self):
        if self._module is None and self.sm90a and self.is_sm90():
            with cupy.cuda.Device(self.device_id):
                self._module = runtime.load_module_sm90a(
                    self.family.name, self.family.unit_source(),
                    tuple(k.name for k in self.family.kernels), self.family.defines)
        return super().load()


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


def _extent(a) -> tuple[int, int]:
    """[first, last + 1) bytes that a 2-D row-strided view spans."""
    return a.data.ptr, a.data.ptr + (a.shape[0] - 1) * a.strides[0] + a.shape[1] * a.itemsize


def _overlap(a, b) -> bool:
    (lo1, hi1), (lo2, hi2) = _extent(a), _extent(b)
    return lo1 < hi2 and lo2 < hi1


class MatmulDispatch(Dispatch):
    """Records quantized GEMMs and quantizers into a stream. Every method takes ``stream=`` (None:
    CuPy's current stream), validates before launching, and returns its output."""

    family = FAMILY

    def __init__(self, device: int | None = None):
        super().__init__(device)
        self._units = {q: _Unit(FAMILIES[f"matmul_f16_{s}"], device, sm90a=True) for q, s in GEMM_QTYPES.items()}
        self._units_i8 = {q: _Unit(FAMILIES[f"matmul_i8_{s}"], device) for q, s in GEMM_QTYPES.items()}
        self._dmmv = None  # DmmvDispatch for the matvec path, made on first use
        self._plans: dict = {}  # _wgr_plan's choices
        self._calls: dict = {}  # checked launches of gemm / gemm_glu calls (_replay)
        self._stage: dict = {}  # (k, stream) -> f16 staging buffer of f32 activations for gemm_wgr (_as_f16)

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _weight(name: str, w) -> QWeight:
        if not isinstance(w, QWeight):
            raise TypeError(f"{name} must be a cukern.dmmv.QWeight (raw GGUF bytes + type + shape), "
                            f"got {type(w).__name__}")
        if w.n_experts:
            raise ValueError(f"{name} is an expert tensor; the tiled GEMM takes one matrix")
        if w.qtype not in GEMM_QTYPES:
            raise ValueError(f"{name}: weight type {QTYPES[w.qtype][0]} has no tiled GEMM "
                             f"(supported: {', '.join(s.upper() for s in GEMM_QTYPES.values())})")
        align = _W_ALIGN[w.qtype]
        if (w.buf.data.ptr + w.offset) % align:
            raise ValueError(f"{name}: {QTYPES[w.qtype][0]} data must start {align}-byte aligned for the "
                             f"tiled GEMM (offset {w.offset} into a buffer at {w.buf.data.ptr:#x})")
        return w

    @staticmethod
    def _aligned16(name: str, a, stride: int) -> None:
        if a.data.ptr % 16 or (stride * a.itemsize) % 16:
            raise ValueError(f"{name} rows must start 16-byte aligned (pointer {a.data.ptr:#x}, "
                             f"row stride {stride * a.itemsize} bytes)")

    # ------------------------------------------------------------------ path choice
    @staticmethod
    def plan_path(qtype: int, n: int, *, q8_1: bool = False) -> str:
        """The path for N = ``n`` token columns of a weight of type ``qtype`` (measurements:
        docs/notes/matmul.md): ``"matvec"`` when ``n <= MATVEC_MAX_N``, ``"int8"``
        when the activations are already Q8_1 (``q8_1``), else ``"f16"``. ``qtype`` is kept
        for type-dependent thresholds (none measured so far)."""
        if n <= MatmulDispatch.MATVEC_MAX_N:
            return "matvec"
        return "int8" if q8_1 else "f16"

    MATVEC_MAX_N = 8  # at or below: DmmvDispatch.dmmv (one launch of 1..8 columns)

    def matmul(self, w: QWeight, b: cupy.ndarray, d: cupy.ndarray, *, accumulate: bool = False,
               path: str | None = None, stream=None) -> cupy.ndarray:
        """``d = W b`` (``d += W b`` with ``accumulate``) by the path :meth:`plan_path` picks, or
        by ``path`` (``"matvec"``, ``"f16"``, ``"int8"``). b: [n, k] f32 or f16 activations, or
        uint8 Q8_1 rows [n, k / 32 * 36] (int8 path only); d: [n, m] f32. The matvec path takes
        f32 C-contiguous activations (``DmmvDispatch.dmmv``)."""
        w = self._weight("w", w)
        check_array("b", b, ndim=2, contiguous=False)
        q8 = b.dtype == _U8
        chosen = path if path is not None else self.plan_path(w.qtype, b.shape[0], q8_1=q8)
        if chosen == "int8":
            if not q8:
                raise ValueError("the int8 path takes Q8_1 activations (uint8 rows): quantize_q8_1 first")
            return self.gemm_q8(w, b, d, accumulate=accumulate, stream=stream)
        if q8:
            raise ValueError(f"Q8_1 activations go through the int8 path, not {chosen!r}")
        if chosen == "f16":
            return self.gemm(w, b, d, accumulate=accumulate, stream=stream)
        if chosen == "matvec":
            if self._dmmv is None:
                from cukern.dmmv import DmmvDispatch
                self._dmmv = DmmvDispatch(self._device)
            return self._dmmv.dmmv(w, b, d, accumulate=accumulate, stream=stream)
        raise ValueError(f"path must be 'matvec', 'f16' or 'int8', got {chosen!r}")

    def _tile(self, n: int) -> int:
        for bt in _TOKEN_TILES:
            if n <= bt:
                return bt
        return _TOKEN_TILES[-1]

    def _split(self, ctas: int, k: int) -> int:
        """K slices so that about two waves of CTAs run: 1 when the tile grid already fills the GPU."""
        target = 2 * self.sm_count()
        if ctas >= target:
            return 1
        return max(1, min(-(-target // ctas), k // 512, 16))  # slices of >= 512 elements

    # ------------------------------------------------------------------ GEMMs
    def _glu_pair(self, w_gate: QWeight, w_up: QWeight) -> tuple[QWeight, QWeight]:
        """Validate the gate/up pair of the fused GLU GEMMs (and of pack_glu): same type and shape."""
        w_gate = self._weight("w_gate", w_gate)
        w_up = self._weight("w_up", w_up)
        if (w_up.qtype, w_up.m, w_up.k) != (w_gate.qtype, w_gate.m, w_gate.k):
            raise ValueError(f"w_gate and w_up must have the same type and shape, got "
                             f"{w_gate.name} {w_gate.m}x{w_gate.k} and {w_up.name} {w_up.m}x{w_up.k}")
        if w_up.row_stride != w_gate.row_stride:
            raise ValueError(f"w_gate and w_up must have the same row_stride (the kernels take one), got "
                             f"{w_gate.row_stride} and {w_up.row_stride}")
        return w_gate, w_up

    def _glu_weights(self, w_gate: QWeight, w_up: QWeight, act: str) -> tuple[QWeight, QWeight]:
        """Validate the gate/up pair of the fused GLU GEMMs and ``act``."""
        w_gate, w_up = self._glu_pair(w_gate, w_up)
        _check_act(act)
        return w_gate, w_up

    def _float_activations(self, b: cupy.ndarray, d: cupy.ndarray, w: QWeight) -> tuple[int, int, int]:
        """Validate the f32/f16 operands of the f16-mma GEMMs: b [n, k] (rows 16-byte aligned),
        d [n, m] f32, not overlapping. Returns (n, b_stride, d_stride)."""
        b_stride = _cols("b", b, tuple(_B_TYPES), w.k)
        n = b.shape[0]
        d_stride = _cols("d", d, _F32, w.m)
        if d.shape[0] != n:
            raise ValueError(f"d must be [{n}, {w.m}] (one row per column of b), got shape {d.shape}")
        self._aligned16("b", b, b_stride)
        if _overlap(b, d):
            raise ValueError("b and d must not overlap")
        return n, b_stride, d_stride

    def gemm(self, w: QWeight | PackedWeight, b: cupy.ndarray, d: cupy.ndarray, *, accumulate: bool = False,
             split_k: int | None = None, wgmma: bool | None = None, stream=None) -> cupy.ndarray:
        """``d = b W^T`` (each token column: ``d[c] = W b[c]``); ``accumulate``: ``d += b W^T``.

        w: QWeight [m, k] of Q4_0, Q5_0, Q8_0, Q4_K, Q5_K or Q6_K, or a PackedWeight (:meth:`pack`;
        gemm_wgr at every n, sm_90 only: ValueError elsewhere or with wgmma=False); b: [n, k] f32 or f16, rows
        16-byte aligned; d: [n, m] f32 (row-strided views allowed, must not overlap b).
        ``split_k``: K slices (None: chosen from the grid size; 1: no split). A split adds partial
        sums with atomics (float addition order then varies from run to run). ``wgmma``: None
        picks the kernel (gemm_wgr on sm_90 for n >= WG_MIN_N, an f32 b rounded to f16 into the
        dispatch's staging buffer first; else gemm_f16); True forces gemm_wgr (ValueError where it
        cannot run), False gemm_f16."""
        key = self._call_key(w, w, b, d, accumulate, split_k, wgmma, None, stream)
        if self._replay(key, b, d, stream):
            return d
        if isinstance(w, PackedWeight):  # gemm_wgr on the packed layout, whatever n
            self._packed_ok(w, wgmma, False)
            n, _, d_stride = self._float_activations(b, d, w)
            return self._remember(key, self._hopper(w, w, b, d, d_stride, n, accumulate, split_k, None, stream), d)
        w = self._weight("w", w)
        n, b_stride, d_stride = self._float_activations(b, d, w)
        if self._use_wg(w, w, n, wgmma):
            return self._remember(key, self._hopper(w, w, b, d, d_stride, n, accumulate, split_k, None, stream), d)
        bt, grid, k_split = self._grid(n, w, split_k, "gemm")
        params = self.struct_of(w.qtype).pack(
            w_offset=w.offset, w2_offset=0, row_bytes=w.row_stride, b_stride=b_stride, d_stride=d_stride,
            m=w.m, n=n, k=w.k, k_split=k_split, mode=1 if accumulate else 0, atomic=int(grid[2] > 1),
            raw16=_raw16(w), d_tma=0)
        name = f"gemm_f16<{w.qtype}, {bt}, false, {_B_TYPES[b.dtype]}>"
        zero = self._zero_for_split(d, grid, accumulate, stream)
        launch = self._units[w.qtype]._launch(name, grid, _THREADS, (d, w.buf, w.buf, b), params,
                                              stream=stream, shared_mem=_smem(bt, b.itemsize, w.qtype))
        return self._remember(key, (zero, launch, None), d)

    # ------------------------------------------------------------------ repeated calls
    # A prefill loop issues the same GEMMs (same weights, activation and output buffers) layer after
    # layer; validation, planning and packing them again can cost more host time than the product
    # takes (a 4096x4096 N = 512 one: ~40 us). gemm and gemm_glu therefore keep each call's checked launch,
    # keyed by everything the checks and the plan read (pointers, shapes, strides, dtypes, options),
    # and replay it when the same call comes again. A kept launch holds bare pointers, not arrays.
    _REPLAYS = 256  # calls remembered per dispatch

    def _call_key(self, w, w2, b, d, accumulate, split_k, wgmma, act, stream):
        """The key of a gemm / gemm_glu call, or None when an argument is not what the checks take
        (the call then goes through them and raises)."""
        try:
            key = (w.buf.data.ptr, w.offset, w.qtype, w.m, w.k, w.n_experts, w.row_stride, getattr(w, "glu", False),
                   w2.buf.data.ptr, w2.offset, w2.qtype, w2.m, w2.k, w2.n_experts, w2.row_stride,
                   b.data.ptr, b.shape, b.strides, b.dtype.char, d.data.ptr, d.shape, d.strides, d.dtype.char, accumulate, split_k, wgmma, act,
                   self.WG_TILE, self.WG_MIN_N,
                   resolve_stream(stream).ptr if b.dtype.char == "f" else None)  # f32 b: staged per stream
            hash(key)
        except (AttributeError, TypeError):
            return None
        return key if type(w) in (QWeight, PackedWeight) and type(w2) is type(w) and type(b) is cupy.ndarray \
            and type(d) is cupy.ndarray else None

    def _replay(self, key, b, d, stream) -> bool:
        rec = self._calls.get(key) if key is not None else None
        if rec is None:
            return False
        zero, launch, stage = rec
        if stage is not None:
            self._convert(b, stage, stream)
        if zero:
            self._zero(d, stream)
        Dispatch.relaunch(launch, stream)
        return True

    def _remember(self, key, rec: tuple, d):
        """Keep (zero d first, launch, staging view) for key: the launch detached (pointers only),
        so the cache holds none of the caller's arrays."""
        if key is not None:
            zero, launch, stage = rec
            bounded_put(self._calls, key, (zero, Dispatch.detach(launch), stage), self._REPLAYS)
        return d

    WG_MIN_N = 256  # gemm_wgr from this many columns (sm_90; f16 b, or f32 b through the staging buffer)

    def _use_wg(self, w: QWeight, w2: QWeight, n: int, wgmma) -> bool:
        """Whether a GGUF-byte gemm / gemm_glu runs on gemm_wgr: forced by ``wgmma``, else from WG_MIN_N
        columns on sm_90 where every weight row is 16-byte aligned. Rows that are not (k = 640 in Q5_0 or
        Q8_0: 440 or 680 bytes) reach shared memory by 2-byte copies, which gemm_wgr's three producer warps
        issue far slower than gemm_f16's whole CTA (docs/notes/matmul.md)."""
        if wgmma is not None and not isinstance(wgmma, bool):
            raise TypeError(f"wgmma must be None, True or False, got {wgmma!r}")
        if wgmma is False or (wgmma is None and (n < self.WG_MIN_N or not _raw16(w, w2))):
            return False
        ok = self._units[w.qtype].is_sm90()
        if wgmma and not ok:
            raise ValueError("wgmma=True needs an sm_90 (Hopper) device")
        return ok

    def _as_f16(self, b: cupy.ndarray, stream) -> tuple[cupy.ndarray, cupy.ndarray | None]:
        """(b as gemm_wgr reads it, the staging view or None): an f16 b itself; an f32 b converted
        (rounded to nearest) into rows of the dispatch's staging buffer for its k and stream, which
        the first such call allocates and a call with more rows regrows (dropping the kept replays,
        whose pointers it invalidates)."""
        if b.dtype == np.float16:
            return b, None
        n, k = b.shape
        key = (k, resolve_stream(stream).ptr)
        buf = self._stage.get(key)
        if buf is None or buf.shape[0] < n:
            with cupy.cuda.Device(self.device_id):  # rows in steps of 256: fewer regrows as n varies
                buf = self._stage[key] = cupy.empty((-(-n // 256) * 256, k), cupy.float16)
            self._calls.clear()
        view = buf[:n]
        self._convert(b, view, stream)
        return view, view

    @staticmethod
    def _convert(b, view, stream) -> None:
        with resolve_stream(stream):
            view[...] = b  # an elementwise cast on the launch stream

    # gemm_wgr's time per 64-element stage at 128 tokens relative to 256 (the dequantization per stage
    # is the same, the MMAs half), and a CTA's fixed cost (pipeline fill, epilogue) and a K split's (the
    # memset of d, the atomics), in 256-token stages. Example, 4096x4096 N = 512 on 132 SMs (32 row
    # tiles, 64 stages): 256 tokens x 2 slices = 64 CTAs x 32 stages, one wave: 32 + 4 + 6 = 42; 128
    # tokens unsplit = 128 CTAs x 64 stages, one wave: 64 * 0.69 + 4 = 48.2; so 256 x 2 slices.
    _WGR_STAGE_COST = {128: 0.69, 256: 1.0}
    _WGR_CTA_COST, _WGR_SPLIT_COST = 4.0, 6.0

    def _wgr_plan(self, n: int, row_tiles: int, k: int, splittable: bool, tiles=_WG_TILES) -> tuple[int, int]:
        """(token tile, K slices) of gemm_wgr: the fewest modelled stage-times over the waves of CTAs
        (one CTA per SM), over the tiles and 1-16 slices of whole super-stages."""
        key = (n, row_tiles, k, splittable, tuple(tiles))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._wgr_plan_uncached(n, row_tiles, k, splittable, tiles)
        return plan

    def _wgr_plan_uncached(self, n, row_tiles, k, splittable, tiles) -> tuple[int, int]:
        sm, best = self.sm_count(), None
        for bt in sorted(tiles, reverse=True):
            ctas = -(-n // bt) * row_tiles
            for split in range(1, 17 if splittable else 2):
                k_split = _k_slice(k, split)
                slices = -(-k // k_split)
                if split > 1 and slices < split:
                    break
                cost = (-(-ctas * slices // sm) * (k_split / _BK * self._WGR_STAGE_COST[bt] + self._WGR_CTA_COST)
                        + (self._WGR_SPLIT_COST if slices > 1 else 0.0))
                if best is None or cost < best[0]:
                    best = (cost, bt, slices)
        return best[1], best[2]

    WG_TILE = None  # force gemm_wgr's token tile (128 or 256); None: chosen per call (_wgr_plan)

    def _hopper(self, w, w2, b, d, d_stride, n, accumulate, split_k, act, stream) -> tuple:
        """gemm_wgr launch: ``act`` None (d = W b, or += with accumulate) or a GLU activation.
        Returns (d zeroed first, the launch, the staging view of an f32 b or None)."""
        b, stage = self._as_f16(b, stream)
        b_stride = b.strides[0] // 2
        glu = act is not None
        packed = isinstance(w, PackedWeight)
        rows = _ROW_TILE_GLU if glu else _ROW_TILE
        grid_r = -(-w.m // rows)
        split_k = _split_arg(split_k)
        bt, split = self._wgr_plan(n, grid_r, w.k, not glu and split_k is None,
                                   (self.WG_TILE,) if self.WG_TILE else _WG_TILES)
        if split_k is not None and not glu:
            split = split_k
        grid_t = -(-n // bt)
        if grid_t > 2**31 - 1 or grid_r > 65535:
            raise ValueError(f"gemm_wgr: {n} columns x {w.m} rows exceed the grid limits")
        k_split = _k_slice(w.k, split)
        grid = (grid_t, grid_r, -(-w.k // k_split))
        mode = _ACTS[act] if glu else (1 if accumulate else 0)
        # d by tensor stores where the copy engine can address it (base and row stride 16-byte aligned)
        d_map = tensor_map_2d(d, (_D_BOX, bt)) if d.data.ptr % 16 == 0 and (n == 1 or d.strides[0] % 16 == 0) \
            else None
        params = self.struct_of(w.qtype).pack(
            w_offset=w.offset, w2_offset=w2.offset if glu else 0, row_bytes=w.row_stride, b_stride=b_stride,
            d_stride=d_stride, m=w.m, n=n, k=w.k, k_split=k_split, mode=mode, atomic=int(grid[2] > 1),
            raw16=1 if packed else _raw16(w, w2), d_tma=int(d_map is not None))
        tmap = tensor_map_2d(b, (_BK, bt))
        zero = self._zero_for_split(d, grid, accumulate, stream)
        code = w.code if packed else w.qtype
        launch = self._units[w.qtype]._launch(f"gemm_wgr<{code}, {bt}, {'true' if glu else 'false'}>", grid,
                                              _WGR_THREADS, (d, w.buf, w2.buf, tmap, tmap if d_map is None else d_map),
                                              params, stream=stream, shared_mem=_smem_wgr(bt, w.qtype, packed))
        return zero, launch, stage

    def _grid(self, n: int, w: QWeight, split_k, what: str, max_tile: int = _TOKEN_TILES[-1], unit: int = _SUPER):
        """(token tile, grid (token tiles, row tiles, K slices), K elements per slice)."""
        bt = min(self._tile(n), max_tile)
        grid_t, grid_r = -(-n // bt), -(-w.m // _ROW_TILE)
        if grid_t > 2**31 - 1 or grid_r > 65535:
            raise ValueError(f"{what}: {n} columns x {w.m} rows exceed the grid limits")
        split = _split_arg(split_k)
        if split is None:
            split = self._split(grid_t * grid_r, w.k)
        k_split = _k_slice(w.k, split, unit)
        return bt, (grid_t, grid_r, -(-w.k // k_split)), k_split

    @staticmethod
    def _zero_for_split(d, grid, accumulate: bool, stream) -> bool:
        """Zero d on the launch stream when K slices will add into it with atomics; returns whether."""
        if grid[2] == 1 or accumulate:
            return False
        MatmulDispatch._zero(d, stream)
        return True

    @staticmethod
    def _zero(d, stream) -> None:
        with resolve_stream(stream) as s:
            if d.flags.c_contiguous:  # a memset node (a few us less host time than a kernel launch)
                cupy.cuda.runtime.memsetAsync(d.data.ptr, 0, d.nbytes, s.ptr)
            else:
                d.fill(0)  # an elementwise kernel on the launch stream: no allocation, capturable

    def gemm_q8(self, w: QWeight, a: cupy.ndarray, d: cupy.ndarray, *, accumulate: bool = False,
                split_k: int | None = None, stream=None) -> cupy.ndarray:
        """``d = W a`` on int8 tensor cores, a holding Q8_1 activations (:meth:`quantize_q8_1`, or
        ``ElementwiseDispatch.residual_rms_norm_q8_1``); ``accumulate``: ``d += W a``.

        w: QWeight [m, k] (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K); a: uint8 [n, k / 32 * 36] Q8_1
        rows (a row-strided view is fine; rows 4-byte aligned); d: [n, m] f32. Per 32-element
        block the integer dot product is exact; scales apply in f32. ``split_k`` as :meth:`gemm`."""
        w = self._weight("w", w)
        n, a_stride = self._q8_act(a, w.k)
        d_stride = _cols("d", d, _F32, w.m)
        if d.shape[0] != n:
            raise ValueError(f"d must be [{n}, {w.m}] (one row per row of a), got shape {d.shape}")
        if _overlap(a, d):
            raise ValueError("a and d must not overlap")
        bt, grid, k_split = self._grid(n, w, split_k, "gemm_q8", _I8_MAX_TILE)
        params = self.struct_of(w.qtype).pack(
            w_offset=w.offset, w2_offset=0, row_bytes=w.row_stride, b_stride=a_stride, d_stride=d_stride,
            m=w.m, n=n, k=w.k, k_split=k_split, mode=1 if accumulate else 0, atomic=int(grid[2] > 1), raw16=_raw16(w),
            d_tma=0)
        self._zero_for_split(d, grid, accumulate, stream)
        self._units_i8[w.qtype]._launch(f"gemm_q8<{w.qtype}, {bt}, 0>", grid, _THREADS, (d, w.buf, w.buf, a), params,
                                        stream=stream, shared_mem=_smem_q8(bt, w.qtype))
        return d

    def _q8_act(self, a, k: int) -> tuple[int, int]:
        """Validate Q8_1 activations [n, k / 32 * 36]; returns (n, row stride in bytes)."""
        nb = k // 32 * Q8_1_BYTES
        check_array("a", a, dtype=_U8, ndim=2, contiguous=False)
        n = a.shape[0]
        if n < 1:
            raise ValueError(f"a must have at least one column (token), got shape {a.shape}")
        if a.shape[1] != nb or a.strides[1] != 1 or (n > 1 and a.strides[0] < nb):
            raise ValueError(f"a must be uint8 [n, {nb}] (Q8_1 rows of k = {k}) with contiguous rows, "
                             f"got shape {a.shape} strides {a.strides}")
        a_stride = a.strides[0] if n > 1 else nb
        if a.data.ptr % 4 or a_stride % 4:
            raise ValueError("a rows must start 4-byte aligned")
        return n, a_stride

    def gemm_q8_glu(self, w_gate: QWeight, w_up: QWeight, a: cupy.ndarray, out: cupy.ndarray, *,
                    act: str = "swiglu", out_format: str = "f32", stream=None) -> cupy.ndarray:
        """``h[c] = act(W_gate a[c]) * (W_up a[c])`` on int8 tensor cores, a holding Q8_1 rows; the
        two products never leave the CTA. ``out_format``: ``"f32"`` (out: f32 [n, m]), ``"q8_1"``
        (out: uint8 [n, m / 32 * 36], the input of the next :meth:`gemm_q8`) or ``"q8_0"``
        (out: uint8 [n, m / 32 * 34]); the Q8 forms need m % 32 == 0 and quantize exactly as
        :meth:`quantize_q8_1` / :meth:`quantize_q8_0` would quantize the f32 h."""
        w_gate, w_up = self._glu_weights(w_gate, w_up, act)
        epi = {"f32": 1, "q8_1": 2, "q8_0": 3}.get(out_format)
        if epi is None:
            raise ValueError(f"out_format must be 'f32', 'q8_1' or 'q8_0', got {out_format!r}")
        m = w_gate.m
        n, a_stride = self._q8_act(a, w_gate.k)
        if epi == 1:
            out_stride = _cols("out", out, _F32, m)
        else:
            if m % 32:
                raise ValueError(f"{out_format} output needs m % 32 == 0, got m = {m}")
            nb = m // 32 * (Q8_1_BYTES if epi == 2 else Q8_0_BYTES)
            check_array("out", out, dtype=_U8, ndim=2, contiguous=False)
            if out.shape[1:] != (nb,) or out.strides[1] != 1 or (out.shape[0] > 1 and out.strides[0] < nb):
                raise ValueError(f"out must be uint8 [n, {nb}] ({out_format} rows of m = {m}) with contiguous "
                                 f"rows, got shape {out.shape} strides {out.strides}")
            out_stride = out.strides[0] if out.shape[0] > 1 else nb
            align = 4 if epi == 2 else 2
            if out.data.ptr % align or out_stride % align:
                raise ValueError(f"out rows must start {align}-byte aligned")
        if out.shape[0] != n:
            raise ValueError(f"out must have one row per row of a ({n}), got shape {out.shape}")
        if _overlap(a, out):
            raise ValueError("a and out must not overlap")
        bt = min(self._tile(n), _I8_MAX_TILE)
        grid = (-(-n // bt), -(-m // _ROW_TILE_GLU), 1)
        if grid[0] > 2**31 - 1 or grid[1] > 65535:
            raise ValueError(f"gemm_q8_glu: {n} columns x {m} rows exceed the grid limits")
        params = self.struct_of(w_gate.qtype).pack(
            w_offset=w_gate.offset, w2_offset=w_up.offset, row_bytes=w_gate.row_stride, b_stride=a_stride,
            d_stride=out_stride, m=m, n=n, k=w_gate.k, k_split=w_gate.k, mode=_ACTS[act], atomic=0,
            raw16=_raw16(w_gate, w_up), d_tma=0)
        self._units_i8[w_gate.qtype]._launch(f"gemm_q8<{w_gate.qtype}, {bt}, {epi}>", grid, _THREADS,
                                             (out, w_gate.buf, w_up.buf, a), params, stream=stream,
                                             shared_mem=_smem_q8(bt, w_gate.qtype))
        return out

    def gemm_glu(self, w_gate: QWeight | PackedWeight, w_up: QWeight | None, b: cupy.ndarray, d: cupy.ndarray, *,
                 act: str = "swiglu", wgmma: bool | None = None, stream=None) -> cupy.ndarray:
        """``d[c] = act(W_gate b[c]) * (W_up b[c])``: the fused gate+up GEMM of a gated MLP; the
        two products never leave registers. act: ``"swiglu"`` (SiLU gate) or ``"geglu"`` (GELU-tanh).

        w_gate, w_up: QWeight [m, k] of the same type, or w_gate a PackedWeight of both (:meth:`pack_glu`;
        gemm_wgr, sm_90 only) and w_up None; b: [n, k] f32 or f16; d: [n, m] f32.
        ``wgmma`` as in :meth:`gemm`."""
        key = self._call_key(w_gate, w_gate if w_up is None else w_up, b, d, False, None, wgmma, act, stream)
        if self._replay(key, b, d, stream):
            return d
        if isinstance(w_gate, PackedWeight):
            if w_up is not None:
                raise TypeError("gemm_glu on a PackedWeight: w_up must be None (pack_glu packs both matrices)")
            self._packed_ok(w_gate, wgmma, True)
            _check_act(act)
            n, _, d_stride = self._float_activations(b, d, w_gate)
            return self._remember(key, self._hopper(w_gate, w_gate, b, d, d_stride, n, False, None, act, stream), d)
        w_gate, w_up = self._glu_weights(w_gate, w_up, act)
        n, b_stride, d_stride = self._float_activations(b, d, w_gate)
        if self._use_wg(w_gate, w_up, n, wgmma):
            return self._remember(key, self._hopper(w_gate, w_up, b, d, d_stride, n, False, None, act, stream), d)
        bt = self._tile(n)
        grid_t, grid_r = -(-n // bt), -(-w_gate.m // _ROW_TILE_GLU)
        if grid_t > 2**31 - 1 or grid_r > 65535:
            raise ValueError(f"gemm_glu: {n} columns x {w_gate.m} rows exceed the grid limits")
        params = self.struct_of(w_gate.qtype).pack(
            w_offset=w_gate.offset, w2_offset=w_up.offset, row_bytes=w_gate.row_stride, b_stride=b_stride,
            d_stride=d_stride, m=w_gate.m, n=n, k=w_gate.k, k_split=w_gate.k, mode=_ACTS[act], atomic=0,
            raw16=_raw16(w_gate, w_up), d_tma=0)
        name = f"gemm_f16<{w_gate.qtype}, {bt}, true, {_B_TYPES[b.dtype]}>"
        launch = self._units[w_gate.qtype]._launch(name, (grid_t, grid_r, 1), _THREADS,
                                                   (d, w_gate.buf, w_up.buf, b), params, stream=stream,
                                                   shared_mem=_smem(bt, b.itemsize, w_gate.qtype))
        return self._remember(key, (False, launch, None), d)

    def _packed_ok(self, w: PackedWeight, wgmma, glu: bool) -> None:
        """A PackedWeight's call: on Hopper (gemm_wgr), through the entry of its kind (gemm or gemm_glu)."""
        if w.glu != glu:
            raise TypeError("a PackedWeight from pack_glu goes through gemm_glu, one from pack through gemm")
        if wgmma is False or not self._units[w.qtype].is_sm90():
            raise ValueError("a PackedWeight runs on gemm_wgr only: an sm_90 (Hopper) device, wgmma not False")

    def struct_of(self, qtype: int):
        return self._units[qtype].struct("GemmParams")

    def packable(self, w: QWeight) -> bool:
        """Whether :meth:`pack` takes ``w`` here: a tiled-GEMM type (each has a packed layout), k a multiple of
        256, and a device that runs gemm_wgr (sm_90)."""
        return w.qtype in PACKED_LAYOUTS and w.k % _SUPER == 0 and self._units[w.qtype].is_sm90()

    def pad_rows(self, w: QWeight, *, stream=None) -> QWeight:
        """A copy of ``w`` whose rows start 16 bytes apart (``row_stride``: the row's bytes rounded up to 16,
        the gap zero), made once on the device at load, like :meth:`pack`: the tiled GEMMs copy such rows to
        shared memory 16 bytes at a time (and take gemm_wgr from WG_MIN_N columns), where rows of other
        lengths (k = 640: Q5_0 440 bytes, Q8_0 680) go 2 bytes at a time. For :meth:`gemm`, :meth:`gemm_glu`
        and the int8 GEMMs; the matvecs take the GGUF bytes. ``w`` itself where its rows are aligned."""
        w = self._weight("w", w)
        stride = -(-w.row_bytes // 16) * 16
        if _raw16(w) and w.row_stride == stride:
            return w
        with cupy.cuda.Device(self.device_id):
            out = cupy.zeros((w.m, stride), cupy.uint8)
        src = cupy.lib.stride_tricks.as_strided(w.buf[w.offset:], (w.m, w.row_bytes), (w.row_stride, 1))
        self._copy_rows(out[:, :w.row_bytes], src, stream)
        return QWeight(out.reshape(-1), w.qtype, w.m, w.k, row_stride=stride)

    @staticmethod
    def _copy_rows(dst: cupy.ndarray, src: cupy.ndarray, stream) -> None:
        with resolve_stream(stream):
            dst[...] = src

    def pack(self, w: QWeight, *, stream=None) -> PackedWeight:
        """``w`` repacked into gemm_wgr's layout (:class:`PackedWeight`), on the device: a one-time step at
        load for the prefill GEMMs, which then run 1.05-1.6x as fast as dequantize + cuBLAS at N >= 512
        (docs/notes/matmul.md). A PackedWeight goes through :meth:`gemm` only (not :meth:`matmul`
        or the matvec path, which take the QWeight). Every type of the tiled GEMM, with k a multiple of 256;
        the packed bytes are 5 (Q4_K) to 10 (the byte layouts) bits a weight."""
        w = self._weight("w", w)
        return self._pack(w, w, False, stream)

    def pack_glu(self, w_gate: QWeight, w_up: QWeight, *, stream=None) -> PackedWeight:
        """The gate and up matrices of a gated MLP packed together (``PackedWeight.glu``: each 128-row tile
        holds 64 rows of each, as gemm_wgr's fused GLU reads them), for :meth:`gemm_glu`. Types and shapes
        as :meth:`pack`, the two matrices alike."""
        w_gate, w_up = self._glu_pair(w_gate, w_up)
        return self._pack(w_gate, w_up, True, stream)

    def _pack(self, w: QWeight, w2: QWeight, glu: bool, stream) -> PackedWeight:
        if w.k % _SUPER:  # (every type of the tiled GEMM has a packed layout: _weight checked it)
            raise ValueError(f"pack: k={w.k} must be a multiple of {_SUPER} (whole super-blocks)")
        tiles, supers = -(-w.m // (_ROW_TILE_GLU if glu else _ROW_TILE)), w.k // _SUPER
        if supers > 65535:
            raise ValueError(f"pack: k={w.k} exceeds the grid limit ({65535 * _SUPER})")
        unit = self._units[w.qtype]
        with cupy.cuda.Device(self.device_id):
            out = cupy.empty(PackedWeight.nbytes_for(w.m, w.k, w.qtype, glu), cupy.uint8)
        params = unit.struct("PackParams").pack(w_offset=w.offset, w2_offset=w2.offset, row_bytes=w.row_stride,
                                                m=w.m, k=w.k, glu=int(glu))
        unit._launch(f"pack_wgr<{w.qtype}>", (tiles, supers, 1), _ROW_TILE, (out, w.buf, w2.buf), params,
                     stream=stream)
        return PackedWeight(out, w.qtype, w.m, w.k, glu=glu)

    # ------------------------------------------------------------------ quantizers
    def _quantize(self, fmt: int, x, q, stream):
        what = "quantize_q8_1" if fmt == 0 else "quantize_q8_0"
        check_array("x", x, dtype=_F32, ndim=2, contiguous=False)
        n_rows, n_cols = x.shape
        if n_rows < 1 or n_cols < 1 or n_cols % 32:
            raise ValueError(f"{what}: x must be [n_rows >= 1, n_cols] with n_cols a positive multiple of 32, "
                             f"got shape {x.shape}")
        if x.strides[1] != 4 or x.strides[0] % 16 or x.data.ptr % 16 or (n_rows > 1 and x.strides[0] < 4 * n_cols):
            raise ValueError(f"{what}: x rows must be contiguous and 16-byte aligned, got strides {x.strides}")
        nb = (Q8_1_BYTES if fmt == 0 else Q8_0_BYTES) * (n_cols // 32)
        check_array("q", q, dtype=_U8, ndim=2, contiguous=False)
        if q.shape != (n_rows, nb) or q.strides[1] != 1 or (n_rows > 1 and q.strides[0] < nb):
            raise ValueError(f"{what}: q must be uint8 [{n_rows}, {nb}] with contiguous rows, got shape "
                             f"{q.shape} strides {q.strides}")
        align = 4 if fmt == 0 else 2
        if q.data.ptr % align or q.strides[0] % align:
            raise ValueError(f"{what}: q rows must start {align}-byte aligned")
        if _overlap(x, q):
            raise ValueError(f"{what}: x and q must not overlap")
        params = self.struct("QuantizeParams").pack(
            x_stride=x.strides[0] // 4 if n_rows > 1 else n_cols, q_stride=q.strides[0] if n_rows > 1 else nb,
            n_rows=n_rows, n_cols=n_cols)
        blocks = max(1, min(-(-(n_rows * n_cols // 4) // _Q_THREADS), _MAX_BLOCKS))
        self._launch(f"quantize_q8<{fmt}>", blocks, _Q_THREADS, (q, x), params, stream=stream)
        return q

    def quantize_q8_1(self, x: cupy.ndarray, q: cupy.ndarray, *, stream=None) -> cupy.ndarray:
        """Quantize the rows of x (f32 [n_rows, n_cols], n_cols % 32 == 0) to Q8_1 blocks
        (``cuda_src/common/q8_1.cuh``) in q: uint8 [n_rows, n_cols / 32 * 36]. One pass."""
        return self._quantize(0, x, q, stream)

    def quantize_q8_0(self, x: cupy.ndarray, q: cupy.ndarray, *, stream=None) -> cupy.ndarray:
        """Quantize the rows of x to GGUF Q8_0 blocks (half d = absmax / 127, 32 int8 rounded half
        away from zero) in q: uint8 [n_rows, n_cols / 32 * 34]. One pass."""
        return self._quantize(1, x, q, stream)

    def dequantize(self, w: QWeight, out: cupy.ndarray, *, stream=None) -> cupy.ndarray:
        """``out = W`` as f16 [m, k] (C-contiguous, 16-byte aligned): what a dequantize + cuBLAS
        pipeline runs first."""
        w = self._weight("w", w)
        check_array("out", out, dtype=np.float16, shape=(w.m, w.k), align=16)
        params = self.struct("DequantParams").pack(w_offset=w.offset, row_bytes=w.row_stride, m=w.m, k=w.k)
        units = w.m * (w.k // 32) * 2
        blocks = max(1, min(-(-units // _Q_THREADS), 4 * _MAX_BLOCKS))
        self._launch(f"dequantize_f16<{w.qtype}>", blocks, _Q_THREADS, (out, w.buf), params, stream=stream)
        return out

