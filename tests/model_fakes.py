"""NumPy stand-ins for the dispatches that cukern.models.transformer drives, so that its orchestration
(chunked prefill, cache growth, positions and lengths on the "device", graph capture and replay,
batching, stop ids) runs on a machine without a GPU.

Each fake does, in float64, what its family's docstring says the kernel does; the kernels themselves
are checked against their references in their own families' tests, and the real forward against the
model reference in the GPU tests of test_models.py. Sampling is greedy only.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np

import cukern.dmmv
import cukern.models.layers as L
import cukern.models.transformer as T
from cukern.reference import dmmv as D_REF
from cukern.reference import models as R


class Arr(np.ndarray):
    """A host array with the two cupy.ndarray methods the forward uses."""

    def get(self, stream=None):
        return np.array(self)

    def set(self, src, stream=None):
        self[...] = np.asarray(src).reshape(self.shape)


def wrap(a) -> Arr:
    return np.asarray(a).view(Arr)


class FakeStream:
    ptr = 1

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


def _empty(shape, dtype=np.float32):
    """Uninitialised memory: NaN (floats) or -7 (ints), so a value never written shows."""
    return wrap(np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -7, dtype))


fake_cupy = types.SimpleNamespace(
    float16=np.float16, float32=np.float32, int32=np.int32, empty=_empty, asarray=lambda a: wrap(np.array(a)),
    full=lambda shape, v, dtype=np.float32: wrap(np.full(shape, v, dtype)),
    cuda=types.SimpleNamespace(Stream=FakeStream))


class FakeGraph:
    """Replays the captured step by calling it again (the real graph relaunches its kernels)."""

    def __init__(self, fn, stream):
        self.fn, self.stream, self.replays = fn, stream, 0

    def replay(self, stream=None):
        self.replays += 1
        self.fn(self.stream)


class Weight:
    """Stands in for a QWeight: the dequantized matrix and the GGML type."""

    def __init__(self, dense: np.ndarray, qtype: int):
        self.dense, self.qtype = dense, qtype
        self.m, self.k = dense.shape


def _rms(x, w, eps):
    return R.rms_norm(np.asarray(x), w, eps)


class Elementwise:
    def rms_norm(self, x, w, out, *, eps, stream=None):
        out[...] = _rms(x, w, eps)

    def residual_rms_norm(self, x, residual, w, out, *, eps, stream=None):
        residual += x
        out[...] = _rms(residual, w, eps)

    def post_norm_residual_rms_norm(self, x, residual, w_post, w, out, *, eps, stream=None):
        residual += _rms(x, w_post, eps)
        out[...] = _rms(residual, w, eps)

    def bias_add(self, x, bias, out, stream=None):
        out[...] = x + bias

    def geglu(self, gate, up, out, stream=None):
        out[...] = R.gelu_tanh(gate) * up

    def swiglu(self, gate, up, out, stream=None):
        out[...] = R.silu(gate) * up

    def qk_norm_rope_kv_write(self, q, k, v, wq, wk, q_out, k_cache, v_cache, page_table, positions, seq_ids, *,
                              eps, neox, freq_base, freqs, pos_mode, stream=None):
        assert (wq is None) == (wk is None)
        page_size = k_cache.shape[1]
        for t in range(q.shape[0]):
            pos, seq = (positions[0] + t, seq_ids[0]) if pos_mode == "consecutive" else (positions[t], seq_ids[t])
            qt, kt = np.asarray(q[t:t + 1]), np.asarray(k[t:t + 1])
            if wq is not None:
                qt, kt = _rms(qt, wq, eps), _rms(kt, wk, eps)
            p = np.array([pos])
            q_out[t] = R.rope(qt, p, freq_base, neox, freqs)[0]
            page = page_table[seq, pos // page_size]
            assert page >= 0, f"write to an unassigned page: sequence {seq}, position {pos}"
            k_cache[page, pos % page_size] = R.rope(kt, p, freq_base, neox, freqs)[0]
            v_cache[page, pos % page_size] = v[t]


class PagedCache:
    """PagedKVCache's allocator and device arrays; ``lengths`` is what the kernels see."""

    kind = "float32"  # PagedKVCache.kind: full-precision pools, so the prompt chunks' attention stays f32

    def __init__(self, n_layers, n_pages, page_size, n_kv_heads, head_dim, *, max_seqs, max_pages_per_seq):
        self.page_size, self.max_pages = page_size, max_pages_per_seq
        shape = (n_pages, page_size, n_kv_heads, head_dim)
        self.k_pools = [wrap(np.zeros(shape)) for _ in range(n_layers)]
        self.v_pools = [wrap(np.zeros(shape)) for _ in range(n_layers)]
        self.page_table = wrap(np.full((max_seqs, max_pages_per_seq), -1, np.int32))
        self.lengths = wrap(np.zeros(max_seqs, np.int32))
        self._len = np.zeros(max_seqs, int)
        self._active = np.zeros(max_seqs, bool)
        self._free = list(range(n_pages - 1, -1, -1))
        self.alloc = self          # PagedKVCache.alloc: the host allocator

    def capacity_tokens(self):
        return self.max_pages * self.page_size

    def active_slots(self):
        return [int(s) for s in np.flatnonzero(self._active)]

    def length(self, slot):
        return int(self._len[slot])

    def add(self, length=0, stream=None):
        slot = int(np.flatnonzero(~self._active)[0])
        self._active[slot] = True
        self.extend(slot, length)
        return slot

    def extend(self, slot, n=1, stream=None):
        old = int(self._len[slot])
        for j in range(-(-old // self.page_size), -(-(old + n) // self.page_size)):
            self.page_table[slot, j] = self._free.pop()
        self._len[slot] = old + n
        self.lengths[slot] = old + n
        return old

    def free(self, slot, stream=None):
        self._free += [int(p) for p in self.page_table[slot] if p >= 0]
        self.page_table[slot] = -1
        self._active[slot], self._len[slot], self.lengths[slot] = False, 0, 0


def _gather(cache, layer, slot, n):
    rows = [(cache.page_table[slot, j // cache.page_size], j % cache.page_size) for j in range(n)]
    assert all(p >= 0 for p, _ in rows), "attention read an unassigned page"
    return (np.stack([cache.k_pools[layer][p, r] for p, r in rows]),
            np.stack([cache.v_pools[layer][p, r] for p, r in rows]))


def _window(window_left):
    return window_left + 1 if window_left >= 0 else 0


class Attention:
    """Queries aligned to the end of each sequence's cached length (the device ``lengths``)."""

    def plan_batched(self, cache, seq_ids, q_lens):
        for s, n in zip(seq_ids, q_lens):
            assert 1 <= n <= cache.length(s)
        return types.SimpleNamespace(cache=cache, seq_ids=wrap(np.array(seq_ids, np.int32)), q_lens=list(q_lens))

    def flash_attn_batched(self, plan, layer, q, out, *, causal, scale, window_left, stream=None):
        row = 0
        for s, n in zip(plan.seq_ids, plan.q_lens):
            kv = int(plan.cache.lengths[s])
            k, v = _gather(plan.cache, layer, s, kv)
            out[row:row + n] = R.attention(np.asarray(q[row:row + n]), k, v, np.arange(kv - n, kv), np.arange(kv),
                                           scale, _window(window_left))
            row += n

    def plan_decode(self, cache, seq_ids, n_heads, *, max_kv_len=None):
        return types.SimpleNamespace(cache=cache, seq_ids=wrap(np.array(seq_ids, np.int32)))

    def flash_attn_decode(self, plan, layer, q, out, *, scale, window_left, stream=None):
        for b, s in enumerate(plan.seq_ids):
            kv = int(plan.cache.lengths[s])
            k, v = _gather(plan.cache, layer, s, kv)
            out[b:b + 1] = R.attention(np.asarray(q[b:b + 1]), k, v, np.array([kv - 1]), np.arange(kv), scale,
                                       _window(window_left))


# cukern.dmmv.NormedX's fields, unchecked (the fakes' arrays are NumPy)
NormedX = dataclasses.make_dataclass(
    "NormedX", [(f.name, f.type) if f.default is dataclasses.MISSING else (f.name, f.type, f.default)
                for f in dataclasses.fields(cukern.dmmv.NormedX)], frozen=True)


def _input(x):
    """The matvec input: x itself, or a NormedX's x (its r written to residual_out, as the first block does)."""
    if not isinstance(x, NormedX):
        return np.asarray(x)
    h, r = D_REF.normed_x(x.residual, x.w, x.proj, x.w_post, eps=x.eps, weight_offset=x.weight_offset)
    if x.residual_out is not None:
        x.residual_out[...] = r
    return h


class Dmmv:
    int8 = False

    def dmmv(self, w, x, y, stream=None):
        y[...] = (_input(x) @ w.dense.T).reshape(y.shape)

    def dmmv_pair(self, w1, w2, x, y1, y2, stream=None):
        x = _input(x)
        self.dmmv(w1, x, y1)
        self.dmmv(w2, x, y2)

    def dmmv_three(self, w1, w2, w3, x, y1, y2, y3, stream=None):
        x = _input(x)
        for w, y in ((w1, y1), (w2, y2), (w3, y3)):
            self.dmmv(w, x, y)

    def dmmv_glu(self, w_gate, w_up, x, y, *, act, stream=None):
        x = _input(x)
        g, u = x @ w_gate.dense.T, x @ w_up.dense.T
        y[...] = (R.gelu_tanh(g) if act == "geglu" else R.silu(g)) * u


class Matmul(Dmmv):
    """The tiled GEMM; counts its launches (the forward must use it only for more than 8 rows)."""

    def __init__(self):
        self.launches = 0

    def gemm(self, w, b, d, stream=None):
        assert b.shape[0] > 8
        self.launches += 1
        self.dmmv(w, b, d)

    def gemm_glu(self, w_gate, w_up, b, d, *, act, stream=None):
        assert b.shape[0] > 8
        self.launches += 1
        self.dmmv_glu(w_gate, w_up, b, d, act=act)


class Plan:
    """SamplePlan's buffers (greedy)."""

    def __init__(self, n_rows, n_cols, *, sampling, history_len=0):
        assert not sampling, "the fakes sample greedily only"
        self.n_rows, self.history_len = n_rows, history_len
        self.next_ids = wrap(np.zeros(n_rows, np.int32))
        self.draws = wrap(np.zeros(n_rows, np.int32))
        self.history = wrap(np.zeros((n_rows, max(history_len, 1)), np.int32))


class Tokens:
    def __init__(self, table: np.ndarray):
        self.table = table

    def embed(self, table, qtype, n_cols, ids, out, *, scale, stream=None):
        out[...] = self.table[np.asarray(ids)] * scale

    def sample(self, plan, logits, *, temperature, top_k, top_p, seed, stream=None):
        ids = np.argmax(np.asarray(logits), axis=-1)
        plan.next_ids[...] = ids
        for r in range(plan.n_rows):
            if plan.draws[r] < plan.history_len:
                plan.history[r, plan.draws[r]] = ids[r]
            plan.draws[r] += 1

    def advance_positions(self, positions, lengths, seq_ids, stream=None):
        positions += 1
        for r, s in enumerate(seq_ids):
            lengths[s] = positions[r] + 1


def fake_base(cls, model, monkeypatch, *, max_seqs, max_tokens, page_size, prefill_chunk):
    """A ``cls`` (Transformer or a subclass) over ``model`` with CuPy, streams, graphs and the cache faked, no
    dispatches or layers yet; returns it with the ``dense``, ``weight`` and ``vector`` tensor readers."""
    monkeypatch.setattr(T, "cupy", fake_cupy)
    monkeypatch.setattr(T, "resolve_stream", lambda s=None: s if s is not None else FakeStream())
    monkeypatch.setattr(T, "capture_graph", lambda fn, stream=None: FakeGraph(fn, stream))
    monkeypatch.setattr(T, "SamplePlan", Plan)
    monkeypatch.setattr(T, "check_array", lambda name, a, **kw: a)
    monkeypatch.setattr(L, "NormedX", NormedX)
    monkeypatch.setattr(T, "_address", lambda a: a.ctypes.data)
    c = model.config
    t = cls.__new__(cls)
    t.model, t.cfg = model, c
    t.max_seqs, t.max_tokens, t.prefill_chunk = max_seqs, max_tokens, prefill_chunk
    pages = -(-max_tokens // page_size)
    t.cache = PagedCache(c.n_layers, max_seqs * pages, page_size, c.n_kv_heads, c.head_dim, max_seqs=max_seqs,
                         max_pages_per_seq=pages)

    def dense(name):
        return model[name].dequantize(np.float64)

    def weight(name):
        return Weight(dense(name), int(model[name].qtype))

    def vector(name):
        return wrap(dense(name)) if name in model.tensors else None

    return t, dense, weight, vector


def fake_transformer(model, monkeypatch, *, max_seqs, max_tokens, page_size, prefill_chunk):
    """A Transformer over ``model`` (a GGUFModel) whose dispatches, cache and CuPy are the fakes above."""
    t, dense, weight, vector = fake_base(T.Transformer, model, monkeypatch, max_seqs=max_seqs, max_tokens=max_tokens,
                                         page_size=page_size, prefill_chunk=prefill_chunk)
    c = model.config

    t.ew, t.attn, t.mm, t.gemm, t.tok = Elementwise(), Attention(), Dmmv(), Matmul(), Tokens(dense("token_embd.weight"))
    t.layers = []
    for i in range(c.n_layers):
        b = f"blk.{i}."
        t.layers.append(T._Layer(
            attn_norm=vector(b + "attn_norm.weight"), wq=weight(b + "attn_q.weight"), wk=weight(b + "attn_k.weight"),
            wv=weight(b + "attn_v.weight"), wo=weight(b + "attn_output.weight"), ffn_norm=vector(b + "ffn_norm.weight"),
            wg=weight(b + "ffn_gate.weight"), wu=weight(b + "ffn_up.weight"), wd=weight(b + "ffn_down.weight"),
            q_norm=vector(b + "attn_q_norm.weight"), k_norm=vector(b + "attn_k_norm.weight"),
            bq=vector(b + "attn_q.bias"), bk=vector(b + "attn_k.bias"), bv=vector(b + "attn_v.bias"),
            post_attn_norm=vector(b + "post_attention_norm.weight"), post_ffn_norm=vector(b + "post_ffw_norm.weight")))
    t.output_norm = vector("output_norm.weight")
    factors = dense("rope_freqs.weight") if c.rope_freq_factors else None
    t.rope_freqs = {local: None if c.rope_is_plain(local) else c.rope_inv_freq(local, factors)
                    for local in (False, True)}
    t.embed_table, t.embed_qtype = None, int(model["token_embd.weight"].qtype)
    t.head = t.head_mv = weight("token_embd.weight" if c.tied_output else "output.weight")
    t._dec = None
    t._chunks, t._stream = {}, None
    return t
