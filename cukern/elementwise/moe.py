"""MoE routing: softmax + top-k, the router matvec / GEMM, weighted expert sums and the shared expert's
gate: the kernels of ``cuda_src/elementwise/moe.cuh``.
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.dispatch import check_array
from cukern.elementwise.common import (_F32, _FLAT_BLOCK, _I32, _MAX_GRID_Y, _aligned, _check_disjoint, _check_distinct,
                                       _check_eps, _flat_grid, _router_shape, _topk_shape, _vec)
from cukern.interop import like, tensors
from cukern.routing import RouteSlot, route_rows

_TOPK_WARPS = 4
_TOPK_MAX_K = 32
_TOPK_EPL = (2, 4, 8)  # experts per lane of softmax_topk_reg: n_experts <= 32 * EPL
_TOPK_MAX_EXPERTS = 2048  # 4 warps x 2048 x 4 B = 32 KiB of shared memory
# softmax_topk_lanes (a group of 8 lanes per token): (V, M) instances, n_experts <= 32 V, n_experts % 4 == 0,
# 16-byte aligned logits, k <= _TOPK_LANES_KMAX; M kept logits per lane: the first M with k <= 4 M. From
# _TOPK_LANES_MIN_TOKENS tokens, where the lanes' parallelism beats a warp per token (e.g. 128 experts, k = 8:
# the warp kernel ahead at 4096 tokens, the lanes 2x at 32768; docs/notes/elementwise.md); the warp kernels
# serve fewer tokens and the other shapes.
_TOPK_LANES_V = (1, 2, 4, 8)
_TOPK_LANES_M = (1, 2, 4)
_TOPK_LANES_KMAX = 16
_TOPK_LANES_TOKENS = 32  # tokens per block (TOPK_L_TOKENS in moe.cuh)
_TOPK_LANES_MIN_TOKENS = 8192
_ROUTER_SMALL = (1, 1, 256)  # (experts, tokens, threads) per block below _ROUTER_BATCH tokens
_ROUTER_LARGE = (8, 8, 64)  # fewer threads: each covers more of n_embd before the 64-value reduction
_ROUTER_BATCH = 16
# router_gemm (register-tiled f32 GEMM) from _ROUTER_GEMM_MIN_TOKENS tokens and _ROUTER_GEMM_MIN_EXPERTS experts,
# the tiled matvec below. Example: n_embd 2048, 128 experts, 8192 tokens: the GEMM 129 us against 321 (at 512
# tokens the matvec wins, 25 against 76; docs/notes/elementwise.md).
_ROUTER_GEMM_MIN_TOKENS = 4096
_ROUTER_GEMM_MIN_EXPERTS = 64
_ROUTER_GEMM_TILE = (32, 128, 128)  # (tokens, experts, threads) per block: RG_TOKENS, RG_EXPERTS, RG_THREADS
_ROUTER_GEMM_CONFIGS = ((32, 4),)
_ROUTER_GEMM_STAGES = _ROUTER_GEMM_CONFIGS[0]  # the instance dispatched


class Moe:
    """ElementwiseDispatch's moe methods (a mixin: launches through the dispatch's ``_launch``)."""

    @tensors(ids=like("logits", shape=_topk_shape, dtype=np.int32),
             weights=like("logits", shape=_topk_shape, dtype=np.float32))
    def softmax_topk(self, logits: cupy.ndarray, ids: cupy.ndarray | None = None, weights: cupy.ndarray | None = None,
                     *, k: int, renorm: bool = True, scale: float = 1.0, slot: RouteSlot | None = None, stream=None):
        """Router top-k: per token, the k largest logits (ties: lower id first) in descending order into
        ids: [n_tokens, k] int32 and weights: [n_tokens, k] f32 = scale * softmax(logits)[id], rescaled to
        sum to scale when ``renorm`` (equal to a softmax over the k selected logits, as gpt-oss and
        Qwen3 route). logits: [n_tokens, n_experts] f32. Returns (ids, weights).

        ``slot``: a :class:`~cukern.routing.RouteSlot` [n_tokens, 2k] written instead (ids and weights
        left None): per token the k ids, then the k weights' bits; returns the slot."""
        n_tokens, n_experts = self._rows(logits, "logits")
        if not isinstance(k, (int, np.integer)) or not 1 <= k <= min(n_experts, _TOPK_MAX_K):
            raise ValueError(f"softmax_topk: k must be in [1, min(n_experts={n_experts}, {_TOPK_MAX_K})], got {k}")
        if n_experts > _TOPK_MAX_EXPERTS:
            raise ValueError(f"softmax_topk: at most {_TOPK_MAX_EXPERTS} experts, got {n_experts}")
        if slot is not None:
            if not isinstance(slot, RouteSlot) or ids is not None or weights is not None:
                raise TypeError("softmax_topk: slot must be a RouteSlot, given without ids and weights")
            if slot.buf.shape[0] != n_tokens or slot.top_k != k:
                raise ValueError(f"softmax_topk: slot must be [{n_tokens}, {2 * k}] with top_k={k}, got "
                                 f"{slot.buf.shape} with top_k={slot.top_k}")
            _check_disjoint("softmax_topk", dict(slot=slot.buf), dict(logits=logits))
            ids, weights = slot.ids, slot.weights
        ids, ids_stride = route_rows("ids", ids, _I32, shape=(n_tokens, k))
        weights, weights_stride = route_rows("weights", weights, _F32, shape=(n_tokens, k))
        params = self.struct("TopkParams").pack(n_tokens=n_tokens, n_experts=n_experts, k=int(k),
                                                renorm=int(bool(renorm)), scale=scale, ids_stride=ids_stride,
                                                weights_stride=weights_stride)
        grid = -(-n_tokens // _TOPK_WARPS)
        epl = next((e for e in _TOPK_EPL if n_experts <= 32 * e), None)
        if (n_tokens >= _TOPK_LANES_MIN_TOKENS and n_experts % 4 == 0 and n_experts <= 32 * _TOPK_LANES_V[-1]
                and k <= _TOPK_LANES_KMAX and _aligned(logits)):
            v = next(v for v in _TOPK_LANES_V if n_experts <= 32 * v)
            m = next(m for m in _TOPK_LANES_M if k <= 4 * m)
            self._launch(f"softmax_topk_lanes<{v}, {m}>", -(-n_tokens // _TOPK_LANES_TOKENS), 8 * _TOPK_LANES_TOKENS,
                         (ids, weights, logits), params, stream=stream)
        elif epl is not None:
            self._launch(f"softmax_topk_reg<{epl}>", grid, 32 * _TOPK_WARPS, (ids, weights, logits), params,
                         stream=stream)
        else:
            self._launch("softmax_topk", grid, 32 * _TOPK_WARPS, (ids, weights, logits), params, stream=stream,
                         shared_mem=_TOPK_WARPS * n_experts * 4)
        return (ids, weights) if slot is None else slot

    @tensors(out=like("expert_out", shape=lambda a: (a("expert_out").shape[0], a("expert_out").shape[2])))
    def moe_weighted_sum(self, expert_out: cupy.ndarray, weights: cupy.ndarray | RouteSlot,
                         out: cupy.ndarray | None = None, *, accumulate: bool = False, stream=None) -> cupy.ndarray:
        """``out[t] (+)= sum_j weights[t, j] * expert_out[t, j]``: expert_out [n_tokens, n_used, n_cols] f32,
        weights [n_tokens, n_used] f32 (rows may be a stride apart) or a RouteSlot (its weights), out
        [n_tokens, n_cols] f32 (``accumulate``: add to out)."""
        check_array("expert_out", expert_out, dtype=_F32, ndim=3)
        n_tokens, n_used, n_cols = expert_out.shape
        if expert_out.size == 0:
            raise ValueError("moe_weighted_sum: expert_out must be non-empty")
        weights, w_stride = route_rows("weights", weights.weights if isinstance(weights, RouteSlot) else weights, _F32,
                                       shape=(n_tokens, n_used))
        check_array("out", out, dtype=_F32, shape=(n_tokens, n_cols))
        _check_disjoint("moe_weighted_sum", dict(out=out), dict(expert_out=expert_out, weights=weights))
        vec = n_cols % 4 == 0 and _aligned(out, expert_out)
        params = self.struct("MoeSumParams").pack(n_tokens=n_tokens, n_used=n_used, n_cols=n_cols,
                                                  accumulate=int(bool(accumulate)), w_stride=w_stride)
        grid = (_flat_grid(n_cols // 4 if vec else n_cols), min(n_tokens, _MAX_GRID_Y))
        self._launch(f"moe_weighted_sum<{_vec(vec)}>", grid, _FLAT_BLOCK, (out, expert_out, weights), params,
                     stream=stream)
        return out

    @tensors
    def shared_expert_accumulate(self, hidden: cupy.ndarray, shared_out: cupy.ndarray, gate_logit: cupy.ndarray, *,
                                 stream=None) -> cupy.ndarray:
        """``hidden[t] += sigmoid(gate_logit[t]) * shared_out[t]``: hidden, shared_out [n_tokens, n_cols]
        f32, gate_logit [n_tokens] f32 (the shared-expert gate's logit, e.g. one more router row)."""
        n_tokens, n_cols = self._rows(hidden, "hidden")
        check_array("shared_out", shared_out, dtype=_F32, shape=(n_tokens, n_cols))
        check_array("gate_logit", gate_logit, dtype=_F32, shape=(n_tokens,))
        _check_distinct("shared_expert_accumulate", hidden=hidden, shared_out=shared_out)
        vec = n_cols % 4 == 0 and _aligned(hidden, shared_out)
        params = self.struct("SharedGateParams").pack(n_tokens=n_tokens, n_cols=n_cols)
        grid = (_flat_grid(n_cols // 4 if vec else n_cols), min(n_tokens, _MAX_GRID_Y))
        self._launch(f"shared_expert_accumulate<{_vec(vec)}>", grid, _FLAT_BLOCK, (hidden, shared_out, gate_logit),
                     params, stream=stream)
        return hidden

    @tensors(logits=like("x", shape=_router_shape))
    def router_matvec(self, x: cupy.ndarray, W: cupy.ndarray, logits: cupy.ndarray | None = None, *, scale: float = 1.0,
                      stream=None) -> cupy.ndarray:
        """``logits = scale * x @ W.T``: x [n_tokens, n_embd] f32, W [n_experts, n_embd] f32 (n_embd % 4 == 0,
        16-byte aligned), logits [n_tokens, n_experts] f32."""
        return self._router("router_matvec", x, None, W, logits, 0.0, 0.0, scale, stream)

    @tensors(logits=like("x", shape=_router_shape))
    def router_rms_norm_matvec(self, x: cupy.ndarray, w_norm: cupy.ndarray, W: cupy.ndarray,
                               logits: cupy.ndarray | None = None, *, eps: float = 1e-6, weight_offset: float = 0.0,
                               scale: float = 1.0, stream=None) -> cupy.ndarray:
        """Fused router norm: ``logits = scale * (rms_norm(x) * (w_norm + weight_offset)) @ W.T`` without
        writing the normed x. Shapes as :meth:`router_matvec`; w_norm: [n_embd] f32."""
        _check_eps(eps, "router_rms_norm_matvec")
        return self._router("router_rms_norm_matvec", x, w_norm, W, logits, eps, weight_offset, scale, stream)

    def _router(self, what, x, w_norm, W, logits, eps, weight_offset, scale, stream):
        n_tokens, n_embd = self._rows(x)
        check_array("W", W, dtype=_F32, ndim=2)
        n_experts = W.shape[0]
        if W.shape[1] != n_embd or n_experts == 0:
            raise ValueError(f"{what}: W must be [n_experts, {n_embd}], got {W.shape}")
        check_array("logits", logits, dtype=_F32, shape=(n_tokens, n_experts))
        if w_norm is not None:
            check_array("w_norm", w_norm, dtype=_F32, shape=(n_embd,))
        if n_embd % 4 or not _aligned(x, W, *(() if w_norm is None else (w_norm,))):
            raise ValueError(f"{what}: needs n_embd % 4 == 0 and 16-byte aligned x, W, w_norm (n_embd={n_embd})")
        params = self.struct("RouterParams").pack(n_tokens=n_tokens, n_experts=n_experts, n_embd=n_embd,
                                                  norm=int(w_norm is not None), eps=eps, weight_offset=weight_offset,
                                                  scale=scale)
        args = (logits, x, W, w_norm if w_norm is not None else x)
        if n_tokens >= _ROUTER_GEMM_MIN_TOKENS and n_experts >= _ROUTER_GEMM_MIN_EXPERTS:
            t_tile, e_tile, threads = _ROUTER_GEMM_TILE
            bk, stages = _ROUTER_GEMM_STAGES
            grid = (-(-n_tokens // t_tile), -(-n_experts // e_tile))
            if grid[1] > _MAX_GRID_Y:
                raise ValueError(f"{what}: at most {_MAX_GRID_Y * e_tile} experts per call, got {n_experts}")
            smem = 4 * stages * ((t_tile + e_tile) * (bk + 4) + bk)  # rg_smem in moe.cuh
            self._launch(f"router_gemm<{'true' if w_norm is not None else 'false'}, {bk}, {stages}>", grid, threads,
                         args, params, stream=stream, shared_mem=smem)
            return logits
        e_tile, t_tile, threads = _ROUTER_SMALL if n_tokens < _ROUTER_BATCH else _ROUTER_LARGE
        grid = (-(-n_experts // e_tile), -(-n_tokens // t_tile))
        if grid[1] > _MAX_GRID_Y:
            raise ValueError(f"{what}: at most {_MAX_GRID_Y * t_tile} tokens per call with fewer than "
                             f"{_ROUTER_GEMM_MIN_EXPERTS} experts, got {n_tokens}")
        self._launch(f"router_matvec<{e_tile}, {t_tile}, {threads}>", grid, threads, args, params, stream=stream)
        return logits
