"""MatmulDispatch's grouped expert GEMMs for MoE prefill (``cuda_src/matmul/moe_gemm.cuh``): :class:`MoeGemm`,
the mixin holding ``moe_gemm`` (``y[slot] = W[expert(slot)] x[row(slot)]``) and ``moe_gemm_glu`` (the
activated gate and up products as f16, the down GEMM's input), over a :class:`~cukern.dmmv.MoeRoute`
that ``DmmvDispatch.moe_route_pack`` filled on the device.

The grid is sized for the route's worst case and every CTA reads its expert from the route's device
offsets: no host round trip, so a step holding these launches is graph-capturable. Tiles of an expert are
``BT`` slots (the smallest of 32 / 64 / 128 that holds the average slots per expert, or ``tile=``); each
expert's last tile is padded, which is why the matvecs (``moe_dmmv_packed``) stay ahead at few slots per
expert (:attr:`cukern.models.moe.MoeBlock.gemm_min_slots_per_expert`).
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.dispatch import Unit, check_array
from cukern.dmmv import QTYPES, MoeRoute, QWeight
from cukern.interop import like, tensors
from cukern.matmul.common import (FAMILIES, MOE_QTYPES, _B_TYPES, _F32, _MOE_TILES, _ROW_TILE, _ROW_TILE_GLU,
                                  _THREADS, _W_ALIGN, _cols, _overlap, _raw16, _smem)

_F16 = np.dtype(np.float16)
_MOE_ACTS = {"swiglu": 2, "silu": 2, "geglu": 3, "gelu": 3, "swiglu_oai": 4}  # MoeGemmParams.mode


def _slots_shape(w: str):
    return lambda a: (a("route").n_slots, a(w).m)


class MoeGemm:
    """The grouped expert GEMMs (a mixin of :class:`~cukern.matmul.MatmulDispatch`; units made on first use)."""

    _moe_units: dict | None = None

    def _moe_unit(self, qtype: int) -> Unit:
        if self._moe_units is None:
            self._moe_units = {}
        u = self._moe_units.get(qtype)
        if u is None:
            u = self._moe_units[qtype] = Unit(FAMILIES[f"matmul_moe_{MOE_QTYPES[qtype]}"], self._device)
        return u

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _experts(name: str, w) -> QWeight:
        if not isinstance(w, QWeight):
            raise TypeError(f"{name} must be a cukern.dmmv.QWeight of stacked experts, got {type(w).__name__}")
        if not w.n_experts:
            raise ValueError(f"{name} is a single matrix; moe_gemm takes an expert tensor [n_experts, m, k]")
        if w.qtype not in MOE_QTYPES:
            raise ValueError(f"{name}: weight type {QTYPES[w.qtype][0]} has no grouped expert GEMM "
                             f"(supported: {', '.join(s.upper() for s in MOE_QTYPES.values())})")
        align = _W_ALIGN[w.qtype]
        if (w.buf.data.ptr + w.offset) % align or w.expert_stride % align or w.row_stride % align:
            raise ValueError(f"{name}: {QTYPES[w.qtype][0]} experts must start {align}-byte aligned with rows and "
                             f"experts a multiple of {align} bytes apart (offset {w.offset}, row {w.row_stride} bytes, "
                             f"expert stride {w.expert_stride}); MXFP4 needs k % 64 == 0")
        return w

    def _moe_operands(self, w: QWeight, x, route, y, y_dtype) -> tuple[int, int, int]:
        """Validate x [n_tokens or n_slots, k] (f32 / f16, rows 16-byte aligned), route and y [n_slots, m]
        (or [n_tokens, top_k, m]); returns (x_stride, top_k or 0 for one row per slot, y_stride)."""
        if not isinstance(route, MoeRoute):
            raise TypeError(f"route must be a MoeRoute from DmmvDispatch.plan_moe_route, got {type(route).__name__}")
        if route.n_experts != w.n_experts:
            raise ValueError(f"route was planned for {route.n_experts} experts, the weights have {w.n_experts}")
        x_stride = _cols("x", x, tuple(_B_TYPES), w.k)
        self._aligned16("x", x, x_stride)
        n_slots, rows = route.n_slots, x.shape[0]
        if rows == n_slots:
            top_k = 0
        elif n_slots % rows == 0:
            top_k = n_slots // rows
        else:
            raise ValueError(f"x must have one row per token (n_slots / top_k) or per slot ({n_slots}), got {rows}")
        check_array("y", y, dtype=y_dtype, contiguous=False)
        if y.ndim == 3 and y.flags.c_contiguous and y.shape[0] * y.shape[1] == n_slots:
            y = y.reshape(n_slots, y.shape[2])
        if y.ndim != 2 or y.shape[0] != n_slots:
            raise ValueError(f"y must be [{n_slots}, {w.m}] (one row per slot), got shape {y.shape}")
        y_stride = _cols("y", y, (y_dtype,), w.m)
        if _overlap(x, y):
            raise ValueError("x and y must not overlap")
        return x_stride, top_k, y_stride

    @staticmethod
    def _bias(name: str, b, w: QWeight) -> tuple[int, int]:
        """An f32 [n_experts, m] bias (element strides allowed, e.g. column 0 of a bias matrix): strides."""
        check_array(name, b, dtype=_F32, shape=(w.n_experts, w.m), contiguous=False)
        if any(s <= 0 or s % 4 for s in b.strides):
            raise ValueError(f"{name} strides must be positive multiples of 4 bytes, got {b.strides}")
        return b.strides[0] // 4, b.strides[1] // 4

    def _moe_tile(self, route: MoeRoute, tile) -> int:
        if tile is not None:
            if tile not in _MOE_TILES:
                raise ValueError(f"tile must be one of {_MOE_TILES} (slots per CTA), got {tile!r}")
            return int(tile)
        avg = -(-route.n_slots // route.n_experts)
        return next((t for t in _MOE_TILES if avg <= t), _MOE_TILES[-1])

    def _moe_launch(self, w, w2, x, route, y, y_stride, x_stride, top_k, tile, glu, mode, biases, alpha, limit,
                    stream):
        bt = self._moe_tile(route, tile)
        rows = _ROW_TILE_GLU if glu else _ROW_TILE
        grid = (route.n_slots // bt + min(route.n_slots, route.n_experts + 1), -(-w.m // rows), 1)
        if grid[0] > 2**31 - 1 or grid[1] > 65535:
            raise ValueError(f"moe_gemm: {route.n_slots} slots x {w.m} rows exceed the grid limits")
        (bg, (be, br)), (bu, _) = biases if biases else ((None, (0, 0)), (None, None))
        unit = self._moe_unit(w.qtype)
        params = unit.struct("MoeGemmParams").pack(
            w_offset=w.offset, w2_offset=w2.offset, row_bytes=w.row_stride, expert_bytes=w.expert_stride,
            x_stride=x_stride, d_stride=y_stride, bias_expert=be, bias_row=br, m=w.m, k=w.k, n_slots=route.n_slots,
            n_experts=route.n_experts, top_k=max(top_k, 1), x_per_slot=int(top_k == 0), mode=mode,
            raw16=_raw16(w, w2), has_bias=int(biases is not None), alpha=float(alpha), limit=float(limit))
        name = f"moe_gemm_f16<{w.qtype}, {bt}, {'true' if glu else 'false'}, {_B_TYPES[x.dtype]}>"
        unit._launch(name, grid, _THREADS, (y, w.buf, w2.buf, x, route.offsets, route.packed,
                                            x if bg is None else bg, x if bu is None else bu), params,
                     stream=stream, shared_mem=_smem(bt, x.itemsize, w.qtype))

    # ------------------------------------------------------------------ public
    @tensors(y=like("x", shape=_slots_shape("w"), dtype=np.float32))
    def moe_gemm(self, w: QWeight, x: cupy.ndarray, route: MoeRoute, y: cupy.ndarray | None = None, *,
                 accumulate: bool = False, tile: int | None = None, stream=None) -> cupy.ndarray:
        """``y[s] = W[e(s)] x[r(s)]`` for every slot s of ``route``: the grouped expert GEMM of a prompt chunk
        (e(s) the slot's expert, r(s) its token s // top_k, or s itself when x has one row per slot);
        ``accumulate``: ``y[s] +=``. Slots whose id was out of range get zeros (the route flagged them).

        w: expert QWeight [n_experts, m, k] of Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K or MXFP4; x: [n_tokens, k]
        (top_k = n_slots / n_tokens) or [n_slots, k], f16 or f32, rows 16-byte aligned; route: a
        :class:`~cukern.dmmv.MoeRoute` filled by ``moe_route_pack`` (on the launch stream, before);
        y: [n_slots, m] f32 in slot order (= [n_tokens, top_k, m], moe_dmmv_packed's layout; a C-contiguous
        3-D y is taken as that). ``tile``: slots per CTA (32, 64, 128; None: from the average per expert)."""
        w = self._experts("w", w)
        x_stride, top_k, y_stride = self._moe_operands(w, x, route, y, _F32)
        y2 = y.reshape(route.n_slots, w.m) if y.ndim == 3 else y
        self._moe_launch(w, w, x, route, y2, y_stride, x_stride, top_k, tile, False, int(bool(accumulate)), None,
                         1.0, 0.0, stream)
        return y

    @tensors(h=like("x", shape=_slots_shape("w_gate"), dtype=np.float16))
    def moe_gemm_glu(self, w_gate: QWeight, w_up: QWeight, x: cupy.ndarray, route: MoeRoute,
                     h: cupy.ndarray | None = None, *, act: str = "silu", gate_bias: cupy.ndarray | None = None,
                     up_bias: cupy.ndarray | None = None, alpha: float = 1.702, limit: float = 7.0,
                     tile: int | None = None, stream=None) -> cupy.ndarray:
        """``h[s] = act(W_g[e(s)] x[r(s)] [+ b_g[e(s)]], W_u[e(s)] x[r(s)] [+ b_u[e(s)]])`` as f16: the gate and
        up GEMMs of the experts fused (64 rows of each per CTA), writing the down GEMM's activations.
        act: ``"silu"`` / ``"swiglu"`` (silu(g) * u), ``"gelu"`` / ``"geglu"`` (gelu_tanh(g) * u) or
        ``"swiglu_oai"`` (gpt-oss: g' = min(g, limit), u' = clamp(u, -limit, limit), g' sigmoid(alpha g') (u' + 1)).

        w_gate, w_up: expert QWeights of one type and shape; x, route, tile as :meth:`moe_gemm`; h: [n_slots, m]
        f16; gate_bias, up_bias: both or neither, f32 [n_experts, m] (element strides allowed: column 0 of an
        [n_experts, m, 4] bias matrix)."""
        w_gate, w_up = self._experts("w_gate", w_gate), self._experts("w_up", w_up)
        if (w_up.qtype, w_up.m, w_up.k, w_up.n_experts, w_up.expert_stride, w_up.row_stride) != \
                (w_gate.qtype, w_gate.m, w_gate.k, w_gate.n_experts, w_gate.expert_stride, w_gate.row_stride):
            raise ValueError("w_up must match w_gate (type, shape, experts, strides)")
        if act not in _MOE_ACTS:
            raise ValueError(f"act must be one of {', '.join(_MOE_ACTS)}, got {act!r}")
        if (gate_bias is None) != (up_bias is None):
            raise ValueError("gate_bias and up_bias go together (pass both or neither)")
        biases = None
        if gate_bias is not None:
            biases = ((gate_bias, self._bias("gate_bias", gate_bias, w_gate)),
                      (up_bias, self._bias("up_bias", up_bias, w_gate)))
            if biases[0][1] != biases[1][1]:
                raise ValueError(f"gate_bias and up_bias must have the same strides, got {gate_bias.strides} and "
                                 f"{up_bias.strides}")
        for name, v in (("alpha", alpha), ("limit", limit)):
            if not isinstance(v, (int, float, np.floating)) or isinstance(v, bool) or not np.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        x_stride, top_k, h_stride = self._moe_operands(w_gate, x, route, h, _F16)
        h2 = h.reshape(route.n_slots, w_gate.m) if h.ndim == 3 else h
        self._moe_launch(w_gate, w_up, x, route, h2, h_stride, x_stride, top_k, tile, True, _MOE_ACTS[act], biases,
                         alpha, limit, stream)
        return h

    @staticmethod
    def _moe_gemm_ok(w) -> bool:
        """Whether :meth:`moe_gemm` takes expert tensor ``w`` (type and alignment; the other operands aside)."""
        try:
            MoeGemm._experts("w", w)
        except (TypeError, ValueError):
            return False
        return True
