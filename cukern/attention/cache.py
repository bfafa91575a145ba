"""The paged KV cache: :class:`PageAllocator` (host page table, lengths, free list, reference counts),
:class:`PagedKVCache` (per-layer K/V page pools and the device copies of the page table and lengths) and
:class:`PagedKVView` (pools, page table and lengths that the caller owns, read in the same layout).

The layout (``cuda_src/common/kv_cache.cuh``): token ``pos`` of a slot lives in page
``page_table[slot, pos // page_size]``, row ``pos % page_size``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import cupy
import numpy as np

from cukern.dispatch import check_int

__all__ = ["PageAllocator", "PagedKVCache", "PagedKVView", "HEAD_DIMS", "BF16"]

BF16 = "bfloat16"
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256, 512)  # decode and the cache


def _norm_kv_dtype(dtype) -> str:
    if isinstance(dtype, str) and dtype.lower() in (BF16, "bf16"):
        return BF16
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"KV dtype must be float16, bfloat16 or float32, got {dtype!r}") from None
    if dt == np.float16:
        return "float16"
    if dt == np.float32:
        return "float32"
    if str(dt) == BF16:
        return BF16
    raise TypeError(f"KV dtype must be float16, bfloat16 or float32, got {dt}")


def _storage(kind: str) -> np.dtype:
    return np.dtype(np.uint16) if kind == BF16 else np.dtype(kind)


class PageAllocator:
    """The host side of a paged KV cache: page table, lengths, free list and page reference counts.

    Pure NumPy (no GPU): :class:`PagedKVCache` wraps one and mirrors its rows on the device. Every
    mutation checks first and changes nothing when it raises ValueError (bad slot, full pool,
    sequence longer than its page-table row)."""

    def __init__(self, n_pages: int, page_size: int, max_seqs: int, max_pages_per_seq: int | None = None):
        n_pages, max_seqs = check_int("n_pages", n_pages, 1), check_int("max_seqs", max_seqs, 1)
        page_size = check_int("page_size (tokens)", page_size, 1, 256)
        max_pages_per_seq = n_pages if max_pages_per_seq is None else check_int("max_pages_per_seq",
                                                                                  max_pages_per_seq, 1)
        if n_pages * page_size >= 2**31 or max_pages_per_seq * page_size >= 2**31:
            raise ValueError("positions and page rows must fit in int32")
        self.n_pages, self.page_size = int(n_pages), int(page_size)
        self.max_seqs, self.max_pages_per_seq = int(max_seqs), int(max_pages_per_seq)
        self.page_table = np.full((self.max_seqs, self.max_pages_per_seq), -1, np.int32)  # -1: no page
        self.lengths = np.zeros(self.max_seqs, np.int32)
        self.active = np.zeros(self.max_seqs, bool)
        self.refs = np.zeros(self.n_pages, np.int32)  # sequences holding each page
        self._free = list(range(self.n_pages - 1, -1, -1))  # pop() hands out low page ids first

    @property
    def n_free_pages(self) -> int:
        return len(self._free)

    def capacity_tokens(self) -> int:
        return self.max_pages_per_seq * self.page_size

    def n_pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def active_slots(self) -> list[int]:
        return [int(s) for s in np.flatnonzero(self.active)]

    def check_slot(self, slot) -> int:
        slot = check_int("sequence id", slot)
        if not 0 <= slot < self.max_seqs or not self.active[slot]:
            raise ValueError(f"sequence {slot} does not exist (active: {self.active_slots()})")
        return int(slot)

    def pages(self, slot: int) -> list[int]:
        slot = self.check_slot(slot)
        return [int(p) for p in self.page_table[slot, :self.n_pages_for(int(self.lengths[slot]))]]

    def _free_slot(self) -> int:
        free_slots = np.flatnonzero(~self.active)
        if free_slots.size == 0:
            raise ValueError(f"no free sequence slot (max_seqs = {self.max_seqs})")
        return int(free_slots[0])

    def _check_pages(self, n: int, what: str) -> None:
        if n > len(self._free):
            raise ValueError(f"{what}: the page pool is full ({n} pages needed, {len(self._free)} free "
                             f"of {self.n_pages})")

    def _take(self, n: int) -> list[int]:
        pages = [self._free.pop() for _ in range(n)]
        self.refs[pages] = 1
        return pages

    def add(self, length: int = 0) -> int:
        """A new sequence with room for ``length`` tokens; returns its slot."""
        length = check_int("length", length, 0)
        if length > self.capacity_tokens():
            raise ValueError(f"length {length} exceeds max_pages_per_seq * page_size = {self.capacity_tokens()}")
        slot = self._free_slot()
        n = self.n_pages_for(length)
        self._check_pages(n, "add")
        self.active[slot] = True
        self.page_table[slot] = -1
        self.page_table[slot, :n] = self._take(n)
        self.lengths[slot] = length
        return slot

    def extend(self, slot: int, n: int = 1) -> int:
        """Grow a sequence by ``n`` tokens; returns the first new position."""
        slot = self.check_slot(slot)
        n = check_int("n", n, 0)
        old = int(self.lengths[slot])
        if old + n > self.capacity_tokens():
            raise ValueError(f"sequence {slot}: {old} + {n} tokens exceed max_pages_per_seq * page_size = "
                             f"{self.capacity_tokens()}")
        have, need = self.n_pages_for(old), self.n_pages_for(old + n)
        self._check_pages(need - have, f"extend sequence {slot}")
        self.page_table[slot, have:need] = self._take(need - have)
        self.lengths[slot] = old + n
        return old

    def fork(self, slot: int) -> tuple[int, tuple[int, int] | None]:
        """A new sequence with the same tokens: full pages shared, a partly filled last page copied.
        Returns (child slot, (src page, dst page) to copy on the device, or None)."""
        slot = self.check_slot(slot)
        child = self._free_slot()
        n = int(self.lengths[slot])
        n_full, n_all = n // self.page_size, self.n_pages_for(n)
        self._check_pages(n_all - n_full, f"fork sequence {slot}")
        self.active[child] = True
        self.page_table[child] = -1
        self.page_table[child, :n_full] = self.page_table[slot, :n_full]
        self.refs[self.page_table[slot, :n_full]] += 1
        copy = None
        if n_all > n_full:
            dst = self._take(1)[0]
            self.page_table[child, n_full] = dst
            copy = (int(self.page_table[slot, n_full]), dst)
        self.lengths[child] = n
        return child, copy

    def free(self, slot: int) -> None:
        """Release a sequence and every page no other sequence holds."""
        slot = self.check_slot(slot)
        for page in self.page_table[slot, :self.n_pages_for(int(self.lengths[slot]))]:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self._free.append(int(page))
        self.active[slot] = False
        self.page_table[slot] = -1
        self.lengths[slot] = 0


class PagedKVCache:
    """Per-layer K and V page pools, a page table and sequence lengths on the device, planned by a
    host :class:`PageAllocator` (``.alloc``).

    Device arrays (point other kernels at them, e.g. the elementwise family's fused
    norm + RoPE + KV write):

    * ``k_pools[layer]``, ``v_pools[layer]``: ``[n_pages, page_size, n_kv_heads, head_dim]``
      (float16, float32, or bfloat16 stored as uint16);
    * ``page_table``: ``[max_seqs, max_pages_per_seq]`` int32, the page ids of each slot's
      sequence in order, -1 where no page is assigned;
    * ``lengths``: ``[max_seqs]`` int32, tokens cached per slot (0 for free slots).

    Sequences live in slots ``0 .. max_seqs-1``. :meth:`add`, :meth:`extend`, :meth:`fork`
    and :meth:`free` update the allocator and upload the changed page-table row and length
    (small host-to-device copies on ``stream``); they are host work, not meant for a captured
    graph. A full pool or a bad slot raises ValueError and changes nothing.

    Token ``pos`` of a slot lives in page ``page_table[slot, pos // page_size]``, row
    ``pos % page_size`` (``cuda_src/common/kv_cache.cuh``). :meth:`fork` shares the full
    pages of the parent (reference-counted) and copies the partly filled last page, so both
    sequences can be extended independently; rewriting a shared position changes both.
    """

    # cukern.repeat keys a cache by identity: its device arrays (pools, page table, lengths) and shape are
    # made once here and never rebound, and the kernels read the table and lengths on the device
    _repeat_by_identity = True

    def __init__(self, n_layers: int, n_pages: int, page_size: int, n_kv_heads: int, head_dim: int, *,
                 max_seqs: int, max_pages_per_seq: int | None = None, dtype="float16", device: int | None = None):
        n_layers, n_kv_heads = check_int("n_layers", n_layers, 1), check_int("n_kv_heads", n_kv_heads, 1)
        if check_int("head_dim", head_dim) not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim!r}")
        self.kind = _norm_kv_dtype(dtype)
        self.alloc = PageAllocator(n_pages, page_size, max_seqs, max_pages_per_seq)
        self.n_layers, self.n_kv_heads, self.head_dim = int(n_layers), int(n_kv_heads), int(head_dim)
        self.n_pages, self.page_size = self.alloc.n_pages, self.alloc.page_size
        self.max_seqs, self.max_pages_per_seq = self.alloc.max_seqs, self.alloc.max_pages_per_seq
        shape = (self.n_pages, self.page_size, self.n_kv_heads, self.head_dim)
        st = _storage(self.kind)
        with cupy.cuda.Device(device) if device is not None else contextlib.nullcontext():
            self.k_pools = [cupy.zeros(shape, st) for _ in range(self.n_layers)]
            self.v_pools = [cupy.zeros(shape, st) for _ in range(self.n_layers)]
            self.page_table = cupy.asarray(self.alloc.page_table)
            self.lengths = cupy.asarray(self.alloc.lengths)

    @property
    def dtype(self) -> str:
        """'float16', 'bfloat16' or 'float32'."""
        return self.kind

    @property
    def n_free_pages(self) -> int:
        return self.alloc.n_free_pages

    def length(self, slot: int) -> int:
        return int(self.alloc.lengths[self.alloc.check_slot(slot)])

    def pages(self, slot: int) -> list[int]:
        return self.alloc.pages(slot)

    def capacity_tokens(self) -> int:
        return self.alloc.capacity_tokens()

    def _upload(self, slot: int, stream=None) -> None:
        st = stream if stream is not None else cupy.cuda.get_current_stream()
        self.page_table[slot].set(self.alloc.page_table[slot], stream=st)
        self.lengths[slot:slot + 1].set(self.alloc.lengths[slot:slot + 1], stream=st)

    def add(self, length: int = 0, *, stream=None) -> int:
        """A new sequence with room for ``length`` tokens (their K/V still to be written); returns its slot."""
        slot = self.alloc.add(length)
        self._upload(slot, stream)
        return slot

    def extend(self, slot: int, n: int = 1, *, stream=None) -> int:
        """Grow a sequence by ``n`` tokens (pages assigned as needed); returns the first new position."""
        old = self.alloc.extend(slot, n)
        self._upload(slot, stream)
        return old

    def fork(self, slot: int, *, stream=None) -> int:
        """A copy of a sequence (shared full pages, copied last page); returns the new slot."""
        child, copy = self.alloc.fork(slot)
        if copy is not None:
            st = stream if stream is not None else cupy.cuda.get_current_stream()
            with st:
                for pool in (*self.k_pools, *self.v_pools):
                    pool[copy[1]] = pool[copy[0]]
        self._upload(child, stream)
        return child

    def free(self, slot: int, *, stream=None) -> None:
        """Release a sequence and the pages no other sequence shares."""
        self.alloc.free(slot)
        self._upload(int(slot), stream)


@dataclass(frozen=True)
class PagedKVView:
    """K/V pools, a page table and lengths that the caller owns, which the attention kernels read as the one
    layer (layer 0) of a :class:`PagedKVCache`, in place: nothing is copied. FlashAttention's
    ``block_table`` + ``cache_seqlens`` and FlashInfer's CSR page indices (``cukern.attention.flash_api``,
    ``cukern.attention.flashinfer_api``) become one of these.

    The same layout as the cache: token ``pos`` of row ``s`` lives in page ``page_table[s, pos // page_size]``,
    row ``pos % page_size`` of ``k_pool`` / ``v_pool`` ``[n_pages, page_size, n_kv_heads, head_dim]``
    (C-contiguous). The kernels take a sequence's row from a plan's ``seq_ids`` and read ``lengths[row]``
    tokens of it; neither the page ids nor the lengths are read on the host. Built without the pools by a
    plan (the schedule needs only the dtype and the shape), :meth:`with_pools` adds them for a launch; the
    builders check every array before."""

    kind: str  # 'float16', 'bfloat16' or 'float32'
    n_kv_heads: int
    head_dim: int
    page_size: int  # tokens per page
    page_table: cupy.ndarray  # [n_rows, max_pages] int32 page ids
    lengths: cupy.ndarray  # [n_rows] int32 tokens of each row
    k_pool: cupy.ndarray | None = None  # [n_pages, page_size, n_kv_heads, head_dim]
    v_pool: cupy.ndarray | None = None  # the same layout as k_pool
    head_major: bool = False  # pools [n_pages, n_kv_heads, page_size, head_dim], page_table holding page ids times
    #                           n_kv_heads (a contiguous [batch, n_kv_heads, capacity, head_dim]: pages of capacity)
    n_layers = 1

    @property
    def max_pages_per_seq(self) -> int:
        return int(self.page_table.shape[1])

    @property
    def k_pools(self) -> tuple:
        return (self.k_pool,)

    @property
    def v_pools(self) -> tuple:
        return (self.v_pool,)

    @property
    def dtype(self) -> str:
        return self.kind

    def capacity_tokens(self) -> int:
        return self.max_pages_per_seq * self.page_size

    def with_pools(self, k_pool: cupy.ndarray, v_pool: cupy.ndarray) -> PagedKVView:
        return dataclasses.replace(self, k_pool=k_pool, v_pool=v_pool)
