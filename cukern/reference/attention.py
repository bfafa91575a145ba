"""Float64 references for the attention family (cukern/attention.py).

Everything is computed on a gathered, contiguous K/V (FlashInfer's way of testing a paged
kernel): :func:`gather` turns a slot's pages back into ``[length, n_kv_heads, head_dim]``.
Conventions are the dispatch's: query at position ``i`` sees key ``j`` when
``i - window_left <= j <= i`` (causal) and ``j >= i - window_left`` (window), logits are
``scale * q.k`` then ``softcap * tanh(logit / softcap)``, sinks join the denominator only (a NaN
sink is no sink), LSE is a natural logarithm.
"""

from __future__ import annotations

import numpy as np


def bf16_bits(x) -> np.ndarray:
    """float array -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_to_float(bits) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_storage(x, kind: str) -> np.ndarray:
    """Host array of x stored as ``kind`` ('float16', 'bfloat16' as uint16 bits, 'float32'), rounded to
    nearest even: the inputs of a 16-bit kernel, whose references then take ``as_float64`` of them."""
    if kind == "bfloat16":
        return bf16_bits(x)
    return np.asarray(x, dtype=np.float32).astype(kind)


def as_float64(a, kind: str) -> np.ndarray:
    """Host values of an array stored as ``kind`` ('float16', 'bfloat16' as uint16 bits, 'float32')."""
    a = a.get() if hasattr(a, "get") else np.asarray(a)
    return (bf16_to_float(a) if kind == "bfloat16" else a).astype(np.float64)


def gather(pool, page_table_row, length: int, page_size: int) -> np.ndarray:
    """Rows 0 .. length-1 of one sequence from a pool [n_pages, page_size, n_kv_heads, head_dim]."""
    pos = np.arange(length)
    pages = np.asarray(page_table_row)[pos // page_size]
    return np.asarray(pool)[pages, pos % page_size]


def _sinks(sinks):
    """Sink logits as float64 with NaN (no sink for that head) as -inf, which weighs nothing; None stays None."""
    if sinks is None:
        return None
    s = np.asarray(sinks, np.float64)
    return np.where(np.isnan(s), -np.inf, s)


def _masked_exp(logits, q_pos, causal: bool, window_left: int, sinks):
    """The softmax's parts of logits [h, n_q, n_k] under the masks: (exp(logit - m) with masked keys 0, the
    denominator [h, n_q, 1] with the sink in it, m [h, n_q, 1], 0 for a row with nothing visible)."""
    n_q, n_k = logits.shape[1:]
    sinks = _sinks(sinks)
    pos = np.asarray(q_pos)[:, None]
    j = np.arange(n_k)[None, :]
    visible = np.ones((n_q, n_k), bool)
    if causal:
        visible &= j <= pos
    if window_left >= 0:
        visible &= j >= pos - window_left
    logits = np.where(visible[None], logits, -np.inf)
    m = logits.max(axis=-1, keepdims=True, initial=-np.inf)  # [h, n_q, 1]
    if sinks is not None:
        m = np.maximum(m, np.asarray(sinks, np.float64)[:, None, None])
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(logits - m_safe)
    den = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        den = den + np.exp(np.asarray(sinks, np.float64)[:, None, None] - m_safe)
    return p, den, m_safe


def attention(q, k, v, q_pos, *, causal: bool = True, scale: float = 0.0, window_left: int = -1,
              softcap: float = 0.0, sinks=None) -> tuple[np.ndarray, np.ndarray]:
    """One sequence. q: [n_q, n_heads, D]; k, v: [n_k, n_kv_heads, D]; q_pos: [n_q] positions of the
    queries (negative: sees no key). Returns (out [n_q, n_heads, D], lse [n_q, n_heads]); a query with no
    visible key (and no sink) gets 0 and -inf."""
    sinks = _sinks(sinks)
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    n_q, h, d = q.shape
    n_k, hk, _ = k.shape
    group = h // hk
    scale = scale if scale > 0 else 1.0 / np.sqrt(d)
    kh = np.repeat(k, group, axis=1)  # [n_k, h, d]
    vh = np.repeat(v, group, axis=1)
    logits = np.einsum("qhd,khd->hqk", q, kh) * scale
    if softcap > 0:
        logits = softcap * np.tanh(logits / softcap)
    p, den, m_safe = _masked_exp(logits, q_pos, causal, window_left, sinks)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.einsum("hqk,khd->qhd", np.where(den > 0, p / den, 0.0), vh)
        lse = np.where(den[..., 0] > 0, (m_safe + np.log(den))[..., 0], -np.inf).T
    return out, lse


def paged_attention(q_rows, k_pool, v_pool, page_table, lengths, seq_ids, q_lens, page_size: int, *,
                    causal: bool = True, **kw) -> tuple[np.ndarray, np.ndarray]:
    """Queries of several sequences over a paged cache: sequence seq_ids[i] owns the next q_lens[i] rows of
    q_rows [n_q, n_heads, D], aligned to the end of its cache (positions length - q_len ... length - 1)."""
    outs, lses, r = [], [], 0
    for s, n in zip(seq_ids, q_lens):
        length = int(lengths[s])
        k = gather(k_pool, page_table[s], length, page_size)
        v = gather(v_pool, page_table[s], length, page_size)
        o, lse = attention(q_rows[r:r + n], k, v, np.arange(length - n, length), causal=causal, **kw)
        outs.append(o)
        lses.append(lse)
        r += n
    return np.concatenate(outs), np.concatenate(lses)


def varlen(q, k, v, cu_q, cu_k, *, causal: bool = False, causal_variant: str = "lower_right",
           **kw) -> tuple[np.ndarray, np.ndarray]:
    """Packed sequences: rows cu_q[i] .. cu_q[i+1] of q against rows cu_k[i] .. cu_k[i+1] of k/v,
    query r at position k_len - q_len + r ("lower_right", FlashAttention's alignment) or r ("upper_left",
    torch's is_causal)."""
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        qs, ks = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]]
        n_q, n_k = len(qs), len(ks)
        pos = np.arange(n_q) if causal_variant == "upper_left" else np.arange(n_k - n_q, n_k)
        o, lse = attention(qs, ks, v[cu_k[i]:cu_k[i + 1]], pos, causal=causal, **kw)
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


def decode_contiguous(q, k, v, lengths, **kw) -> tuple[np.ndarray, np.ndarray]:
    """One query per sequence over head-major K/V: q [batch, n_heads, D]; k, v [batch, n_kv_heads, capacity, D];
    sequence b's query at position lengths[b] - 1 against its first lengths[b] keys."""
    outs, lses = [], []
    for b, n in enumerate(np.asarray(lengths)):
        n = int(n)
        o, lse = attention(q[b:b + 1], np.swapaxes(k[b, :, :n], 0, 1), np.swapaxes(v[b, :, :n], 0, 1), [n - 1], **kw)
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


def merge_states(v, s, sinks=None) -> tuple[np.ndarray, np.ndarray]:
    """v: [n, n_states, h, d] normalised partial outputs; s: [n, n_states, h] natural-log LSE.
    Returns (out [n, h, d], lse [n, h])."""
    sinks = _sinks(sinks)
    v = np.asarray(v, np.float64)
    s = np.asarray(s, np.float64)
    m = s.max(axis=1)  # [n, h]
    if sinks is not None:
        m = np.maximum(m, np.asarray(sinks, np.float64)[None])
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(s - m_safe[:, None])  # [n, S, h]
    den = w.sum(axis=1)
    if sinks is not None:
        den = den + np.exp(np.asarray(sinks, np.float64)[None] - m_safe)
    num = np.einsum("nsh,nshd->nhd", w, np.where(w[..., None] > 0, v, 0.0))
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(den[..., None] > 0, num / den[..., None], 0.0)
        lse = np.where(den > 0, m_safe + np.log(den), -np.inf)
    return out, lse


def attention_backward(dout, q, k, v, q_pos, *, causal: bool = True, scale: float = 0.0, window_left: int = -1,
                       softcap: float = 0.0, sinks=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients (dq, dk, dv) of :func:`attention`'s ``out`` against ``dout`` [n_q, n_heads, D], by the explicit
    formulas: with x = q.k, z = scale x (or softcap tanh(scale x / softcap)), P = softmax(z) over the visible
    keys (a sink joins the denominator only), D = rowsum(dout * out): dv = P^T dout, dP = dout v^T,
    dz = P (dP - D), dx = dz dz/dx (scale, times 1 - tanh^2 with a cap), dq = dx k, dk = dx^T q; dk and dv of
    a KV head summed over its group's query heads. A query that sees no key contributes nothing."""
    q, k, v, do = (np.asarray(a, np.float64) for a in (q, k, v, dout))
    n_q, h, d = q.shape
    n_k, hk, _ = k.shape
    group = h // hk
    s = scale if scale > 0 else 1.0 / np.sqrt(d)
    kh = np.repeat(k, group, axis=1)
    vh = np.repeat(v, group, axis=1)
    x = np.einsum("qhd,khd->hqk", q, kh)
    if softcap > 0:
        t = np.tanh(s * x / softcap)
        z, dzdx = softcap * t, s * (1.0 - t * t)
    else:
        z, dzdx = s * x, s
    e, den, _ = _masked_exp(z, q_pos, causal, window_left, sinks)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(den > 0, e / den, 0.0)  # [h, n_q, n_k]
    out = np.einsum("hqk,khd->qhd", p, vh)
    dv = np.einsum("hqk,qhd->khd", p, do)
    dp = np.einsum("qhd,khd->hqk", do, vh)
    delta = np.einsum("qhd,qhd->hq", do, out)[..., None]
    dx = p * (dp - delta) * dzdx
    dq = np.einsum("hqk,khd->qhd", dx, kh)
    dk = np.einsum("hqk,qhd->khd", dx, q)
    return dq, dk.reshape(n_k, hk, group, d).sum(2), dv.reshape(n_k, hk, group, d).sum(2)


def varlen_backward(dout, q, k, v, cu_q, cu_k, *, causal: bool = False, causal_variant: str = "lower_right",
                    **kw) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`attention_backward` of :func:`varlen`'s packed sequences (query positions as there): (dq
    [total_q, ...], dk, dv [total_k, ...])."""
    dqs, dks, dvs = [], [], []
    for i in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        n_q, n_k = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        pos = np.arange(n_q) if causal_variant == "upper_left" else np.arange(n_k - n_q, n_k)
        g = attention_backward(dout[rq], q[rq], k[rk], v[rk], pos, causal=causal, **kw)
        dqs.append(g[0])
        dks.append(g[1])
        dvs.append(g[2])
    return np.concatenate(dqs), np.concatenate(dks), np.concatenate(dvs)
