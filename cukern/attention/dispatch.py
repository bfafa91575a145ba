"""AttentionDispatch: the family's compilation units and the launches (cache writes, tensor-core batched
prefill and varlen here; split-KV decode and merge in :mod:`cukern.attention.decode`, a mixin).

Each method validates its arguments, packs one params struct and launches; the host work is in the
plans (:mod:`cukern.attention.plan`) and the cache (:mod:`cukern.attention.cache`).
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.attention.backward import Backward, bwd_unit, bwd_wg_unit
from cukern.attention.cache import BF16, HEAD_DIMS, PagedKVCache, PagedKVView
from cukern.attention.common import (_CTYPE, _DECODE_THREADS, _F32, _I32, _SHORT, _causal_field, _check_kind,
                                     _int_list, _kv_strides, _page_shift, _scale_fields, _sink_fields)
from cukern.attention.decode import Decode
from cukern.attention.plan import (_TC_DECODE_MAX_D, BatchedPlan, _decode_smem, _groups, _head_block, _prefill_shape,
                                   _prefill_wg_shape, _tc_warps)
from cukern.dispatch import Unit, check_array, check_int
from cukern.interop import like, tensors
from cukern.runtime import FamilySpec, KernelSpec

__all__ = ["AttentionDispatch", "FAMILY", "FAMILIES", "PREFILL_HEAD_DIMS", "PREFILL_WG_HEAD_DIMS"]

PREFILL_HEAD_DIMS = HEAD_DIMS[:-1]  # tensor-core prefill / varlen (512 and f32: the SIMT decode kernel)
PREFILL_WG_HEAD_DIMS = (128, 256)  # prefill_wg (Hopper wgmma) head dims; the others run prefill (mma.sync)
_KV_WRITE_THREADS = 128


def _decode_unit(kv: str) -> FamilySpec:
    t = _CTYPE[kv]
    kernels = [KernelSpec(f"decode<{t}, {d}, {g}>", "DecodeParams") for d in HEAD_DIMS for g in _groups(d)]
    if kv != "float32":
        kernels += [KernelSpec(f"decode_tc<{t}, {d}, {nw}>", "DecodeParams")
                    for d in HEAD_DIMS if d <= _TC_DECODE_MAX_D for nw in _tc_warps(d)]
    kernels.append(KernelSpec("merge_states<float>", "MergeParams"))
    srcs = [t] if kv == "float32" else [t, "float"]
    kernels += [KernelSpec(f"kv_write<{t}, {s}>", "KvWriteParams") for s in srcs]
    name = "attention" if kv == "float16" else f"attention_{_SHORT[kv]}"
    return FamilySpec(name, tuple(kernels), source="attention/attention.cu", params_header="attention/params.cuh")


def _decode_q16_unit(kv: str) -> FamilySpec:
    """Decode with q and out in the (16-bit) cache's dtype: the kernels flash_attn_decode runs for such a cache
    (decode_tc up to head_dim 256, decode beyond) and their merge, a unit apart so that the f32-q units compile
    as before and these only when first used."""
    t = _CTYPE[kv]
    kernels = [KernelSpec(f"decode_tc<{t}, {d}, {nw}, {t}>", "DecodeParams")
               for d in HEAD_DIMS if d <= _TC_DECODE_MAX_D for nw in _tc_warps(d)]
    kernels += [KernelSpec(f"decode<{t}, {d}, {g}, {t}>", "DecodeParams")
                for d in HEAD_DIMS if d > _TC_DECODE_MAX_D for g in _groups(d)]
    kernels.append(KernelSpec(f"merge_states<{t}>", "MergeParams"))
    return FamilySpec(f"attention_{_SHORT[kv]}_q16", tuple(kernels), source="attention/attention.cu",
                      params_header="attention/params.cuh")


def _prefill_unit(kv: str, kernel: str = "prefill") -> FamilySpec:
    """The unit of ``kernel`` (prefill: mma.sync, PREFILL_HEAD_DIMS; prefill_wg: wgmma, PREFILL_WG_HEAD_DIMS) for
    one KV dtype."""
    t = _CTYPE[kv]
    dims = PREFILL_WG_HEAD_DIMS if kernel == "prefill_wg" else PREFILL_HEAD_DIMS
    kernels = [KernelSpec(f"{kernel}<{t}, {d}, {paged}>", "PrefillParams") for d in dims for paged in ("true", "false")]
    return FamilySpec(f"attention_{kernel}_{_SHORT[kv]}", tuple(kernels), source=f"attention/{kernel}.cu",
                      params_header="attention/params.cuh")


# built for sm_90a on sm_90 (Unit): the wgmma prefill and backward
_SM90A_UNITS = {f"attention_{kernel}_{_SHORT[kv]}" for kv in ("float16", BF16) for kernel in ("prefill_wg", "bwd_wg")}


# One RawModule per unit: decode + cache writes + merge per KV dtype, decode with 16-bit q / out per 16-bit KV
# dtype, prefill and prefill_wg per dtype, the backward and its wgmma bwd_dkdv per dtype.
FAMILIES = {spec.name: spec for spec in (
    [_decode_unit(kv) for kv in ("float16", BF16, "float32")] + [_decode_q16_unit(kv) for kv in ("float16", BF16)]
    + [_prefill_unit(kv) for kv in ("float16", BF16)]
    + [_prefill_unit(kv, "prefill_wg") for kv in ("float16", BF16)]
    + [bwd_unit(kv) for kv in ("float16", BF16)] + [bwd_wg_unit(kv) for kv in ("float16", BF16)])}
FAMILY = FAMILIES["attention"]




class AttentionDispatch(Decode, Backward):
    """Records attention kernels into a stream. Every method takes ``stream=`` (None: CuPy's
    current stream, torch's for torch tensors) and validates its arguments before launching; none
    synchronises, allocates or reads device memory (``plan_*`` and the cache do the host work; an
    output left None is allocated by cukern.interop).

    Dtypes: :meth:`flash_attn_decode` takes q and out in float32 or in the cache's dtype (a float16 or
    bfloat16 cache; bf16 as uint16 bits), out in q's dtype; :meth:`flash_attn_batched` takes Q in the
    cache's 16-bit dtype (tensor cores) or float32 (SIMT); :meth:`flash_attn_varlen` float16 / bfloat16 (tensor
    cores; head_dim 512 SIMT) or float32 (SIMT). Arithmetic is f32 throughout; LSE, sinks and the merge's inputs
    are f32.

    ``pdl`` (default False; sm_90+) launches :meth:`flash_attn_decode` (and :meth:`merge_states`, which
    touches memory only after the wait) with programmatic dependent launch: its blocks start while
    the previous kernel in the stream finishes and stream their first
    K/V tiles before waiting for it (``pdl_wait`` in common/pdl.cuh), which hides the launch gap and
    the ramp-up of a decode loop's back-to-back attention calls (with long chunks it also asks L2 for
    a few more tiles and streams K/V evict-first: :meth:`_prefetch_tiles`). Before the wait the kernel reads
    only the plan's ``seq_ids``, the cache's ``lengths`` and ``page_table``, and the K/V rows of the
    positions below each sequence's last token (``length - 1``); so a kernel still in flight may
    write q, sinks, the outputs and the newest token's K/V (the decode step's KV write), but must not
    write the lengths, the page table or older K/V rows (host uploads through
    :class:`PagedKVCache` are never in flight). The attribute may be changed between calls."""

    families = FAMILIES

    def __init__(self, device: int | None = None, *, pdl: bool = False):
        self._device = device
        self.pdl = bool(pdl)
        self._units = {name: Unit(spec, device, sm90a=name in _SM90A_UNITS) for name, spec in FAMILIES.items()}

    def _repeat_state(self):
        """The setting a repeatable method's launches depend on besides its arguments (cukern.repeat)."""
        return self.pdl

    def _unit(self, kind: str, prefill: bool = False, q16: bool = False) -> Unit:
        """The unit of a cache of this kind: prefill, decode with 16-bit q / out (q16), else decode and writes."""
        if prefill or q16:
            return self._units[f"attention_{'prefill_' if prefill else ''}{_SHORT[kind]}{'_q16' if q16 else ''}"]
        return self._units["attention" if kind == "float16" else f"attention_{_SHORT[kind]}"]

    def struct(self, name: str):
        return self._units["attention"].struct(name)

    def sm_count(self) -> int:
        return self._units["attention"].sm_count()

    def max_shared_optin(self) -> int:
        """The most dynamic shared memory one block may opt in to on this device (bytes)."""
        return self._units["attention"].max_shared_optin()

    # ------------------------------------------------------------------ cache writes
    def _kv_src(self, cache: PagedKVCache, k, v, n: int | None):
        kinds = (cache.kind,) if cache.kind == "float32" else (cache.kind, "float32")
        ks = _check_kind("k", k, kinds)
        vs = _check_kind("v", v, kinds)
        if ks != vs:
            raise TypeError(f"k and v must have the same dtype, got {k.dtype} and {v.dtype}")
        check_array("k", k, shape=(n, cache.n_kv_heads, cache.head_dim))
        check_array("v", v, shape=k.shape)   # as many rows as k: the kernel reads both per token
        if k.shape[0] == 0:
            raise ValueError("k and v must hold at least one token")
        return ks

    def _check_layer(self, cache: PagedKVCache | PagedKVView, layer: int) -> int:
        if not isinstance(cache, (PagedKVCache, PagedKVView)):
            raise TypeError(f"cache must be a PagedKVCache or a PagedKVView, got {type(cache).__name__}")
        return check_int("layer", layer, 0, cache.n_layers - 1)

    @tensors
    def write_kv(self, cache: PagedKVCache, layer: int, k: cupy.ndarray, v: cupy.ndarray, slot_ids: cupy.ndarray,
                 positions: cupy.ndarray, *, stream=None) -> None:
        """Write one K/V row per token: row i to slot ``slot_ids[i]`` at ``positions[i]`` (a decode step).

        k, v: [n, n_kv_heads, head_dim], the cache dtype or float32; slot_ids, positions: [n] int32
        (device values, not read on the host: positions outside the slot's allocated pages are skipped,
        so call :meth:`PagedKVCache.extend` first)."""
        layer = self._check_layer(cache, layer)
        src = self._kv_src(cache, k, v, None)
        n = k.shape[0]
        check_array("slot_ids", slot_ids, dtype=_I32, shape=(n,))
        check_array("positions", positions, dtype=_I32, shape=(n,))
        self._kv_launch(cache, layer, k, v, src, slot_ids, positions, n, 1, 0, 0, stream)

    @tensors
    def write_kv_run(self, cache: PagedKVCache, layer: int, k: cupy.ndarray, v: cupy.ndarray, slot: int, pos0: int,
                     *, stream=None) -> None:
        """Write n consecutive tokens of one sequence at positions ``pos0 ... pos0 + n - 1`` (a prefill chunk).

        The positions must already be part of the sequence (``cache.extend``), checked on the host."""
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache (lengths checked on the host), got {type(cache).__name__}")
        layer = self._check_layer(cache, layer)
        src = self._kv_src(cache, k, v, None)
        n = k.shape[0]
        slot = cache.alloc.check_slot(slot)
        pos0 = check_int("pos0", pos0, 0)
        if pos0 + n > cache.length(slot):
            raise ValueError(f"positions {pos0} ... {pos0 + n - 1} are outside sequence {slot} "
                             f"(length {cache.length(slot)}; extend it first)")
        self._kv_launch(cache, layer, k, v, src, cache.page_table, cache.page_table, n, 0, slot, int(pos0), stream)

    def _kv_launch(self, cache, layer, k, v, src, slot_ids, positions, n, per_token, slot, pos0, stream):
        unit = self._unit(cache.kind)
        params = unit.struct("KvWriteParams").pack(
            n_tokens=n, row_elems=cache.n_kv_heads * cache.head_dim, page_size=cache.page_size,
            max_pages=cache.max_pages_per_seq, per_token=per_token, slot=slot, pos0=pos0, pad0=0)
        name = f"kv_write<{_CTYPE[cache.kind]}, {_CTYPE[src]}>"
        unit._launch(name, n, _KV_WRITE_THREADS,
                     (cache.k_pools[layer], cache.v_pools[layer], k, v, cache.page_table, slot_ids, positions),
                     params, stream=stream, pdl=self.pdl)

    # ------------------------------------------------------------------ batched prefill
    def plan_batched(self, cache: PagedKVCache, seq_ids, q_lens) -> BatchedPlan:
        """Schedule queries of several sequences against the cache: sequence ``seq_ids[i]`` (host ints)
        has ``q_lens[i]`` query rows, its last ``q_lens[i]`` cached tokens (write their K/V first), so
        ``seq_start = length - q_len`` (0 on a fresh prefill, > 0 when extending)."""
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        ids = _int_list("seq_ids", seq_ids)
        ql = _int_list("q_lens", q_lens)
        if len(ids) != len(ql):
            raise ValueError(f"seq_ids and q_lens differ in length ({len(ids)} vs {len(ql)})")
        if len(ids) > 65535:
            raise ValueError(f"at most 65535 sequences per call, got {len(ids)}")
        for s, n in zip(ids, ql):
            cache.alloc.check_slot(int(s))
            if not 1 <= n <= cache.alloc.lengths[s]:
                raise ValueError(f"sequence {s}: q_len {n} must be 1 ... its cached length {cache.alloc.lengths[s]}")
        indptr = np.concatenate([[0], np.cumsum(ql)]).astype(np.int32)
        return BatchedPlan(cache, cupy.asarray(ids.astype(np.int32)), cupy.asarray(indptr), int(indptr[-1]),
                           int(ql.max()))

    @tensors(out=like("q"))
    def flash_attn_batched(self, plan: BatchedPlan, layer: int, q: cupy.ndarray, out: cupy.ndarray | None = None, *,
                           causal: bool = True, causal_variant: str = "lower_right", scale: float = 0.0,
                           window_left: int = -1, softcap: float = 0.0, sinks: cupy.ndarray | None = None,
                           sink_offset: int = 0, lse: cupy.ndarray | None = None, wgmma: bool | None = None,
                           stream=None) -> cupy.ndarray:
        """Many queries per sequence against the paged cache (prefill, or a chunk that extends one).

        q, out: [n_q, n_heads, head_dim] with the rows of sequence i at ``q_indptr[i] ...``. Q in the cache
        dtype (float16 / bfloat16) runs on tensor cores (f32 accumulation; head_dim up to 256): on sm_90 at
        head_dim 128 and 256 the wgmma kernel prefill_wg, else mma.sync m16n8k16 (prefill); ``wgmma`` None picks,
        True forces prefill_wg (ValueError where it cannot run), False prefill. float32 Q runs the SIMT
        decode kernel over every query row (any cache dtype, head_dim up to 512). lse: optional [n_q,
        n_heads] f32, natural log. ``causal_variant``: ``"lower_right"`` (the last query at the last key,
        FlashAttention's alignment) or ``"upper_left"`` (query r at position r, torch's ``is_causal``; a torch
        ``CausalVariant`` is taken by name); sinks / sink_offset as in :meth:`flash_attn_decode`."""
        if not isinstance(plan, BatchedPlan):
            raise TypeError(f"plan must be a BatchedPlan (AttentionDispatch.plan_batched), got {type(plan).__name__}")
        cache = plan.cache
        layer = self._check_layer(cache, layer)
        d = cache.head_dim
        qk = _check_kind("q", q, ("float16", BF16, "float32"))
        check_array("q", q, ndim=3)
        n_q, h = q.shape[0], q.shape[1]
        if n_q != plan.n_q or q.shape[2] != d:
            raise ValueError(f"q must have shape ({plan.n_q}, n_heads, {d}), got {q.shape}")
        if h % cache.n_kv_heads:
            raise ValueError(f"n_heads ({h}) must be a multiple of n_kv_heads ({cache.n_kv_heads})")
        if _check_kind("out", out, (qk,)) != qk:
            raise TypeError("out must have q's dtype")
        check_array("out", out, shape=q.shape)
        if lse is not None:
            check_array("lse", lse, dtype=_F32, shape=(n_q, h))
        fields = (_scale_fields(scale, d, softcap, window_left) | _sink_fields(sinks, sink_offset, h)
                  | dict(causal=_causal_field(causal, causal_variant)))
        if qk == "float32":
            if n_q > 65535:
                raise ValueError(f"the float32 (SIMT) path takes at most 65535 query rows per call, got {n_q}")
            check_array("q", q, align=16)
            self._simt_batched(cache, layer, "float32", q, out, lse, sinks, plan.seq_ids, cache.page_table,
                               cache.lengths, plan.q_indptr, len(plan.seq_ids), cache.page_size,
                               cache.max_pages_per_seq, cache.capacity_tokens(), False, fields, stream)
            return out
        if qk != cache.kind:
            raise TypeError(f"q is {qk} but the cache holds {cache.kind}: tensor-core prefill needs Q in the "
                            f"cache dtype (or float32 Q for the SIMT path)")
        if d not in PREFILL_HEAD_DIMS:
            raise ValueError(f"tensor-core prefill supports head_dim {PREFILL_HEAD_DIMS}; use float32 Q for {d}")
        check_array("q", q, align=16)
        check_array("out", out, align=4)
        self._prefill(qk, d, True, out, lse, q, cache.k_pools[layer], cache.v_pools[layer], plan.q_indptr,
                      cache.lengths, cache.page_table, plan.seq_ids, sinks, len(plan.seq_ids), h, cache.n_kv_heads,
                      plan.max_q_len, cache.page_size, cache.max_pages_per_seq, fields, wgmma, stream)
        return out

    def _simt_batched(self, cache, layer, qk, q, out, lse, sinks, seq_ids, page_table, lengths, q_indptr, n_seqs,
                      page_size, max_pages, chunk, kv_rows, fields, stream):
        """The SIMT decode kernel in its batched mode (one unsplit block row per query row) on checked arguments:
        over the paged ``cache`` (layer ``layer``), or with ``kv_rows`` over packed rows (``cache`` then a
        PagedKVView of the K/V arrays as its pools: page_table = cu_seqlens_k, lengths = its tail). qk: q and
        out's kind (float32, or the K/V's 16-bit kind through the q16 unit: head_dim 512)."""
        n_q, h, d = q.shape
        group = h // cache.n_kv_heads
        hb = _head_block(group, d)
        nhb = -(-group // hb)
        unit = self._unit(cache.kind, q16=qk != "float32")
        qo = "" if qk == "float32" else f", {_CTYPE[qk]}"
        params = unit.struct("DecodeParams").pack(
            n_queries=n_q, n_seqs=n_seqs, batched=1, n_heads=h, n_kv_heads=cache.n_kv_heads, group=group,
            n_head_blocks=nhb, page_size=page_size, max_pages=max_pages, n_splits=1, chunk=chunk,
            write_lse=int(lse is not None), page_shift=_page_shift(page_size), l2_prefetch=0, evict_first=0,
            merge_apart=0, l2_ahead=0, kv_rows=int(kv_rows), pad0=0, **_kv_strides(cache), **fields)
        lse_arg = lse if lse is not None else out
        unit._launch(f"decode<{_CTYPE[cache.kind]}, {d}, {hb}{qo}>", (1, cache.n_kv_heads * nhb, n_q), _DECODE_THREADS,
                     (out, lse_arg, out, lse_arg, seq_ids, q, cache.k_pools[layer], cache.v_pools[layer],
                      page_table, lengths, seq_ids, q_indptr, sinks if sinks is not None else out), params,
                     stream=stream, shared_mem=_decode_smem(cache.kind, d, hb))

    def _use_wg(self, kind: str, d: int, h: int, wgmma) -> bool:
        """Whether a tensor-core prefill runs prefill_wg (see flash_attn_batched's ``wgmma``)."""
        if wgmma is not None and not isinstance(wgmma, bool):
            raise TypeError(f"wgmma must be None, True or False, got {wgmma!r}")
        if wgmma is False:
            return False
        ok = d in PREFILL_WG_HEAD_DIMS and h <= 65535 and self._units[f"attention_prefill_wg_{_SHORT[kind]}"].is_sm90()
        if wgmma and not ok:
            raise ValueError(f"wgmma=True needs an sm_90 (Hopper) device, head_dim in {PREFILL_WG_HEAD_DIMS} "
                             f"and at most 65535 heads")
        return ok

    def _prefill(self, kind, d, paged, out, lse, q, k, v, q_indptr, kv_info, page_table, seq_ids, sinks, n_seqs, h,
                 n_kv_heads, max_q_len, page_size, max_pages, fields, wgmma, stream):
        wg = self._use_wg(kind, d, h, wgmma)
        threads, bm, smem = _prefill_wg_shape(d) if wg else _prefill_shape(d)
        n_tiles = -(-max_q_len // bm)
        unit = self._units[f"attention_prefill_wg_{_SHORT[kind]}"] if wg else self._unit(kind, prefill=True)
        params = unit.struct("PrefillParams").pack(
            n_seqs=n_seqs, n_heads=h, n_kv_heads=n_kv_heads, group=h // n_kv_heads, n_q_tiles=n_tiles,
            page_size=page_size, max_pages=max_pages, write_lse=int(lse is not None), page_shift=_page_shift(page_size),
            **fields)
        name = f"prefill{'_wg' if wg else ''}<{_CTYPE[kind]}, {d}, {'true' if paged else 'false'}>"
        if not wg and n_tiles > 65535:
            raise ValueError(f"at most {65535 * bm} query rows per sequence, got {max_q_len}")
        # prefill: grid (heads, sequences, query tiles); prefill_wg: (query tiles, heads, sequences)
        grid = (n_tiles, h, n_seqs) if wg else (h, n_seqs, n_tiles)
        unit._launch(name, grid, threads,
                     (out, lse if lse is not None else q_indptr, q, k, v, q_indptr, kv_info, page_table, seq_ids,
                      sinks if sinks is not None else q_indptr), params, stream=stream, shared_mem=smem)

    # ------------------------------------------------------------------ varlen
    @tensors(out=like("q"))
    def flash_attn_varlen(self, q: cupy.ndarray, k: cupy.ndarray, v: cupy.ndarray, cu_seqlens_q: cupy.ndarray,
                          cu_seqlens_k: cupy.ndarray, out: cupy.ndarray | None = None, *, max_seqlen_q: int,
                          causal: bool = False, causal_variant: str = "lower_right", scale: float = 0.0,
                          window_left: int = -1, softcap: float = 0.0, sinks: cupy.ndarray | None = None,
                          sink_offset: int = 0, lse: cupy.ndarray | None = None, wgmma: bool | None = None,
                          stream=None) -> tuple[cupy.ndarray, cupy.ndarray | None]:
        """Packed variable-length attention (FlashAttention's varlen forward).

        q, out: [total_q, n_heads, head_dim]; k, v: [total_k, n_kv_heads, head_dim], all float16, bfloat16
        (uint16 bits) or float32; cu_seqlens_q / cu_seqlens_k: [batch + 1] int32 prefix sums (device values,
        not read here); max_seqlen_q: host bound on any sequence's q length (sizes the tensor-core grid; rows
        past it are not computed). float16 / bfloat16 at head_dim 32 ... 256 (multiples of 32) run on tensor
        cores (P rounded to the dtype); float32 (head_dim in ``HEAD_DIMS``) and head_dim 512 run the SIMT decode
        kernel over each query row (f32 arithmetic on the stored values, K/V read once per query row; at most
        65535 query rows a call). Causal masking: ``causal_variant`` ``"lower_right"`` aligns the last query
        with the last key (FlashAttention: query r sees keys j <= k_len - q_len + r), ``"upper_left"`` the
        first with the first (torch's ``is_causal``: j <= r); a query that sees no key gets 0 and LSE -inf.
        lse: optional [total_q, n_heads] f32, natural log; sinks / sink_offset as in :meth:`flash_attn_decode`.
        ``wgmma``: as in :meth:`flash_attn_batched`. Returns (out, lse)."""
        kind = _check_kind("q", q, ("float16", BF16, "float32"))
        for name, a in (("k", k), ("v", v), ("out", out)):
            if _check_kind(name, a, (kind,)) != kind:
                raise TypeError(f"{name} must have q's dtype")
        check_array("q", q, ndim=3, align=16)
        check_array("k", k, ndim=3, align=16)
        check_array("v", v, shape=k.shape, align=16)
        check_array("out", out, shape=q.shape, align=4)
        total_q, h, d = q.shape
        total_k, hk = k.shape[0], k.shape[1]
        if k.shape[2] != d:
            raise ValueError(f"k has head_dim {k.shape[2]}, q has {d}")
        simt = kind == "float32" or d not in PREFILL_HEAD_DIMS
        if d not in (HEAD_DIMS if kind == "float32" else PREFILL_HEAD_DIMS + (512,)):
            raise ValueError(f"head_dim must be one of {PREFILL_HEAD_DIMS} or 512 ({HEAD_DIMS} in float32), got {d}")
        if hk < 1 or h % hk:
            raise ValueError(f"n_heads ({h}) must be a multiple of n_kv_heads ({hk})")
        check_array("cu_seqlens_q", cu_seqlens_q, dtype=_I32, ndim=1)
        b = cu_seqlens_q.shape[0] - 1
        if b < 1 or b > 65535:
            raise ValueError(f"cu_seqlens_q must hold batch + 1 entries, 1 <= batch <= 65535, got {b + 1}")
        check_array("cu_seqlens_k", cu_seqlens_k, dtype=_I32, shape=(b + 1,))
        if not isinstance(max_seqlen_q, (int, np.integer)) or max_seqlen_q < 1:
            raise ValueError(f"max_seqlen_q must be an int >= 1, got {max_seqlen_q!r}")
        if total_q == 0 or total_k == 0:
            raise ValueError("q and k must hold at least one token")
        if lse is not None:
            check_array("lse", lse, dtype=_F32, shape=(total_q, h))
        fields = (_scale_fields(scale, d, softcap, window_left) | _sink_fields(sinks, sink_offset, h)
                  | dict(causal=_causal_field(causal, causal_variant)))
        if simt:
            if total_q > 65535:
                raise ValueError(f"float32 / head_dim 512 varlen (the SIMT kernel) takes at most 65535 query rows "
                                 f"per call, got {total_q}")
            if wgmma:
                raise ValueError("wgmma=True: float32 / head_dim 512 varlen runs the SIMT kernel")
            rows = PagedKVView(kind, hk, d, 1, cu_seqlens_k, cu_seqlens_k[1:], k, v)
            self._simt_batched(rows, 0, kind, q, out, lse, sinks, cu_seqlens_k, cu_seqlens_k, cu_seqlens_k[1:],
                               cu_seqlens_q, b, 1, 1, 1 << 30, True, fields, stream)
        else:
            self._prefill(kind, d, False, out, lse, q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k, cu_seqlens_k,
                          sinks, b, h, hk, int(max_seqlen_q), 1, 1, fields, wgmma, stream)
        return out, lse
