"""TokensDispatch: the two ends of a decode step, token ids in and token ids out, on the device.

Kernels: ``cuda_src/tokens/``; float64 references: ``cukern/reference/tokens.py``;
tests: ``tests/test_tokens.py``.

:meth:`TokensDispatch.embed` gathers embedding rows of a quantized table by token ids that
live on the device (the previous step's samples). :meth:`TokensDispatch.sample` runs two launches (the best candidates of each chunk of a
row, then one block per row that merges them and draws) and writes the chosen ids into a
device buffer that the next decode step reads, so a whole step — forward, sample,
:meth:`TokensDispatch.advance_positions` — is captured in one CUDA graph and replayed
without a host round trip. Randomness is a counter-based hash of (seed, row, draw number),
the draw number being a device counter the kernel increments: replays draw fresh numbers,
and a run is reproducible from its seed.
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.dispatch import Dispatch, check_array, check_int, check_real
from cukern.runtime import FamilySpec, KernelSpec

__all__ = ["TokensDispatch", "SamplePlan", "FAMILY", "MAX_TOP_K", "EMBED_QTYPES", "check_sampling"]

MAX_TOP_K = 64          # SAMPLE_MAX_K in sampling.cu
_SORT_ELEMS = 4096      # SORT_ELEMS
_THREADS = 256
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


class SamplePlan:
    """Workspaces of one (batch, vocabulary, k) shape: allocate once, reuse in every step."""

    def __init__(self, n_rows: int, n_cols: int, *, sampling: bool, history_len: int = 0):
        if not isinstance(n_rows, (int, np.integer)) or n_rows < 1 or n_rows > 65535:
            raise ValueError(f"n_rows must be 1 ... 65535, got {n_rows!r}")
        if not isinstance(n_cols, (int, np.integer)) or n_cols < 1 or n_cols >= 2**31:
            raise ValueError(f"n_cols must be 1 ... 2**31 - 1, got {n_cols!r}")
        if not isinstance(history_len, (int, np.integer)) or history_len < 0:
            raise ValueError(f"history_len must be >= 0, got {history_len!r}")
        self.n_rows, self.n_cols, self.sampling, self.history_len = int(n_rows), int(n_cols), bool(sampling), int(history_len)
        if sampling:
            # every row's candidates (n_chunks * 64) must fit the stage-2 sort: n_chunks <= 64
            chunk = 1 << max(6, int(np.ceil(np.log2(-(-n_cols // (_SORT_ELEMS // MAX_TOP_K))))))
            if chunk > _SORT_ELEMS:
                raise ValueError(f"sampling supports at most {_SORT_ELEMS * _SORT_ELEMS // MAX_TOP_K} logits per row, "
                                 f"got {n_cols} (greedy has no limit)")
            self.k = MAX_TOP_K
        else:
            chunk, self.k = _GREEDY_CHUNK, 1
        self.chunk = chunk
        self.n_chunks = -(-n_cols // chunk)
        self.cand_val = cupy.empty((n_rows, self.n_chunks, self.k), cupy.float32)
        self.cand_idx = cupy.empty((n_rows, self.n_chunks, self.k), cupy.int32)
        self.next_ids = cupy.zeros(n_rows, cupy.int32)
        self.draws = cupy.zeros(n_rows, cupy.int32)
        self.history = cupy.zeros((n_rows, max(history_len, 1)), cupy.int32)

    def reset(self, stream=None) -> None:
        """Restart the draw counters (and so the history column); not for use inside a capture."""
        with (stream or cupy.cuda.get_current_stream()):
            self.draws.fill(0)


class TokensDispatch(Dispatch):
    """Records embedding and sampling kernels into a stream (``stream=`` on every method; None: CuPy's
    current). Validation raises before any launch; nothing here synchronises, allocates or reads device
    memory, so every method can be captured in a CUDA graph."""

    family = FAMILY

    def embed(self, table: cupy.ndarray, qtype: int, n_cols: int, ids: cupy.ndarray, out: cupy.ndarray, *,
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
