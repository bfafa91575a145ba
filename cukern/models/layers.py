"""The decoder layers of :class:`cukern.models.transformer.Transformer`: its projections, MLP, residual
adds and norms, launched over a block of rows (a prompt chunk, or one token per sequence of a decode
batch). A mixin: the methods read the Transformer's config, weights, dispatches and cache.

Rows above ``MatmulDispatch.MATVEC_MAX_N`` run the projections as tiled GEMMs (on packed or padded
copies where kept) and the norms as elementwise kernels; fewer rows run the matvecs; one row runs
them on normed inputs (``NormedX``: every residual add and norm folded into the matvecs after it, q,
k and v in one launch where ``dmmv_three`` has the types).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import cupy

from cukern.dmmv import THREE_TYPES, NormedX, QWeight
from cukern.matmul import GEMM_QTYPES, MatmulDispatch, PackedWeight
from cukern.profiler import nvtx_range

if TYPE_CHECKING:
    from cukern.models.transformer import _Buffers, _Layer

__all__ = ["Layers"]


class Layers:
    """The layer methods of Transformer (a mixin over its attributes: cfg, layers, mm, gemm, ew, tok,
    cache, rope_freqs, output_norm, head, head_mv, embed_table, embed_qtype)."""

    def _gemm_ok(self, w: QWeight, n: int) -> bool:
        return n > MatmulDispatch.MATVEC_MAX_N and w.qtype in GEMM_QTYPES

    def _pack(self, L: _Layer) -> None:
        """pack_prefill: L's packable projections (MatmulDispatch.packable), the gate and up as one pair where
        alike, else each where it packs."""
        glu = L.gate_up_alike and self.gemm.packable(L.wg)
        if glu:
            L.packed["glu"] = self.gemm.pack_glu(L.wg, L.wu)
        for name in ("wq", "wk", "wv", "wo", "wd") + (() if glu else ("wg", "wu")):
            if self.gemm.packable(getattr(L, name)):
                L.packed[name] = self.gemm.pack(getattr(L, name))

    def _pad(self, L: _Layer) -> None:
        """L's projections whose GGUF rows are not 16-byte multiples (k = 640 in Q5_0 or Q8_0), copied once
        with rows padded to 16 bytes (MatmulDispatch.pad_rows) for the prompt GEMMs, which copy such rows
        16 bytes at a time instead of 2; the matvecs keep reading the GGUF bytes."""
        for name in ("wq", "wk", "wv", "wo", "wg", "wu", "wd"):
            w = getattr(L, name)
            if w.qtype in GEMM_QTYPES and w.row_bytes % 16:
                L.padded[name] = self.gemm.pad_rows(w)

    def _gemm_copy(self, L: _Layer, name: str, n: int) -> PackedWeight | QWeight | None:
        """L's copy of a projection made for the prompt GEMMs that serves a chunk of n rows: the packed one
        (pack_prefill, from WG_MIN_N rows), else the padded one (past the matvec's MATVEC_MAX_N), else None."""
        p = L.packed.get(name)
        if p is not None and n >= self.gemm.WG_MIN_N:
            return p
        return L.padded.get(name) if n > MatmulDispatch.MATVEC_MAX_N else None

    def _matmul(self, w: QWeight, x, y, stream, copy: PackedWeight | QWeight | None = None):
        """y = x W^T for n = x.shape[0] rows: the tiled GEMM for a prompt chunk (on ``copy``, W's packed or
        padded copy, where given), the matvec otherwise."""
        if copy is not None:
            self.gemm.gemm(copy, x, y, stream=stream)
        elif self._gemm_ok(w, x.shape[0]):
            self.gemm.gemm(w, x, y, stream=stream)
        else:
            self.mm.dmmv(w, x, y, stream=stream)

    def _window(self, i: int) -> int:
        c = self.cfg
        return c.sliding_window - 1 if c.local_layers[i] and c.sliding_window else -1

    def _attn_kwargs(self, i: int) -> dict:
        """Layer i's extra attention arguments (the MoE models' ``sinks``); none here."""
        return {}

    def _project(self, L: _Layer, buf: _Buffers, stream):
        h, q, k, v, n = buf.h, buf.q, buf.k, buf.v, buf.n
        if L.wq.qtype == L.wk.qtype and not self._gemm_ok(L.wq, n):
            self.mm.dmmv_pair(L.wq, L.wk, h, q, k, stream=stream)
        else:
            self._matmul(L.wq, h, q, stream, self._gemm_copy(L, "wq", n))
            self._matmul(L.wk, h, k, stream, self._gemm_copy(L, "wk", n))
        self._matmul(L.wv, h, v, stream, self._gemm_copy(L, "wv", n))
        self._biases(L, q, k, v, stream)

    def _mlp(self, L: _Layer, buf: _Buffers, stream):
        c = self.cfg
        h, gate, up, n = buf.h, buf.gate, buf.up, buf.n
        act = "geglu" if c.activation == "gelu_tanh" else "swiglu"
        if self._gemm_copy(L, "glu", n) is not None:
            self.gemm.gemm_glu(L.packed["glu"], None, h, gate, act=act, stream=stream)
        elif L.gate_up_alike:
            if self._gemm_ok(L.wg, n):
                self.gemm.gemm_glu(L.padded.get("wg", L.wg), L.padded.get("wu", L.wu), h, gate, act=act,
                                   stream=stream)
            else:
                self.mm.dmmv_glu(L.wg, L.wu, h, gate, act=act, stream=stream)
        else:
            self._matmul(L.wg, h, gate, stream, self._gemm_copy(L, "wg", n))
            self._matmul(L.wu, h, up, stream, self._gemm_copy(L, "wu", n))
            (self.ew.geglu if act == "geglu" else self.ew.swiglu)(gate, up, gate, stream=stream)
        self._matmul(L.wd, gate, buf.proj, stream, self._gemm_copy(L, "wd", n))

    def _residual(self, proj, x, post_norm, next_norm, h, stream):
        """x += [post_norm](proj); h = next_norm(x)."""
        eps = self.cfg.rms_eps
        if post_norm is not None:
            self.ew.post_norm_residual_rms_norm(proj, x, post_norm, next_norm, h, eps=eps, stream=stream)
        else:
            self.ew.residual_rms_norm(proj, x, next_norm, h, eps=eps, stream=stream)

    def _normed_path(self, n: int) -> bool:
        """Whether n rows run the layers on the matvecs' normed inputs (NormedX: each residual add and
        norm folded into the matvecs that read it, two launches a layer fewer): one row on the f32
        matvec path. Batches keep the norm kernels: every block of a NormedX matvec makes its columns'
        inputs one after the other (H200, Gemma 3 270M: b1 713 against 774 us a step, b8 1,503
        against 981; docs/notes/models.md)."""
        return n == 1 and not self.mm.int8

    def _head(self, n: int):
        """The LM head's weights for a decode step of n rows: the split Q8_0 copy (one column: the f32
        dmmv_split, more: dmmv_split_tc on tensor cores; both faster than the GGUF blocks,
        docs/notes/models.md)."""
        return self.head_mv

    def _project_normed(self, L: _Layer, buf: _Buffers, x_in: NormedX, stream):
        """q, k, v from a NormedX: the first launch writes its residual_out, the others only read."""
        q, k, v = buf.q, buf.k, buf.v
        if L.wq.qtype == L.wk.qtype and (L.wq.qtype, L.wv.qtype) in THREE_TYPES:
            self.mm.dmmv_three(L.wq, L.wk, L.wv, x_in, q, k, v, stream=stream)
            return self._biases(L, q, k, v, stream)
        rest = dataclasses.replace(x_in, residual_out=None) if x_in.residual_out is not None else x_in
        if L.wq.qtype == L.wk.qtype:
            self.mm.dmmv_pair(L.wq, L.wk, x_in, q, k, stream=stream)
        else:
            self.mm.dmmv(L.wq, x_in, q, stream=stream)
            self.mm.dmmv(L.wk, rest, k, stream=stream)
        self.mm.dmmv(L.wv, rest, v, stream=stream)
        self._biases(L, q, k, v, stream)

    def _biases(self, L: _Layer, q, k, v, stream):
        if L.bq is not None:
            for y, bias in ((q, L.bq), (k, L.bk), (v, L.bv)):
                self.ew.bias_add(y, bias, y, stream=stream)

    def _mlp_normed(self, L: _Layer, buf: _Buffers, x_in: NormedX, stream):
        c = self.cfg
        gate, up = buf.gate, buf.up
        act = "geglu" if c.activation == "gelu_tanh" else "swiglu"
        if L.gate_up_alike:
            self.mm.dmmv_glu(L.wg, L.wu, x_in, gate, act=act, stream=stream)
        else:
            self.mm.dmmv(L.wg, x_in, gate, stream=stream)
            self.mm.dmmv(L.wu, dataclasses.replace(x_in, residual_out=None), up, stream=stream)
            (self.ew.geglu if act == "geglu" else self.ew.swiglu)(gate, up, gate, stream=stream)
        self.mm.dmmv(L.wd, gate, buf.proj, stream=stream)

    def _normed_inputs(self, buf: _Buffers) -> tuple[list[NormedX], list[NormedX], cupy.ndarray]:
        """The NormedX inputs of every layer's projections (attention) and MLP on buf, made once per
        buffer set (they depend on nothing else), and the residual buffer the last layer leaves. The
        residual stream alternates between buf.x and buf.x2: the first matvec after each sub-layer
        reads the residual, the sub-layer's output and the norms, and writes the new residual into
        the other buffer (layer 0's attention input is the embedded x itself, which it only reads)."""
        if buf.normed is None:
            c, xs, cur = self.cfg, (buf.x, buf.x2), 0
            attn_in = [NormedX(buf.x, self.layers[0].attn_norm, eps=c.rms_eps)]
            mlp_in = []
            for i, L in enumerate(self.layers):
                mlp_in.append(NormedX(xs[cur], L.ffn_norm, buf.proj, L.post_attn_norm, xs[1 - cur], eps=c.rms_eps))
                cur = 1 - cur
                if i + 1 < c.n_layers:
                    attn_in.append(NormedX(xs[cur], self.layers[i + 1].attn_norm, buf.proj, L.post_ffn_norm,
                                           xs[1 - cur], eps=c.rms_eps))
                    cur = 1 - cur
            buf.normed = (attn_in, mlp_in, xs[cur])
        return buf.normed

    def _layers(self, buf: _Buffers, attend, positions, seq_ids, pos_mode: str, stream):
        """Every layer over buf's rows (the embedded tokens in buf.x); ``attend(i, q_rot, o)`` runs
        attention of layer i. Leaves the final-normed hidden state in buf.h. On the normed path
        (:meth:`_normed_path`) the residual adds and norms are folded into the matvecs
        (:meth:`_normed_inputs`)."""
        c = self.cfg
        normed = self._normed_path(buf.n)
        if normed:
            attn_in, mlp_in, last = self._normed_inputs(buf)
        else:
            self.ew.rms_norm(buf.x, self.layers[0].attn_norm, buf.h, eps=c.rms_eps, stream=stream)
        for i, L in enumerate(self.layers):
            with nvtx_range(f"layer {i}"):  # per-layer ranges under nsys (CUKERN_NVTX=1); free otherwise
                if normed:
                    self._project_normed(L, buf, attn_in[i], stream)
                else:
                    self._project(L, buf, stream)
                local = c.local_layers[i]
                self.ew.qk_norm_rope_kv_write(
                    buf.q3, buf.k3, buf.v3, L.q_norm, L.k_norm, buf.q_rot, self.cache.k_pools[i],
                    self.cache.v_pools[i], self.cache.page_table, positions, seq_ids, eps=c.rms_eps, neox=c.rope_neox,
                    freq_base=c.rope_base_local if local else c.rope_base, freqs=self.rope_freqs[local],
                    pos_mode=pos_mode, stream=stream)
                attend(i, buf.q_rot, buf.o)
                self._matmul(L.wo, buf.o2, buf.proj, stream, self._gemm_copy(L, "wo", buf.n))
                nxt = self.layers[i + 1].attn_norm if i + 1 < c.n_layers else self.output_norm
                if normed:
                    self._mlp_normed(L, buf, mlp_in[i], stream)
                    if i + 1 == c.n_layers:  # the LM head's input: the last residual add and the output norm
                        self._residual(buf.proj, last, L.post_ffn_norm, nxt, buf.h, stream)
                else:
                    self._residual(buf.proj, buf.x, L.post_attn_norm, L.ffn_norm, buf.h, stream)
                    self._mlp(L, buf, stream)
                    self._residual(buf.proj, buf.x, L.post_ffn_norm, nxt, buf.h, stream)

    def _embed(self, ids: cupy.ndarray, buf: _Buffers, stream):
        c = self.cfg
        self.tok.embed(self.embed_table, self.embed_qtype, c.d_model, ids, buf.x, scale=c.embed_scale,
                       stream=stream)
