"""The GPU forward of the mixture-of-experts models (``qwen3moe``, ``qwen2moe``, ``gpt-oss``):
:class:`MoeTransformer`, the :class:`~cukern.models.transformer.Transformer` step machinery (chunked
prefill with chunk graphs, graph-captured decode, batches through the paged cache, device sampling)
with a MoE feed-forward block (:mod:`cukern.models.moe`) in every layer.

One layer (the dense layer's launches up to the FFN; gpt-oss additions in brackets)::

    q, k, v   = Wq h, Wk h, Wv h  [+ biases]              dmmv | gemm, bias_add
    q', cache = rope(norm(q)), rope(norm(k)), v            qk_norm_rope_kv_write [YaRN freqs, attn_scale]
    o         = attention(q', cache)  [sinks, window]      flash_attn_batched / flash_attn_decode
    x, h      = x + Wo o [+ bo], norm(x)                   dmmv | gemm, [bias_add], residual_rms_norm
    y         = moe(h)  [+ shared expert]                  MoeBlock.run
    x, h      = x + y, norm_next(x)                        residual_rms_norm

The residual adds and norms stay kernels of their own at every row count (the dense model's
``NormedX`` folding needs a matvec after each norm, and the MoE block starts with the router).

``Transformer(model)`` and ``Transformer.load(path)`` build one for a model with experts. The MoE
kernels flag expert ids out of range on the device (:attr:`cukern.dmmv.DmmvDispatch.error_flag`);
:meth:`MoeTransformer.check_errors` reads the flag (it synchronises) and raises
:class:`MoeRoutingError` naming the file; :meth:`generate` calls it after its last step.
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np
from gguf import GGMLQuantizationType as QT

from cukern.dmmv import QWeight
from cukern.dmmv.moe import DeviceError
from cukern.models.moe import MoeBlock, MoeWeights, bias_matrix
from cukern.models.transformer import Transformer, _Layer
from cukern.profiler import nvtx_range

__all__ = ["MoeTransformer", "MoeRoutingError", "moe_weights"]


class MoeRoutingError(DeviceError):
    """A MoE kernel met an expert id outside [0, n_experts) during a step of this model."""


@dataclass
class _MoeLayer(_Layer):
    moe: MoeWeights | None = None
    bo: cupy.ndarray | None = None       # gpt-oss: the attention output's bias [d_model]
    sinks: cupy.ndarray | None = None    # gpt-oss: one logit per query head [n_heads]


def moe_weights(model, i: int, qw, cfg) -> MoeWeights:
    """Layer i's :class:`MoeWeights` from an uploaded GGUFModel: the 3-D expert tensors as QWeights over their
    GGUF bytes, the F32 router, gpt-oss's bias matrices, the shared expert (``qw(name)``: a matrix's
    QWeight) and its gate [1, d_model]; ``cfg`` the :class:`~cukern.models.moe_config.MoeConfig`."""
    m, dev, b = model, model.device, f"blk.{i}."

    def experts(name) -> QWeight:
        t = m[name]
        return QWeight(m.raw[name].reshape(-1), int(t.qtype), t.shape[1], t.shape[2], n_experts=t.shape[0])

    def bias(name) -> QWeight:
        mat = cupy.asarray(bias_matrix(m[name].dequantize(np.float32)))
        return QWeight(mat.view(cupy.uint8).reshape(-1), int(QT.F32), mat.shape[1], mat.shape[2],
                       n_experts=mat.shape[0])

    W = MoeWeights(router=dev[b + "ffn_gate_inp.weight"], gate=experts(b + "ffn_gate_exps.weight"),
                   up=experts(b + "ffn_up_exps.weight"), down=experts(b + "ffn_down_exps.weight"))
    if cfg.gpt_oss:
        W.router_bias = dev[b + "ffn_gate_inp.bias"]
        W.gate_bias, W.up_bias = bias(b + "ffn_gate_exps.bias"), bias(b + "ffn_up_exps.bias")
        W.down_bias = bias(b + "ffn_down_exps.bias")
    if cfg.shared_expert:
        W.sh_gate, W.sh_up = qw(b + "ffn_gate_shexp.weight"), qw(b + "ffn_up_shexp.weight")
        W.sh_down = qw(b + "ffn_down_shexp.weight")
        W.sh_router = dev[b + "ffn_gate_inp_shexp.weight"].reshape(1, -1)
    return W


class MoeTransformer(Transformer):
    """A MoE GGUF model on the GPU; arguments as :class:`~cukern.models.transformer.Transformer`.

    gpt-oss's YaRN angles come from ``cukern.elementwise.rope.yarn_freqs`` (f32 table, mscale), passed
    to the RoPE kernel as ``freqs`` and ``attn_scale``."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        c = self.cfg
        self.rope_kwargs = {}
        if c.yarn:
            from cukern.elementwise.rope import yarn_freqs  # the RoPE methods' YaRN arguments
            table, mscale = yarn_freqs(c.head_dim, **c.yarn_kwargs())
            freqs = cupy.asarray(np.asarray(table, np.float32))
            self.rope_freqs = {False: freqs, True: freqs}
            self.rope_kwargs = {"attn_scale": float(mscale)}
        self.moe = MoeBlock(self)

    # ------------------------------------------------------------------ weights
    def _load_layer(self, i: int, qw) -> _MoeLayer:
        c, dev, b = self.cfg, self.model.device, f"blk.{i}."
        W = moe_weights(self.model, i, qw, c)
        return _MoeLayer(
            attn_norm=dev[b + "attn_norm.weight"], wq=qw(b + "attn_q.weight"), wk=qw(b + "attn_k.weight"),
            wv=qw(b + "attn_v.weight"), wo=qw(b + "attn_output.weight"), ffn_norm=dev[b + c.ffn_norm_name],
            wg=W.gate, wu=W.up, wd=W.down, q_norm=dev.get(b + "attn_q_norm.weight"),
            k_norm=dev.get(b + "attn_k_norm.weight"), bq=dev.get(b + "attn_q.bias"), bk=dev.get(b + "attn_k.bias"),
            bv=dev.get(b + "attn_v.bias"), moe=W, bo=dev.get(b + "attn_output.bias"),
            sinks=dev.get(b + "attn_sinks.weight"))

    _ATTN_PROJECTIONS = ("wq", "wk", "wv", "wo")

    def _pad(self, L: _MoeLayer) -> None:
        """The attention projections' padded copies (Layers._pad); the experts run on the matvecs only."""
        from cukern.matmul import GEMM_QTYPES
        for name in self._ATTN_PROJECTIONS:
            w = getattr(L, name)
            if w.qtype in GEMM_QTYPES and w.row_bytes % 16:
                L.padded[name] = self.gemm.pad_rows(w)

    def _pack(self, L: _MoeLayer) -> None:
        for name in self._ATTN_PROJECTIONS:
            if self.gemm.packable(getattr(L, name)):
                L.packed[name] = self.gemm.pack(getattr(L, name))

    # ------------------------------------------------------------------ layers
    def _attn_kwargs(self, i: int) -> dict:
        sinks = self.layers[i].sinks
        return {} if sinks is None else {"sinks": sinks}

    def _normed_path(self, n: int) -> bool:
        return False

    def _layers(self, buf, attend, positions, seq_ids, pos_mode: str, stream):
        """Every layer over buf's rows (the embedded tokens in buf.x); leaves the final-normed hidden state
        in buf.h. ``attend(i, q_rot, o)`` runs layer i's attention (with its sinks: _attn_kwargs)."""
        c, cache = self.cfg, self.cache
        self.ew.rms_norm(buf.x, self.layers[0].attn_norm, buf.h, eps=c.rms_eps, stream=stream)
        for i, L in enumerate(self.layers):
            with nvtx_range(f"layer {i}"):
                self._project(L, buf, stream)
                local = c.local_layers[i]
                self.ew.qk_norm_rope_kv_write(
                    buf.q3, buf.k3, buf.v3, L.q_norm, L.k_norm, buf.q_rot, cache.k_pools[i], cache.v_pools[i],
                    cache.page_table, positions, seq_ids, eps=c.rms_eps, neox=c.rope_neox, freq_base=c.rope_base,
                    freqs=self.rope_freqs[local], pos_mode=pos_mode, stream=stream, **self.rope_kwargs)
                attend(i, buf.q_rot, buf.o)
                self._matmul(L.wo, buf.o2, buf.proj, stream, self._gemm_copy(L, "wo", buf.n))
                if L.bo is not None:
                    self.ew.bias_add(buf.proj, L.bo, buf.proj, stream=stream)
                self.ew.residual_rms_norm(buf.proj, buf.x, L.ffn_norm, buf.h, eps=c.rms_eps, stream=stream)
                self.moe.run(L.moe, buf.h, buf.proj, stream)
                nxt = self.layers[i + 1].attn_norm if i + 1 < c.n_layers else self.output_norm
                self.ew.residual_rms_norm(buf.proj, buf.x, nxt, buf.h, eps=c.rms_eps, stream=stream)

    # ------------------------------------------------------------------ errors
    def check_errors(self) -> None:
        """Raise :class:`MoeRoutingError` (naming the model file) if a MoE kernel flagged an expert id out of
        range since the last check, and clear the flag. Synchronises: call it between steps, not in one."""
        try:
            self.mm.check_errors()
        except DeviceError as e:
            raise MoeRoutingError(f"{self.model.path}: {e}") from None

    def generate(self, prompts, max_new_tokens: int, **kwargs):
        """:meth:`Transformer.generate`, then :meth:`check_errors` (the routing of every step it ran)."""
        out = super().generate(prompts, max_new_tokens, **kwargs)
        self.check_errors()
        return out
