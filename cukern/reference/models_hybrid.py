"""NumPy forward of the DeltaNet hybrid (``qwen3next``, cukern/models/hybrid.py), float64 by default.

Each layer: ``x += mixer(rms_norm(x))``, then ``x += ffn(rms_norm(x, post_attention_norm))``; the mixer is
a gated DeltaNet layer or, every ``full_attention_interval``-th layer, gated full attention.

DeltaNet, per token t (state carried across calls, like the K/V cache)::

    qkv = W_qkv h; z = W_gate h; b, alpha = W_ba h      (per key head: its value heads' b, then alpha)
    q|k|v = silu(causal conv1d(qkv))                     (taps over the last conv_kernel inputs)
    q, k = q / sqrt(|q|^2 + eps), k / sqrt(|k|^2 + eps)  (per head)
    beta = sigmoid(b); g = ssm_a * softplus(alpha + dt_bias)
    per value head h (key head h // (n_v / n_k)):
        S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q / sqrt(dk)
    out = W_out (rms_norm(o) * ssm_norm * silu(z))      (per value head)

Full attention: ``[q | gate] = W_q h`` per head, Q/K RMS norm, NeoX RoPE over the first ``rope_dim`` dims
of a head, causal GQA attention, ``out = W_o (o * sigmoid(gate))``. The FFN is the one registered in
:data:`FFN_REFERENCES` under the config's ``ffn`` kind: the dense SwiGLU, or Qwen3-Next's MoE block (the MoE
reference's :func:`cukern.reference.models_moe.moe_ffn` over ``cfg.moe``: routed experts plus the
sigmoid-gated shared expert).
"""

from __future__ import annotations

import numpy as np

from cukern.reference.models import ReferenceModel, attention, rms_norm, rope, silu
from cukern.reference.models_moe import moe_ffn

__all__ = ["HybridReference", "FFN_REFERENCES", "dense_ffn"]


def dense_ffn(model: "HybridReference", i: int, h: np.ndarray) -> np.ndarray:
    b = f"blk.{i}."
    g, u = h @ model.w(b + "ffn_gate.weight").T, h @ model.w(b + "ffn_up.weight").T
    return (silu(g) * u) @ model.w(b + "ffn_down.weight").T


# FFN kind (HybridConfig.ffn) -> fn(model, layer, h [T, d]) -> [T, d]
FFN_REFERENCES = {"dense": dense_ffn, "moe": lambda model, i, h: moe_ffn(model.cfg.moe, model.w, i, h)}


def _l2(x, eps):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


class HybridReference(ReferenceModel):
    """Forward pass of a ``qwen3next`` :class:`cukern.models.GGUFModel`; ``conv`` / ``ssm`` hold every
    DeltaNet layer's recurrent state (None for attention layers)."""

    def reset(self) -> None:
        super().reset()
        c = self.cfg
        self._n = 0
        self.conv = [np.zeros((c.conv_kernel - 1, c.conv_channels), self.dtype) if r else None for r in c.recurrent]
        self.ssm = [np.zeros((c.ssm_v_heads, c.ssm_dk, c.ssm_dv), self.dtype) if r else None for r in c.recurrent]

    @property
    def n_cached(self) -> int:
        return self._n

    def w(self, name: str) -> np.ndarray:
        if self.cfg.ssm_in_legacy and name.endswith(("attn_qkv.weight", "attn_gate.weight")) and name not in self._w:
            from cukern.models.hybrid_config import legacy_rows
            rows = legacy_rows(self.cfg)[0 if name.endswith("attn_qkv.weight") else 1]
            self._w[name] = np.ascontiguousarray(self.w(name.rsplit(".", 2)[0] + ".ssm_in.weight")[rows])
        return super().w(name)

    def hidden(self, tokens) -> np.ndarray:
        out = super().hidden(tokens)
        self._n += int(np.asarray(tokens).size)
        return out

    def _layer(self, i: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        c, b = self.cfg, f"blk.{i}."
        h = rms_norm(x, self.w(b + "attn_norm.weight"), c.rms_eps)
        x = x + (self._deltanet(i, h) if c.recurrent[i] else self._attention(i, h, pos))
        h = rms_norm(x, self.w(b + "post_attention_norm.weight"), c.rms_eps)
        ffn = FFN_REFERENCES.get(c.ffn)
        if ffn is None:
            raise NotImplementedError(f"no reference for the {c.ffn!r} FFN: register one in "
                                      f"cukern.reference.models_hybrid.FFN_REFERENCES")
        return x + ffn(self, i, h)

    def _attention(self, i, h, pos):
        c, b = self.cfg, f"blk.{i}."
        T, hd = h.shape[0], c.head_dim
        qg = (h @ self.w(b + "attn_q.weight").T).reshape(T, c.n_heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(T, c.q_dim)
        k = (h @ self.w(b + "attn_k.weight").T).reshape(T, c.n_kv_heads, hd)
        v = (h @ self.w(b + "attn_v.weight").T).reshape(T, c.n_kv_heads, hd)
        q = rms_norm(q, self.w(b + "attn_q_norm.weight"), c.rms_eps)
        k = rms_norm(k, self.w(b + "attn_k_norm.weight"), c.rms_eps)
        rd = c.rope_dim
        q = np.concatenate([rope(q[..., :rd], pos, c.rope_base, True), q[..., rd:]], axis=-1)
        k = np.concatenate([rope(k[..., :rd], pos, c.rope_base, True), k[..., rd:]], axis=-1)
        self.k[i] = np.concatenate([self.k[i], k])
        self.v[i] = np.concatenate([self.v[i], v])
        o = attention(q, self.k[i], self.v[i], pos, np.arange(self.k[i].shape[0]), c.attn_scale)
        o = o.reshape(T, c.q_dim) / (1.0 + np.exp(-gate))
        return o @ self.w(b + "attn_output.weight").T

    def _deltanet(self, i, h):
        c, b = self.cfg, f"blk.{i}."
        T, K = h.shape[0], c.conv_kernel
        n_k, n_v, dk, dv = c.ssm_k_heads, c.ssm_v_heads, c.ssm_dk, c.ssm_dv
        group = n_v // n_k
        qkv = h @ self.w(b + "attn_qkv.weight").T                                   # [T, channels]
        z = (h @ self.w(b + "attn_gate.weight").T).reshape(T, n_v, dv)
        ba = (h @ self.w(b + "ssm_ba.weight").T).reshape(T, n_k, 2, group)
        beta = 1.0 / (1.0 + np.exp(-ba[:, :, 0].reshape(T, n_v)))
        x = ba[:, :, 1].reshape(T, n_v) + self.w(b + "ssm_dt.bias")
        g = self.w(b + "ssm_a") * np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))
        seq = np.concatenate([self.conv[i], qkv])                                  # [K - 1 + T, channels]
        taps = self.w(b + "ssm_conv1d.weight")                                     # [channels, K], oldest first
        y = sum(taps[:, j] * seq[j:j + T] for j in range(K))
        y = silu(y)
        self.conv[i] = seq[-(K - 1):].copy()
        qk = n_k * dk
        q = _l2(y[:, :qk].reshape(T, n_k, dk), c.rms_eps)
        k = _l2(y[:, qk:2 * qk].reshape(T, n_k, dk), c.rms_eps)
        v = y[:, 2 * qk:].reshape(T, n_v, dv)
        S, o, scale = self.ssm[i], np.empty((T, n_v, dv), self.dtype), dk ** -0.5
        for t in range(T):
            for hv in range(n_v):
                kt, qt = k[t, hv // group], q[t, hv // group]
                S[hv] *= np.exp(g[t, hv])
                S[hv] += np.outer(kt, beta[t, hv] * (v[t, hv] - S[hv].T @ kt))
                o[t, hv] = S[hv].T @ qt * scale
        o = rms_norm(o, self.w(b + "ssm_norm.weight"), c.rms_eps) * silu(z)
        return o.reshape(T, n_v * dv) @ self.w(b + "ssm_out.weight").T
