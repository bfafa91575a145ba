"""MatmulDispatch: validation, the path rule, gemm_f16 and the fused GLU, replayed launches; the
gemm_wgr and int8 methods come from the :mod:`cukern.matmul.wgr` and :mod:`cukern.matmul.int8` mixins.
"""

from __future__ import annotations

import math

import cupy
import numpy as np

from cukern.dispatch import Dispatch, Unit, bounded_put, check_array
from cukern.dmmv import QTYPES, QWeight
from cukern.interop import like, tensors
from cukern.matmul.common import (FAMILIES, FAMILY, GEMM_QTYPES, _ACTS, _B_TYPES, _F32, _ROW_TILE, _ROW_TILE_GLU,
                                  _SUPER, _THREADS, _TOKEN_TILES, _U8, _W_ALIGN, PackedWeight, _check_act, _cols,
                                  _d_shape, _k_slice, _overlap, _raw16, _smem,
                                  _split_arg)
from cukern.matmul.int8 import Int8
from cukern.matmul.moe import MoeGemm
from cukern.matmul.wgr import Wgr
from cukern.streams import resolve_stream


class MatmulDispatch(Wgr, Int8, MoeGemm, Dispatch):
    """Records quantized GEMMs and quantizers into a stream. Every method takes ``stream=`` (None:
    CuPy's current stream), validates before launching, and returns its output."""

    family = FAMILY

    def __init__(self, device: int | None = None):
        super().__init__(device)
        self._units = {q: Unit(FAMILIES[f"matmul_f16_{s}"], device, sm90a=True) for q, s in GEMM_QTYPES.items()}
        self._units_i8 = {q: Unit(FAMILIES[f"matmul_i8_{s}"], device) for q, s in GEMM_QTYPES.items()}
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

    @tensors(d=like("b", shape=_d_shape("w"), dtype=np.float32))
    def matmul(self, w: QWeight, b: cupy.ndarray, d: cupy.ndarray | None = None, *, accumulate: bool = False,
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

    # A gemm_f16 grid below this many CTAs per SM (a prompt chunk of ~128 tokens against a few hundred rows: a
    # handful of CTAs, each a long serial K loop while the other SMs idle) takes smaller token tiles and K slices
    # of one raw super-stage until it reaches it (the fastest tile and split measured per shape: notes/matmul.md).
    _FILL = 0.6

    def _fill(self, n: int, grid_r: int, bt: int, k: int, unit: int, split_ok: bool = True) -> tuple[int, int]:
        """(token tile, K slices) of a small gemm_f16 grid: the largest token tile up to ``bt`` whose CTAs, times
        the K slices of ``unit`` elements k allows (at most 16; none where not ``split_ok``), reach
        ``_FILL`` per SM, with only as many slices as that needs; the smallest tile where none does."""
        target = math.ceil(self._FILL * self.sm_count())
        most = min(16, -(-k // unit)) if split_ok else 1
        tiles = [t for t in reversed(_TOKEN_TILES) if t <= bt]
        for t in tiles:
            ctas = -(-n // t) * grid_r
            if ctas * most >= target:
                return t, max(1, min(most, -(-target // ctas)))
        return tiles[-1], most

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

    @tensors(d=like("b", shape=_d_shape("w"), dtype=np.float32))
    def gemm(self, w: QWeight | PackedWeight, b: cupy.ndarray, d: cupy.ndarray | None = None, *,
             accumulate: bool = False, split_k: int | None = None, wgmma: bool | None = None,
             stream=None) -> cupy.ndarray:
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
        bt, grid, k_split = self._grid(n, w, split_k, "gemm", fill=True)
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

    def _grid(self, n: int, w: QWeight, split_k, what: str, max_tile: int = _TOKEN_TILES[-1], unit: int = _SUPER,
              fill: bool = False):
        """(token tile, grid (token tiles, row tiles, K slices), K elements per slice); ``fill``: a small grid
        chosen by :meth:`_fill` where ``split_k`` is None."""
        bt = min(self._tile(n), max_tile)
        grid_t, grid_r = -(-n // bt), -(-w.m // _ROW_TILE)
        if grid_t > 2**31 - 1 or grid_r > 65535:
            raise ValueError(f"{what}: {n} columns x {w.m} rows exceed the grid limits")
        split = _split_arg(split_k)
        if split is None:
            split = self._split(grid_t * grid_r, w.k)
            if fill and grid_t * grid_r * split < self._FILL * self.sm_count():
                bt, split = self._fill(n, grid_r, bt, w.k, unit)
                grid_t = -(-n // bt)
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

    @tensors(d=like("b", shape=_d_shape("w_gate"), dtype=np.float32))
    def gemm_glu(self, w_gate: QWeight | PackedWeight, w_up: QWeight | None, b: cupy.ndarray,
                 d: cupy.ndarray | None = None, *, act: str = "swiglu", wgmma: bool | None = None,
                 stream=None) -> cupy.ndarray:
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
        grid_r = -(-w_gate.m // _ROW_TILE_GLU)
        bt, _ = self._fill(n, grid_r, self._tile(n), w_gate.k, _SUPER, split_ok=False)  # (its products never split)
        grid_t = -(-n // bt)
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

    def struct_of(self, qtype: int):
        return self._units[qtype].struct("GemmParams")
