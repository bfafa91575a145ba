"""The decode side of AttentionDispatch (a mixin): the decode plan, split-KV decode over the paged cache
(``decode_tc`` on tensor cores, ``decode`` SIMT), its split pass alone, and merge_states.
"""

from __future__ import annotations

import dataclasses

import cupy
import numpy as np

from cukern.attention.cache import HEAD_DIMS, PagedKVCache, PagedKVView, _norm_kv_dtype
from cukern.attention.common import (_CTYPE, _DECODE_THREADS, _F32, _I32, _check_kind, _int_list, _kv_strides,
                                     _page_shift, _scale_fields, _sink_fields)
from cukern.attention.plan import (_MERGE_THREADS, _NO_OVERRIDES, _TC_KEYS, DecodeOverrides, DecodePlan,
                                   _decode_smem, _decode_tc_smem, _merge_cols4, decode_plan)
from cukern.dispatch import Unit, check_array, check_int
from cukern.interop import like, tensors
from cukern.repeat import repeatable


class Decode:
    """AttentionDispatch's decode methods (a mixin over its units, ``pdl``, ``_unit``, ``_check_layer``
    and ``sm_count``)."""

    # ------------------------------------------------------------------ decode
    def plan_decode(self, cache: PagedKVCache, seq_ids, n_heads: int, *, max_kv_len: int | None = None,
                    n_splits: int | None = None, window_left: int = -1,
                    overrides: DecodeOverrides | None = None, partials: bool = False) -> DecodePlan:
        """Schedule a decode batch: one query token for each sequence of ``seq_ids`` (host ints).

        Validates the slots, uploads them, picks the split count (default: :func:`_choose_splits`, chunks
        of at least 32 tokens, at most 256 splits; ``n_splits`` overrides it), with it the tensor-core
        kernel's warps and where the splits merge (``merge_apart``, see :meth:`flash_attn_decode`), and
        allocates the partial buffers and the merge counters. ``overrides`` (a :class:`DecodeOverrides`)
        forces any of those choices and the launch's L2 settings. ``max_kv_len`` (default: the longest of
        these sequences now) sizes the chunks; a sequence that later grows past it is still computed
        right (its last chunk runs to its end), only less parallel. Reuse the plan across steps (and
        graph replays) while the batch holds, on one stream at a time (launches of one plan share its
        partial buffers and counters).

        ``partials``: the plan also serves :meth:`flash_attn_decode_partials` (the split states left
        for a separate merge, e.g. ``DmmvDispatch.dmmv`` on a ``MergedX``): its states always merge
        apart and its ``o_part`` holds them at every split count, one included."""
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        ov = _NO_OVERRIDES if overrides is None else overrides
        if not isinstance(ov, DecodeOverrides):
            raise TypeError(f"overrides must be a DecodeOverrides, got {type(overrides).__name__}")
        if partials and ov.merge_apart is False:
            raise ValueError("partials=True leaves the states for a separate merge: overrides.merge_apart=False "
                             "(merged in the decode's last block) contradicts it")
        if partials:
            ov = dataclasses.replace(ov, merge_apart=True)
        ids = _int_list("seq_ids", seq_ids)
        if len(ids) > 65535:
            raise ValueError(f"at most 65535 sequences per decode call, got {len(ids)}")
        for s in ids:
            cache.alloc.check_slot(int(s))
        longest = int(max(cache.alloc.lengths[ids]))
        max_kv_len = max(longest, 1) if max_kv_len is None else max_kv_len
        return decode_plan(cache, cupy.asarray(ids.astype(np.int32)), n_heads, max_kv_len, n_splits, window_left, ov,
                           self.sm_count(), partials)

    @repeatable
    @tensors(out=like("q"))
    def flash_attn_decode(self, plan: DecodePlan, layer: int, q: cupy.ndarray, out: cupy.ndarray | None = None, *,
                          scale: float = 0.0, window_left: int = -1, softcap: float = 0.0,
                          sinks: cupy.ndarray | None = None, sink_offset: int = 0, lse: cupy.ndarray | None = None,
                          stream=None) -> cupy.ndarray:
        """Single-query attention of a batch of sequences over the paged cache (split-KV + merge).

        q: [batch, n_heads, head_dim], float32 or the cache's dtype (float16 / bfloat16 as uint16 bits;
        16-byte aligned); out: the same shape and dtype as q (written: f32 arithmetic, rounded once); lse:
        optional [batch, n_heads] f32, natural log (sinks included); sinks: optional 1-D f32, head h's sink at
        ``sinks[sink_offset + h]`` (one buffer for every layer; NaN: no sink for that head). Mixed q / cache
        dtypes other than an f32 q are not taken (an f32 cache takes f32 q). K/V of a tile are read once for all the
        query heads of their group. With ``plan.n_splits > 1`` the chunks write normalised partial
        (O, LSE) into the plan's buffers and, in the same launch, one block of each (query, head block)
        merges them (as :meth:`merge_states` would), adding the sinks once: the last block to finish (an
        atomic counter); or, with ``plan.merge_apart``, a :meth:`merge_states` launch after
        the decode merges them (blocks of columns of each query and head instead of one block per head
        block: the plan's choice where that single block's merge would be long, e.g. head_dim 256 with one
        KV head).
        out must be 16-byte aligned.

        f16/bf16 caches up to head_dim 256 run on tensor cores (``decode_tc``): q (scaled to base-2 logits
        and by a power of two that keeps it in f16 range) and the softmax weights are each split into
        hi + lo parts of the cache dtype, so S and O keep f32 accuracy (the same tolerance as the SIMT
        kernel, which serves f32 caches and head_dim 512)."""
        layer, qk = self._check_decode(plan, layer, q)
        return self._decode_merged(plan, layer, q, out, qk, scale, window_left, softcap, sinks, sink_offset, lse,
                                   stream)

    def _decode_merged(self, plan: DecodePlan, layer: int, q, out, qk: str, scale, window_left, softcap, sinks,
                       sink_offset, lse, stream):
        """flash_attn_decode's checks of the outputs and the scalars, its launch and the merge apart."""
        b, h, d = plan.batch, plan.n_heads, plan.cache.head_dim
        check_array("out", out, dtype=q.dtype, shape=(b, h, d), align=16)
        if lse is not None:
            check_array("lse", lse, dtype=_F32, shape=(b, h))
        fields = _scale_fields(scale, d, softcap, window_left) | _sink_fields(sinks, sink_offset, h)
        unit = self._decode_launch(plan, layer, q, out, lse, sinks, fields, stream, qk)
        if plan.merge_apart:
            self._merge(unit, plan.o_part, plan.lse_part, out, lse, sinks, b, plan.n_splits, h, d, stream,
                        _CTYPE[qk], fields["sink_offset"])
        return out

    @repeatable
    @tensors
    def flash_attn_decode_partials(self, plan: DecodePlan, layer: int, q: cupy.ndarray, *, scale: float = 0.0,
                                   window_left: int = -1, softcap: float = 0.0,
                                   stream=None) -> tuple[cupy.ndarray, cupy.ndarray]:
        """The split pass of :meth:`flash_attn_decode` alone: returns the plan's ``(o_part, lse_part)``,
        ``[batch, n_splits, n_heads, head_dim]`` normalised partial outputs and ``[batch, n_splits,
        n_heads]`` their natural-log LSE (-inf for a split with no keys), for a separate merge:
        :meth:`merge_states`, or ``DmmvDispatch.dmmv`` on a ``MergedX`` (the output projection with the
        merge folded in), which also adds sinks. With one split the state is the whole attention
        without sinks. q: [batch, n_heads, head_dim] f32 (the states are f32). The plan must come from
        ``plan_decode(..., partials=True)``; the states are overwritten by the plan's next launch."""
        layer, _ = self._check_decode(plan, layer, q, ("float32",))
        if not plan.partials:
            raise ValueError("flash_attn_decode_partials needs a plan made with plan_decode(..., partials=True)")
        b, h, d = plan.batch, plan.n_heads, plan.cache.head_dim
        fields = _scale_fields(scale, d, softcap, window_left) | _sink_fields(None, 0, h)
        if plan.n_splits > 1:
            self._decode_launch(plan, layer, q, plan.o_part, None, None, fields, stream)
        else:  # one split writes its state as the final output (no sinks: the merge adds them)
            self._decode_launch(plan, layer, q, plan.o_part.reshape(b, h, d), plan.lse_part.reshape(b, h), None,
                                fields, stream)
        return plan.o_part, plan.lse_part

    def _check_decode(self, plan: DecodePlan, layer: int, q: cupy.ndarray,
                      q_kinds: tuple | None = None) -> tuple[int, str]:
        """(layer, q's kind) of a decode call, q one of ``q_kinds`` (default: f32 or the cache's kind)."""
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan must be a DecodePlan (AttentionDispatch.plan_decode), got {type(plan).__name__}")
        layer = self._check_layer(plan.cache, layer)
        if q_kinds is None:
            q_kinds = tuple(dict.fromkeys(("float32", plan.cache.kind)))
        qk = _check_kind("q", q, q_kinds)
        check_array("q", q, shape=(plan.batch, plan.n_heads, plan.cache.head_dim), align=16)
        return layer, qk

    def _decode_launch(self, plan: DecodePlan, layer: int, q, out, lse, sinks, fields: dict, stream,
                       qk: str = "float32") -> Unit:
        """The decode kernel's launch on checked arguments: final O (and LSE) into out (lse) with one
        split, else the split states into the plan's buffers (merged in the launch unless merge_apart).
        qk: the kind of q and out (float32, or the cache's 16-bit kind)."""
        cache = plan.cache
        b, h, d = plan.batch, plan.n_heads, cache.head_dim
        group = h // cache.n_kv_heads
        hb = plan.head_block
        nhb = -(-group // hb)
        visible = plan.max_kv_len if fields["window_left"] < 0 else min(plan.max_kv_len, fields["window_left"] + 1)
        split = plan.n_splits > 1
        chunk = -(-visible // plan.n_splits)
        tiles = -(-chunk // (_TC_KEYS * plan.warps)) if plan.warps else 0  # decode_tc: 16-key tiles a warp
        pf = self._prefetch_tiles(plan, tiles, nhb)
        ahead = self._ahead_tiles(plan, tiles)
        ef = plan.overrides.evict_first
        qo = "" if qk == "float32" else f", {_CTYPE[qk]}"  # the kernels' trailing q/out type (default float)
        unit = self._unit(cache.kind, q16=qk != "float32")
        params = unit.struct("DecodeParams").pack(
            n_queries=b, n_seqs=b, batched=0, n_heads=h, n_kv_heads=cache.n_kv_heads, group=group, n_head_blocks=nhb,
            page_size=cache.page_size, max_pages=cache.max_pages_per_seq, n_splits=plan.n_splits,
            chunk=chunk, causal=1, write_lse=int(lse is not None), page_shift=_page_shift(cache.page_size),
            l2_prefetch=pf, evict_first=int(pf > 0 or ahead > 0 if ef is None else ef),
            merge_apart=int(plan.merge_apart), l2_ahead=ahead, kv_rows=0, pad0=0, **_kv_strides(cache), **fields)
        if plan.warps:
            name, smem = f"decode_tc<{_CTYPE[cache.kind]}, {d}, {plan.warps}{qo}>", _decode_tc_smem(d, plan.warps)
        else:
            name, smem = f"decode<{_CTYPE[cache.kind]}, {d}, {hb}{qo}>", _decode_smem(cache.kind, d, hb)
        unit._launch(name, (plan.n_splits, cache.n_kv_heads * nhb, b), 32 * plan.warps or _DECODE_THREADS,
                     (out, lse if lse is not None else out, plan.o_part if split else out, plan.lse_part,
                      plan.counters, q, cache.k_pools[layer], cache.v_pools[layer], cache.page_table, cache.lengths,
                      plan.seq_ids, plan.seq_ids, sinks if sinks is not None else plan.lse_part), params,
                     stream=stream, shared_mem=smem, pdl=self.pdl)
        return unit

    def _prefetch_tiles(self, plan: DecodePlan, tiles: int, n_head_blocks: int) -> int:
        """Warp tiles after the prologue's that decode_tc asks L2 to prefetch before pdl_wait (pdl only; K/V
        then stream with an evict-first policy so that the next launch's prefetched lines stay in L2).

        With t tiles a warp: none up to 2 (the prologue holds them), then t // 8 between 1 and 3, where no
        other head block reads the same K/V. Example: B1 32/8 D128 at 128k keys, w8 s16: 8192 keys a split,
        t = 64, so 3 tiles (8 lost everywhere; measurements in docs/notes/attention.md)."""
        if not self.pdl or not plan.warps:
            return 0
        if plan.overrides.l2_prefetch is not None:
            return plan.overrides.l2_prefetch
        return min(3, max(1, tiles // 8)) if n_head_blocks == 1 and tiles > 2 else 0

    def _ahead_tiles(self, plan: DecodePlan, tiles: int) -> int:
        """How many tiles after the one it copies next each decode_tc warp keeps L2 asked for (0: none): under
        pdl two from 48 tiles a warp, where a warp's three-stage ring is too short to keep its SM's share of DRAM
        busy; without pdl one from 16 up to head_dim 128. K/V then stream evict-first, so that the lines asked
        for stay in L2 until the ring copies them. Example: B1 32/8 D128 at 128k keys, w8 s16, t = 64 tiles a
        warp: 2 under pdl, 1 without (three ahead lost, four far more: the prefetches crowd out the ring's
        copies; measurements in docs/notes/attention.md)."""
        if not plan.warps:
            return 0
        if plan.overrides.l2_ahead is not None:
            return plan.overrides.l2_ahead
        if self.pdl:
            return 2 if tiles >= 48 else 0
        return 1 if tiles >= 16 and plan.cache.head_dim <= 128 else 0

    # ------------------------------------------------------------------ decode over a contiguous K/V
    def plan_decode_contiguous(self, batch: int, n_heads: int, n_kv_heads: int, head_dim: int, capacity: int,
                               dtype="float16", *, max_kv_len: int | None = None, n_splits: int | None = None,
                               window_left: int = -1, overrides: DecodeOverrides | None = None) -> DecodePlan:
        """Schedule :meth:`flash_attn_decode_contiguous`: one query token for each of ``batch`` sequences whose K/V
        are head-major contiguous arrays ``[batch, n_kv_heads, capacity, head_dim]`` of ``dtype`` (float16,
        bfloat16, float32). The kernels read them as pages of ``capacity`` rows (sequence b's page
        ``b * n_kv_heads``, rows ``head_dim`` apart, heads ``capacity * head_dim`` apart): the paged decode's
        split schedule, buffers and kernels. ``max_kv_len`` (default: capacity) sizes the chunks as in
        :meth:`plan_decode`; ``n_splits``, ``window_left`` and ``overrides`` as there."""
        kind = _norm_kv_dtype(dtype)
        batch = check_int("batch", batch, 1, 65535)
        hk = check_int("n_kv_heads", n_kv_heads, 1)
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim!r}")
        capacity = check_int("capacity", capacity, 1)
        if batch * hk * capacity >= 2**32 or capacity * head_dim >= 2**32:
            raise ValueError(f"batch * n_kv_heads * capacity ({batch * hk * capacity}) rows and capacity * head_dim "
                             f"({capacity * head_dim}) elements must each fit in 32 bits")
        max_kv_len = capacity if max_kv_len is None else check_int("max_kv_len", max_kv_len, 1, capacity)
        ov = _NO_OVERRIDES if overrides is None else overrides
        if not isinstance(ov, DecodeOverrides):
            raise TypeError(f"overrides must be a DecodeOverrides, got {type(overrides).__name__}")
        pages = cupy.asarray((np.arange(batch, dtype=np.int64) * hk).astype(np.int32).reshape(batch, 1))
        view = PagedKVView(kind, hk, int(head_dim), capacity, pages, pages[:, 0], head_major=True)
        ids = cupy.asarray(np.arange(batch, dtype=np.int32))
        return decode_plan(view, ids, n_heads, max_kv_len, n_splits, window_left, ov, self.sm_count())

    @tensors(out=like("q"))
    def flash_attn_decode_contiguous(self, plan: DecodePlan, q: cupy.ndarray, k: cupy.ndarray, v: cupy.ndarray,
                                     lengths: cupy.ndarray, out: cupy.ndarray | None = None, *, scale: float = 0.0,
                                     window_left: int = -1, softcap: float = 0.0, sinks: cupy.ndarray | None = None,
                                     sink_offset: int = 0, lse: cupy.ndarray | None = None,
                                     stream=None) -> cupy.ndarray:
        """:meth:`flash_attn_decode` over head-major contiguous K/V (a plan from :meth:`plan_decode_contiguous`).

        k, v: ``[batch, n_kv_heads, capacity, head_dim]`` of the plan's dtype (bfloat16 as uint16 bits),
        C-contiguous, or ``[n_kv_heads, capacity, head_dim]`` for a batch of one; lengths: [batch] int32 keys of
        each sequence (device values, not read here: 1 ... capacity is the caller's to keep); q: ``[batch,
        n_heads, head_dim]`` (``[n_heads, head_dim]`` for a batch of one), float32 or the K/V dtype; out: q's
        shape and dtype; lse: optional f32 of q's shape without head_dim. The query is the last key's token:
        GQA, ``scale``, ``window_left``, ``softcap``, ``sinks`` / ``sink_offset`` as in :meth:`flash_attn_decode`.
        """
        if not isinstance(plan, DecodePlan) or not getattr(plan.cache, "head_major", False):
            raise TypeError(f"plan must be a DecodePlan from plan_decode_contiguous, got {type(plan).__name__}")
        view = plan.cache
        b, h, hk, d, cap = plan.batch, plan.n_heads, view.n_kv_heads, view.head_dim, view.page_size
        qk = _check_kind("q", q, tuple(dict.fromkeys(("float32", view.kind))))
        lead = (b,) if q.ndim == 3 or b > 1 else ()
        check_array("q", q, shape=lead + (h, d), align=16)
        kv_shape = (b, hk, cap, d) if k.ndim == 4 or b > 1 else (hk, cap, d)
        for name, a in (("k", k), ("v", v)):
            if _check_kind(name, a, (view.kind,)) != view.kind:
                raise TypeError(f"{name} must have the plan's dtype")
            check_array(name, a, shape=kv_shape, align=16)
        check_array("out", out, shape=q.shape)
        if lse is not None:
            check_array("lse", lse, dtype=_F32, shape=q.shape[:-1])
            lse = lse.reshape(b, h)
        check_array("lengths", lengths, dtype=_I32, shape=(b,))
        plan = dataclasses.replace(plan, cache=dataclasses.replace(view, lengths=lengths, k_pool=k, v_pool=v))
        self._decode_merged(plan, 0, q.reshape(b, h, d), out.reshape(b, h, d), qk, scale, window_left, softcap, sinks,
                            sink_offset, lse, stream)
        return out

    # ------------------------------------------------------------------ merge
    @tensors(out=like("v", shape=lambda a: a("v").shape[:1] + a("v").shape[2:]))
    def merge_states(self, v: cupy.ndarray, s: cupy.ndarray, out: cupy.ndarray | None = None, *,
                     lse: cupy.ndarray | None = None, sinks: cupy.ndarray | None = None, sink_offset: int = 0,
                     stream=None) -> cupy.ndarray:
        """Merge partial attention states of the same queries.

        v: [n_tokens, n_states, n_heads, head_dim] f32, each state's output normalised over its own keys;
        s: [n_tokens, n_states, n_heads] f32, each state's **natural-log** LSE (-inf: empty state);
        out: [n_tokens, n_heads, head_dim] f32; lse: optional [n_tokens, n_heads] f32 merged LSE;
        sinks: optional 1-D f32 natural-log logits added to the denominator once, head h's at
        ``sinks[sink_offset + h]`` (NaN: none for that head).
        A row whose states are all empty (and no sink) gets 0 and LSE -inf."""
        check_array("v", v, dtype=_F32, ndim=4, align=16)
        n, ns, h, d = v.shape
        if min(v.shape) == 0:
            raise ValueError(f"v must be non-empty, got shape {v.shape}")
        if d % 4 or d > 4 * _MERGE_THREADS:
            raise ValueError(f"head_dim must be a multiple of 4 up to {4 * _MERGE_THREADS}, got {d}")
        check_array("s", s, dtype=_F32, shape=(n, ns, h))
        check_array("out", out, dtype=_F32, shape=(n, h, d), align=16)
        if lse is not None:
            check_array("lse", lse, dtype=_F32, shape=(n, h))
        offset = _sink_fields(sinks, sink_offset, h)["sink_offset"]
        if n > 65535:
            raise ValueError(f"merge_states takes at most 65535 tokens per call, got {n}")
        self._merge(self._units["attention"], v, s, out, lse, sinks, n, ns, h, d, stream, sink_offset=offset)
        return out

    def _merge(self, unit, v, s, out, lse, sinks, n, ns, h, d, stream, out_type="float", sink_offset=0):
        cols4 = _merge_cols4(n * h, d, self.sm_count())
        params = unit.struct("MergeParams").pack(n_tokens=n, n_states=ns, n_heads=h, head_dim=d,
                                                 has_sinks=int(sinks is not None), write_lse=int(lse is not None),
                                                 cols4=cols4, sink_offset=sink_offset)
        unit._launch(f"merge_states<{out_type}>", (h, n, -(-(d // 4) // cols4)), _MERGE_THREADS,
                     (out, lse if lse is not None else out, v, s, sinks if sinks is not None else s), params,
                     stream=stream, pdl=self.pdl)
