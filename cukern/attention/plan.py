"""Decode and batched-prefill plans, the kernels' shapes the plans size launches by, and the fitted
split model that picks a decode launch's split count, warps and merge place.

A plan (FlashInfer's ``plan()``) holds everything a launch needs that costs host work: validated
slots uploaded, the schedule, the partial buffers and merge counters. The split model and the L2
rules are stated where they are used; their measurements are in ``docs/notes/attention.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cupy
import numpy as np

from cukern.attention.cache import BF16, PagedKVCache

__all__ = ["DecodePlan", "DecodeOverrides", "BatchedPlan", "decode_plan"]

_GROUPS = (1, 4, 8)  # query heads per decode block (GQA heads beyond 8 take several blocks)
_ITEMSIZE = {"float16": 2, BF16: 2, "float32": 4}
_MERGE_THREADS = 128
_MIN_CHUNK = 32  # smallest KV chunk of a split (tokens)
_MAX_SPLITS = 256  # grid.x of a decode launch; the merging block reads n_splits partial states
_DECODE_PIPE_BYTES = 64 * 1024  # K/V stages of a decode block (DECODE_PIPE_BYTES in decode.cuh)
_DECODE_BLOCKS_PER_SM = 2  # decode's __launch_bounds__ minimum: resident blocks per SM in the split model
_TC_DECODE_MAX_D = 256  # decode_tc: f16/bf16 caches up to this head_dim
_TC_GROUP = 8  # query heads per decode_tc block (DecodeTcShape::G)
_DECODE_TC_WARP_BYTES = 26 * 1024  # DECODE_TC_WARP_BYTES in decode_tc.cuh
_TC_KEYS = 16  # keys of a decode_tc warp tile (DecodeTcShape::KW)


@dataclass(frozen=True)
class _SplitModel:
    """Constants of the decode split model (bytes per us, us), fitted to H100 runs of bench_attention
    (docs/notes/attention.md)."""

    block_rate: float  # K/V bytes one block streams per us, alone on its SM
    sm_rate: float  # ... all blocks of one SM together
    block_us: float  # a block's start-up and epilogue
    blocks_per_sm: int  # resident blocks per SM (the kernel's __launch_bounds__ minimum)
    merge_rate: float = 64e3  # partial-state bytes the merging block reads per us
    merge_us: float = 1.0  # the merge's fixed cost (counter, weights)
    # decode_tc's form of the model (used when merge_trip_us > 0): the merging block's threads each combine
    # float4 columns of 16 states per L2 round trip; the SMs in use share dram_rate
    merge_trip_us: float = 0.0  # one round trip of the merge's loads
    threads: int = 128  # threads of a block
    dram_rate: float = 0.0  # K/V bytes per us of the whole device
    # merge_apart (decode_tc): the states merged by a merge_states launch after the decode (blocks of columns of
    # each query and head) instead of by the decode's last block: apart_us fixed, then one merge_trip_us per 8
    # states of a thread group (merge.cuh: 128 threads in groups of _merge_cols4 columns)
    merge_apart: bool = False
    apart_us: float = 0.0
    head_dim: int = 128


_SIMT_MODEL = _SplitModel(block_rate=12.5e3, sm_rate=13.5e3, block_us=2.0, blocks_per_sm=_DECODE_BLOCKS_PER_SM)
# decode_tc by warps per block: 4 warps (two blocks per SM up to head_dim 128, else one), 8 warps (one).
# Fitted to H100 graph timings of B1/B32 32/8 D128 (fixed cost of a launch ~4.4 us, merge ~2 us + trips) and
# apart_us to B1 KV8k 8/1 and 4/1 D256 (docs/notes/attention.md).
_TC_MODELS = {nw: _SplitModel(block_rate=33e3 if nw == 4 else 36e3, sm_rate=22e3, block_us=4.6 if nw == 4 else 4.3,
                              blocks_per_sm=2 if nw == 4 else 1, merge_us=2.0, merge_trip_us=0.6, threads=32 * nw,
                              apart_us=2.5, dram_rate=2.9e6) for nw in (4, 8)}
_TC_MODEL_WIDE = _SplitModel(block_rate=30e3, sm_rate=22e3, block_us=4.6, blocks_per_sm=1, merge_us=2.0,
                             merge_trip_us=0.6, threads=128, dram_rate=2.9e6, apart_us=2.5)  # head_dim > 128: 4 warps


def _groups(d: int) -> tuple[int, ...]:
    """Query heads per decode block available at head_dim d (8 heads of 512 would spill registers)."""
    return _GROUPS if d <= 256 else _GROUPS[:-1]


def _decode_smem(kind: str, d: int, g: int) -> int:
    """Dynamic shared bytes of decode<T, d, g>: DecodeShape::SMEM in cuda_src/attention/decode.cuh (the
    kernel traps when launched with less; tests/test_attention.py checks the two agree)."""
    vec = 16 // _ITEMSIZE[kind]
    nv = d // vec
    lpk = min(nv & -nv, 32)
    vpl = nv // lpk
    step = 4 * (32 // lpk)
    s = max(1, (2 if g >= 8 else 4) // vpl)
    stage = 2 * s * step * nv * 16
    ns = min(8, max(2, _DECODE_PIPE_BYTES // stage))
    return max(ns * stage, 4 * g * d * 4)


def _prefill_shape(d: int) -> tuple[int, int, int]:
    """(threads, query rows per block, dynamic shared bytes) of prefill<T, d> (PrefillShape)."""
    mt = 2 if d <= 128 else 1
    bn = 64 if d <= 128 else 32
    bm = 64 * mt
    return 128, bm, (bm + 4 * bn) * (d + 8) * 2


def _prefill_wg_shape(d: int) -> tuple[int, int, int]:
    """(threads, query rows per block, dynamic shared bytes) of prefill_wg<T, d> (PrefillWgShape): two
    warpgroups of 64 rows; 1 KB of alignment slack, the Q tile and two stages of K and V tiles of 128 keys
    (64 at head_dim 256)."""
    bn = 64 if d > 128 else 128
    return 256, 128, 1024 + 128 * d * 2 + 4 * bn * d * 2


def _tc_decode(kind: str, d: int) -> bool:
    """Whether decode of this cache runs decode_tc (tensor cores): f16/bf16 K/V, head_dim up to 256."""
    return kind != "float32" and d <= _TC_DECODE_MAX_D


def _decode_tc_smem(d: int, nw: int) -> int:
    """Dynamic shared bytes of decode_tc<T, d, nw>: DecodeTcShape::SMEM in cuda_src/attention/decode_tc.cuh
    (tests/test_attention.py checks the two agree)."""
    stage = 2 * 16 * (d + 8)  # elements of K and V of a 16-key warp tile
    ns = min(8, max(2, _DECODE_TC_WARP_BYTES // (2 * stage)))
    return max(nw * ns * stage * 2, nw * _TC_GROUP * d * 4)


def _tc_warps(d: int) -> tuple[int, ...]:
    """Warp counts of decode_tc at head_dim d (8 warps need ~26 KB of stages each: up to d = 128)."""
    return (4, 8) if d <= 128 else (4,)


def _merge_cols4(rows: int, d: int, sms: int) -> int:
    """float4 columns per merge_states block (MergeParams.cols4): the whole head where the (token, head)
    rows fill the SMs, else narrower column blocks (at least 8 columns) until about ``sms`` blocks
    share the merge (B1 one KV head: 8 rows of head_dim 256 become 64 blocks of 8 columns)."""
    d4 = d // 4
    chunks = min(max(1, d4 // 8), max(1, -(-sms // rows)))
    return -(-d4 // chunks)


def _head_block(group: int, d: int) -> int:
    for g in _groups(d):
        if group <= g:
            return g
    return _groups(d)[-1]


def _split_time(n: int, blocks: int, visible: int, row_bytes: int, state_bytes: int, sms: int,
                model: _SplitModel) -> float:
    """Modelled time (us) of a decode launch in n splits (see _choose_splits)."""
    k = -(-blocks * n // sms)
    sm_rate = model.sm_rate
    if model.dram_rate:  # fewer busy SMs each get a larger share of the device's bandwidth
        sm_rate = max(sm_rate, model.dram_rate / min(sms, blocks * n))
    rate = min(model.block_rate * k, sm_rate)
    t = k * -(-visible // n) * row_bytes / rate + -(-k // model.blocks_per_sm) * model.block_us
    if n > 1 and model.merge_apart:
        rows = blocks * max(1, state_bytes // (4 * model.head_dim))  # (query, head) rows of the merge
        groups = max(1, _MERGE_THREADS // _merge_cols4(rows, model.head_dim, sms))
        t += model.apart_us + -(-n // (8 * groups)) * model.merge_trip_us
    elif n > 1 and model.merge_trip_us:
        t += model.merge_us + -(-state_bytes // (16 * model.threads)) * -(-n // 16) * model.merge_trip_us
    elif n > 1:
        t += model.merge_us + n * state_bytes / model.merge_rate
    return t


def _choose_splits(blocks: int, visible: int, row_bytes: int, state_bytes: int, sms: int,
                   model: _SplitModel = _SIMT_MODEL) -> int:
    """Split count of a decode launch: the n that minimises a time model fitted to H100 runs (us).

    The busiest SM holds ``k = ceil(blocks * n / sms)`` blocks, each streaming ``ceil(visible / n)`` K/V
    rows of ``row_bytes``: one block alone at ``model.block_rate``, several together at most at
    ``model.sm_rate``; each wave of ``model.blocks_per_sm`` blocks pays ``model.block_us``. With n > 1 the
    last block reads back n partial states of ``state_bytes`` at ``model.merge_rate`` after a fixed
    ``model.merge_us``. Chunks stay at least ``_MIN_CHUNK`` tokens, n at most ``_MAX_SPLITS``."""
    best, best_t = 1, None
    for n in range(1, max(1, min(_MAX_SPLITS, visible // _MIN_CHUNK)) + 1):
        t = _split_time(n, blocks, visible, row_bytes, state_bytes, sms, model)
        if best_t is None or t < best_t:
            best, best_t = n, t
    return best


def _schedule(tc: bool, d: int, blocks: int, visible: int, row_bytes: int, state_bytes: int, sms: int,
              n_splits: int | None, ov: DecodeOverrides) -> tuple[int, bool, int]:
    """(warps, merge apart, splits) of a decode launch of ``blocks`` blocks a split: the candidate with the
    least modelled time (:func:`_split_time`), each candidate at its best split count (:func:`_choose_splits`)
    unless ``n_splits`` is given. Candidates: the SIMT kernel (warps 0), or decode_tc at each of
    :func:`_tc_warps` with the states merged in the last block or apart; ``ov`` narrows them."""
    if not tc:
        models = [(0, _SIMT_MODEL)]
    else:
        if ov.warps is not None and ov.warps not in _tc_warps(d):
            raise ValueError(f"overrides.warps: decode_tc at head_dim {d} runs {_tc_warps(d)} warps, got {ov.warps}")
        nws = (ov.warps,) if ov.warps is not None else _tc_warps(d)
        models = [(nw, _TC_MODELS[nw] if d <= 128 else _TC_MODEL_WIDE) for nw in nws]
    aparts = (False, True) if tc else (False,)
    if ov.merge_apart is not None:
        aparts = (ov.merge_apart,)
    cands = []  # (modelled us, warps, merge apart, splits); a given n_splits leaves the rest to choose
    for nw, base in models:
        for apart in aparts:
            model = dataclasses.replace(base, merge_apart=apart, head_dim=d)
            n = n_splits if n_splits is not None else _choose_splits(blocks, visible, row_bytes, state_bytes, sms,
                                                                     model)
            cands.append((_split_time(n, blocks, visible, row_bytes, state_bytes, sms, model), nw, apart, n))
    _, warps, apart, n = min(cands)
    return warps, apart, n


@dataclass(frozen=True)
class DecodeOverrides:
    """Overrides of :meth:`AttentionDispatch.plan_decode`'s heuristics, as FlashInfer's ``plan(...)`` keywords:
    every field None (the default) leaves that choice to the plan. For tests, benchmarks and tuning; the
    heuristics' reasons and measurements are in ``docs/notes/attention.md``.

    Attributes
    ----------
    warps : int or None
        Warps per block of the tensor-core decode (``decode_tc``): 4, or 8 up to head_dim 128. Ignored by the
        SIMT kernel (f32 caches, head_dim 512).
    merge_apart : bool or None
        Where split states merge (``n_splits > 1``): True in a :meth:`AttentionDispatch.merge_states` launch after
        the decode, False in the decode's last block to finish. None: the split model's choice.
    l2_prefetch : int or None
        ``decode_tc`` warp tiles after the prologue's asked of L2 before ``pdl_wait`` (>= 0; only under pdl).
        None: :meth:`AttentionDispatch._prefetch_tiles`'s rule.
    l2_ahead : int or None
        ``decode_tc``'s in-loop L2 prefetch distance in warp tiles (>= 0). None:
        :meth:`AttentionDispatch._ahead_tiles`'s rule.
    evict_first : bool or None
        Whether ``decode_tc`` streams K/V with an L2 evict-first policy. None: wherever it prefetches.
    """

    warps: int | None = None
    merge_apart: bool | None = None
    l2_prefetch: int | None = None
    l2_ahead: int | None = None
    evict_first: bool | None = None

    def __post_init__(self):
        if self.warps is not None and (isinstance(self.warps, bool) or self.warps not in (4, 8)):
            raise ValueError(f"DecodeOverrides.warps must be None, 4 or 8, got {self.warps!r}")
        for f in ("merge_apart", "evict_first"):
            v = getattr(self, f)
            if v is not None and not isinstance(v, bool):
                raise TypeError(f"DecodeOverrides.{f} must be None, True or False, got {v!r}")
        for f in ("l2_prefetch", "l2_ahead"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0):
                raise ValueError(f"DecodeOverrides.{f} must be None or an int >= 0, got {v!r}")


_NO_OVERRIDES = DecodeOverrides()


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """Host-side schedule and device buffers of one decode batch (see AttentionDispatch.plan_decode).
    Frozen: a decode call with an equal plan, layer and arrays repeats its launches (cukern.repeat)."""

    cache: PagedKVCache
    seq_ids: cupy.ndarray  # [batch] int32 slots
    n_heads: int
    max_kv_len: int  # grid bound: chunks are sized from it, the last chunk runs to the real length
    n_splits: int
    head_block: int  # query heads per block (template G)
    warps: int  # decode_tc: warps per block (template NW); 0: the SIMT kernel
    merge_apart: bool  # n_splits > 1: the states merged by a merge_states launch, not by the decode's last block
    o_part: cupy.ndarray | None  # [batch, n_splits, n_heads, head_dim] f32 (n_splits > 1)
    lse_part: cupy.ndarray  # [batch, n_splits, n_heads] f32
    counters: cupy.ndarray  # [batch * n_kv_heads * head blocks] int32 zeros: blocks done per merge (left zero)
    overrides: DecodeOverrides = _NO_OVERRIDES  # what plan_decode was asked to override (the launch: L2 fields)
    partials: bool = False  # plan_decode(partials=True): o_part at every split count, states merged apart

    @property
    def batch(self) -> int:
        return int(self.seq_ids.shape[0])


@dataclass
class BatchedPlan:
    """Sequences and query counts of one batched prefill (see AttentionDispatch.plan_batched)."""

    cache: PagedKVCache
    seq_ids: cupy.ndarray  # [n_seqs] int32 slots
    q_indptr: cupy.ndarray  # [n_seqs + 1] int32 first query row of each sequence
    n_q: int  # total query rows
    max_q_len: int


def decode_plan(cache, seq_ids: cupy.ndarray, n_heads: int, max_kv_len: int, n_splits: int | None, window_left: int,
                ov: DecodeOverrides, sms: int, partials: bool = False) -> DecodePlan:
    """The schedule and buffers of a decode batch over ``cache`` (a :class:`PagedKVCache` or a
    :class:`~cukern.attention.cache.PagedKVView`) whose sequences' slots are the device array ``seq_ids``
    ([batch] int32): warps, split count and merge place from :func:`_schedule` (``n_splits`` and ``ov`` force
    them), the partial buffers and the merge counters (zeros, left zero by every launch). ``max_kv_len``
    sizes the chunks (host bound; a longer sequence is still computed right, only less parallel); ``partials``
    keeps ``o_part`` at every split count (:meth:`AttentionDispatch.plan_decode`)."""
    if not isinstance(n_heads, (int, np.integer)) or n_heads < 1 or n_heads % cache.n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a positive multiple of n_kv_heads ({cache.n_kv_heads})")
    if not isinstance(max_kv_len, (int, np.integer)) or max_kv_len < 1:
        raise ValueError(f"max_kv_len must be an int >= 1, got {max_kv_len!r}")
    if n_splits is not None and (not isinstance(n_splits, (int, np.integer)) or not 1 <= n_splits <= _MAX_SPLITS):
        raise ValueError(f"n_splits must be 1 ... {_MAX_SPLITS}, got {n_splits!r}")
    b, d = int(seq_ids.shape[0]), cache.head_dim
    group = n_heads // cache.n_kv_heads
    tc = _tc_decode(cache.kind, d)
    hb = _TC_GROUP if tc else _head_block(group, d)
    blocks = b * cache.n_kv_heads * -(-group // hb)
    visible = max_kv_len if window_left < 0 else min(max_kv_len, window_left + 1)
    row_bytes = 2 * d * _ITEMSIZE[cache.kind]  # a K and a V row of one KV head
    state_bytes = min(hb, group) * d * 4
    warps, apart, n_splits = _schedule(tc, d, blocks, visible, row_bytes, state_bytes, sms, n_splits, ov)
    o_part = cupy.empty((b, n_splits, n_heads, d), cupy.float32) if n_splits > 1 or partials else None
    lse_part = cupy.empty((b, n_splits, n_heads), cupy.float32)
    counters = cupy.zeros(blocks, cupy.int32)
    return DecodePlan(cache, seq_ids, int(n_heads), int(max_kv_len), int(n_splits), hb, int(warps),
                      apart and n_splits > 1, o_part, lse_part, counters, ov, bool(partials))
