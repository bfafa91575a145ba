"""Float64 references for the tokens family (cukern/tokens.py)."""

from __future__ import annotations

import numpy as np


def greedy(logits) -> np.ndarray:
    """Argmax of every row, lowest id on ties, NaN counted as -inf."""
    x = np.asarray(logits, dtype=np.float64)
    x = np.where(np.isnan(x), -np.inf, x)
    return np.argmax(x, axis=-1)


def candidate_probs(row, *, temperature: float, top_k: int, top_p: float):
    """(ids, probabilities) the sampler draws from for one row: the top_k best (ties by id),
    softmax(value / T), cut to the fewest best whose mass reaches top_p, renormalised."""
    x = np.asarray(row, dtype=np.float64)
    x = np.where(np.isnan(x), -np.inf, x)
    order = np.lexsort((np.arange(x.size), -x))[:top_k]
    w = np.exp((x[order] - x[order[0]]) / temperature)
    c = np.cumsum(w)
    keep = int(np.searchsorted(c, top_p * c[-1] * (1 - 1e-12))) + 1
    keep = min(keep, top_k)
    return order[:keep], w[:keep] / w[:keep].sum()


def embed(table_f64, ids, *, scale: float = 1.0) -> np.ndarray:
    """Rows ``ids`` of a dequantized table times scale; ids outside the table give zero rows."""
    t = np.asarray(table_f64, dtype=np.float64)
    ids = np.asarray(ids)
    ok = (ids >= 0) & (ids < t.shape[0])
    out = np.zeros((ids.size, t.shape[1]))
    out[ok] = t[ids[ok]] * scale
    return out
