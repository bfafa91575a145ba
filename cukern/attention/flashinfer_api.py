"""FlashInfer's paged-KV wrappers over cukern's kernels: :class:`BatchDecodeWithPagedKVCacheWrapper` (split-KV
decode) and :class:`BatchPrefillWithPagedKVCacheWrapper` (the batched prefill kernels), each split into
``plan()`` and ``run()`` as FlashInfer's are.

``plan(indptr, indices, last_page_len, ...)`` takes FlashInfer's CSR page layout: sequence ``b`` holds pages
``indices[indptr[b] : indptr[b + 1]]`` in order, the last one filled to ``last_page_len[b]`` (1 ...
page_size), so it has ``(pages - 1) * page_size + last_page_len[b]`` tokens. It is the host work: it reads
those arrays on the host (a device array is copied back, a sync, as FlashInfer's plan does), checks them,
turns them into a padded page table and lengths, uploads them (on ``stream``) into buffers the wrapper keeps,
and picks the decode's schedule. ``run(q, paged_kv_cache)`` checks the arrays, packs the parameters and
launches: no host sync, no allocation once ``out`` (and ``lse``) are passed, so it can be captured in a CUDA
graph. Plan and run on one stream. Both take torch tensors (CUDA index arrays of ``plan`` are copied back;
``run`` through ``interop.tensors``: zero-copy, ``out`` made in the inputs' framework, torch's current
stream when ``stream`` is None).

The cache is FlashInfer's ``NHD`` layout, read in place: a pair ``(k_cache, v_cache)`` of ``[num_pages,
page_size, n_kv_heads, head_dim]``, or one ``[num_pages, 2, page_size, n_kv_heads, head_dim]`` array (K then V
in each page, read as pages of twice the stride through a second page table of doubled ids, which the plan
uploads beside the first). ``HND`` (``[num_pages, n_kv_heads, page_size, head_dim]``) is refused: the kernels
step a page's tokens by ``n_kv_heads * head_dim`` elements. The pools must be C-contiguous; page ids are
checked on the host against the pool's size at each run.

The LSE (``return_lse=True``) is FlashInfer's **base-2** logarithm, ``[tokens, n_heads]`` float32, unless
``lse_base="ln"`` (the natural log, cukern's and FlashAttention's); the kernels write the natural log and run
converts it in place (one elementwise launch). ``lse_to_natural`` / ``lse_to_log2`` convert either way.
Queries are aligned to the end of each sequence's keys (causal prefill: query ``r`` of ``q_len`` sees keys
``j <= kv_len - q_len + r``); ``window_left`` keeps keys ``j >= position - window_left``; ``logits_soft_cap``
caps logits at ``cap * tanh(logit / cap)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cupy
import numpy as np

from cukern.attention.cache import HEAD_DIMS, PagedKVView, _norm_kv_dtype
from cukern.attention.common import _kind
from cukern.attention.dispatch import AttentionDispatch
from cukern.attention.foreign import check_pools, lse_to_log2, scale_arg, softcap_arg
from cukern.attention.plan import _MAX_SPLITS, _NO_OVERRIDES, BatchedPlan, DecodeOverrides, DecodePlan, decode_plan
from cukern.dispatch import check_array, check_int
from cukern.interop import as_cupy, like, tensors
from cukern.streams import resolve_stream

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"]


@dataclass(frozen=True)
class _HostPages:
    """A plan's checked host side: FlashInfer's CSR pages as a padded table, and the settings."""

    table: np.ndarray  # [batch, max pages] int32 page ids, -1 past a sequence's pages
    lengths: np.ndarray  # [batch] int64 tokens per sequence
    kv_kind: str
    q_kind: str | None  # None: run takes any query dtype the kernel does
    fields: dict  # the launches' scale, window_left, softcap
    n_heads: int
    n_kv_heads: int
    head_dim: int
    page_size: int
    max_page: int  # the largest page id, checked against the cache at run


def _host_ints(name: str, a) -> np.ndarray:
    """A 1-D integer array on the host (a device array, a CUDA torch tensor too, copied back)."""
    if getattr(a, "is_cuda", False) or hasattr(a, "__cuda_array_interface__"):
        a = as_cupy(a, name)
    arr = np.asarray(a.get() if isinstance(a, cupy.ndarray) else a)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a 1-D array of integers, got {arr.dtype} of shape {arr.shape}")
    return arr.astype(np.int64)


def _kind_of(name: str, dtype) -> str:
    """'float16', 'bfloat16' or 'float32' from a NumPy dtype or type, a name, or a torch dtype (``torch.bfloat16``)."""
    text = str(dtype)
    try:
        return _norm_kv_dtype(text.removeprefix("torch.") if text.startswith("torch.") else dtype)
    except TypeError:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {dtype!r}") from None


class _PagedWrapper:
    """The CSR page tables, the cache's checks and the LSE base shared by the decode and prefill wrappers."""

    def __init__(self, float_workspace_buffer=None, kv_layout: str = "NHD", *, device: int | None = None,
                 pdl: bool = False):
        if kv_layout != "NHD":
            raise ValueError(f"kv_layout {kv_layout!r}: cukern's kernels read NHD pages ([num_pages, page_size, "
                             f"n_kv_heads, head_dim]) only")
        self.device = cupy.cuda.Device(device).id if device is not None else cupy.cuda.Device().id
        self._device = self.device  # where interop.tensors checks the tensors of run()
        self._dispatch = AttentionDispatch(self.device, pdl=pdl)
        self._bufs: dict[str, cupy.ndarray] = {}  # page tables (plain, doubled ids), lengths, seq ids, q_indptr
        self._views: tuple[PagedKVView, PagedKVView] | None = None  # over the plain and the doubled page table
        self._pages: _HostPages | None = None  # the last plan's host side

    def _buffer(self, name: str, shape: tuple, fill: int, host: np.ndarray, stream) -> cupy.ndarray:
        """The kept buffer ``name`` (made anew only when ``shape`` outgrows it), filled with ``host`` in its
        leading corner and ``fill`` elsewhere, uploaded on ``stream``."""
        buf = self._bufs.get(name)
        if buf is None or any(n > have for n, have in zip(shape, buf.shape)):
            grown = tuple(shape) if buf is None else tuple(max(n, have) for n, have in zip(shape, buf.shape))
            with stream:
                buf = self._bufs[name] = cupy.empty(grown, np.int32)
        full = np.full(buf.shape, fill, np.int32)
        full[tuple(slice(0, n) for n in host.shape)] = host
        buf.set(full, stream=stream)
        return buf

    def _check_pages(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                     pos_encoding_mode, window_left, logits_soft_cap, sm_scale, q_data_type,
                     kv_data_type) -> _HostPages:
        """FlashInfer's CSR page layout, the heads and the launch settings, checked on the host."""
        if pos_encoding_mode != "NONE":
            raise ValueError(f"pos_encoding_mode {pos_encoding_mode!r}: cukern's attention applies no rotary "
                             f"embedding (apply RoPE before, e.g. the elementwise family's fused RoPE + KV write)")
        page_size = check_int("page_size", page_size, 1)
        hq, hk = check_int("num_qo_heads", num_qo_heads, 1), check_int("num_kv_heads", num_kv_heads, 1)
        if hq % hk:
            raise ValueError(f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hk})")
        if check_int("head_dim", head_dim) not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
        kv_kind = _kind_of("kv_data_type", kv_data_type if kv_data_type is not None else (q_data_type or "float16"))
        q_kind = None if q_data_type is None else _kind_of("q_data_type", q_data_type)
        fields = _launch_fields(sm_scale, window_left, logits_soft_cap)
        ptr, ids = _host_ints("indptr", indptr), _host_ints("indices", indices)
        last = _host_ints("last_page_len", last_page_len)
        batch = len(ptr) - 1
        if not 1 <= batch <= 65535 or ptr[0] != 0:
            raise ValueError(f"indptr must hold batch + 1 entries (1 <= batch <= 65535) from 0, got {len(ptr)} "
                             f"entries from {ptr[:1]}")
        pages = np.diff(ptr)
        if pages.min() < 1 or ptr[-1] > len(ids):
            raise ValueError(f"indptr must rise by at least one page per sequence and end within indices "
                             f"({len(ids)} ids), got {ptr}")
        ids = ids[:ptr[-1]]
        if ids.min() < 0 or ids.max() >= 2**30:
            raise ValueError(f"page ids must be 0 ... 2**30 - 1, got {ids.min()} ... {ids.max()}")
        if len(last) != batch or last.min() < 1 or last.max() > page_size:
            raise ValueError(f"last_page_len must hold {batch} values in 1 ... page_size ({page_size}), got {last}")
        width = int(pages.max())
        if width * page_size >= 2**31:
            raise ValueError(f"a sequence of {width} pages of {page_size} tokens overflows int32 positions")
        table = np.full((batch, width), -1, np.int32)  # row b: its pages in order, -1 past them
        table[np.repeat(np.arange(batch), pages), np.arange(len(ids)) - np.repeat(ptr[:-1], pages)] = ids
        return _HostPages(table, (pages - 1) * page_size + last, kv_kind, q_kind, fields, hq, hk, int(head_dim),
                          page_size, int(ids.max()))

    def _upload(self, hp: _HostPages, stream, width: int = 0) -> None:
        """Upload the checked tables into the kept buffers (on ``stream``; rows at least ``width`` pages wide)
        and point the views at them."""
        batch = len(hp.lengths)
        shape = (batch, max(width, hp.table.shape[1]))
        plain = self._buffer("pages", shape, -1, hp.table, stream)
        doubled = self._buffer("pages2", shape, -1, np.where(hp.table >= 0, 2 * hp.table, -1), stream)
        lens = self._buffer("lengths", (batch,), 0, hp.lengths.astype(np.int32), stream)
        self._buffer("seq_ids", (batch,), 0, np.arange(batch, dtype=np.int32), stream)
        self._views = tuple(PagedKVView(hp.kv_kind, hp.n_kv_heads, hp.head_dim, hp.page_size, t, lens)
                            for t in (plain, doubled))
        self._pages = hp

    def _seq_ids(self, batch: int) -> cupy.ndarray:
        return self._bufs["seq_ids"][:batch]

    def _run_view(self, q, paged_kv_cache) -> PagedKVView:
        """The planned view with the caller's pools (checked against the plan)."""
        if self._views is None:
            raise RuntimeError("call plan() before run()")
        hp, view = self._pages, self._views[0]
        check_array("q", q, device=self.device)
        if hp.q_kind is not None and _kind(q) != hp.q_kind:
            raise TypeError(f"q is {q.dtype} but plan() was told q_data_type {hp.q_kind}")
        page = (hp.page_size, hp.n_kv_heads, hp.head_dim)
        if isinstance(paged_kv_cache, (tuple, list)):
            if len(paged_kv_cache) != 2:
                raise ValueError(f"paged_kv_cache must be (k_cache, v_cache) or one array, got {len(paged_kv_cache)}")
            k, v = (as_cupy(a, name) for a, name in zip(paged_kv_cache, ("k_cache", "v_cache")))  # torch: views
            kind = check_pools(("k_cache", "v_cache"), k, v, self.device)
            if k.shape[1:] != page:
                raise ValueError(f"k_cache must have shape (num_pages, {', '.join(map(str, page))}), got {k.shape}")
            n_pages = k.shape[0]
        else:
            kv = as_cupy(paged_kv_cache, "paged_kv_cache")
            kind = check_pools(("paged_kv_cache", "paged_kv_cache"), kv, kv, self.device, ndim=5)
            if kv.shape[1:] != (2, *page):
                raise ValueError(f"paged_kv_cache must have shape (num_pages, 2, {', '.join(map(str, page))}), "
                                 f"got {kv.shape}")
            n_pages = kv.shape[0]
            half = hp.page_size * hp.n_kv_heads * hp.head_dim * kv.itemsize  # bytes of a page's K (or V)
            k = cupy.ndarray((2 * n_pages, *page), kv.dtype, memptr=kv.data)  # its page 2p: K of page p
            v = cupy.ndarray((2 * n_pages - 1, *page), kv.dtype, memptr=kv.data + half)  # its page 2p: V of page p
            view = self._views[1]
        if kind != hp.kv_kind:
            raise TypeError(f"the cache is {kind} but plan() was told kv_data_type {hp.kv_kind}")
        if hp.max_page >= n_pages:
            raise ValueError(f"indices name page {hp.max_page}, the cache holds {n_pages} pages")
        return view.with_pools(k, v)

    def _outputs(self, q, rows: int, out, lse, return_lse: bool, lse_base: str, stream):
        """``out`` (or a new one like q) and the LSE buffer (the caller's, checked; new with ``return_lse``)."""
        if lse_base not in ("log2", "ln"):
            raise ValueError(f"lse_base must be 'log2' (FlashInfer's) or 'ln' (natural), got {lse_base!r}")
        check_array("q", q, shape=(rows, self._pages.n_heads, self._pages.head_dim))
        if lse is not None:
            check_array("lse", lse, dtype=np.float32, shape=(rows, self._pages.n_heads), device=self.device)
        with stream:
            out = cupy.empty(q.shape, q.dtype) if out is None else out
            if lse is None and return_lse:
                lse = cupy.empty((rows, self._pages.n_heads), cupy.float32)
        return out, lse

    @staticmethod
    def _finish(out, lse, return_lse: bool, lse_base: str, stream):
        """The natural-log LSE the kernels wrote in FlashInfer's base 2 (in place), and run's result."""
        if lse is not None and lse_base == "log2":
            with stream:
                lse_to_log2(lse, out=lse)
        return (out, lse) if return_lse else out


def _launch_fields(sm_scale, window_left, logits_soft_cap) -> dict:
    """FlashInfer's sm_scale / window_left / logits_soft_cap as the dispatch's keywords, checked."""
    return dict(scale=scale_arg("sm_scale", sm_scale), window_left=max(check_int("window_left", window_left), -1),
                softcap=softcap_arg("logits_soft_cap", logits_soft_cap))


def _same_schedule(a: DecodePlan, b: DecodePlan) -> bool:
    """Whether two decode plans launch the same grid over split buffers of the same shapes."""
    fields = ("batch", "n_heads", "n_splits", "head_block", "warps", "merge_apart")
    return (all(getattr(a, f) == getattr(b, f) for f in fields)
            and (a.cache.kind, a.cache.n_kv_heads, a.cache.head_dim) == (b.cache.kind, b.cache.n_kv_heads,
                                                                         b.cache.head_dim))


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    """FlashInfer's batch decode over a paged cache the caller owns: one query per sequence, split-KV.

    ``float_workspace_buffer`` is accepted for FlashInfer's signature and not used (the plan keeps its own
    buffers); ``kv_layout`` must be ``"NHD"``; ``device`` (default: the current one); ``pdl`` launches with
    programmatic dependent launch (as :class:`AttentionDispatch`'s ``pdl``: a kernel still running before this
    one may write q and the newest token's K/V, not older K/V)."""

    _plan: DecodePlan | None = None

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, *, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, q_data_type=None, kv_data_type=None,
             sm_scale: float | None = None, max_kv_len: int | None = None, n_splits: int | None = None,
             overrides: DecodeOverrides | None = None, stream=None) -> None:
        """Plan a decode batch (host work; module docstring).

        indptr : [batch + 1] ints; indices : [>= indptr[-1]] page ids; last_page_len : [batch] ints (1 ...
        page_size): FlashInfer's CSR page layout. num_qo_heads, num_kv_heads, head_dim, page_size: the
        shapes run will get. kv_data_type (default q_data_type, else float16): the cache's dtype, which the
        schedule depends on; q_data_type (default: any): run checks q against it. sm_scale (None: 1 /
        sqrt(head_dim)), window_left (-1: none), logits_soft_cap (None or 0: none): as FlashInfer's.
        max_kv_len (default: the longest sequence), n_splits and overrides (a :class:`DecodeOverrides`)
        fix the split schedule (:meth:`AttentionDispatch.plan_decode`).

        The page tables (at least ``max_kv_len`` tokens wide), lengths and split buffers are kept: a plan whose
        sequences fit the kept tables and whose schedule (batch size, split count, warps, merge place) equals
        the previous plan's reuses them, so a CUDA graph captured of run() stays valid (fix ``n_splits`` and
        ``max_kv_len`` to keep both); a plan that does not makes new ones (capture again)."""
        ov = _NO_OVERRIDES if overrides is None else overrides
        if not isinstance(ov, DecodeOverrides):
            raise TypeError(f"overrides must be a DecodeOverrides, got {type(overrides).__name__}")
        if max_kv_len is not None:
            check_int("max_kv_len", max_kv_len, 1)
        if n_splits is not None:
            check_int("n_splits", n_splits, 1, _MAX_SPLITS)
        hp = self._check_pages(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                               pos_encoding_mode, window_left, logits_soft_cap, sm_scale, q_data_type, kv_data_type)
        st = resolve_stream(stream)
        kept = dict(self._bufs)
        bound = int(hp.lengths.max()) if max_kv_len is None else int(max_kv_len)
        self._upload(hp, st, -(-bound // hp.page_size))  # tables as wide as max_kv_len needs, kept as it holds
        batch = len(hp.lengths)
        with st:
            plan = decode_plan(self._views[0], self._seq_ids(batch), hp.n_heads, bound, n_splits,
                               hp.fields["window_left"], ov, self._dispatch.sm_count())
        old = self._plan
        if old is not None and _same_schedule(old, plan) and kept.keys() == self._bufs.keys() and all(
                kept[n] is self._bufs[n] for n in kept):  # the tables not regrown: keep the split buffers too
            plan = dataclasses.replace(old, cache=plan.cache, max_kv_len=plan.max_kv_len, overrides=ov)
        self._plan = plan

    @tensors(out=like("q"))
    def run(self, q, paged_kv_cache, *, out=None, lse=None, return_lse: bool = False, lse_base: str = "log2",
            stream=None):
        """Decode attention of the planned batch: fill the parameters and launch.

        q : [batch, num_qo_heads, head_dim], float32 or the cache's dtype, 16-byte aligned.
        paged_kv_cache : (k_cache, v_cache), each [num_pages, page_size, num_kv_heads, head_dim], or one
            [num_pages, 2, page_size, num_kv_heads, head_dim] array, of the planned kv_data_type.
        out : [batch, num_qo_heads, head_dim] of q's dtype, or None (allocated).
        lse : [batch, num_qo_heads] float32 to write the LSE into, or None (allocated with ``return_lse``).
        return_lse, lse_base : return ``(out, lse)``, the LSE in base 2 ("log2", FlashInfer's) or natural ("ln").

        Returns ``out``, or ``(out, lse)`` with ``return_lse``."""
        view = self._run_view(q, paged_kv_cache)
        st = resolve_stream(stream)
        plan = dataclasses.replace(self._plan, cache=view)
        out, lse = self._outputs(q, plan.batch, out, lse, return_lse, lse_base, st)
        self._dispatch.flash_attn_decode(plan, 0, q, out, lse=lse, stream=st, **self._pages.fields)
        return self._finish(out, lse, return_lse, lse_base, st)


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    """FlashInfer's batch prefill (append) over a paged cache the caller owns: ``qo_indptr`` queries per
    sequence, its last ``q_len`` cached tokens (write their K/V first). Q in the cache's dtype runs on tensor
    cores (head_dim up to 256; on Hopper the wgmma kernel at 128 and 256), float32 Q on the SIMT kernel.
    Constructor arguments: as :class:`BatchDecodeWithPagedKVCacheWrapper`'s (``pdl`` is unused: the prefill
    kernels launch plainly)."""

    _plan: BatchedPlan | None = None

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads: int,
             num_kv_heads: int, head_dim_qk: int, page_size: int, *, causal: bool = False,
             pos_encoding_mode: str = "NONE", window_left: int = -1, logits_soft_cap: float | None = None,
             sm_scale: float | None = None, q_data_type=None, kv_data_type=None, stream=None) -> None:
        """Plan a prefill batch (host work; module docstring): qo_indptr [batch + 1] ints, the query rows of
        each sequence (1 ... its key count); the rest as :meth:`BatchDecodeWithPagedKVCacheWrapper.plan`.
        The kept tables are reused while the batch fits them."""
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError(f"causal must be a bool, got {causal!r}")
        hp = self._check_pages(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                               num_kv_heads, head_dim_qk, page_size, pos_encoding_mode, window_left,
                               logits_soft_cap, sm_scale, q_data_type, kv_data_type)
        qo = _host_ints("qo_indptr", qo_indptr)
        q_lens = np.diff(qo)
        if len(qo) != len(hp.lengths) + 1 or qo[0] != 0 or q_lens.min() < 1 or np.any(q_lens > hp.lengths):
            raise ValueError(f"qo_indptr must hold batch + 1 = {len(hp.lengths) + 1} entries from 0 with 1 ... "
                             f"its key count queries per sequence, got {qo} for key counts {hp.lengths}")
        st = resolve_stream(stream)
        self._upload(hp, st)
        q_indptr = self._buffer("q_indptr", qo.shape, int(qo[-1]), qo.astype(np.int32), st)
        self._plan = BatchedPlan(self._views[0], self._seq_ids(len(q_lens)), q_indptr[:len(qo)], int(qo[-1]),
                                 int(q_lens.max()))
        self._causal = bool(causal)

    @tensors(out=like("q"))
    def run(self, q, paged_kv_cache, *, out=None, lse=None, return_lse: bool = False, lse_base: str = "log2",
            stream=None):
        """Prefill attention of the planned batch: fill the parameters and launch.

        q : [qo_indptr[-1], num_qo_heads, head_dim] in the cache's dtype (tensor cores) or float32.
        paged_kv_cache, out, lse, return_lse, lse_base : as :meth:`BatchDecodeWithPagedKVCacheWrapper.run`
        (out and lse with qo_indptr[-1] rows). Returns ``out``, or ``(out, lse)`` with ``return_lse``."""
        view = self._run_view(q, paged_kv_cache)
        st = resolve_stream(stream)
        plan = dataclasses.replace(self._plan, cache=view)
        out, lse = self._outputs(q, plan.n_q, out, lse, return_lse, lse_base, st)
        self._dispatch.flash_attn_batched(plan, 0, q, out, causal=self._causal, lse=lse, stream=st,
                                          **self._pages.fields)
        return self._finish(out, lse, return_lse, lse_base, st)
