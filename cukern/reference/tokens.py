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


def _splitmix64(x: int) -> int:
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def uniform(seed: int, row: int, draw: int) -> float:
    """The sampler's uniform number in [0, 1) for draw ``draw`` of row ``row``: the top 24 bits of
    splitmix64(seed ^ splitmix64(row << 32 | draw)), as the kernel computes it."""
    h = _splitmix64(int(seed) ^ _splitmix64((int(row) << 32) | (int(draw) & 0xFFFFFFFF)))
    return (h >> 40) / 16777216.0


def embed(table_f64, ids, *, scale: float = 1.0) -> np.ndarray:
    """Rows ``ids`` of a dequantized table times scale; ids outside the table give zero rows."""
    t = np.asarray(table_f64, dtype=np.float64)
    ids = np.asarray(ids)
    ok = (ids >= 0) & (ids < t.shape[0])
    out = np.zeros((ids.size, t.shape[1]))
    out[ok] = t[ids[ok]] * scale
    return out
