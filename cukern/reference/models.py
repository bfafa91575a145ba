"""NumPy forward passes of the model architectures cukern runs (cukern/models/).

The ground truth the GPU forward is compared with: weights dequantized by
``gguf.quants.dequantize`` (the reference of record for GGUF blocks), every
step written out plainly, float64 by default (float32 for the real model,
where a float64 copy of a 262k-row embedding would cost 1.3 GB for little gain).

:class:`ReferenceModel` keeps a contiguous K/V cache per layer, so the same
code runs a whole prompt (prefill) or one token at a time (decode).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ReferenceModel", "rms_norm", "rope", "gelu_tanh", "silu", "attention"]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x**2) + eps) * w`` over the last axis (GGUF Gemma weights already hold 1 + w)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, positions: np.ndarray, base: float, neox: bool, inv_freq=None) -> np.ndarray:
    """Rotary embedding of ``x [T, H, D]`` at ``positions [T]``.

    Pair i (0 <= i < D/2) turns by ``pos * base**(-2i/D)`` (or ``pos * inv_freq[i]``); NeoX pairs
    (i, i + D/2), else (2i, 2i + 1)."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d) if inv_freq is None else np.asarray(inv_freq)
    ang = positions.astype(np.float64)[:, None] * inv[None, :]            # [T, D/2]
    cos, sin = np.cos(ang)[:, None, :].astype(x.dtype), np.sin(ang)[:, None, :].astype(x.dtype)
    if neox:
        x0, x1 = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    return out


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def attention(q, k, v, q_pos, k_pos, scale: float, window: int = 0) -> np.ndarray:
    """Causal GQA attention. q: [T, Hq, D]; k, v: [S, Hkv, D]; key j visible to query i when
    ``k_pos[j] <= q_pos[i]`` and (window > 0) ``q_pos[i] - k_pos[j] < window``. Returns [T, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    s = np.einsum("thd,shd->hts", q, k) * scale                               # [H, T, S]
    delta = q_pos[:, None] - k_pos[None, :]
    visible = delta >= 0
    if window:
        visible &= delta < window
    s = np.where(visible[None], s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, v)


class ReferenceModel:
    """Forward pass of a :class:`cukern.models.GGUFModel` (or any ``config`` + ``weights`` mapping).

    ``weights[name]`` is a float array in PyTorch order (``[out, in]`` for matrices); with a
    GGUFModel the tensors are dequantized on first use and kept. A config with experts builds a
    :class:`cukern.reference.models_moe.MoeReferenceModel`."""

    def __new__(cls, config, *args, **kwargs):
        if cls is ReferenceModel and getattr(config, "n_experts", 0):
            from cukern.reference.models_moe import MoeReferenceModel
            cls = MoeReferenceModel
        return super().__new__(cls)

    def __init__(self, config, weights, *, dtype=np.float64):
        self.cfg = config
        self.dtype = np.dtype(dtype)
        self._src = weights
        self._w: dict[str, np.ndarray] = {}
        self.reset()

    def reset(self) -> None:
        """Forget every cached position."""
        self.k = [np.zeros((0, self.cfg.n_kv_heads, self.cfg.head_dim), self.dtype) for _ in range(self.cfg.n_layers)]
        self.v = [np.zeros_like(k) for k in self.k]

    @property
    def n_cached(self) -> int:
        return self.k[0].shape[0]

    def w(self, name: str) -> np.ndarray:
        if name not in self._w:
            t = self._src[name]
            a = t.dequantize(self.dtype) if hasattr(t, "dequantize") else np.asarray(t)
            self._w[name] = np.ascontiguousarray(a, dtype=self.dtype)
        return self._w[name]

    def _qkv(self, i: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Layer i's q [T, n_heads, hd], k and v [T, n_kv_heads, hd] of x: the attention norm, the
        projections (+ biases), the Q/K norms; no RoPE."""
        c, b = self.cfg, f"blk.{i}."
        T = x.shape[0]
        h = rms_norm(x, self.w(b + "attn_norm.weight"), c.rms_eps)
        q, k, v = (h @ self.w(b + f"attn_{n}.weight").T for n in "qkv")
        if c.qkv_bias:
            q, k, v = (t + self.w(b + f"attn_{n}.bias") for t, n in zip((q, k, v), "qkv"))
        q = q.reshape(T, c.n_heads, c.head_dim)
        k = k.reshape(T, c.n_kv_heads, c.head_dim)
        v = v.reshape(T, c.n_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, self.w(b + "attn_q_norm.weight"), c.rms_eps)
            k = rms_norm(k, self.w(b + "attn_k_norm.weight"), c.rms_eps)
        return q, k, v

    def _layer(self, i: int, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        c, b = self.cfg, f"blk.{i}."
        q, k, v = self._qkv(i, x)
        local = c.local_layers[i]
        inv = c.rope_inv_freq(local, self.w("rope_freqs.weight") if c.rope_freq_factors else None)
        q, k = rope(q, pos, 0.0, c.rope_neox, inv), rope(k, pos, 0.0, c.rope_neox, inv)
        self.k[i] = np.concatenate([self.k[i], k])
        self.v[i] = np.concatenate([self.v[i], v])
        k_pos = np.arange(self.k[i].shape[0])
        o = attention(q, self.k[i], self.v[i], pos, k_pos, c.attn_scale, c.sliding_window if local else 0)
        o = o.reshape(x.shape[0], c.q_dim) @ self.w(b + "attn_output.weight").T
        if c.post_norms:
            o = rms_norm(o, self.w(b + "post_attention_norm.weight"), c.rms_eps)
        x = x + o
        h = rms_norm(x, self.w(b + "ffn_norm.weight"), c.rms_eps)
        g, u = h @ self.w(b + "ffn_gate.weight").T, h @ self.w(b + "ffn_up.weight").T
        act = gelu_tanh(g) if c.activation == "gelu_tanh" else silu(g)
        d = (act * u) @ self.w(b + "ffn_down.weight").T
        if c.post_norms:
            d = rms_norm(d, self.w(b + "post_ffw_norm.weight"), c.rms_eps)
        return x + d

    def hidden(self, tokens) -> np.ndarray:
        """Run ``tokens`` after the cached positions; returns the final-normed hidden states [T, d_model]."""
        c = self.cfg
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise ValueError("tokens must be non-empty")
        if tokens.min() < 0 or tokens.max() >= c.vocab_size:
            raise ValueError(f"token ids must lie in [0, {c.vocab_size})")
        pos = np.arange(self.n_cached, self.n_cached + tokens.size)
        x = self.w("token_embd.weight")[tokens] * self.dtype.type(c.embed_scale)
        for i in range(c.n_layers):
            x = self._layer(i, x, pos)
        return rms_norm(x, self.w("output_norm.weight"), c.rms_eps)

    def forward(self, tokens, *, last_only: bool = False, last: int | None = None) -> np.ndarray:
        """Logits [T, vocab] for ``tokens``, appended to the cache; only the last ``last`` positions'
        [last, vocab] with ``last`` (the LM head is most of a long prompt's work), [vocab] with
        ``last_only``."""
        h = self.hidden(tokens)
        head = self.w("token_embd.weight" if self.cfg.tied_output else "output.weight")
        if last_only:
            return h[-1] @ head.T
        return (h if last is None else h[h.shape[0] - last:]) @ head.T

    def generate(self, prompt, n_tokens: int) -> list[int]:
        """Greedy continuation of ``prompt`` (resets the cache first)."""
        self.reset()
        logits = self.forward(prompt, last_only=True)
        out = []
        for _ in range(n_tokens):
            out.append(int(np.argmax(logits)))
            logits = self.forward([out[-1]], last_only=True)
        return out
