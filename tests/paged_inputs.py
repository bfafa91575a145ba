"""Caller-owned paged K/V caches for the tests of the FlashAttention- and FlashInfer-style entry points
(tests/test_attention_flash_api.py, tests/test_attention_flashinfer_api.py): random pools, pages handed out
in a shuffled order, the same pages as a FlashAttention block table and as FlashInfer's CSR arrays, the
float64 reference over the pages gathered back, and torch SDPA as a peer.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np
from attention_helpers import _store  # tests/ is on sys.path under pytest

from cukern.reference import attention as ref


@dataclass
class Paged:
    k: cupy.ndarray  # [n_pages, page_size, n_kv_heads, head_dim] of kind
    v: cupy.ndarray
    k64: np.ndarray  # the stored values, float64
    v64: np.ndarray
    pages: list[np.ndarray]  # page ids of each sequence, in order
    lengths: np.ndarray  # [batch] tokens per sequence
    page_size: int
    kind: str

    def block_table(self, pad: int = 0) -> np.ndarray:
        """FlashAttention's [batch, max_blocks] int32, padded with page id ``pad`` (never read)."""
        t = np.full((len(self.pages), max(len(p) for p in self.pages)), pad, np.int32)
        for b, p in enumerate(self.pages):
            t[b, :len(p)] = p
        return t

    def csr(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """FlashInfer's (indptr [batch + 1], indices, last_page_len [batch]) int32."""
        counts = np.array([len(p) for p in self.pages])
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        last = (self.lengths - (counts - 1) * self.page_size).astype(np.int32)
        return indptr, np.concatenate(self.pages).astype(np.int32), last

    def combined(self) -> cupy.ndarray:
        """FlashInfer's single-array cache [n_pages, 2, page_size, n_kv_heads, head_dim] (K then V per page)."""
        return cupy.asarray(np.ascontiguousarray(np.stack([self.k.get(), self.v.get()], axis=1)))

    def reference(self, q_rows: np.ndarray, q_lens, **kw) -> tuple[np.ndarray, np.ndarray]:
        """Float64 attention of q_rows (each sequence's rows in turn, aligned to its last keys)."""
        table = self.block_table()
        return ref.paged_attention(q_rows, self.k64, self.v64, table, self.lengths, range(len(self.pages)),
                                   q_lens, self.page_size, **kw)


def make_paged(rng, lengths, *, page_size: int, n_kv_heads: int, head_dim: int, kind: str,
               extra_pages: int = 3) -> Paged:
    counts = [-(-n // page_size) for n in lengths]
    n_pages = sum(counts) + extra_pages
    order = rng.permutation(n_pages)
    starts = np.concatenate([[0], np.cumsum(counts)])
    pages = [order[starts[i]:starts[i + 1]] for i in range(len(lengths))]
    shape = (n_pages, page_size, n_kv_heads, head_dim)
    k = _store(rng.standard_normal(shape).astype(np.float32), kind)
    v = _store(rng.standard_normal(shape).astype(np.float32), kind)
    return Paged(k, v, ref.as_float64(k, kind), ref.as_float64(v, kind), pages, np.asarray(lengths), page_size,
                 kind)


def sdpa(q, k, v, q_pos, causal: bool, window_left: int = -1) -> np.ndarray:
    """torch SDPA in float32 of one sequence: q [n_q, h, d], k/v [n_k, hk, d] float64 NumPy; queries at
    q_pos (aligned to the end of the keys, which SDPA's own is_causal does not do: an explicit mask)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    h, hk = q.shape[1], k.shape[1]
    tq, tk, tv = (torch.tensor(x, dtype=torch.float32, device="cuda").transpose(0, 1) for x in (q, k, v))
    tk, tv = tk.repeat_interleave(h // hk, 0), tv.repeat_interleave(h // hk, 0)
    j = torch.arange(k.shape[0], device="cuda")[None, :]
    pos = torch.tensor(q_pos, device="cuda")[:, None]
    mask = torch.ones((len(q_pos), k.shape[0]), dtype=torch.bool, device="cuda")
    if causal:
        mask &= j <= pos
    if window_left >= 0:
        mask &= j >= pos - window_left
    with sdpa_kernel([SDPBackend.MATH]):  # float32 throughout, no TF32
        o = torch.nn.functional.scaled_dot_product_attention(tq[None], tk[None], tv[None], attn_mask=mask)
    return o[0].transpose(0, 1).double().cpu().numpy()
