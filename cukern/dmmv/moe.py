"""The mixture-of-experts matvecs (``cuda_src/dmmv/moe.cu``, ``moe_packed.cu`` over ``moe.cuh``):
:class:`Moe`, DmmvDispatch's ``moe_dmmv`` (every slot's expert in one launch), ``moe_dmmv_packed``
(token-batched over a :class:`~cukern.dmmv.MoeRoute`), ``moe_down`` (down projection and weighted
sum), the routing kernels and the device-side error flag they set.
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.dispatch import check_array
from cukern.dmmv.common import _ACTS, _F32, _I32, _ROWS, _STEP, _warps
from cukern.dmmv.q8 import _Q8_MAX_TOP_K, _q8_blocks, _q8_down_kernel, _q8_kernel, _q8_moe_glu_kernel
from cukern.dmmv.weights import MoeRoute, QWeight
from cukern.interop import tensors
from cukern.routing import RouteSlot, route_rows

_PACK_COLS = 4  # slots per work item of moe_dmmv_packed (kPackCols)
_MAX_EXPERTS = 1023  # moe_route_pack: one thread per bucket, 1024 threads


def _route_ids(ids) -> tuple[cupy.ndarray, int]:
    """ids [n_tokens, top_k] int32 (rows a stride apart allowed) or a RouteSlot's: (ids, row stride)."""
    return route_rows("ids", ids.ids if isinstance(ids, RouteSlot) else ids, _I32)


class DeviceError(RuntimeError):
    """A condition a kernel detected on the device (e.g. an expert id out of range)."""


class Moe:
    """DmmvDispatch's MoE methods (a mixin: launches through the dispatch's ``_moe`` and ``_packed``
    units; the int8-path plans are :class:`~cukern.dmmv.q8.Int8Path`'s)."""

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

    def _moe_params(self, w: QWeight, *, w2: QWeight | None = None, top_k: int, n_slots: int, x_per_slot: bool,
                    act: int = 0, mode: int = 0, alpha: float = 1.0, max_items: int = 0, ids_stride: int = 0,
                    weights_stride: int = 0):
        return self.struct("MoeParams").pack(
            w_offset=w.offset, w2_offset=w2.offset if w2 is not None else 0, row_bytes=w.row_bytes,
            expert_bytes=w.expert_stride, m=w.m, k=w.k, n_full=w.k // _STEP, tail=w.k % _STEP,
            n_experts=w.n_experts, top_k=top_k, n_slots=n_slots, x_per_slot=int(x_per_slot),
            max_items=max_items, act=act, mode=mode, alpha=float(alpha), ids_stride=ids_stride or top_k,
            weights_stride=weights_stride or top_k)

    def _moe_inputs(self, w: QWeight, w_up, x, ids, act: str):
        w = self._check_weight("w", w, experts=True)
        if w_up is not None:
            wu = self._check_weight("w_up", w_up, experts=True)
            if (wu.qtype, wu.m, wu.k, wu.n_experts, wu.expert_stride) != (w.qtype, w.m, w.k, w.n_experts,
                                                                         w.expert_stride):
                raise ValueError("w_up must match w (type, shape, experts, stride)")
        if act not in _ACTS:
            raise ValueError(f"act must be one of {', '.join(_ACTS)}, got {act!r}")
        ids, ids_stride = _route_ids(ids)
        n_tokens, top_k = ids.shape
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
        return w, ids, ids_stride, per_slot

    @tensors
    def moe_dmmv(self, w: QWeight, x: cupy.ndarray, ids: cupy.ndarray | RouteSlot, y: cupy.ndarray, *,
                 w_up: QWeight | None = None, act: str = "swiglu", alpha: float = 1.0, stream=None) -> cupy.ndarray:
        """For every token t and slot j: ``y[t, j] = alpha * W[ids[t, j]] x[t]`` (x [n_tokens, k]) or
        ``... x[t, j]`` (x [n_tokens, top_k, k]); with ``w_up``, ``act(Wg x) * (Wu x)``. All slots in one
        launch; expert ids are read on the device (out of range: zeros and the error flag). On the
        int8 path a block quantizes its slot's x and streams rows of the slot's expert (with GLU its
        outputs' gate and up rows as one sequence, as :meth:`dmmv_glu`; timings: docs/notes/dmmv.md).

        w (, w_up): expert QWeight [n_experts, m, k]; ids: [n_tokens, top_k] int32 (rows may be a stride
        apart: ``route_rows``) or a :class:`~cukern.routing.RouteSlot`; y: [n_tokens, top_k, m]."""
        w, ids, ids_stride, per_slot = self._moe_inputs(w, w_up, x, ids, act)
        n_tokens, top_k = ids.shape
        check_array("y", y, dtype=_F32, shape=(n_tokens, top_k, w.m))
        n_slots = n_tokens * top_k
        if n_slots > 65535:
            raise ValueError(f"moe_dmmv: at most 65535 slots per launch, got {n_slots} (use moe_dmmv_packed)")
        params = self._moe_params(w, w2=w_up, top_k=top_k, n_slots=n_slots, x_per_slot=per_slot,
                                  act=_ACTS[act], alpha=alpha, ids_stride=ids_stride)
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

    @tensors
    def moe_route_pack(self, ids: cupy.ndarray | RouteSlot, route: MoeRoute, *, stream=None) -> MoeRoute:
        """Group the slots of ``ids`` [n_tokens, top_k] int32 (rows may be a stride apart, or a RouteSlot)
        by expert into ``route`` (device only)."""
        if not isinstance(route, MoeRoute):
            raise TypeError(f"route must be a MoeRoute from plan_moe_route, got {type(route).__name__}")
        ids, ids_stride = _route_ids(ids)
        if ids.size != route.n_slots:
            raise ValueError(f"ids has {ids.size} slots, the route was planned for {route.n_slots}")
        params = self.struct("RouteParams").pack(n_slots=route.n_slots, n_experts=route.n_experts,
                                                 cols=_PACK_COLS, max_items=route.max_items, top_k=ids.shape[1],
                                                 ids_stride=ids_stride)
        self._moe._launch("moe_route_pack", 1, 1024, (route.counts, route.offsets, route.packed, route.items,
                                                     route.n_items, self.error_flag, ids), params, stream=stream)
        return route

    @tensors
    def moe_count_experts(self, ids: cupy.ndarray | RouteSlot, counts: cupy.ndarray, *, layer: int | None = None,
                          stream=None) -> cupy.ndarray:
        """``counts[e]`` = slots of ``ids`` routed to expert e; counts: [n_experts] int32. ids: [n_tokens, top_k]
        int32 (rows may be a stride apart: a view of a wider capture, or a RouteSlot), or a per-(token,
        layer) capture [n_tokens, n_layers, top_k] int32 with ``layer`` naming the layer counted."""
        if layer is not None or getattr(ids, "ndim", 2) == 3:
            check_array("ids", ids, dtype=_I32, ndim=3)
            if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool) or not 0 <= layer < ids.shape[1]:
                raise ValueError(f"moe_count_experts: a [n_tokens, n_layers, top_k] capture needs layer in "
                                 f"[0, {ids.shape[1]}), got {layer!r}")
            ids = ids[:, layer, :]
        ids, ids_stride = _route_ids(ids)
        check_array("counts", counts, dtype=_I32, ndim=1)
        if not 1 <= counts.size <= _MAX_EXPERTS:
            raise ValueError(f"counts must have 1 to {_MAX_EXPERTS} entries, got {counts.size}")
        params = self.struct("RouteParams").pack(n_slots=ids.size, n_experts=counts.size, cols=_PACK_COLS,
                                                 max_items=0, top_k=ids.shape[1], ids_stride=ids_stride)
        self._moe._launch("moe_count_experts", 1, 1024, (counts, self.error_flag, ids), params, stream=stream)
        return counts

    @tensors
    def moe_dmmv_packed(self, w: QWeight, x: cupy.ndarray, ids: cupy.ndarray | RouteSlot, route: MoeRoute,
                        y: cupy.ndarray, *, w_up: QWeight | None = None, act: str = "swiglu", alpha: float = 1.0,
                        accumulate: bool = False, weights: cupy.ndarray | None = None, stream=None) -> cupy.ndarray:
        """As :meth:`moe_dmmv`, token-batched: each expert's weights are read once per 4 of its slots,
        using a ``route`` filled by :meth:`moe_route_pack` from the same ``ids``. The grid is sized for
        the worst case; blocks past the device-side item count exit.

        y: [n_tokens, top_k, m], written (``accumulate``: added to). With ``weights`` [n_tokens, top_k] f32
        (rows may be a stride apart, e.g. a RouteSlot's ``weights``) the down projection summed into y
        [n_tokens, m]: ``y[t] += alpha * sum_j weights[t, j] W[ids[t, j]] x[t, j]``, which needs
        ``accumulate=True`` (zero y first for the sum alone); the terms of a token are added with
        atomics, in no fixed order. Out-of-range ids: zeros written (accumulating: the term dropped)."""
        w, ids, ids_stride, per_slot = self._moe_inputs(w, w_up, x, ids, act)
        n_tokens, top_k = ids.shape
        if not isinstance(route, MoeRoute) or route.n_slots != n_tokens * top_k or route.n_experts != w.n_experts:
            raise ValueError("route must be a MoeRoute planned for these ids and w.n_experts")
        weights_stride, mode = 0, int(bool(accumulate))
        if weights is not None:
            if not accumulate:
                raise ValueError("moe_dmmv_packed: weights sum the slots into y, which needs accumulate=True "
                                 "(zero y first for the sum alone)")
            weights, weights_stride = route_rows("weights", weights, _F32, shape=(n_tokens, top_k))
            check_array("y", y, dtype=_F32, shape=(n_tokens, w.m))
            mode = 2
        else:
            check_array("y", y, dtype=_F32, shape=(n_tokens, top_k, w.m))
        params = self._moe_params(w, w2=w_up, top_k=top_k, n_slots=route.n_slots, x_per_slot=per_slot,
                                  act=_ACTS[act], alpha=alpha, max_items=route.max_items, mode=mode,
                                  ids_stride=ids_stride, weights_stride=weights_stride)
        glu = "true" if w_up is not None else "false"
        self._packed._launch(f"moe_dmmv_packed<{w.qtype}, {glu}>", (-(-w.m // _ROWS), route.max_items),
                             _warps(w.k) * 32, (y, w.buf, (w_up or w).buf, x, x if weights is None else weights,
                                                route.packed, route.items, route.n_items), params, stream=stream)
        return y

    @tensors
    def moe_down(self, w: QWeight, h: cupy.ndarray, ids: cupy.ndarray | RouteSlot, weights: cupy.ndarray | None,
                 y: cupy.ndarray, *,
                 accumulate: bool = False, alpha: float = 1.0, stream=None) -> cupy.ndarray:
        """``y[t] (+)= alpha * sum_j weights[t, j] * W[ids[t, j]] h[t, j]``: the MoE down projection and the
        weighted sum over each token's experts in one launch (no atomics; an out-of-range id drops its term
        and sets the error flag). On the int8 path (top_k <= 16) a block quantizes the h of each of its
        token's slots, streams its outputs' rows of every slot's expert as one sequence and sums the
        dot products over the slots in slot order (every block quantizes all top_k h; timings:
        docs/notes/dmmv.md).

        w: expert QWeight [n_experts, m, k]; h: [n_tokens, top_k, k]; ids: [n_tokens, top_k] int32 and
        weights: [n_tokens, top_k] f32 (rows of either may be a stride apart), or ids a
        :class:`~cukern.routing.RouteSlot` and weights None (the slot's); y: [n_tokens, m]."""
        w = self._check_weight("w", w, experts=True)
        if isinstance(ids, RouteSlot) and weights is None:
            weights = ids.weights
        ids, ids_stride = _route_ids(ids)
        n_tokens, top_k = ids.shape
        if n_tokens > 65535:
            raise ValueError(f"ids must be [n_tokens, top_k] with n_tokens <= 65535, got {ids.shape}")
        check_array("h", h, dtype=_F32, shape=(n_tokens, top_k, w.k), align=16)
        weights, weights_stride = route_rows("weights", weights, _F32, shape=(n_tokens, top_k))
        check_array("y", y, dtype=_F32, shape=(n_tokens, w.m))
        params = self._moe_params(w, top_k=top_k, n_slots=n_tokens * top_k, x_per_slot=True,
                                  mode=1 if accumulate else 0, alpha=alpha, ids_stride=ids_stride,
                                  weights_stride=weights_stride)
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
