"""The GPU forward of the DeltaNet hybrid (llama.cpp's ``qwen3next``: Qwen3-Next's layout), from cukern dispatches.

:class:`HybridModel` is a :class:`cukern.models.transformer.Transformer` whose layers alternate gated DeltaNet
(linear attention with a recurrent state) and gated full attention; prompt chunks, graph-captured decode
steps, sampling and :meth:`generate` are the Transformer's. :class:`HybridCache` keeps the recurrent state of
every sequence beside the paged K/V cache (of the attention layers only): per DeltaNet layer and slot the
conv1d's last inputs and the delta rule's matrices, zeroed when a sequence is added, copied by a fork, and
updated in place by the kernels, so a captured step replays on the same slots.

A DeltaNet layer over n rows (a prompt chunk of one sequence, or one token of each sequence of a batch)::

    q, k, v, z, ba = W h                         dmmv / gemm (attn_qkv's row ranges, attn_gate, ssm_ba)
    g, beta = deltanet_gates(ba)                 elementwise (softplus, sigmoid)
    q, k, v = conv1d_silu(q, k, v; conv state)   per sequence
    q, k = l2 norm per head                      group_norm
    o = deltanet(q, k, v, g, beta; state)        per sequence
    proj = W_out gated_rms_norm(o, z)

A full-attention layer: ``[q | gate] = W_q h`` (deinterleave), ``k, v``, Q/K norm + partial RoPE + K/V write in
one launch, the paged attention of the Transformer, ``o * sigmoid(gate)``, ``W_o``. Then every layer:
``x += proj; h = post_attention_norm(x)``, the FFN block of :data:`FFN_BLOCKS` (the dense SwiGLU, or Qwen3-Next's
MoE: :class:`MoeFFN`), ``x += proj; h = next norm(x)``. A MoE model's kernels flag expert ids out of range on
the device; :meth:`HybridModel.check_errors` raises it as the MoE models do, after :meth:`generate`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import cupy
import numpy as np

from cukern.attention import PagedKVCache
from cukern.dispatch import bounded_put
from cukern.dmmv import QWeight
from cukern.models.gguf_loader import GGUFModel
from cukern.models.hybrid_config import ARCH, HybridConfig, legacy_rows
from cukern.models.moe import MoeBlock, MoeWeights
from cukern.models.moe_transformer import MoeTransformer, moe_weights
from cukern.models.transformer import Transformer, _Chunk
from cukern.profiler import nvtx_range

__all__ = ["HybridModel", "HybridCache", "FFN_BLOCKS", "DenseFFN", "MoeFFN"]


class HybridCache(PagedKVCache):
    """A :class:`PagedKVCache` of the attention layers (cache layer j is ``cfg.attn_layers[j]``) plus the
    recurrent state of every DeltaNet layer i, per slot: ``states[i]`` maps ``conv_q`` / ``conv_k`` /
    ``conv_v`` to ``[max_seqs, conv_kernel - 1, channels]`` and ``ssm`` to ``[max_seqs, n_v, dk, dv]``, f32
    (``cfg.state_shapes()``). :meth:`add` zeroes the new slot's state, :meth:`fork` copies it."""

    def __init__(self, cfg: HybridConfig, n_pages: int, page_size: int, *, max_seqs: int, max_pages_per_seq: int,
                 dtype="float16", device: int | None = None):
        super().__init__(len(cfg.attn_layers), n_pages, page_size, cfg.n_kv_heads, cfg.head_dim, max_seqs=max_seqs,
                         max_pages_per_seq=max_pages_per_seq, dtype=dtype, device=device)
        shapes = cfg.state_shapes()
        with cupy.cuda.Device(device) if device is not None else contextlib.nullcontext():
            self.states = {i: {k: cupy.zeros((max_seqs,) + s, cupy.float32) for k, s in shapes.items()}
                           for i, r in enumerate(cfg.recurrent) if r}

    def state(self, layer: int, slot: int) -> dict:
        """Slot ``slot``'s state arrays of DeltaNet layer ``layer`` (views, updated in place)."""
        return {k: a[slot] for k, a in self.states[layer].items()}

    def reset_state(self, slot: int, *, stream=None) -> None:
        """Zero a slot's recurrent state on ``stream`` (host work: not for a captured graph)."""
        st = stream if stream is not None else cupy.cuda.get_current_stream()
        with st:
            for arrays in self.states.values():
                for a in arrays.values():
                    a[slot].fill(0)

    def add(self, length: int = 0, *, stream=None) -> int:
        slot = super().add(length, stream=stream)
        self.reset_state(slot, stream=stream)
        return slot

    def fork(self, slot: int, *, stream=None) -> int:
        child = super().fork(slot, stream=stream)
        st = stream if stream is not None else cupy.cuda.get_current_stream()
        with st:
            for arrays in self.states.values():
                for a in arrays.values():
                    a[child] = a[slot]
        return child


@dataclass
class DenseFFN:
    """The SwiGLU FFN of a layer (``ffn_gate`` / ``ffn_up`` / ``ffn_down``): ``proj = W_d (silu(W_g h) * W_u h)``,
    run by the Transformer's MLP (tiled GEMMs for a prompt chunk, the fused GLU matvec for a batch)."""

    wg: QWeight
    wu: QWeight
    wd: QWeight
    packed: dict = field(default_factory=dict)
    padded: dict = field(default_factory=dict)

    @property
    def gate_up_alike(self) -> bool:
        return (self.wg.qtype, self.wg.m, self.wg.k) == (self.wu.qtype, self.wu.m, self.wu.k)

    @classmethod
    def build(cls, lm: "HybridModel", i: int) -> "DenseFFN":
        b = f"blk.{i}."
        return cls(lm._qw(b + "ffn_gate.weight"), lm._qw(b + "ffn_up.weight"), lm._qw(b + "ffn_down.weight"))

    def run(self, lm: "HybridModel", buf, stream) -> None:
        """buf.proj = FFN(buf.h) over buf's rows."""
        lm._mlp(self, buf, stream)


@dataclass
class MoeFFN:
    """Qwen3-Next's FFN: layer's :class:`MoeWeights` run by the model's one :class:`MoeBlock` (router, softmax
    top-k renormalised; experts per (token, slot) for a decode batch, grouped by expert for a prompt chunk;
    the shared expert times sigmoid(ffn_gate_inp_shexp . h))."""

    W: MoeWeights
    block: MoeBlock

    @classmethod
    def build(cls, lm: "HybridModel", i: int) -> "MoeFFN":
        if getattr(lm, "moe", None) is None:
            lm.moe = MoeBlock(lm, lm.cfg.moe)   # its buffers per row count, shared by the layers
        return cls(moe_weights(lm.model, i, lm._qw, lm.cfg.moe), lm.moe)

    def run(self, lm: "HybridModel", buf, stream) -> None:
        """buf.proj = MoE(buf.h) over buf's rows."""
        self.block.run(self.W, buf.h, buf.proj, stream)


# FFN kind (HybridConfig.ffn) -> builder(model, layer) of an object whose run(model, buf, stream) writes buf.proj
# [n, d_model] from buf.h
FFN_BLOCKS = {"dense": DenseFFN.build, "moe": MoeFFN.build}


@dataclass
class _DeltaNetLayer:
    attn_norm: cupy.ndarray
    ffn_norm: cupy.ndarray                       # post_attention_norm: the FFN's input norm
    wq: QWeight                                  # attn_qkv's rows of q, k, v (views, no copy)
    wk: QWeight
    wv: QWeight
    wz: QWeight                                  # attn_gate
    wba: QWeight                                 # ssm_ba
    wo: QWeight                                  # ssm_out
    conv: tuple                                  # the conv taps of q, k, v: [channels, conv_kernel] f32 views
    a: cupy.ndarray                              # ssm_a [n_v] = -exp(A_log)
    dt_bias: cupy.ndarray                        # ssm_dt.bias [n_v]
    norm: cupy.ndarray                           # ssm_norm [dv]
    ffn: object
    recurrent = True


@dataclass
class _AttnLayer:
    attn_norm: cupy.ndarray
    ffn_norm: cupy.ndarray
    wq: QWeight                                  # [2 q_dim, d]: per head the query, then its gate
    wk: QWeight
    wv: QWeight
    wo: QWeight
    q_norm: cupy.ndarray
    k_norm: cupy.ndarray
    cache_layer: int                             # its K/V pools in the HybridCache
    ffn: object
    recurrent = False


class _HybridBuffers:
    """The hybrid's activations beside a Transformer ``_Buffers`` of n rows (attached as ``buf.hy``)."""

    def __init__(self, c: HybridConfig, n: int):
        f = cupy.float32
        self.qg = cupy.empty((n, c.n_heads, 2 * c.head_dim), f)   # attention: [q | gate] per head
        self.qg2 = self.qg.reshape(n, 2 * c.q_dim)
        self.gate = cupy.empty((n, c.n_heads, c.head_dim), f)
        qk, v = c.qk_channels, c.v_channels
        self.x = [cupy.empty((n, w), f) for w in (qk, qk, v)]    # DeltaNet projections of q, k, v
        self.y = [cupy.empty((n, w), f) for w in (qk, qk, v)]    # ... after the conv1d + SiLU (q, k L2-normed)
        self.q3 = self.y[0].reshape(n, c.ssm_k_heads, c.ssm_dk)
        self.k3 = self.y[1].reshape(n, c.ssm_k_heads, c.ssm_dk)
        self.v3 = self.y[2].reshape(n, c.ssm_v_heads, c.ssm_dv)
        self.z = cupy.empty((n, v), f)
        self.ba = cupy.empty((n, 2 * c.ssm_v_heads), f)
        self.g = cupy.empty((n, c.ssm_v_heads), f)
        self.beta = cupy.empty((n, c.ssm_v_heads), f)
        self.o = cupy.empty((n, c.ssm_v_heads, c.ssm_dv), f)
        self.o2 = self.o.reshape(n, v)
        self.normed = cupy.empty((n, v), f)


class HybridModel(Transformer):
    """A ``qwen3next`` GGUF model on the GPU: ``HybridModel.load(path)`` parses, validates and uploads it.

    Arguments as :class:`Transformer`'s (``max_seqs`` sequences of up to ``max_tokens`` tokens, ``page_size``,
    ``kv_dtype``, ``prefill_chunk``); the matvecs take dmmv's f32 path and the layers the norm kernels (no
    ``NormedX`` folding, no packed or padded prompt copies). The recurrent state is sized for ``max_seqs``
    sequences at load (:class:`HybridCache`)."""

    def __init__(self, model: GGUFModel, *, max_seqs: int = 1, max_tokens: int = 4096, page_size: int = 16,
                 kv_dtype: str = "float16", prefill_chunk: int = 1024, device: int | None = None):
        c = model.config
        if c.arch != ARCH or not isinstance(c, HybridConfig):
            raise ValueError(f"{model.path}: HybridModel runs {ARCH!r} files, this one is {c.arch!r} (use Transformer)")
        build_ffn = FFN_BLOCKS.get(c.ffn)
        if build_ffn is None:
            raise NotImplementedError(f"{model.path}: the {c.ffn!r} FFN has no GPU block yet: register its builder "
                                      f"in cukern.models.hybrid.FFN_BLOCKS[{c.ffn!r}]")
        self._setup(model, max_seqs, max_tokens, kv_dtype, prefill_chunk, dmmv_int8=False, device=device)
        pages = -(-max_tokens // page_size)
        self.cache = HybridCache(c, max_seqs * pages, page_size, max_seqs=max_seqs, max_pages_per_seq=pages,
                                 dtype=kv_dtype, device=device)
        self._owned = []   # device copies made at load (a legacy ssm_in's rows regrouped)
        self.moe = None    # the MoE FFN's block (MoeFFN.build)
        self.layers = [self._deltanet_layer(i, build_ffn) if r else self._attn_layer(i, build_ffn)
                       for i, r in enumerate(c.recurrent)]
        dev, raw = model.device, model.raw
        self.output_norm = dev["output_norm.weight"]
        self.rope_freqs = {False: None, True: None}
        self.embed_table, self.embed_qtype = raw["token_embd.weight"], int(model["token_embd.weight"].qtype)
        self.head = self._qw("token_embd.weight" if c.tied_output else "output.weight")
        self.head_mv = self.mm.split_q8_0(self.head) if self.head.qtype == 8 else self.head
        self._dec = None
        self._chunks = {}
        self._stream = None

    # ------------------------------------------------------------------ weights
    def _qw(self, name: str, rows: tuple[int, int] | None = None, raw=None) -> QWeight:
        """The QWeight of tensor ``name`` (or of its rows [r0, r1): a view of the GGUF bytes)."""
        t = self.model[name]
        r = self.model.raw[name] if raw is None else raw
        r0, r1 = rows if rows is not None else (0, r.shape[0])
        return QWeight(r[r0:r1].reshape(-1), int(t.qtype), r1 - r0, t.shape[1])

    def _deltanet_layer(self, i: int, build_ffn) -> _DeltaNetLayer:
        c, dev, b = self.cfg, self.model.device, f"blk.{i}."
        qk, v = c.qk_channels, c.v_channels
        if c.ssm_in_legacy:
            name = b + "ssm_in.weight"
            t = self.model[name]
            host = np.ascontiguousarray(t.data).view(np.uint8).reshape(t.shape[0], -1)
            qkv, z = (cupy.asarray(np.ascontiguousarray(host[r])) for r in legacy_rows(c))
            self._owned += [qkv, z]
            wq, wk, wv = (self._qw(name, (a, e), qkv) for a, e in ((0, qk), (qk, 2 * qk), (2 * qk, 2 * qk + v)))
            wz = self._qw(name, None, z)
        else:
            name = b + "attn_qkv.weight"
            wq, wk, wv = (self._qw(name, (a, e)) for a, e in ((0, qk), (qk, 2 * qk), (2 * qk, 2 * qk + v)))
            wz = self._qw(b + "attn_gate.weight")
        taps = dev[b + "ssm_conv1d.weight"]
        return _DeltaNetLayer(
            attn_norm=dev[b + "attn_norm.weight"], ffn_norm=dev[b + "post_attention_norm.weight"], wq=wq, wk=wk,
            wv=wv, wz=wz, wba=self._qw(b + "ssm_ba.weight"), wo=self._qw(b + "ssm_out.weight"),
            conv=(taps[:qk], taps[qk:2 * qk], taps[2 * qk:]), a=dev[b + "ssm_a"], dt_bias=dev[b + "ssm_dt.bias"],
            norm=dev[b + "ssm_norm.weight"], ffn=build_ffn(self, i))

    def _attn_layer(self, i: int, build_ffn) -> _AttnLayer:
        dev, b = self.model.device, f"blk.{i}."
        return _AttnLayer(
            attn_norm=dev[b + "attn_norm.weight"], ffn_norm=dev[b + "post_attention_norm.weight"],
            wq=self._qw(b + "attn_q.weight"), wk=self._qw(b + "attn_k.weight"), wv=self._qw(b + "attn_v.weight"),
            wo=self._qw(b + "attn_output.weight"), q_norm=dev[b + "attn_q_norm.weight"],
            k_norm=dev[b + "attn_k_norm.weight"], cache_layer=self.cfg.attn_layers.index(i), ffn=build_ffn(self, i))

    # ------------------------------------------------------------------ the Transformer's hooks
    def _chunk_attn_dtype(self, n: int):
        return np.float32   # the gate multiplies the attention output in f32

    def _chunk(self, n: int, slot: int) -> _Chunk:
        """A prompt chunk's buffers and graphs per (length, slot): its launches hold the slot's state arrays."""
        key = (n, slot)
        st = self._chunks.get(key)
        if st is None:
            st = bounded_put(self._chunks, key, _Chunk(self, n, slot), self._CHUNK_STATES * self.max_seqs)
            st.buf.slots = (slot,)
        return st

    def _setup_decode(self, slots, positions, max_kv_len, sampling, history_len):
        d = super()._setup_decode(slots, positions, max_kv_len, sampling, history_len)
        d["buf"].slots = tuple(slots)   # row j of a step is sequence slots[j]
        return d

    # ------------------------------------------------------------------ errors
    check_errors = MoeTransformer.check_errors

    def generate(self, prompts, max_new_tokens: int, **kwargs):
        """:meth:`Transformer.generate`, then (the MoE FFN) :meth:`check_errors`: the routing of every step."""
        out = super().generate(prompts, max_new_tokens, **kwargs)
        if self.moe is not None:
            self.check_errors()
        return out

    # ------------------------------------------------------------------ layers
    def _layers(self, buf, attend, positions, seq_ids, pos_mode: str, stream):
        """Every layer over buf's rows (embedded tokens in buf.x; buf.slots: one slot for a prompt chunk, or
        the slot of each row of a decode batch); leaves the output-normed hidden state in buf.h."""
        c = self.cfg
        eps = c.rms_eps
        if getattr(buf, "hy", None) is None:
            buf.hy = _HybridBuffers(c, buf.n)
        self.ew.rms_norm(buf.x, self.layers[0].attn_norm, buf.h, eps=eps, stream=stream)
        for i, L in enumerate(self.layers):
            with nvtx_range(f"layer {i}"):
                if L.recurrent:
                    self._deltanet(i, L, buf, buf.slots, stream)
                else:
                    self._gated_attention(L, buf, attend, positions, seq_ids, pos_mode, stream)
                self.ew.residual_rms_norm(buf.proj, buf.x, L.ffn_norm, buf.h, eps=eps, stream=stream)
                L.ffn.run(self, buf, stream)
                nxt = self.layers[i + 1].attn_norm if i + 1 < c.n_layers else self.output_norm
                self.ew.residual_rms_norm(buf.proj, buf.x, nxt, buf.h, eps=eps, stream=stream)

    def _gated_attention(self, L: _AttnLayer, buf, attend, positions, seq_ids, pos_mode, stream):
        c, hy, cache = self.cfg, buf.hy, self.cache
        self._matmul(L.wq, buf.h, hy.qg2, stream)
        self._matmul(L.wk, buf.h, buf.k, stream)
        self._matmul(L.wv, buf.h, buf.v, stream)
        self.ew.deinterleave(hy.qg, buf.q3, hy.gate, stream=stream)
        j = L.cache_layer
        self.ew.qk_norm_rope_kv_write(
            buf.q3, buf.k3, buf.v3, L.q_norm, L.k_norm, buf.q_rot, cache.k_pools[j], cache.v_pools[j],
            cache.page_table, positions, seq_ids, eps=c.rms_eps, rope_dim=c.rope_dim, neox=True,
            freq_base=c.rope_base, pos_mode=pos_mode, stream=stream)
        attend(j, buf.q_rot, buf.o)
        self.ew.sigmoid_mul(buf.o, hy.gate, buf.o, stream=stream)
        self._matmul(L.wo, buf.o2, buf.proj, stream)

    def _deltanet(self, i: int, L: _DeltaNetLayer, buf, slots, stream):
        """buf.proj = the DeltaNet layer's output over buf's rows; a prompt chunk is one sequence (slots has one
        slot), a decode batch one row per slot; each sequence's conv and delta-rule state is updated in place."""
        c, hy, ew = self.cfg, buf.hy, self.ew
        for w, y in zip((L.wq, L.wk, L.wv, L.wz, L.wba), (*hy.x, hy.z, hy.ba)):
            self._matmul(w, buf.h, y, stream)
        ew.deltanet_gates(hy.ba, L.a, L.dt_bias, hy.g, hy.beta, group=c.ssm_v_heads // c.ssm_k_heads, stream=stream)
        states = self.cache.states[i]
        rows = [(slice(0, buf.n), slots[0])] if len(slots) == 1 else [(slice(j, j + 1), s) for j, s in enumerate(slots)]
        for r, s in rows:
            for x, y, w, name in zip(hy.x, hy.y, L.conv, ("conv_q", "conv_k", "conv_v")):
                ew.conv1d_silu(x[r], states[name][s], w, y[r], stream=stream)
        for y in hy.y[:2]:
            ew.group_norm(y, y, group_size=c.ssm_dk, l2=True, eps=c.rms_eps, stream=stream)
        for r, s in rows:
            ew.deltanet(hy.q3[r], hy.k3[r], hy.v3[r], hy.g[r], hy.beta[r], states["ssm"][s], hy.o[r],
                        q_scale=c.ssm_dk ** -0.5, stream=stream)
        ew.gated_rms_norm(hy.o2, hy.z, L.norm, hy.normed, group_size=c.ssm_dv, eps=c.rms_eps, stream=stream)
        self._matmul(L.wo, hy.normed, buf.proj, stream)
