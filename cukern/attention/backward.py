"""The varlen backward of AttentionDispatch (a mixin): dQ, dK, dV of :meth:`flash_attn_varlen` from its output
and natural-log LSE (kernels: ``cuda_src/attention/varlen_bwd.cuh``, units ``attention_bwd_{f16,bf16}``).

Launches, all on one stream: ``bwd_preprocess`` (D = rowsum(dO * O), and the f32 dQ accumulator zeroed), then
``bwd_dkdv`` (parallel over K tiles, KV heads and sequences; dK and dV summed over a GQA group in registers),
then dQ: by default ``bwd_dkdv`` adds it with f32 atomics and ``bwd_dq_convert`` rounds it to the inputs'
type; ``deterministic=True`` computes it in ``bwd_dq`` instead (parallel over Q tiles, the same bits on every
run, about 40% more tensor-core work). Design: docs/notes/attention.md.
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.attention.cache import BF16
from cukern.attention.common import _CTYPE, _F32, _I32, _SHORT, _causal_field, _check_kind, _scale_fields
from cukern.dispatch import check_array, check_int
from cukern.interop import like, tensors
from cukern.runtime import FamilySpec, KernelSpec

__all__ = ["BWD_HEAD_DIMS", "Backward", "bwd_unit"]

BWD_HEAD_DIMS = (64, 128)  # head_dim 256 would need 256 f32 accumulators of dK and dV per thread
_BWD_THREADS = 128
_CONVERT_THREADS = 256


def bwd_unit(kind: str) -> FamilySpec:
    """The backward's unit for one element type (float16 or bfloat16)."""
    t = _CTYPE[kind]
    kernels = [KernelSpec(f"bwd_preprocess<{t}, {d}>", "BwdPreParams") for d in BWD_HEAD_DIMS]
    kernels += [KernelSpec(f"bwd_dkdv<{t}, {d}, {kw}>", "BwdParams") for d in BWD_HEAD_DIMS for kw in (4, 8)]
    kernels += [KernelSpec(f"bwd_dq<{t}, {d}>", "BwdParams") for d in BWD_HEAD_DIMS]
    kernels.append(KernelSpec(f"bwd_dq_convert<{t}>", "BwdConvertParams"))
    return FamilySpec(f"attention_bwd_{_SHORT[kind]}", tuple(kernels), source="attention/varlen_bwd.cu",
                      params_header="attention/bwd_params.cuh")


def _bwd_shape(d: int, kw: int) -> dict:
    """Tiles and dynamic shared bytes of the backward kernels at head_dim d, bwd_dkdv with kw warps
    (BwdShape<d, kw> in varlen_bwd.cuh; bwd_dq's tiles: BwdShape<d>)."""
    ld, bn, bm, qm = d + 8, 16 * kw, 32, 64
    qn = 64 if d <= 64 else 32
    return dict(kw=kw, bn=bn, bm=bm, qm=qm, qn=qn, dkdv_smem=((2 * bn + 4 * bm) * ld + bn * (bm + 8)) * 2,
                dq_smem=(2 * qm + 4 * qn) * ld * 2)


def _dq_accum_shape(get):
    """dq_accum's shape: q's ([total_q, n_heads, head_dim]), or (0,) with deterministic=True (not used)."""
    return (0,) if get("deterministic") else get("q").shape


class Backward:
    """AttentionDispatch's varlen backward (a mixin over its units)."""

    @tensors(dq=like("q"), dk=like("k"), dv=like("v"), delta=like("lse"),
             dq_accum=like("q", shape=_dq_accum_shape, dtype=np.float32))
    def flash_attn_varlen_backward(self, dout: cupy.ndarray, q: cupy.ndarray, k: cupy.ndarray, v: cupy.ndarray,
                                   out: cupy.ndarray, lse: cupy.ndarray, cu_seqlens_q: cupy.ndarray,
                                   cu_seqlens_k: cupy.ndarray, max_seqlen_q: int, max_seqlen_k: int, *,
                                   scale: float | None = 0.0, causal: bool = False,
                                   causal_variant: str = "lower_right", window_left: int = -1,
                                   softcap: float = 0.0, dq: cupy.ndarray | None = None,
                                   dk: cupy.ndarray | None = None, dv: cupy.ndarray | None = None,
                                   delta: cupy.ndarray | None = None, dq_accum: cupy.ndarray | None = None,
                                   deterministic: bool = False, stream=None):
        """Gradients of :meth:`flash_attn_varlen` (FlashAttention-2's varlen backward) on tensor cores.

        dout, q, out, dq: [total_q, n_heads, head_dim]; k, v, dk, dv: [total_k, n_kv_heads, head_dim]; float16
        or bfloat16 (uint16 bits), one dtype, head_dim 64 or 128; f32 accumulation. lse: [total_q, n_heads]
        f32, the forward's natural-log LSE (its ``lse=`` output; -inf or +inf for a row that saw no key, whose
        gradients are 0). cu_seqlens_q / cu_seqlens_k: [batch + 1] int32 prefix sums (device values, not read
        here). max_seqlen_q / max_seqlen_k: host bounds on any sequence's query / key count (they size the
        grids: rows or keys past them get no gradient). scale (0 or None: 1 / sqrt(head_dim)), causal,
        causal_variant ("lower_right" or "upper_left", as :meth:`flash_attn_varlen` takes it), window_left and
        softcap must be the forward's. GQA: dK and dV of a KV head are summed over its group's
        query heads. A forward run with ``sinks`` gets the right dQ, dK and dV (the sink is in its LSE); the
        sinks' own gradient is not computed.

        delta: [total_q, n_heads] f32 workspace, rowsum(dO * O) on return. dq_accum: [total_q, n_heads,
        head_dim] f32 workspace of the default mode, where dQ is summed with f32 atomics (the order of the sum,
        so dQ's last bits, may vary from run to run; dK and dV never do). ``deterministic=True`` computes dQ
        in a separate pass parallel over query tiles instead (the same bits every run, more work) and needs no
        dq_accum. Workspaces and outputs left None are allocated (cukern.interop). Returns (dq, dk, dv)."""
        kind = _check_kind("q", q, ("float16", BF16))
        for name, a in (("dout", dout), ("k", k), ("v", v), ("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
            _check_kind(name, a, (kind,))  # q's dtype
        check_array("q", q, ndim=3, align=16)
        total_q, h, d = q.shape
        check_array("k", k, ndim=3, align=16)
        total_k, hk = k.shape[0], k.shape[1]
        if k.shape[2] != d:
            raise ValueError(f"k has head_dim {k.shape[2]}, q has {d}")
        if d not in BWD_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {BWD_HEAD_DIMS} for the backward, got {d}")
        if hk < 1 or h % hk:
            raise ValueError(f"n_heads ({h}) must be a multiple of n_kv_heads ({hk})")
        if h > 65535:
            raise ValueError(f"at most 65535 heads, got {h}")
        check_array("v", v, shape=k.shape, align=16)
        for name, a in (("dout", dout), ("out", out)):
            check_array(name, a, shape=q.shape, align=16)
        check_array("dq", dq, shape=q.shape, align=16)
        for name, a in (("dk", dk), ("dv", dv)):
            check_array(name, a, shape=k.shape, align=4)
        check_array("lse", lse, dtype=_F32, shape=(total_q, h))
        check_array("delta", delta, dtype=_F32, shape=(total_q, h))
        check_array("cu_seqlens_q", cu_seqlens_q, dtype=_I32, ndim=1)
        b = cu_seqlens_q.shape[0] - 1
        if b < 1 or b > 65535:
            raise ValueError(f"cu_seqlens_q must hold batch + 1 entries, 1 <= batch <= 65535, got {b + 1}")
        check_array("cu_seqlens_k", cu_seqlens_k, dtype=_I32, shape=(b + 1,))
        max_seqlen_q = check_int("max_seqlen_q", max_seqlen_q, 1)
        max_seqlen_k = check_int("max_seqlen_k", max_seqlen_k, 1)
        if total_q == 0 or total_k == 0:
            raise ValueError("q and k must hold at least one token")
        if total_q * h * d >= 2**31:
            raise ValueError(f"at most 2^31 - 1 values of q per call, got {total_q * h * d}")
        if not isinstance(deterministic, (bool, np.bool_)):
            raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
        causal = _causal_field(causal, causal_variant)
        if not deterministic:
            check_array("dq_accum", dq_accum, dtype=_F32, shape=q.shape, align=16)
        scale = 0.0 if scale is None else float(scale)
        fields = _scale_fields(scale, d, float(softcap), window_left)
        fields["scale"] = scale if scale > 0 else 1.0 / np.sqrt(d)
        sh = _bwd_shape(d, self._dkdv_warps(d))
        n_k_tiles = -(-max_seqlen_k // sh["bn"])
        n_q_tiles = -(-max_seqlen_q // sh["qm"])
        if deterministic and n_q_tiles > 65535:
            raise ValueError(f"deterministic=True takes at most {65535 * sh['qm']} query rows per sequence, "
                             f"got max_seqlen_q {max_seqlen_q}")
        if n_k_tiles >= 2**31:
            raise ValueError(f"max_seqlen_k {max_seqlen_k} is too large")
        self._bwd_launch(kind, d, dq, dk, dv, delta, dq_accum, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                         b, h, hk, n_k_tiles, n_q_tiles, causal, fields, bool(deterministic), stream)
        return dq, dk, dv

    def _dkdv_warps(self, d: int) -> int:
        """bwd_dkdv's warps: 8 (128-key tiles: every staged Q / dO tile and dQ atomic serves twice the keys of
        4 warps'; measured in docs/notes/attention.md) where their shared memory fits a block, else 4
        (head_dim 128 on sm_86 / sm_89, 99 KB a block)."""
        sh = _bwd_shape(d, 8)
        static = 2 * 2 * sh["bm"] * 4  # lse_s and del_s: 2 stages of BM f32 each
        return 8 if sh["dkdv_smem"] + static <= self.max_shared_optin() else 4

    def _bwd_launch(self, kind, d, dq, dk, dv, delta, dq_accum, dout, q, k, v, out, lse, cu_q, cu_k, b, h, hk,
                    n_k_tiles, n_q_tiles, causal, fields, deterministic, stream):
        unit = self._units[f"attention_bwd_{_SHORT[kind]}"]
        t = _CTYPE[kind]
        sh = _bwd_shape(d, self._dkdv_warps(d))
        total_q = q.shape[0]
        n_rows = total_q * h
        rows_per_block = (_BWD_THREADS // 32) * (32 // (d // 8))
        pre = unit.struct("BwdPreParams").pack(n_rows=n_rows, zero_dq=int(not deterministic))
        acc = dq if deterministic else dq_accum  # (unused by the preprocess when deterministic)
        unit._launch(f"bwd_preprocess<{t}, {d}>", -(-n_rows // rows_per_block), _BWD_THREADS, (delta, acc, dout, out),
                     pre, stream=stream)
        common = dict(n_seqs=b, n_heads=h, n_kv_heads=hk, group=h // hk, causal=int(causal), **fields)
        p = unit.struct("BwdParams").pack(n_tiles=n_k_tiles, dq_atomic=int(not deterministic), **common)
        unit._launch(f"bwd_dkdv<{t}, {d}, {sh['kw']}>", (n_k_tiles, hk, b), 32 * sh["kw"],
                     (dk, dv, acc, q, k, v, dout, lse, delta, cu_q, cu_k), p, stream=stream,
                     shared_mem=sh["dkdv_smem"])
        if deterministic:
            p = unit.struct("BwdParams").pack(n_tiles=n_q_tiles, dq_atomic=0, **common)
            unit._launch(f"bwd_dq<{t}, {d}>", (h, b, n_q_tiles), _BWD_THREADS,
                         (dq, q, k, v, dout, lse, delta, cu_q, cu_k), p, stream=stream, shared_mem=sh["dq_smem"])
        else:
            n4 = total_q * h * d // 4
            blocks = min(-(-n4 // _CONVERT_THREADS), 8 * 65535)
            p = unit.struct("BwdConvertParams").pack(n4=n4, scale=fields["scale"])
            unit._launch(f"bwd_dq_convert<{t}>", blocks, _CONVERT_THREADS, (dq, dq_accum), p, stream=stream)
