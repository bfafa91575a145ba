"""The int8 path (``cuda_src/dmmv/q8.cuh``): x quantized per 32-element block to int8, ``__dp4a``
dot products, blocks that stream their rows' weights through a ring of shared-memory slots. The
kernel names and shared-memory sizes of ``dmmv_q8`` / ``dmmv_q8_two`` / ``moe_dmmv_q8*`` /
``moe_down_q8``, the block planner, and :class:`Int8Path`: DmmvDispatch's plans, the launch of a
planned ``dmmv_q8`` and the quantizers of :class:`~cukern.dmmv.QuantizedX`.
"""

from __future__ import annotations

import cupy

from cukern.dispatch import Dispatch, check_array
from cukern.dmmv.common import _ACTS, _F32
from cukern.dmmv.weights import Q8_TYPES, QTYPES, QuantizedX, QWeight
from cukern.interop import tensors
from cukern.qtypes import GGMLType as T

_Q8_MAX_WARPS = 32  # q8::kMaxWarps
_Q8_SPLIT_K = 8192  # k up to which the int8 path runs two blocks of 16 warps per SM (_q8_plan)
# (LU units per lane and iteration, ST ring slots per warp, BULK: Hopper bulk copies) of
# dmmv_q8<QT, NC, LU, ST, BULK> and moe_dmmv_q8<QT, LU, ST, BULK>, per type: under programmatic
# dependent launch two units per lane and three slots, MXFP4 four units and two slots (H100 sweeps
# at 14336x4096 and 4096x14336: docs/notes/dmmv.md).
_Q8_CONFIG = {T.Q4_0: (2, 3, 1), T.Q5_0: (2, 3, 1), T.Q8_0: (2, 3, 0), T.MXFP4: (4, 2, 1), T.Q4_K: (2, 3, 1),
              T.Q5_K: (2, 3, 1), T.Q6_K: (2, 3, 1)}


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


class Int8Path:
    """DmmvDispatch's int8-path methods (a mixin: plans on the dispatch's device, launches through
    its units; ``_params``, ``_cols``, ``_chunks``, ``_mode`` and ``_check_gate`` are DmmvDispatch's)."""

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

    def _l2_items(self, w: QWeight) -> int:
        """Items per warp that dmmv_q8 asks L2 for before pdl_wait, beyond its ring's first ST - 1
        (DmmvParams::l2_items): one for MXFP4 (two ring slots) at k >= 12288 under pdl, else none.
        Example (H100, pdl, weights evict-first): MXFP4 4096x14336 gains ~1.5 points of copy with one
        item and loses ~6 with two; one loses at 14336x4096 and for the three-slot types
        (docs/notes/dmmv.md)."""
        return int(self.pdl and w.qtype == T.MXFP4 and w.k >= 12288)

    @tensors
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

    @tensors
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
                             f"element order), {w.name} needs {'MXFP4' if w.qtype == T.MXFP4 else 'non-MXFP4'}'s: "
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
