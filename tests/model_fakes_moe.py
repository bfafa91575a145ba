"""NumPy stand-ins for the MoE dispatch methods that cukern.models.moe and moe_transformer drive (the
dense model's fakes are model_fakes.py), so that the MoE models' orchestration (routing buffers, the
per-slot and expert-grouped paths, the bias matrices, the shared expert, sinks, YaRN's scale, chunk
and decode graphs) runs on a machine without a GPU. Each fake does in float64 what its method's
docstring says; the route fake checks that a grouped launch reads a route packed from its own ids.
"""

from __future__ import annotations

import types

import numpy as np

import cukern.models.moe as M
import cukern.models.moe_transformer as MT
from cukern.reference import models as R
from cukern.reference import models_moe as RM
from model_fakes import (Attention, Dmmv, Elementwise, Matmul, Tokens, Weight, _gather, _window, fake_base, fake_cupy,
                         wrap)


class ExpertWeight(Weight):
    """Stands in for an expert QWeight: dense [n_experts, m, k]."""

    def __init__(self, dense, qtype):
        self.dense, self.qtype = dense, qtype
        self.n_experts, self.m, self.k = dense.shape


class MoeElementwise(Elementwise):
    def qk_norm_rope_kv_write(self, q, k, v, wq, wk, q_out, k_cache, v_cache, page_table, positions, seq_ids, *,
                              attn_scale=1.0, **kw):
        super().qk_norm_rope_kv_write(q, k, v, wq, wk, q_out, k_cache, v_cache, page_table, positions, seq_ids, **kw)
        q_out *= attn_scale
        for t in range(q.shape[0]):  # the rows just written, scaled like Q
            pos, seq = (positions[0] + t, seq_ids[0]) if kw["pos_mode"] == "consecutive" else (positions[t], seq_ids[t])
            page = page_table[seq, pos // k_cache.shape[1]]
            k_cache[page, pos % k_cache.shape[1]] *= attn_scale

    def router_matvec(self, x, W, logits, *, scale=1.0, stream=None):
        logits[...] = scale * (np.asarray(x) @ np.asarray(W).T)

    def softmax_topk(self, logits, ids, weights, *, k, renorm=True, scale=1.0, stream=None):
        i, w = RM.route(np.asarray(logits, np.float64), k, renorm=renorm)
        ids[...], weights[...] = i, scale * w

    def add(self, a, b, out, stream=None):
        out[...] = np.asarray(a) + np.asarray(b)

    def swiglu_oai(self, gate, up, out, *, alpha, limit, stream=None):
        out[...] = RM.swiglu_oai(np.asarray(gate), np.asarray(up), alpha, limit)

    def moe_weighted_sum(self, expert_out, weights, out, *, accumulate=False, stream=None):
        s = np.einsum("tj,tjc->tc", np.asarray(weights), np.asarray(expert_out))
        out[...] = (out + s) if accumulate else s

    def shared_expert_accumulate(self, hidden, shared_out, gate_logit, *, stream=None):
        hidden += np.asarray(shared_out) / (1.0 + np.exp(-np.asarray(gate_logit)))[:, None]


class MoeAttention(Attention):
    def flash_attn_batched(self, plan, layer, q, out, *, causal, scale, window_left, sinks=None, stream=None):
        row = 0
        for s, n in zip(plan.seq_ids, plan.q_lens):
            kv = int(plan.cache.lengths[s])
            k, v = _gather(plan.cache, layer, s, kv)
            out[row:row + n] = RM.attention_sinks(np.asarray(q[row:row + n]), k, v, np.arange(kv - n, kv),
                                                  np.arange(kv), scale, _window(window_left), sinks)
            row += n

    def flash_attn_decode(self, plan, layer, q, out, *, scale, window_left, sinks=None, stream=None):
        for b, s in enumerate(plan.seq_ids):
            kv = int(plan.cache.lengths[s])
            k, v = _gather(plan.cache, layer, s, kv)
            out[b:b + 1] = RM.attention_sinks(np.asarray(q[b:b + 1]), k, v, np.array([kv - 1]), np.arange(kv),
                                              scale, _window(window_left), sinks)


class MoeDmmv(Dmmv):
    """The MoE matvecs; ``calls`` counts them by name (which path ran)."""

    def __init__(self):
        self.calls, self.flag = {}, 0

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def _slots(self, w, x, ids, w_up=None, act="swiglu"):
        ids = np.asarray(ids)
        if (ids < 0).any() or (ids >= w.n_experts).any():
            self.flag |= 1
            ids = np.where((ids >= 0) & (ids < w.n_experts), ids, -1)
        x = np.asarray(x)
        y = np.zeros((*ids.shape, w.m))
        for t in range(ids.shape[0]):
            for j in range(ids.shape[1]):
                if ids[t, j] < 0:
                    continue
                xi = x[t, j] if x.ndim == 3 else x[t]
                g = w.dense[ids[t, j]] @ xi
                y[t, j] = g if w_up is None else R.silu(g) * (w_up.dense[ids[t, j]] @ xi)
        return y

    def moe_dmmv(self, w, x, ids, y, *, w_up=None, act="swiglu", alpha=1.0, stream=None):
        assert ids.shape[0] <= M.SLOT_MAX_ROWS
        self._count("moe_dmmv")
        y[...] = alpha * self._slots(w, x, ids, w_up, act)

    def plan_moe_route(self, n_tokens, top_k, n_experts):
        return types.SimpleNamespace(n_slots=n_tokens * top_k, n_experts=n_experts, packed_from=None)

    def moe_route_pack(self, ids, route, *, stream=None):
        self._count("moe_route_pack")
        route.packed_from = np.array(ids)

    def moe_dmmv_packed(self, w, x, ids, route, y, *, w_up=None, act="swiglu", alpha=1.0, stream=None):
        assert route.packed_from is not None and np.array_equal(route.packed_from, ids), "route packed from other ids"
        assert route.n_experts == w.n_experts
        self._count("moe_dmmv_packed")
        y[...] = alpha * self._slots(w, x, ids, w_up, act)

    def moe_down(self, w, h, ids, weights, y, *, accumulate=False, alpha=1.0, stream=None):
        self._count("moe_down")
        s = alpha * np.einsum("tj,tjc->tc", np.asarray(weights), self._slots(w, h, ids))
        y[...] = (y + s) if accumulate else s

    def check_errors(self, *, reset=True):
        v, self.flag = self.flag, 0 if reset else self.flag
        if v & 1:
            raise MT.DeviceError("a MoE kernel met an expert id outside [0, n_experts)")


class MoeMatmul(Matmul, MoeDmmv):
    def __init__(self):
        Matmul.__init__(self)
        MoeDmmv.__init__(self)


def fake_moe_weights(model, cfg, i, dense, weight):
    """Layer i's MoeWeights on the fakes: ``dense(name)`` a float64 tensor, ``weight(name)`` a matrix's
    Weight; ``cfg`` the MoeConfig (gpt-oss's biases as bias matrices, the shared expert where it has one)."""
    b = f"blk.{i}."

    def experts(name):
        return ExpertWeight(dense(name), int(model[name].qtype))

    def bias(name):
        return ExpertWeight(M.bias_matrix(dense(name)).astype(np.float64), 0)

    W = M.MoeWeights(router=wrap(dense(b + "ffn_gate_inp.weight")), gate=experts(b + "ffn_gate_exps.weight"),
                     up=experts(b + "ffn_up_exps.weight"), down=experts(b + "ffn_down_exps.weight"))
    if cfg.gpt_oss:
        W.router_bias = wrap(dense(b + "ffn_gate_inp.bias"))
        W.gate_bias, W.up_bias = bias(b + "ffn_gate_exps.bias"), bias(b + "ffn_up_exps.bias")
        W.down_bias = bias(b + "ffn_down_exps.bias")
    if cfg.shared_expert:
        W.sh_gate, W.sh_up = weight(b + "ffn_gate_shexp.weight"), weight(b + "ffn_up_shexp.weight")
        W.sh_down, W.sh_router = weight(b + "ffn_down_shexp.weight"), wrap(dense(b + "ffn_gate_inp_shexp.weight")[None])
    return W


def fake_moe_transformer(model, monkeypatch, *, max_seqs, max_tokens, page_size, prefill_chunk):
    """A MoeTransformer over ``model`` (a GGUFModel with experts) on the fakes."""
    t, dense, weight, vector = fake_base(MT.MoeTransformer, model, monkeypatch, max_seqs=max_seqs,
                                         max_tokens=max_tokens, page_size=page_size, prefill_chunk=prefill_chunk)
    monkeypatch.setattr(M, "cupy", fake_cupy)
    c = model.config

    t.ew, t.attn, t.tok = MoeElementwise(), MoeAttention(), Tokens(dense("token_embd.weight"))
    t.mm = t.gemm = MoeMatmul()
    t.layers = []
    for i in range(c.n_layers):
        b = f"blk.{i}."
        W = fake_moe_weights(model, c, i, dense, weight)
        t.layers.append(MT._MoeLayer(
            attn_norm=vector(b + "attn_norm.weight"), wq=weight(b + "attn_q.weight"), wk=weight(b + "attn_k.weight"),
            wv=weight(b + "attn_v.weight"), wo=weight(b + "attn_output.weight"), ffn_norm=vector(b + c.ffn_norm_name),
            wg=W.gate, wu=W.up, wd=W.down, q_norm=vector(b + "attn_q_norm.weight"),
            k_norm=vector(b + "attn_k_norm.weight"), bq=vector(b + "attn_q.bias"), bk=vector(b + "attn_k.bias"),
            bv=vector(b + "attn_v.bias"), moe=W, bo=vector(b + "attn_output.bias"),
            sinks=vector(b + "attn_sinks.weight")))
    t.output_norm = vector("output_norm.weight")
    t.rope_freqs = {local: None if c.rope_is_plain(local) else c.rope_inv_freq(local) for local in (False, True)}
    t.rope_kwargs = {"attn_scale": c.rope_mscale} if c.yarn else {}
    t.embed_table, t.embed_qtype = None, int(model["token_embd.weight"].qtype)
    t.head = t.head_mv = weight("token_embd.weight" if c.tied_output else "output.weight")
    t._dec, t._chunks, t._stream = None, {}, None
    t.moe = M.MoeBlock(t)
    return t
