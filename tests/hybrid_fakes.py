"""NumPy stand-ins for what cukern.models.hybrid adds to the Transformer's dispatches (tests/model_fakes.py):
the DeltaNet kernels, the Q/gate deinterleave, the gated output, partial RoPE, and a HybridCache, so that
HybridModel's orchestration (per-slot recurrent state, prompt chunks keyed by slot, batched decode through a
replayed "graph") runs on a machine without a GPU, in float64, against the model reference. A MoE file's FFN
runs the real MoeBlock on tests/model_fakes_moe.py's routing and expert fakes.
"""

from __future__ import annotations

import numpy as np

import cukern.models.hybrid as H
import cukern.models.moe as M
from cukern.reference import elementwise as E
from cukern.reference import models as R
import cukern.models.layers as L
import cukern.models.transformer as T
from model_fakes import (Attention, Dmmv, Elementwise, FakeGraph, FakeStream, Matmul, NormedX, PagedCache, Plan,
                         Tokens, Weight, fake_cupy, wrap)
from model_fakes_moe import MoeElementwise, MoeMatmul, fake_moe_weights


class HybridElementwise(Elementwise):
    def deinterleave(self, x, q, gate, stream=None):
        d = q.shape[-1]
        q[...], gate[...] = x[..., :d], x[..., d:]

    def sigmoid_mul(self, x, g, out, stream=None):
        out[...] = np.asarray(x) / (1.0 + np.exp(-np.asarray(g)))

    def qk_norm_rope_kv_write(self, q, k, v, wq, wk, q_out, k_cache, v_cache, page_table, positions, seq_ids, *,
                              eps, rope_dim, neox, freq_base, pos_mode, stream=None):
        page_size, rd = k_cache.shape[1], rope_dim
        for t in range(q.shape[0]):
            pos, seq = (positions[0] + t, seq_ids[0]) if pos_mode == "consecutive" else (positions[t], seq_ids[t])
            p = np.array([pos])
            qt, kt = R.rms_norm(np.asarray(q[t:t + 1]), wq, eps), R.rms_norm(np.asarray(k[t:t + 1]), wk, eps)
            qt[..., :rd] = R.rope(qt[..., :rd], p, freq_base, neox)
            kt[..., :rd] = R.rope(kt[..., :rd], p, freq_base, neox)
            q_out[t] = qt[0]
            page = page_table[seq, pos // page_size]
            assert page >= 0, f"write to an unassigned page: sequence {seq}, position {pos}"
            k_cache[page, pos % page_size] = kt[0]
            v_cache[page, pos % page_size] = v[t]

    def deltanet_gates(self, ba, a, dt_bias, g, beta, *, group, stream=None):
        g[...], beta[...] = E.deltanet_gates(ba, a, dt_bias, group=group)

    def conv1d_silu(self, x, state, w, y, stream=None):
        y[...], state[...] = E.conv1d_silu(x, state, w)

    def group_norm(self, x, out, *, group_size, l2=False, eps, stream=None):
        out[...] = E.group_norm(x, group_size=group_size, l2=l2, eps=eps)

    def deltanet(self, q, k, v, g, beta, state, o, *, q_scale, stream=None):
        o[...], state[...] = E.deltanet(q, k, v, g, beta, state, q_scale=q_scale)

    def gated_rms_norm(self, y, z, w, out, *, group_size, eps, stream=None):
        out[...] = E.group_norm(y, group_size=group_size, w=w, z=z, eps=eps)


class HybridMoeElementwise(HybridElementwise, MoeElementwise):
    """The hybrid's fakes plus the MoE block's (routing, the shared expert's gate); partial RoPE the hybrid's."""


class FakeHybridCache(PagedCache):
    """The fakes' paged cache of the attention layers plus HybridCache's per-slot states."""

    def __init__(self, cfg, n_pages, page_size, *, max_seqs, max_pages_per_seq):
        super().__init__(len(cfg.attn_layers), n_pages, page_size, cfg.n_kv_heads, cfg.head_dim, max_seqs=max_seqs,
                         max_pages_per_seq=max_pages_per_seq)
        self.states = {i: {k: wrap(np.full((max_seqs,) + s, np.nan)) for k, s in cfg.state_shapes().items()}
                       for i, r in enumerate(cfg.recurrent) if r}
        self.resets = 0

    def add(self, length=0, stream=None):
        slot = super().add(length, stream)
        H.HybridCache.reset_state(self, slot, stream=_NoStream())
        self.resets += 1
        return slot


class _NoStream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def fake_hybrid(model, monkeypatch, *, max_seqs, max_tokens, page_size, prefill_chunk):
    """A HybridModel over ``model`` (a qwen3next GGUFModel) whose dispatches, cache and CuPy are fakes."""
    for mod, name, value in ((T, "cupy", fake_cupy), (H, "cupy", fake_cupy), (M, "cupy", fake_cupy),
                             (T, "SamplePlan", Plan),
                             (T, "resolve_stream", lambda s=None: s if s is not None else FakeStream()),
                             (T, "capture_graph", lambda fn, stream=None: FakeGraph(fn, stream)),
                             (T, "check_array", lambda name, a, **kw: a), (L, "NormedX", NormedX),
                             (T, "_address", lambda a: a.ctypes.data)):
        monkeypatch.setattr(mod, name, value)
    c = model.config
    t = H.HybridModel.__new__(H.HybridModel)
    t.model, t.cfg = model, c
    t.max_seqs, t.max_tokens, t.prefill_chunk = max_seqs, max_tokens, prefill_chunk
    pages = -(-max_tokens // page_size)
    t.cache = FakeHybridCache(c, max_seqs * pages, page_size, max_seqs=max_seqs, max_pages_per_seq=pages)
    from cukern.reference.models_hybrid import HybridReference
    dense = HybridReference(c, model).w    # dequantized (the legacy in-projection regrouped) float64

    def weight(name, rows=None):
        d = dense(name)
        src = name if name in model.tensors else name.rsplit(".", 2)[0] + ".ssm_in.weight"  # legacy
        return Weight(d if rows is None else d[rows[0]:rows[1]], int(model[src].qtype))

    def vec(name):
        return wrap(dense(name))

    moe = c.ffn == "moe"
    t.ew, t.attn, t.mm, t.gemm, t.tok = (HybridMoeElementwise() if moe else HybridElementwise(), Attention(), Dmmv(),
                                         Matmul(), Tokens(dense("token_embd.weight")))
    if moe:
        t.mm = t.gemm = MoeMatmul()
    t.moe = M.MoeBlock(t, c.moe) if moe else None
    qk, v = c.qk_channels, c.v_channels
    t.layers = []
    for i in range(c.n_layers):
        b = f"blk.{i}."
        ffn = H.MoeFFN(fake_moe_weights(model, c.moe, i, dense, weight), t.moe) if moe else \
            H.DenseFFN(weight(b + "ffn_gate.weight"), weight(b + "ffn_up.weight"), weight(b + "ffn_down.weight"))
        if c.recurrent[i]:
            taps = vec(b + "ssm_conv1d.weight")
            t.layers.append(H._DeltaNetLayer(
                attn_norm=vec(b + "attn_norm.weight"), ffn_norm=vec(b + "post_attention_norm.weight"),
                wq=weight(b + "attn_qkv.weight", (0, qk)), wk=weight(b + "attn_qkv.weight", (qk, 2 * qk)),
                wv=weight(b + "attn_qkv.weight", (2 * qk, 2 * qk + v)), wz=weight(b + "attn_gate.weight"),
                wba=weight(b + "ssm_ba.weight"), wo=weight(b + "ssm_out.weight"),
                conv=(taps[:qk], taps[qk:2 * qk], taps[2 * qk:]), a=vec(b + "ssm_a"), dt_bias=vec(b + "ssm_dt.bias"),
                norm=vec(b + "ssm_norm.weight"), ffn=ffn))
        else:
            t.layers.append(H._AttnLayer(
                attn_norm=vec(b + "attn_norm.weight"), ffn_norm=vec(b + "post_attention_norm.weight"),
                wq=weight(b + "attn_q.weight"), wk=weight(b + "attn_k.weight"), wv=weight(b + "attn_v.weight"),
                wo=weight(b + "attn_output.weight"), q_norm=vec(b + "attn_q_norm.weight"),
                k_norm=vec(b + "attn_k_norm.weight"), cache_layer=c.attn_layers.index(i), ffn=ffn))
    t.output_norm = vec("output_norm.weight")
    t.rope_freqs = {False: None, True: None}
    t.embed_table, t.embed_qtype = None, int(model["token_embd.weight"].qtype)
    t.head = t.head_mv = weight("token_embd.weight" if c.tied_output else "output.weight")
    t._dec, t._chunks, t._stream = None, {}, None
    return t
