"""NumPy forward of the mixture-of-experts architectures (``qwen3moe``, ``qwen2moe``, ``gpt-oss``).

:class:`MoeReferenceModel` is :class:`cukern.reference.models.ReferenceModel` with a MoE layer
(``ReferenceModel(config, weights)`` builds one for a :class:`cukern.models.moe_config.MoeConfig`).
Everything in float64 from the dequantized GGUF tensors, written plainly:

* routing: ``p = softmax(router h [+ bias])``, the k largest (ties: lower id first), weights ``p[top]``,
  renormalised to sum to 1 where the arch does (qwen3moe; gpt-oss's softmax over the k selected
  logits is the same numbers); qwen2moe keeps ``p[top]``;
* each selected expert: ``down_e(act(gate_e h [+ b]) * (up_e h [+ b])) [+ b]``, act SiLU, or gpt-oss's
  ``swiglu_oai`` (gate clamped above at ``limit``, up to ``[-limit, limit]``, ``g sigmoid(alpha g) (u + 1)``);
* the shared expert: ``+ sigmoid(h . g_shexp) * down(silu(gate h) * up h)``;
* gpt-oss attention: one sink logit per head in the softmax's denominator, sliding-window layers,
  YaRN angles (:func:`cukern.models.moe_config.yarn_inv_freq`) and its mscale on the rotated Q and K.
"""

from __future__ import annotations

import numpy as np

from cukern.reference.models import ReferenceModel, rms_norm, rope, silu

__all__ = ["MoeReferenceModel", "moe_ffn", "route", "swiglu_oai", "attention_sinks"]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def route(logits: np.ndarray, k: int, *, renorm: bool) -> tuple[np.ndarray, np.ndarray]:
    """(ids [T, k] in descending logit order, ties lower id first; weights [T, k])."""
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(_softmax(logits), ids, axis=-1)
    if renorm:
        w = w / w.sum(axis=-1, keepdims=True)
    return ids, w


def swiglu_oai(gate: np.ndarray, up: np.ndarray, alpha: float = 1.702, limit: float = 7.0) -> np.ndarray:
    g, u = np.minimum(gate, limit), np.clip(up, -limit, limit)
    return g / (1.0 + np.exp(-alpha * g)) * (u + 1.0)


def attention_sinks(q, k, v, q_pos, k_pos, scale: float, window: int, sinks) -> np.ndarray:
    """Causal GQA attention (as cukern.reference.models.attention) with one extra logit per head,
    ``sinks [H]``, in the denominator (never attended to)."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("thd,shd->hts", q, k) * scale
    delta = q_pos[:, None] - k_pos[None, :]
    visible = (delta >= 0) & ((delta < window) if window else True)
    s = np.where(visible[None], s, -np.inf)
    sink = np.asarray(sinks, s.dtype)[:, None, None] if sinks is not None else None
    m = s.max(axis=-1, keepdims=True) if sink is None else np.maximum(s.max(axis=-1, keepdims=True), sink)
    p = np.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True) + (np.exp(sink - m) if sink is not None else 0.0)
    return np.einsum("hts,shd->thd", p / denom, v)


def moe_ffn(cfg, w, i: int, h: np.ndarray) -> np.ndarray:
    """The MoE feed-forward block of layer i on normed inputs h [T, d_model]: ``cfg`` a
    :class:`~cukern.models.moe_config.MoeConfig`, ``w(name)`` a tensor as a float array."""
    c, b = cfg, f"blk.{i}."
    logits = h @ w(b + "ffn_gate_inp.weight").T
    if c.gpt_oss:
        logits = logits + w(b + "ffn_gate_inp.bias")
    ids, weights = route(logits, c.n_experts_used, renorm=c.norm_topk)
    wg, wu, wd = (w(b + f"ffn_{n}_exps.weight") for n in ("gate", "up", "down"))
    out = np.zeros_like(h)
    for e in np.unique(ids):
        t, j = np.nonzero(ids == e)
        g, u = h[t] @ wg[e].T, h[t] @ wu[e].T
        if c.gpt_oss:
            g, u = g + w(b + "ffn_gate_exps.bias")[e], u + w(b + "ffn_up_exps.bias")[e]
            a = swiglu_oai(g, u, c.swiglu_alpha, c.swiglu_limit)
        else:
            a = silu(g) * u
        y = a @ wd[e].T
        if c.gpt_oss:
            y = y + w(b + "ffn_down_exps.bias")[e]
        np.add.at(out, t, weights[t, j][:, None] * y)
    if c.shared_expert:
        s = (silu(h @ w(b + "ffn_gate_shexp.weight").T) * (h @ w(b + "ffn_up_shexp.weight").T)) \
            @ w(b + "ffn_down_shexp.weight").T
        gate = h @ w(b + "ffn_gate_inp_shexp.weight")
        out = out + s / (1.0 + np.exp(-gate))[:, None]
    return out


class MoeReferenceModel(ReferenceModel):
    """The float64 forward of a MoE GGUF model (see the module docstring)."""

    def _attention(self, i: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        c, b = self.cfg, f"blk.{i}."
        T = x.shape[0]
        q, k, v = self._qkv(i, x)
        local = c.local_layers[i]
        inv, mscale = c.rope_inv_freq(local), c.rope_mscale
        q, k = rope(q, pos, 0.0, c.rope_neox, inv) * mscale, rope(k, pos, 0.0, c.rope_neox, inv) * mscale
        self.k[i] = np.concatenate([self.k[i], k])
        self.v[i] = np.concatenate([self.v[i], v])
        sinks = self.w(b + "attn_sinks.weight") if c.gpt_oss else None
        o = attention_sinks(q, self.k[i], self.v[i], pos, np.arange(self.k[i].shape[0]), c.attn_scale,
                            c.sliding_window if local else 0, sinks)
        o = o.reshape(T, c.q_dim) @ self.w(b + "attn_output.weight").T
        return o + self.w(b + "attn_output.bias") if c.gpt_oss else o

    def moe(self, i: int, h: np.ndarray) -> np.ndarray:
        """The MoE feed-forward block of layer i on normed inputs h [T, d_model]: :func:`moe_ffn`."""
        return moe_ffn(self.cfg, self.w, i, h)

    def _layer(self, i: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        x = x + self._attention(i, x, pos)
        return x + self.moe(i, rms_norm(x, self.w(f"blk.{i}." + self.cfg.ffn_norm_name), self.cfg.rms_eps))
