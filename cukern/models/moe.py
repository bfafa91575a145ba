"""The mixture-of-experts feed-forward block on the device: routing and expert work from cukern
dispatches, with no host round trip (every launch reads and writes device buffers, so a step that
holds it is graph-capturable).

For n rows of normed input h [n, d_model] (:meth:`MoeBlock.run`)::

    logits      = router h [+ router bias]                 router_matvec [bias_add]        elementwise
    ids, w      = top-k of softmax(logits) [renormalised]  softmax_topk                    elementwise
    experts     rows <= SLOT_MAX_ROWS: per (token, slot)   moe_dmmv (GLU fused), moe_down  dmmv
                more rows: slots grouped by expert         moe_route_pack, moe_dmmv_packed, moe_weighted_sum
    [gpt-oss]   + expert biases, swiglu_oai                moe_dmmv / moe_down on F32 [E, m, 4] bias
                                                           matrices and a unit input, add, swiglu_oai
    [shared]    + sigmoid(g . h) * down(silu(gate h) * up h)   dmmv_glu | GEMMs, router_matvec,
                                                               shared_expert_accumulate

The expert biases ride on the matvecs: bias b[e] is stored as an F32 expert matrix whose rows are
``(b[e][r], 0, 0, 0)``, so that ``moe_dmmv(B, u, ids)`` with ``u = (1, 0, 0, 0)`` gathers ``b[ids]`` and
``moe_down(B, u, ids, w, accumulate=True)`` adds ``sum_j w_j b[ids_j]``.

:class:`MoeBuffers` holds one row count's activations and, past SLOT_MAX_ROWS, its
:class:`~cukern.dmmv.MoeRoute` (allocated on the first, eager, run of that row count). The grouped
path (:meth:`MoeBlock._experts_grouped`) is the one place a grouped expert GEMM would replace.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from cukern.dmmv import QWeight

__all__ = ["MoeWeights", "MoeBuffers", "MoeBlock", "SLOT_MAX_ROWS", "bias_matrix"]

SLOT_MAX_ROWS = 8  # up to this many rows the experts run per (token, slot); more are grouped by expert
_UNIT = 4          # columns of the bias matrices (F32 rows are read 4 elements at a time)


def bias_matrix(bias: np.ndarray) -> np.ndarray:
    """F32 [E, m, 4] with bias [E, m] in column 0: an expert matrix whose product with (1, 0, 0, 0) is the bias."""
    b = np.zeros((*bias.shape, _UNIT), np.float32)
    b[..., 0] = bias
    return b


@dataclass
class MoeWeights:
    """One layer's experts: gate, up ([E, d_ff, d_model]) and down ([E, d_model, d_ff]) QWeights, the F32
    router [E, d_model]; gpt-oss: the router bias [E] and the bias matrices (:func:`bias_matrix`);
    a shared expert: its three QWeights and its gate [1, d_model] F32."""

    router: cupy.ndarray
    gate: QWeight
    up: QWeight
    down: QWeight
    router_bias: cupy.ndarray | None = None
    gate_bias: QWeight | None = None
    up_bias: QWeight | None = None
    down_bias: QWeight | None = None
    sh_gate: QWeight | None = None
    sh_up: QWeight | None = None
    sh_down: QWeight | None = None
    sh_router: cupy.ndarray | None = None


class MoeBuffers:
    """The block's activations for n rows (a prompt chunk, or one token per sequence of a decode batch)."""

    def __init__(self, mm, cfg, n: int):
        f, k, e, ff, d = cupy.float32, cfg.n_experts_used, cfg.n_experts, cfg.d_ff, cfg.d_model
        self.n = n
        self.logits = cupy.empty((n, e), f)
        self.ids = cupy.empty((n, k), cupy.int32)
        self.weights = cupy.empty((n, k), f)
        self.gate = cupy.empty((n, k, ff), f)
        self.up = cupy.empty((n, k, ff), f) if cfg.gpt_oss else None
        self.route = mm.plan_moe_route(n, k, e) if n > SLOT_MAX_ROWS else None
        self.down = cupy.empty((n, k, d), f) if self.route is not None else None
        # the grouped GEMMs' activated gate x up, one f16 row per slot (the down GEMM's input)
        self.hidden16 = cupy.empty((n * k, ff), cupy.float16) if self.route is not None else None
        if cfg.gpt_oss:
            unit = np.zeros((n, k, _UNIT), np.float32)
            unit[..., 0] = 1.0
            self.unit_slot = cupy.asarray(unit)                                  # moe_down's per-slot input
            self.unit_tok = cupy.asarray(np.ascontiguousarray(unit[:, 0]))     # moe_dmmv's per-token input
            self.bias = cupy.empty((n, k, ff), f)
        if cfg.shared_expert:
            fs = cfg.d_ff_shexp
            self.sh_gate, self.sh_up = cupy.empty((n, fs), f), cupy.empty((n, fs), f)
            self.sh_out = cupy.empty((n, d), f)
            self.sh_logit = cupy.empty((n, 1), f)


class MoeBlock:
    """The MoE feed-forward of one model: ``run(W, h, out)`` writes ``out [n, d_model]`` for the normed
    rows h. ``lm`` is the :class:`~cukern.models.moe_transformer.MoeTransformer` or the hybrid model (its
    ``ew``, ``mm`` and ``_matmul`` / ``_gemm_ok`` for the shared expert); ``cfg`` the
    :class:`~cukern.models.moe_config.MoeConfig` the block reads (default ``lm.cfg``)."""

    def __init__(self, lm, cfg=None):
        self.lm, self.cfg = lm, (cfg if cfg is not None else lm.cfg)
        self._bufs: dict[int, MoeBuffers] = {}

    def buffers(self, n: int) -> MoeBuffers:
        b = self._bufs.get(n)
        if b is None:
            b = self._bufs[n] = MoeBuffers(self.lm.mm, self.cfg, n)
        return b

    def run(self, W: MoeWeights, h: cupy.ndarray, out: cupy.ndarray, stream) -> None:
        c, ew = self.cfg, self.lm.ew
        mb = self.buffers(h.shape[0])
        ew.router_matvec(h, W.router, mb.logits, stream=stream)
        if W.router_bias is not None:
            ew.bias_add(mb.logits, W.router_bias, mb.logits, stream=stream)
        ew.softmax_topk(mb.logits, mb.ids, mb.weights, k=c.n_experts_used, renorm=c.norm_topk, stream=stream)
        if mb.route is None:
            self._experts_slots(W, h, mb, out, stream)
        else:
            self._experts_grouped(W, h, mb, out, stream)
        if W.sh_gate is not None:
            self._shared(W, h, mb, out, stream)

    def _gate_up(self, W: MoeWeights, h, mb: MoeBuffers, stream) -> None:
        """mb.gate = act(gate h [+ b]) * (up h [+ b]) per slot, by ``up_proj`` (slots or grouped)."""
        c, ew = self.cfg, self.lm.ew
        if not c.gpt_oss:
            return self._up_proj(W.gate, h, mb, mb.gate, stream, w_up=W.up)
        n, k, ff = mb.gate.shape
        for w, b, y in ((W.gate, W.gate_bias, mb.gate), (W.up, W.up_bias, mb.up)):
            self._up_proj(w, h, mb, y, stream)
            self._up_proj(b, mb.unit_tok, mb, mb.bias, stream)
            ew.add(y, mb.bias, y, stream=stream)
        ew.swiglu_oai(mb.gate.reshape(n * k, ff), mb.up.reshape(n * k, ff), mb.gate.reshape(n * k, ff),
                      alpha=c.swiglu_alpha, limit=c.swiglu_limit, stream=stream)

    def _up_proj(self, w: QWeight, x, mb: MoeBuffers, y, stream, w_up: QWeight | None = None) -> None:
        mm = self.lm.mm
        if mb.route is None:
            mm.moe_dmmv(w, x, mb.ids, y, w_up=w_up, act="swiglu", stream=stream)
        else:
            mm.moe_dmmv_packed(w, x, mb.ids, mb.route, y, w_up=w_up, act="swiglu", stream=stream)

    def _experts_slots(self, W: MoeWeights, h, mb: MoeBuffers, out, stream) -> None:
        """Few rows: every (token, slot) its own blocks; the down projection sums the slots."""
        mm = self.lm.mm
        self._gate_up(W, h, mb, stream)
        mm.moe_down(W.down, mb.gate, mb.ids, mb.weights, out, stream=stream)
        if W.down_bias is not None:
            mm.moe_down(W.down_bias, mb.unit_slot, mb.ids, mb.weights, out, accumulate=True, stream=stream)

    # The grouped expert GEMMs (MatmulDispatch.moe_gemm_glu / moe_gemm) replace the packed matvecs from this many
    # slots per expert on average (n_rows * top_k >= it * n_experts; None: never). A GEMM CTA multiplies
    # 32-128 slots of one expert, each expert's last tile padded: at 16 slots per expert a 32-slot tile is
    # half used, where the matvecs read each expert's weights once per 4 slots. A starting point, not yet
    # measured against them (bench_matmul's moe rows time both at 1024 tokens).
    gemm_min_slots_per_expert: int | None = 16

    def _experts_grouped(self, W: MoeWeights, h, mb: MoeBuffers, out, stream) -> None:
        """A chunk's rows: the slots grouped by expert on the device (moe_route_pack); from
        ``gemm_min_slots_per_expert`` slots per expert the grouped GEMMs (gate and up fused into the f16
        hidden, then down), else each expert's weights read once per 4 of its slots (moe_dmmv_packed);
        then the weighted sum per token."""
        mm, gm, c = self.lm.mm, self.lm.gemm, self.cfg
        mm.moe_route_pack(mb.ids, mb.route, stream=stream)
        rule, route = self.gemm_min_slots_per_expert, mb.route
        n, k, ff = mb.gate.shape
        if rule is not None and route.n_slots >= rule * route.n_experts and W.gate.qtype == W.up.qtype \
                and all(gm._moe_gemm_ok(w) for w in (W.gate, W.up, W.down)) and ff % 8 == 0:
            hid = mb.hidden16
            if c.gpt_oss:
                bias = lambda b: b.buf.view(cupy.float32).reshape(b.n_experts, b.m, _UNIT)[..., 0]  # noqa: E731
                gm.moe_gemm_glu(W.gate, W.up, h, route, hid, act="swiglu_oai", gate_bias=bias(W.gate_bias),
                                up_bias=bias(W.up_bias), alpha=c.swiglu_alpha, limit=c.swiglu_limit, stream=stream)
            else:
                gm.moe_gemm_glu(W.gate, W.up, h, route, hid, act="silu", stream=stream)
            gm.moe_gemm(W.down, hid, route, mb.down.reshape(n * k, -1), stream=stream)
        else:
            self._gate_up(W, h, mb, stream)
            mm.moe_dmmv_packed(W.down, mb.gate, mb.ids, route, mb.down, stream=stream)
        self.lm.ew.moe_weighted_sum(mb.down, mb.weights, out, stream=stream)
        if W.down_bias is not None:
            mm.moe_down(W.down_bias, mb.unit_slot, mb.ids, mb.weights, out, accumulate=True, stream=stream)

    def _shared(self, W: MoeWeights, h, mb: MoeBuffers, out, stream) -> None:
        """out += sigmoid(h . g) * down(silu(gate h) * up h)."""
        lm, n = self.lm, h.shape[0]
        alike = (W.sh_gate.qtype, W.sh_gate.m, W.sh_gate.k) == (W.sh_up.qtype, W.sh_up.m, W.sh_up.k)
        if alike and not lm._gemm_ok(W.sh_gate, n):
            lm.mm.dmmv_glu(W.sh_gate, W.sh_up, h, mb.sh_gate, act="swiglu", stream=stream)
        else:
            lm._matmul(W.sh_gate, h, mb.sh_gate, stream)
            lm._matmul(W.sh_up, h, mb.sh_up, stream)
            lm.ew.swiglu(mb.sh_gate, mb.sh_up, mb.sh_gate, stream=stream)
        lm._matmul(W.sh_down, mb.sh_gate, mb.sh_out, stream)
        lm.ew.router_matvec(h, W.sh_router, mb.sh_logit, stream=stream)
        lm.ew.shared_expert_accumulate(out, mb.sh_out, mb.sh_logit.reshape(n), stream=stream)
