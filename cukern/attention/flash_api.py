"""FlashAttention's forward entry points over cukern's kernels: :func:`flash_attn_varlen_func` (packed
sequences, the varlen kernels) and :func:`flash_attn_with_kvcache` (queries against a K/V cache the caller
owns: split-KV decode for one query per sequence, the batched prefill kernels for more).

FlashAttention's conventions: ``softmax_scale=None`` is ``1 / sqrt(head_dim)``; with ``window_size=(left,
right)`` query ``i`` of a sequence sees keys ``i + k_len - q_len - left ... i + k_len - q_len + right``
(-1: unbounded), ``causal`` sets ``right = 0``; ``softcap > 0`` caps each logit at ``softcap * tanh(logit /
softcap)``; the LSE (``return_lse=True``, FlashAttention's ``softmax_lse``) is a **natural** logarithm laid
out as FlashAttention's: ``[n_heads, total_q]`` (varlen), ``[batch, n_heads, seqlen_q]`` (cache), a
transposed view of the kernels' ``[tokens, heads]`` array (``lse_to_log2`` gives FlashInfer's base 2). A query
that sees no key gets 0 and LSE -inf (FlashAttention writes +inf). Every argument after the positional ones
is keyword-only (FlashAttention 2 and 3 order them differently).

Refused before any launch, as the kernels do not do them: windows with ``right > 0`` (keys after the
query), ALiBi, dropout, rotary embedding, and appending new K/V (FlashAttention's ``k``/``v``: write them into
the cache first, e.g. with the elementwise family's fused RoPE + KV write, and pass the grown lengths).

The cache (``flash_attn_with_kvcache``) is FlashAttention's: paged ``[num_blocks, page_size, n_kv_heads,
head_dim]`` with ``block_table [batch, max_blocks]`` int32, or ``[batch_cache, seqlen_cache, n_kv_heads,
head_dim]`` without one (row ``b`` of the batch is row ``b`` of the cache); that is cukern's own pool layout,
read in place through a :class:`~cukern.attention.cache.PagedKVView`. The pools must be C-contiguous (the
kernels step pages by ``page_size * n_kv_heads * head_dim`` elements). Page ids and lengths are device
values, never read on the host: ids outside the pool, lengths past ``max_blocks * page_size`` or below
``seqlen_q`` are the caller's to rule out.

Arrays of any framework are taken as the dispatch methods take them (``interop.tensor_function``: torch
tensors zero-copy, ``out`` allocated in the inputs' framework, torch's current stream when ``stream`` is
None). Outputs are allocated when ``out`` is None. Host work per call is the checks; small index arrays and the
decode's split buffers are made on a call's first use of a shape (per stream) and kept, so later calls
allocate nothing but ``out`` (and the lengths, for an int ``cache_seqlens``): run each shape once before
capturing a CUDA graph, and pass ``out``.
"""

from __future__ import annotations

import dataclasses

import cupy
import numpy as np

from cukern.attention.cache import HEAD_DIMS, PagedKVView
from cukern.attention.common import _kind
from cukern.attention.foreign import check_pools, device_arange, dispatch_for, scale_arg, softcap_arg
from cukern.attention.plan import _NO_OVERRIDES, BatchedPlan, DecodePlan, decode_plan
from cukern.dispatch import check_array, check_int
from cukern.interop import like, tensor_function
from cukern.streams import resolve_stream

__all__ = ["flash_attn_varlen_func", "flash_attn_with_kvcache"]

_I32 = np.dtype(np.int32)
_DECODE_PLANS: dict[tuple, DecodePlan] = {}  # split buffers per (device, stream, shape), reused by later calls


def _window(window_size, causal: bool, k_bound: int) -> tuple[bool, int]:
    """FlashAttention's (window_size, causal) as the kernels' (causal, window_left). As FlashAttention does,
    a side as long as the longest key range (``k_bound``) is no bound and ``causal`` sets ``right = 0``;
    ``right == 0`` is causal; ``right > 0`` the kernels cannot mask."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}") from None
    left, right = check_int("window_size[0]", left), check_int("window_size[1]", right)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    left = -1 if left < 0 or left >= k_bound else left
    right = 0 if causal else (-1 if right < 0 or right >= k_bound else right)
    if right > 0:
        raise ValueError(f"window_size right = {right}: keys after the query's own position are not masked by "
                         f"cukern's kernels (right must be -1, 0, or cover every key)")
    return right == 0, left


def _outputs(out, lse_rows: int | None, shape: tuple, dtype, heads: int, device: int, stream):
    """``out`` (checked, or allocated as [shape] of dtype) and the LSE buffer ([lse_rows, heads] f32, or None)."""
    with stream:
        if out is None:
            out = cupy.empty(shape, dtype)
        lse = None if lse_rows is None else cupy.empty((lse_rows, heads), cupy.float32)
    check_array("out", out, dtype=dtype, shape=shape, device=device)
    return out, lse


@tensor_function(out=like("q"))
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                           softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1),
                           softcap: float = 0.0, return_lse: bool = False, causal_variant: str = "lower_right",
                           out=None, stream=None):
    """Packed variable-length attention, as FlashAttention's ``flash_attn_varlen_func`` (forward).

    Parameters
    ----------
    q : [total_q, n_heads, head_dim] float16 or bfloat16 (uint16 bits), head_dim a multiple of 32 up to 256 or
        512; or float32, head_dim in ``HEAD_DIMS`` (float32 and head_dim 512 run the SIMT kernel: at most 65535
        query rows).
    k, v : [total_k, n_kv_heads, head_dim], q's dtype; n_heads a multiple of n_kv_heads (GQA).
    cu_seqlens_q, cu_seqlens_k : [batch + 1] int32 prefix sums of the sequences' query / key counts (device
        values, not read on the host).
    max_seqlen_q : host bound on any sequence's query count (sizes the grid).
    max_seqlen_k : host bound on any sequence's key count (bounds the window as FlashAttention does).
    softmax_scale, causal, window_size, softcap : FlashAttention's (module docstring); causal and windows
        align the last query with the last key.
    return_lse : also return the natural-log LSE, ``[n_heads, total_q]`` float32 (a transposed view).
    causal_variant : cukern's, not FlashAttention's: ``"lower_right"`` (FlashAttention's alignment, the default)
        or ``"upper_left"`` (torch's ``is_causal``: query r sees keys 0 ... r, and a window counts back from r).
    out : [total_q, n_heads, head_dim] of q's dtype, or None (allocated).
    stream : CuPy / torch stream, raw handle or None (torch's current stream for torch tensors, else CuPy's).

    Returns ``out``, or ``(out, lse)`` with ``return_lse``."""
    check_array("q", q, ndim=3)
    dev = q.device.id
    scale = scale_arg("softmax_scale", softmax_scale)
    max_seqlen_q, max_seqlen_k = check_int("max_seqlen_q", max_seqlen_q, 1), check_int("max_seqlen_k", max_seqlen_k, 1)
    causal, window_left = _window(window_size, causal, max_seqlen_k)
    cap = softcap_arg("softcap", softcap)
    st = resolve_stream(stream)
    out, lse = _outputs(out, q.shape[0] if return_lse else None, q.shape, q.dtype, q.shape[1], dev, st)
    dispatch_for(dev).flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, out, max_seqlen_q=max_seqlen_q,
                                        causal=causal, causal_variant=causal_variant, scale=scale,
                                        window_left=window_left, softcap=cap, lse=lse, stream=st)
    return (out, lse.T) if return_lse else out


def _cache_view(q, k_cache, v_cache, cache_seqlens, block_table, dev: int, st) -> PagedKVView:
    """FlashAttention's cache arguments as a PagedKVView over the caller's arrays (checked)."""
    batch, _, _, d = q.shape
    kind = check_pools(("k_cache", "v_cache"), k_cache, v_cache, dev)
    n_pages, page_size, hk, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"k_cache has head_dim {dk}, q has {d}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {d}")
    if min(k_cache.shape) == 0:
        raise ValueError(f"k_cache must be non-empty, got shape {k_cache.shape}")
    if block_table is not None:
        check_array("block_table", block_table, dtype=_I32, ndim=2, device=dev)
        if block_table.shape[0] != batch or block_table.shape[1] == 0:
            raise ValueError(f"block_table must have shape ({batch}, max_blocks >= 1), got {block_table.shape}")
        page_table = block_table
    else:  # one contiguous row of the cache per sequence: page b of page_size = seqlen_cache tokens
        if n_pages < batch:
            raise ValueError(f"k_cache holds {n_pages} sequences, q {batch} (without a block_table row b of the "
                             f"batch reads row b of the cache)")
        page_table = device_arange(batch, 1, dev, st).reshape(batch, 1)
    capacity = page_table.shape[1] * page_size
    if capacity >= 2**31 or n_pages * page_size >= 2**31:
        raise ValueError(f"positions and pool rows must fit in int32 (capacity {capacity}, {n_pages} pages)")
    if cache_seqlens is None or isinstance(cache_seqlens, (int, np.integer)):
        n = capacity if cache_seqlens is None else check_int("cache_seqlens", cache_seqlens, 0, capacity)
        with st:
            lengths = cupy.full((batch,), n, cupy.int32)
    else:
        lengths = check_array("cache_seqlens", cache_seqlens, dtype=_I32, shape=(batch,), device=dev)
    return PagedKVView(kind, int(hk), int(d), int(page_size), page_table, lengths, k_cache, v_cache)


def _decode_plan(view: PagedKVView, batch: int, heads: int, max_kv_len: int, window_left: int, dev: int,
                 st) -> DecodePlan:
    """The decode schedule and split buffers of this shape on this stream (made once), over ``view``."""
    key = (dev, st.ptr, view.kind, view.n_kv_heads, view.head_dim, batch, heads, max_kv_len, window_left)
    plan = _DECODE_PLANS.get(key)
    if plan is None:
        d = dispatch_for(dev)
        with st:
            plan = decode_plan(view, device_arange(batch, 1, dev, st), heads, max_kv_len, None, window_left,
                               _NO_OVERRIDES, d.sm_count())
        _DECODE_PLANS[key] = plan
    return dataclasses.replace(plan, cache=view)


@tensor_function(out=like("q"))
def flash_attn_with_kvcache(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None,
                            softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1),
                            softcap: float = 0.0, return_lse: bool = False, max_seqlen_k: int | None = None,
                            out=None, stream=None):
    """Queries against a K/V cache the caller owns, as FlashAttention's ``flash_attn_with_kvcache`` (forward,
    without appending new K/V). The queries of a sequence are its last ``seqlen_q`` cached tokens.

    Parameters
    ----------
    q : [batch, seqlen_q, n_heads, head_dim], float32 or the cache's dtype. seqlen_q == 1 runs the split-KV
        decode (head_dim up to 512); more queries the batched prefill kernels: q in the cache's dtype on
        tensor cores (head_dim up to 256), float32 q on the SIMT kernel.
    k_cache, v_cache : [num_blocks, page_size, n_kv_heads, head_dim] with ``block_table``, else [batch_cache,
        seqlen_cache, n_kv_heads, head_dim] (batch_cache >= batch); float16, bfloat16 (uint16 bits) or
        float32, C-contiguous, head_dim one of ``HEAD_DIMS``.
    cache_seqlens : [batch] int32 keys cached per sequence (device values), an int for all of them, or None
        (the whole capacity, ``max_blocks * page_size`` or ``seqlen_cache``).
    block_table : [batch, max_blocks] int32 page ids of each sequence, in order (device values), or None.
    softmax_scale, causal, window_size, softcap : FlashAttention's (module docstring).
    return_lse : also return the natural-log LSE, ``[batch, n_heads, seqlen_q]`` float32 (a transposed view).
    max_seqlen_k : host bound on cache_seqlens that sizes the decode's split schedule (default: the
        capacity); a longer sequence is still computed right, only with less parallelism.
    out : [batch, seqlen_q, n_heads, head_dim] of q's dtype, or None (allocated).
    stream : CuPy / torch stream, raw handle or None (torch's current stream for torch tensors, else CuPy's).

    Returns ``out``, or ``(out, lse)`` with ``return_lse``."""
    check_array("q", q, ndim=4)
    batch, sq, h, d = q.shape
    if min(q.shape) == 0 or batch > 65535:
        raise ValueError(f"q must be non-empty with batch <= 65535, got shape {q.shape}")
    dev = q.device.id
    st = resolve_stream(stream)
    view = _cache_view(q, k_cache, v_cache, cache_seqlens, block_table, dev, st)
    if h % view.n_kv_heads:
        raise ValueError(f"n_heads ({h}) must be a multiple of n_kv_heads ({view.n_kv_heads})")
    capacity = view.capacity_tokens()
    causal, window_left = _window(window_size, causal, capacity)
    scale, cap = scale_arg("softmax_scale", softmax_scale), softcap_arg("softcap", softcap)
    bound = capacity if max_seqlen_k is None else min(check_int("max_seqlen_k", max_seqlen_k, 1), capacity)
    out, lse = _outputs(out, batch * sq if return_lse else None, q.shape, q.dtype, h, dev, st)
    kw = dict(scale=scale, window_left=window_left, softcap=cap, lse=lse, stream=st)
    if sq == 1 and _kind(q) in ("float32", view.kind):  # one query per sequence: the split-KV decode
        plan = _decode_plan(view, batch, h, bound, window_left, dev, st)
        dispatch_for(dev).flash_attn_decode(plan, 0, q.reshape(batch, h, d), out.reshape(batch, h, d), **kw)
    else:
        plan = BatchedPlan(view, device_arange(batch, 1, dev, st), device_arange(batch + 1, sq, dev, st), batch * sq,
                           sq)
        dispatch_for(dev).flash_attn_batched(plan, 0, q.reshape(batch * sq, h, d), out.reshape(batch * sq, h, d),
                                             causal=causal, **kw)
    return (out, lse.reshape(batch, sq, h).transpose(0, 2, 1)) if return_lse else out
