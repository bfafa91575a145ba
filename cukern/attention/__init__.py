"""AttentionDispatch and PagedKVCache: paged KV cache, split-KV decode, tensor-core prefill, varlen.

Kernels: ``cuda_src/attention/``; float64 references: ``cukern/reference/attention.py``;
tests: ``tests/test_attention*.py``; benchmark: ``profiling/bench_attention.py``; measurements:
``docs/notes/attention.md``. Modules: ``cache`` (page allocator, paged cache, views of caller-owned
caches), ``plan`` (plans, kernel shapes, the fitted split model), ``common`` (dtype and argument helpers),
``decode`` (the decode and merge methods, a mixin), ``dispatch`` (units and launches), ``flash_api`` /
``flashinfer_api`` / ``foreign`` (the FlashAttention- and FlashInfer-style entry points).

Conventions (every method):

* a query at position ``i`` sees key ``j`` when ``max(0, i - window_left) <= j <= i``
  (``window_left < 0``: no window); the last query of a sequence sits at its last cached
  token, so queries are aligned to the end of the cache (``seq_start = kv_len - q_len``); prefill and
  varlen also take ``causal_variant="upper_left"`` (query ``r`` at position ``r``, torch's ``is_causal``);
* logits are ``scale * q.k`` (``scale = 0`` means ``1 / sqrt(head_dim)``), then
  ``softcap * tanh(logit / softcap)`` when ``softcap > 0``;
* ``sinks`` (1-D f32, head ``h`` at ``sinks[sink_offset + h]``: one buffer for every layer; NaN: no
  sink for that head) are one logit per query head that joins the softmax denominator exactly once
  (gpt-oss), never scaled or capped;
* every log-sum-exp (LSE) is a **natural** logarithm, laid out ``[tokens, heads]`` f32;
* bfloat16 arrays are passed as ``uint16`` bit patterns (NumPy and CuPy have no bfloat16
  dtype; an ``ml_dtypes`` bfloat16 array is accepted too).

Callers that own their cache use the conventions they know, as thin wrappers over the same kernels:
``flash_api`` (FlashAttention's ``flash_attn_varlen_func``, ``flash_attn_with_kvcache``: natural-log LSE)
and ``flashinfer_api`` (FlashInfer's ``BatchDecode/BatchPrefillWithPagedKVCacheWrapper``: base-2 LSE), which
read the caller's arrays in place through a ``PagedKVView``; ``lse_to_log2`` / ``lse_to_natural`` convert.

Host work (validating sequence ids against the allocator, choosing the split count,
uploading index arrays, allocating workspaces) happens in :class:`PagedKVCache` and in the
``plan_*`` methods; the dispatch methods then only pack a struct and launch, so they can be
captured in CUDA graphs (FlashInfer's plan/run split).
"""

from cukern.attention.cache import BF16, HEAD_DIMS, PageAllocator, PagedKVCache, PagedKVView
from cukern.attention.dispatch import FAMILIES, FAMILY, PREFILL_HEAD_DIMS, PREFILL_WG_HEAD_DIMS, AttentionDispatch
from cukern.attention.flash_api import flash_attn_varlen_func, flash_attn_with_kvcache
from cukern.attention.flashinfer_api import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper
from cukern.attention.foreign import lse_to_log2, lse_to_natural
from cukern.attention.plan import BatchedPlan, DecodeOverrides, DecodePlan

__all__ = ["AttentionDispatch", "PagedKVCache", "PagedKVView", "PageAllocator", "DecodePlan", "DecodeOverrides",
           "BatchedPlan", "flash_attn_varlen_func", "flash_attn_with_kvcache", "BatchDecodeWithPagedKVCacheWrapper",
           "BatchPrefillWithPagedKVCacheWrapper", "lse_to_log2", "lse_to_natural",
           "FAMILY", "FAMILIES", "HEAD_DIMS", "PREFILL_HEAD_DIMS", "PREFILL_WG_HEAD_DIMS", "BF16"]
