"""The f32 path's matvecs (``cuda_src/dmmv/dmmv.cu`` over ``core.cuh``): :class:`Dense`, DmmvDispatch's
``dmmv`` (plain, batched, the accumulate and gate epilogues, on a :class:`~cukern.dmmv.SplitQ8`),
``dmmv_pair``, ``dmmv_glu``, the forms on a :class:`~cukern.dmmv.NormedX` (``dmmv_nx``,
``dmmv_glu_nx``, ``dmmv_three``) and on a :class:`~cukern.dmmv.MergedX` (``dmmv_mx``), and
``dequantize``; each sends the int8-path types to :mod:`cukern.dmmv.q8` where it has a plan.
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.dispatch import check_array
from cukern.dmmv.common import _ACTS, _F32, _ROWS, _STEP, _warps, _y_shape
from cukern.dmmv.q8 import _q8_blocks, _q8_kernel, _q8_pair_blocks, _q8_two_kernel
from cukern.dmmv.weights import QTYPES, MergedX, NormedX, QuantizedX, QWeight, SplitQ8
from cukern.interop import like, tensors
from cukern.qtypes import GGMLType as T
from cukern.runtime import device_arch
from cukern.streams import resolve_stream

# (rows per block R, loop variant V) of dmmv<QT, NC, R, V> (cuda_src/dmmv/dmmv.cu, core.cuh row_dots), per
# type for one column, measured on an H100 (14336x4096 and 4096x14336; docs/notes/dmmv.md): 4-bit types gain
# from sharing each x load over 4 rows, the K-quants also from the pipelined loop; batches use (2, 0).
_ONE_COL = {T.F32: (2, 1), T.F16: (2, 1), T.BF16: (2, 1), T.Q4_0: (4, 0), T.Q5_0: (4, 0), T.Q8_0: (2, 0),
            T.MXFP4: (4, 0), T.Q4_K: (4, 1), T.Q5_K: (4, 1), T.Q6_K: (2, 0)}
# dmmv_three's (type of W1 and W2, type of W3): W3 of the same type, or Q8_0 or Q6_K (the v projection
# that GGUF mixes such as Q4_K_M and Gemma 3's Q5_0 files give more bits)
THREE_TYPES = tuple((q, q3) for q in QTYPES for q3 in sorted({q, T.Q8_0, T.Q6_K}))


def _config(qt: int, n: int) -> tuple[int, int]:
    return _ONE_COL[qt] if n == 1 else (2, 0)


def _kernel(qt: int, n: int) -> str:
    r, v = _config(qt, n)
    return f"dmmv<{qt}, {n}, {r}, {v}>"


_SPLIT_WARPS = 8  # warps per block of dmmv_split (kSplitWarps)
_SPLIT_ROWS, _SPLIT_UNROLL = 2, 2  # rows per warp R, chunks per lane loaded at once U of dmmv_split<NC, R, U>
_NORM_ITEMS = 4  # float4s of each input a thread of a NormedX prologue holds (kNormItems)


def _nx_kernel(qt: int, n: int) -> str:
    """dmmv_nx<QT, NC, R, V>: dmmv's instantiation on a NormedX (the same rows per block and loop)."""
    r, v = _config(qt, n)
    return f"dmmv_nx<{qt}, {n}, {r}, {v}>"


def _three_kernel(qt: int, qt3: int) -> str:
    """dmmv_nx3<QT, R, V, QT3, R3, V3>: each matrix at its type's one-column (R, V)."""
    return f"dmmv_nx3<{qt}, {_ONE_COL[qt][0]}, {_ONE_COL[qt][1]}, {qt3}, {_ONE_COL[qt3][0]}, {_ONE_COL[qt3][1]}>"


def _mx_kernel(qt: int) -> str:
    """dmmv_mx<QT, R, V>: dmmv's one-column instantiation on a MergedX."""
    r, v = _ONE_COL[qt]
    return f"dmmv_mx<{qt}, {r}, {v}>"


def _split_kernel(n: int) -> str:
    return f"dmmv_split<{n}, {_SPLIT_ROWS}, {_SPLIT_UNROLL}>"


# dmmv_split_tc<NC, RT> (tensor cores, mma.sync: sm_80+) takes the chunks of these widths; one column stays on
# dmmv_split (an MMA's 8 columns would be 7/8 idle and x's two f16 parts cost a second pass of the products)
_SPLIT_TC_COLS = (2, 4, 8)
_SPLIT_TC_WARPS = 8  # warps per block of dmmv_split_tc (kSplitTcWarps)
_SPLIT_TC_TILES = 2  # 16-row tiles per warp RT


def _split_tc_kernel(n: int) -> str:
    return f"dmmv_split_tc<{n}, {_SPLIT_TC_TILES}>"


def _split_tc_smem(n: int, k: int) -> int:
    """Dynamic shared bytes of dmmv_split_tc: x's hi and lo f16 parts, 2n rows of k | 32 halves."""
    return 2 * n * (k | 32) * 2


def _split_tc_fits(width: int, k: int, arch: int, max_shared: int) -> bool:
    """Whether a chunk of ``width`` columns of a SplitQ8 matvec takes dmmv_split_tc: a width it is built
    for, a device with mma.sync m16n8k16 (``arch`` >= 80), and x's f16 parts within the ``max_shared``
    bytes one block may have (else dmmv_split)."""
    return width in _SPLIT_TC_COLS and arch >= 80 and _split_tc_smem(width, k) <= max_shared


def _normed_warps(k: int) -> int:
    """Warps per block of a NormedX kernel: the matvec's, or enough that every thread of the prologue
    holds at most _NORM_ITEMS float4s of an input (one load each, all in flight together; past
    8 warps, k > 4096, the prologue loops)."""
    return max(_warps(k), min(8, -(-k // (4 * _NORM_ITEMS * 32))))


class Dense:
    """DmmvDispatch's f32-path matvecs (a mixin: launches through the dispatch's units; the int8-path
    plans are :class:`~cukern.dmmv.q8.Int8Path`'s, ``_params``, ``_cols``, ``_chunks``, ``_mode`` and
    ``_check_gate`` DmmvDispatch's)."""

    @tensors(out=like("w", shape=lambda a: (a("w").m, a("w").k), dtype=np.float32))
    def dequantize(self, w: QWeight, out: cupy.ndarray | None = None, *, stream=None) -> cupy.ndarray:
        """``out = W`` as f32 [m, k] (per-element path; for tests and dense fallbacks)."""
        w = self._check_weight("w", w)
        check_array("out", out, dtype=_F32, shape=(w.m, w.k))
        params = self.struct("DequantParams").pack(w_offset=w.offset, row_bytes=w.row_bytes, m=w.m, k=w.k)
        blocks = max(1, min(-(-(w.m * w.k) // 256), 4096))
        self._launch(f"dequantize<{w.qtype}>", blocks, 256, (out, w.buf), params, stream=stream)
        return out

    @tensors
    def split_q8_0(self, w: QWeight, *, stream=None) -> SplitQ8:
        """A :class:`SplitQ8` copy of Q8_0 weights ``w`` (GGUF rows or rows padded by
        ``MatmulDispatch.pad_rows``): new device arrays of ``w.m * w.k * 34 / 32`` bytes, made by CuPy
        copies on ``stream`` (allocates: call it at load time, outside a captured graph)."""
        if not isinstance(w, QWeight):
            raise TypeError(f"w must be a QWeight, got {type(w).__name__}")
        if w.qtype != T.Q8_0 or w.n_experts:
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

    @tensors(y=like("x", shape=_y_shape("w"), dtype=np.float32))
    def dmmv(self, w: QWeight | SplitQ8, x: cupy.ndarray | QuantizedX, y: cupy.ndarray | None = None, *,
             accumulate: bool = False, alpha: float = 1.0, gate: cupy.ndarray | None = None,
             stream=None) -> cupy.ndarray:
        """``y = alpha * W x``; with ``accumulate``, ``y += alpha * W x``; with ``gate``,
        ``y += alpha * sigmoid(gate[c]) * W x[c]`` (the shared-expert path).

        w: QWeight [m, k], or a :class:`SplitQ8` (f32 x only); x: [k] or [n, k] f32 (n columns:
        weights are read once per 8), a :class:`NormedX` of that shape (x made by every block from the
        residual stream: the f32 path, no gate), a :class:`MergedX` of k = heads * head_dim (x merged
        by every block from split attention states: one column, the f32 path, no gate), or a
        :class:`QuantizedX` of that shape made for w's type (int8 path only: the same result as from
        the f32 x it holds, without quantizing it again); y: [m] or [n, m] f32 (same leading shape as
        x; [m] or [1, m] for a MergedX); gate: [n] f32 logits on the device."""
        if isinstance(w, SplitQ8):
            return self._dmmv_split(w, x, y, accumulate=accumulate, alpha=alpha, gate=gate, stream=stream)
        w = self._check_weight("w", w)
        if isinstance(x, MergedX):
            return self._merged(w, x, y, accumulate=accumulate, alpha=alpha, gate=gate, stream=stream)
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
        """dmmv on a SplitQ8: chunks of 2, 4 or 8 columns on tensor cores (dmmv_split_tc<NC, RT>, blocks of 8
        warps taking RT 16-row tiles each; sm_80+, x's two f16 rows per column in shared memory), the rest
        on dmmv_split<NC, R> (f32 FMAs, blocks of 8 warps taking R rows each)."""
        if isinstance(x, QuantizedX):
            raise TypeError("a SplitQ8 takes f32 x (its matvec multiplies the quants by x exactly)")
        x, n = self._cols("x", x, w.k)
        check_array("y", y, dtype=_F32, shape=x.shape[:-1] + (w.m,))
        self._check_gate(gate, n)
        mode = self._mode(accumulate, gate)
        for c0, width in self._chunks(n):
            xs, ys = (x, y) if n == 1 else (x[c0:], y[c0:])
            g = ys if gate is None else gate[c0:]
            tc = self._split_tc_fits(width, w.k)
            rows = _SPLIT_TC_WARPS * _SPLIT_TC_TILES * 16 if tc else _SPLIT_WARPS * _SPLIT_ROWS
            blocks = -(-w.m // rows)
            params = self.struct("DmmvParams").pack(
                w_offset=0, w2_offset=0, row_bytes=w.k, m=w.m, m2=0, k=w.k, n_full=0, tail=0, blocks1=blocks,
                x_stride=w.k, y_stride=w.m, y2_stride=0, mode=mode, act=0, alpha=float(alpha), l2_items=0, pad0=0)
            args = (ys, w.quants, w.scales, xs, g)
            if tc:
                self._split_tc._launch(_split_tc_kernel(width), blocks, _SPLIT_TC_WARPS * 32, args, params,
                                       stream=stream, shared_mem=_split_tc_smem(width, w.k), pdl=self.pdl)
            else:
                self._launch(_split_kernel(width), blocks, _SPLIT_WARPS * 32, args, params, stream=stream,
                             pdl=self.pdl)
        return y

    def _split_tc_fits(self, width: int, k: int) -> bool:
        """:func:`_split_tc_fits` on this dispatch's device (its compute capability read once)."""
        if width not in _SPLIT_TC_COLS:
            return False
        if self._split_tc_arch is None:
            with cupy.cuda.Device(self.device_id):
                self._split_tc_arch = device_arch()
        return _split_tc_fits(width, k, self._split_tc_arch, self.max_shared_optin())

    def _merged(self, w: QWeight, x: MergedX, y, *, accumulate: bool, alpha: float, gate, stream) -> cupy.ndarray:
        """dmmv_mx: dmmv on a MergedX (one column), at dmmv's one-column rows per block and loop."""
        if gate is not None:
            raise ValueError("dmmv on a MergedX: no gate epilogue (store or accumulate)")
        if x.k != w.k:
            raise ValueError(f"x (a MergedX of {x.n_heads} heads x {x.head_dim}) has k={x.k}, w has k={w.k}")
        if y is None or getattr(y, "shape", None) not in ((w.m,), (1, w.m)):
            raise ValueError(f"y must have shape ({w.m},) or (1, {w.m}) for a MergedX (one column), got "
                             f"{getattr(y, 'shape', type(y).__name__)}")
        check_array("y", y, dtype=_F32)
        smem = (w.k + 2 * x.n_heads) * 4  # x and each head's (M, 1 / den)
        if smem > self.max_shared_optin():
            raise ValueError(f"a MergedX of k={w.k} needs {smem} bytes of shared memory per block, the device "
                             f"allows {self.max_shared_optin()}")
        blocks = -(-w.m // _ONE_COL[w.qtype][0])
        params = self.struct("DmmvMergeParams").pack(
            w_offset=w.offset, w2_offset=0, row_bytes=w.row_bytes, m=w.m, m2=0, k=w.k, n_full=w.k // _STEP,
            tail=w.k % _STEP, blocks1=blocks, y_stride=0, y2_stride=0, mode=int(accumulate), alpha=float(alpha),
            n_states=x.n_states, n_heads=x.n_heads, head_dim=x.head_dim, has_sinks=int(x.sinks is not None),
            sink_offset=x.sink_offset)
        self._mx._launch(_mx_kernel(w.qtype), blocks, _normed_warps(w.k) * 32,
                         (y, w.buf, x.o_part, x.lse_part, x.sinks if x.sinks is not None else x.lse_part), params,
                         stream=stream, shared_mem=smem, pdl=self.pdl)
        return y

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
                kernel = _nx_kernel(w.qtype, width)
                rows = _config(w.qtype, width)[0]
                b1, b2 = -(-w.m // rows), (-(-w2.m // rows) if w2 is not None else 0)
            else:
                kernel, b1, b2 = f"dmmv_glu_nx<{w.qtype}, {width}>", -(-w.m // _ROWS), 0
            yy = tuple(y if n == 1 else y[c0:] for y in ys)
            launches.append((kernel, b1 + b2, b1, yy, x.columns(c0), smem))
        pair = w2 is not None and glu is None
        w2 = w2 if w2 is not None else w
        for kernel, blocks, b1, yy, (res, proj, w_post, w_norm, out), smem in launches:
            params = self._nx_params(w, w2, x, m2=w2.m if pair else 0, blocks1=b1, blocks2=blocks,
                                     y2_stride=0 if glu is not None else w2.m, mode=mode, act=glu or 0, alpha=alpha)
            args = (yy[0], yy[-1], w.buf, w2.buf) if glu is None else (yy[0], w.buf, w2.buf)
            self._nx._launch(kernel, blocks, _normed_warps(w.k) * 32, args + (res, proj, w_post, w_norm, out),
                             params, stream=stream, shared_mem=smem, pdl=self.pdl)

    def _nx_params(self, w: QWeight, w2: QWeight, x: NormedX, *, m2: int, blocks1: int, blocks2: int,
                   y2_stride: int, mode: int = 0, act: int = 0, alpha: float = 1.0, w3: QWeight | None = None):
        """DmmvNormParams of a launch on NormedX x: matrix 1 (and 2, and dmmv_nx3's 3) and the norm fields."""
        return self.struct("DmmvNormParams").pack(
            w_offset=w.offset, w2_offset=w2.offset, row_bytes=w.row_bytes, m=w.m, m2=m2, k=w.k, n_full=w.k // _STEP,
            tail=w.k % _STEP, blocks1=blocks1, x_stride=w.k, y_stride=w.m, y2_stride=y2_stride, mode=mode, act=act,
            alpha=float(alpha), eps=x.eps, weight_offset=x.weight_offset, post=x.post,
            write_out=int(x.residual_out is not None), w3_offset=w3.offset if w3 is not None else 0,
            row_bytes3=w3.row_bytes if w3 is not None else 0, m3=w3.m if w3 is not None else 0, blocks2=blocks2)

    @tensors(y1=like("x", shape=_y_shape("w1"), dtype=np.float32), y2=like("x", shape=_y_shape("w2"), dtype=np.float32),
             y3=like("x", shape=_y_shape("w3"), dtype=np.float32))
    def dmmv_three(self, w1: QWeight, w2: QWeight, w3: QWeight, x: NormedX, y1=None, y2=None, y3=None, *,
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
        r, r3 = _ONE_COL[w1.qtype][0], _ONE_COL[w3.qtype][0]  # rows per block of each matrix
        b1, b2, b3 = -(-w1.m // r), -(-w2.m // r), -(-w3.m // r3)
        params = self._nx_params(w1, w2, x, m2=w2.m, blocks1=b1, blocks2=b1 + b2, y2_stride=w2.m, w3=w3)
        res, proj, w_post, w_norm, out = x.columns(0)
        self._three._launch(_three_kernel(w1.qtype, w3.qtype), b1 + b2 + b3, _normed_warps(w1.k) * 32,
                            (y1, y2, y3, w1.buf, w2.buf, w3.buf, res, proj, w_post, w_norm, out), params,
                            stream=stream, shared_mem=smem, pdl=self.pdl)
        return y1, y2, y3

    @tensors
    def dmmv_scale_acc(self, w: QWeight, x, y, scale: float, *, stream=None) -> cupy.ndarray:
        """``y += scale * W x`` (fused scale-accumulate)."""
        return self.dmmv(w, x, y, accumulate=True, alpha=scale, stream=stream)

    @tensors
    def dmmv_gated_acc(self, w: QWeight, x, y, gate: cupy.ndarray, *, alpha: float = 1.0, stream=None):
        """``y[c] += alpha * sigmoid(gate[c]) * W x[c]`` (sigmoid-gated accumulate; gate on the device)."""
        return self.dmmv(w, x, y, gate=gate, alpha=alpha, stream=stream)

    @tensors(y1=like("x", shape=_y_shape("w1"), dtype=np.float32), y2=like("x", shape=_y_shape("w2"), dtype=np.float32))
    def dmmv_pair(self, w1: QWeight, w2: QWeight, x, y1=None, y2=None, *,
                  stream=None) -> tuple[cupy.ndarray, cupy.ndarray]:
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

    @tensors(y=like("x", shape=_y_shape("w_gate"), dtype=np.float32))
    def dmmv_glu(self, w_gate: QWeight, w_up: QWeight, x, y=None, *, act: str = "swiglu", accumulate: bool = False,
                 alpha: float = 1.0, stream=None) -> cupy.ndarray:
        """``y = alpha * act(W_gate x) * (W_up x)`` (``accumulate``: ``y +=``): act "swiglu" (SiLU)
        or "geglu" (GELU, tanh form). On the int8 path (dmmv_q8_two) a block streams the gate and up
        rows of its outputs as one sequence and combines each pair's dot products in shared memory
        (about half the f32 path's fused kernel's time: docs/notes/dmmv.md).

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
