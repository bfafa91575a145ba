"""gemm_wgr (``cuda_src/matmul/gemm_wgr.cuh``, Hopper wgmma with the weights dequantized into
registers) and the packed weights it reads (``packed_wgr.cuh``): the kernel choice, the f16 staging
of f32 activations, the tile / K-split plan, the launch, and :meth:`pack` / :meth:`pad_rows`.
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.dispatch import tensor_map_2d
from cukern.dmmv import QWeight
from cukern.interop import tensors
from cukern.matmul.common import (PACKED_LAYOUTS, _ACTS, _BK, _D_BOX, _ROW_TILE, _ROW_TILE_GLU, _SUPER, _WGR_THREADS,
                                  _WG_TILES, PackedWeight, _k_slice, _raw16, _smem_wgr, _split_arg)
from cukern.streams import resolve_stream


class Wgr:
    """MatmulDispatch's gemm_wgr and packing methods (a mixin)."""

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

    def _packed_ok(self, w: PackedWeight, wgmma, glu: bool) -> None:
        """A PackedWeight's call: on Hopper (gemm_wgr), through the entry of its kind (gemm or gemm_glu)."""
        if w.glu != glu:
            raise TypeError("a PackedWeight from pack_glu goes through gemm_glu, one from pack through gemm")
        if wgmma is False or not self._units[w.qtype].is_sm90():
            raise ValueError("a PackedWeight runs on gemm_wgr only: an sm_90 (Hopper) device, wgmma not False")

    def packable(self, w: QWeight) -> bool:
        """Whether :meth:`pack` takes ``w`` here: a tiled-GEMM type (each has a packed layout), k a multiple of
        256, and a device that runs gemm_wgr (sm_90)."""
        return w.qtype in PACKED_LAYOUTS and w.k % _SUPER == 0 and self._units[w.qtype].is_sm90()

    @tensors
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

    @tensors
    def pack(self, w: QWeight, *, stream=None) -> PackedWeight:
        """``w`` repacked into gemm_wgr's layout (:class:`PackedWeight`), on the device: a one-time step at
        load for the prefill GEMMs, which then run 1.05-1.6x as fast as dequantize + cuBLAS at N >= 512
        (docs/notes/matmul.md). A PackedWeight goes through :meth:`gemm` only (not :meth:`matmul`
        or the matvec path, which take the QWeight). Every type of the tiled GEMM, with k a multiple of 256;
        the packed bytes are 5 (Q4_K) to 10 (the byte layouts) bits a weight."""
        w = self._weight("w", w)
        return self._pack(w, w, False, stream)

    @tensors
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
