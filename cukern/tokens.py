"""TokensDispatch: the two ends of a decode step, token ids in and token ids out, on the device.

Kernels: ``cuda_src/tokens/``; float64 references: ``cukern/reference/tokens.py``;
tests: ``tests/test_tokens.py``.

:meth:`TokensDispatch.embed` gathers embedding rows of a quantized table by token ids that
live on the device (the previous step's samples). :meth:`TokensDispatch.sample` runs two
launches (the best candidates of each chunk of a row, found by selection rather than a sort,
then one block per row that merges them and draws) and writes the chosen ids into a device
buffer that the next decode step reads, so a whole step — forward, sample,
:meth:`TokensDispatch.advance_positions` — is captured in one CUDA graph and replayed
without a host round trip. Randomness is a counter-based hash of (seed, row, draw number),
the draw number being a device counter the kernel increments: replays draw fresh numbers,
and a run is reproducible from its seed.
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.dispatch import Dispatch, check_array, check_int, check_real, repeatable
from cukern.interop import like, tensors
from cukern.runtime import FamilySpec, KernelSpec

__all__ = ["TokensDispatch", "SamplePlan", "sample_chunks", "FAMILY", "MAX_TOP_K", "MAX_SAMPLE_COLS", "EMBED_QTYPES",
           "check_sampling"]

MAX_TOP_K = 64          # SAMPLE_MAX_K in tokens/sample.cuh (this block mirrors its constants)
_THREADS = 256          # THREADS
_MAX_CHUNK = 4096       # MAX_CHUNK = THREADS * CHUNK_ITEMS: logits of one stage-1 block, at most
_MAX_CHUNKS = 128       # MAX_CHUNKS = THREADS * MERGE_ITEMS / SAMPLE_MAX_K: chunks per row, at most
_CHUNK_ALIGN = 32       # sampling chunks are whole warps of logits
_TARGET_BLOCKS = 512    # stage-1 blocks a sampling plan aims for (about 4 resident per SM on 132 SMs)
# temperature: 0 (greedy) or within these bounds. Below 1e-4 sampling is greedy in all but name and
# 1/T (a float32 in the kernel) times a large logit overflows; above 1e4 every candidate is equally
# likely and 1/T nears float32's denormals.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 1e4


def check_sampling(temperature, top_k, top_p, seed) -> tuple[float, int, float, int]:
    """The sampling arguments of :meth:`TokensDispatch.sample`, checked and converted to Python
    (float, int, float, int): temperature 0 or in [MIN_TEMPERATURE, MAX_TEMPERATURE], top_k
    1 ... MAX_TOP_K, top_p in (0, 1], seed in [0, 2**64). Callers that change state before they
    sample (``Transformer.generate``) call it first."""
    temperature = check_real("temperature", temperature)
    if temperature != 0 and not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                         f"got {temperature!r}")
    top_k = check_int("top_k", top_k, 1, MAX_TOP_K)
    top_p = check_real("top_p", top_p)
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return temperature, top_k, top_p, check_int("seed", seed, 0, 2**64 - 1)


_GREEDY_CHUNK = 4096
MAX_SAMPLE_COLS = _MAX_CHUNK * _MAX_CHUNKS   # 524288 logits per row for sampling (greedy has no limit)
_EMBED_THREADS = 128
_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
# GGML type id -> (name, elements per block, bytes per block) of the embedding tables embed() reads
EMBED_QTYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 2: ("Q4_0", 32, 18), 6: ("Q5_0", 32, 22),
                8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}

FAMILY = FamilySpec(
    name="tokens",
    kernels=tuple(KernelSpec(f"embed_rows<{q}>", "EmbedParams") for q in EMBED_QTYPES) + (KernelSpec("topk_chunk<1>", "SampleParams"), KernelSpec(f"topk_chunk<{MAX_TOP_K}>", "SampleParams"),
             KernelSpec("sample_rows<1>", "SampleParams"), KernelSpec(f"sample_rows<{MAX_TOP_K}>", "SampleParams"),
             KernelSpec("advance_positions", "AdvanceParams")),
)


def sample_chunks(n_rows: int, n_cols: int, n_chunks: int | None = None) -> tuple[int, int]:
    """``(chunk, n_chunks)``: how the sampling path splits a row into stage-1 blocks (pure host arithmetic).

    Stage 1 runs ``n_chunks * n_rows`` blocks, each selecting the best 64 of ``chunk`` logits; stage 2 runs
    one block per row over the ``64 * n_chunks`` candidates. A block's cost is mostly its fixed chain of
    barriers, so the rule aims for about ``_TARGET_BLOCKS`` stage-1 blocks in all (enough to cover the SMs,
    few enough to run in one wave at 4 blocks per SM), within 64 <= chunk <= 4096 (a multiple of 32) and
    n_chunks <= 128. Example, 262144 logits: batch 1 -> 128 chunks of 2048 (128 blocks); batch 8 -> 64
    chunks of 4096 (512 blocks). ``n_chunks`` overrides the target (the limits on chunk still hold, and
    rounding the chunk up to whole warps may leave fewer chunks)."""
    if n_chunks is None:
        target = min(_MAX_CHUNKS, max(1, -(-_TARGET_BLOCKS // n_rows)))
    elif isinstance(n_chunks, (int, np.integer)) and 1 <= n_chunks <= _MAX_CHUNKS:
        target = int(n_chunks)
    else:
        raise ValueError(f"n_chunks must be 1 ... {_MAX_CHUNKS}, got {n_chunks!r}")
    chunk = max(MAX_TOP_K, -(-n_cols // target))
    chunk = min(_MAX_CHUNK, -(-chunk // _CHUNK_ALIGN) * _CHUNK_ALIGN)
    count = -(-n_cols // chunk)
    if count > _MAX_CHUNKS:
        raise ValueError(f"sampling supports at most {MAX_SAMPLE_COLS} logits per row, got {n_cols} "
                         f"(greedy has no limit)")
    return chunk, count


class SamplePlan:
    """Workspaces of one (batch, vocabulary, k) shape: allocate once, reuse in every step.

    ``sampling=True`` sizes the plan for temperature > 0 (up to :data:`MAX_SAMPLE_COLS` logits per row;
    the split is :func:`sample_chunks`, ``n_chunks`` overrides its target); otherwise greedy only."""

    def __init__(self, n_rows: int, n_cols: int, *, sampling: bool, history_len: int = 0,
                 n_chunks: int | None = None):
        if not isinstance(n_rows, (int, np.integer)) or n_rows < 1 or n_rows > 65535:
            raise ValueError(f"n_rows must be 1 ... 65535, got {n_rows!r}")
        if not isinstance(n_cols, (int, np.integer)) or n_cols < 1 or n_cols >= 2**31:
            raise ValueError(f"n_cols must be 1 ... 2**31 - 1, got {n_cols!r}")
        if not isinstance(history_len, (int, np.integer)) or history_len < 0:
            raise ValueError(f"history_len must be >= 0, got {history_len!r}")
        self.n_rows, self.n_cols, self.sampling, self.history_len = int(n_rows), int(n_cols), bool(sampling), int(history_len)
        if sampling:
            self.chunk, self.n_chunks = sample_chunks(self.n_rows, self.n_cols, n_chunks)
            self.k = MAX_TOP_K
        else:
            if n_chunks is not None:
                raise ValueError("n_chunks applies to sampling plans only")
            self.chunk, self.k = _GREEDY_CHUNK, 1
            self.n_chunks = -(-self.n_cols // self.chunk)
        # stage-1 candidates, slot-major: [row, r, c] is the r-th best of chunk c (k == 1: [row, 0, c])
        self.cand_val = cupy.empty((n_rows, self.k, self.n_chunks), cupy.float32)
        self.cand_idx = cupy.empty((n_rows, self.k, self.n_chunks), cupy.int32)
        self.next_ids = cupy.zeros(n_rows, cupy.int32)
        self.draws = cupy.zeros(n_rows, cupy.int32)
        self.history = cupy.zeros((n_rows, max(history_len, 1)), cupy.int32)

    def reset(self, stream=None) -> None:
        """Restart the draw counters (and so the history column); not for use inside a capture."""
        with (stream or cupy.cuda.get_current_stream()):
            self.draws.fill(0)


class TokensDispatch(Dispatch):
    """Records embedding and sampling kernels into a stream (``stream=`` on every method; None: CuPy's
    current, torch's for torch tensors: cukern.interop). Validation raises before any launch; nothing
    here synchronises or reads device memory, nor allocates it but an output left None, so every
    method can be captured in a CUDA graph.

    ``pdl`` (default False; sm_90+) launches every kernel with programmatic dependent launch (each
    waits for the previous kernel first thing: ``pdl_enter`` in common/pdl.cuh). ``embed`` and
    ``advance_positions`` are ``repeatable`` (cukern.dispatch): a repeated call replays its launches."""

    family = FAMILY

    def __init__(self, device: int | None = None, *, pdl: bool = False):
        super().__init__(device)
        self.pdl = bool(pdl)

    def _launch(self, kernel, grid, block, pointers, params, *, stream=None, shared_mem=0):
        return super()._launch(kernel, grid, block, pointers, params, stream=stream, shared_mem=shared_mem,
                               pdl=self.pdl)

    @repeatable
    @tensors(out=like("ids", shape=lambda a: (a("ids").shape[0], a("n_cols")), dtype=np.float32))
    def embed(self, table: cupy.ndarray, qtype: int, n_cols: int, ids: cupy.ndarray, out: cupy.ndarray | None = None, *,
              scale: float = 1.0, stream=None) -> cupy.ndarray:
        """``out[t] = scale * dequantize(table row ids[t])``; an id outside the table gives a zero row.

        table: raw GGUF blocks, uint8 [n_table_rows, row_bytes] (C-contiguous, 2-byte aligned rows), or a
        float32 / float16 / uint16 (BF16 bits) [n_table_rows, n_cols] array; qtype: its GGML type id
        (``gguf.GGMLQuantizationType``); ids: [n_tokens] int32 on the device; out: [n_tokens, n_cols] f32."""
        qt = int(qtype)
        if qt not in EMBED_QTYPES:
            raise ValueError(f"embed: unsupported table type {qtype!r} (supported: "
                             f"{', '.join(v[0] for v in EMBED_QTYPES.values())})")
        name, be, bb = EMBED_QTYPES[qt]
        if not isinstance(n_cols, (int, np.integer)) or n_cols < 1 or n_cols % be:
            raise ValueError(f"embed: n_cols must be a positive multiple of the {name} block ({be}), got {n_cols!r}")
        check_array("table", table, ndim=2)
        row_bytes = n_cols // be * bb
        if table.shape[1] * table.itemsize != row_bytes:
            raise ValueError(f"embed: a {name} row of {n_cols} elements is {row_bytes} bytes, the table rows are "
                             f"{table.shape[1] * table.itemsize} bytes")
        if table.data.ptr % 4:
            raise ValueError("embed: table must be 4-byte aligned")
        check_array("ids", ids, dtype=_I32, ndim=1)
        n = ids.shape[0]
        if n < 1 or n > 65535:
            raise ValueError(f"embed: 1 ... 65535 ids per call, got {n}")
        check_array("out", out, dtype=_F32, shape=(n, n_cols))
        if not np.isfinite(scale):
            raise ValueError(f"embed: scale must be finite, got {scale}")
        params = self.struct("EmbedParams").pack(row_bytes=row_bytes, n_tokens=n, n_cols=int(n_cols),
                                                 n_table_rows=table.shape[0], scale=float(scale))
        grid_x = max(1, min(-(-n_cols // (4 * _EMBED_THREADS)), 64))
        self._launch(f"embed_rows<{qt}>", (grid_x, n), _EMBED_THREADS, (out, table, ids), params, stream=stream)
        return out

    @tensors
    def sample(self, plan: SamplePlan, logits: cupy.ndarray, *, temperature: float = 0.0, top_k: int = MAX_TOP_K,
               top_p: float = 1.0, seed: int = 0, stream=None) -> cupy.ndarray:
        """Choose one token per row of ``logits [n_rows, n_cols]`` f32 into ``plan.next_ids`` [n_rows] int32.

        temperature 0: greedy (argmax, lowest id on ties; NaN counts as -inf). temperature > 0 (needs a plan
        made with ``sampling=True``): softmax(logits / T) restricted to the ``top_k`` best (1 ... 64), then to
        the fewest best whose probability sums to >= ``top_p``, and one draw. Each call also writes the id
        to ``plan.history[row, draw]`` (while draw < history_len) and increments ``plan.draws``."""
        if not isinstance(plan, SamplePlan):
            raise TypeError(f"plan must be a SamplePlan, got {type(plan).__name__}")
        check_array("logits", logits, dtype=_F32, shape=(plan.n_rows, plan.n_cols))
        temperature, top_k, top_p, seed = check_sampling(temperature, top_k, top_p, seed)
        greedy = temperature == 0
        if not greedy and not plan.sampling:
            raise ValueError("temperature > 0 needs a SamplePlan made with sampling=True")
        k = plan.k
        params = self.struct("SampleParams").pack(
            n_rows=plan.n_rows, n_cols=plan.n_cols, chunk=plan.chunk, n_chunks=plan.n_chunks,
            top_k=1 if greedy else top_k, history_len=plan.history_len,
            inv_temperature=0.0 if greedy else 1.0 / temperature, top_p=top_p, seed=seed)
        self._launch(f"topk_chunk<{k}>", (plan.n_chunks, plan.n_rows), _THREADS,
                     (plan.cand_val, plan.cand_idx, logits), params, stream=stream)
        self._launch(f"sample_rows<{k}>", plan.n_rows, _THREADS,
                     (plan.next_ids, plan.history, plan.draws, plan.cand_val, plan.cand_idx), params, stream=stream)
        return plan.next_ids

    @repeatable
    @tensors
    def advance_positions(self, positions: cupy.ndarray, lengths: cupy.ndarray, seq_ids: cupy.ndarray, *,
                          stream=None) -> cupy.ndarray:
        """After a decode step: ``positions[r] += 1`` and ``lengths[seq_ids[r]] = positions[r] + 1``.

        positions, seq_ids: [n_rows] int32; lengths: [max_seqs] int32 (a PagedKVCache's device lengths;
        the pages must already be allocated, e.g. by extending the sequence for the whole generation)."""
        check_array("positions", positions, dtype=_I32, ndim=1)
        n = positions.shape[0]
        if n == 0:
            raise ValueError("positions must be non-empty")
        check_array("seq_ids", seq_ids, dtype=_I32, shape=(n,))
        check_array("lengths", lengths, dtype=_I32, ndim=1)
        if lengths.shape[0] == 0:
            raise ValueError("lengths must be non-empty (one entry per sequence slot)")
        params = self.struct("AdvanceParams").pack(n_rows=n, pad0=0)
        self._launch("advance_positions", -(-n // _THREADS), _THREADS, (positions, lengths, seq_ids), params,
                     stream=stream)
        return positions
