"""The varlen backward of AttentionDispatch (a mixin): dQ, dK, dV of :meth:`flash_attn_varlen` from its output
and natural-log LSE (kernels: ``cuda_src/attention/varlen_bwd.cuh``, units ``attention_bwd_{f16,bf16}``; the
wgmma ``bwd_dkdv_wg`` of ``varlen_bwd_wg.cuh``, units ``attention_bwd_wg_{f16,bf16}``, sm_90a).

Launches, all on one stream: ``bwd_preprocess`` (D = rowsum(dO * O), and the f32 dQ accumulator zeroed), then
``bwd_dkdv`` (parallel over K tiles, KV heads and sequences; dK and dV summed over a GQA group in registers),
then dQ: by default ``bwd_dkdv`` adds it with f32 atomics and ``bwd_dq_convert`` rounds it to the inputs'
type; ``deterministic=True`` computes it in ``bwd_dq`` instead (parallel over Q tiles, the same bits on every
run, about 40% more tensor-core work). On sm_90 ``bwd_dkdv_wg`` (wgmma) runs in place of ``bwd_dkdv`` by default,
in either dQ mode (``wgmma=False``: ``bwd_dkdv``). Design: docs/notes/attention.md.
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.attention.cache import BF16
from cukern.attention.common import _CTYPE, _F32, _I32, _SHORT, _causal_field, _check_kind, _scale_fields
from cukern.dispatch import check_array, check_int
from cukern.interop import like, tensors
from cukern.runtime import FamilySpec, KernelSpec

__all__ = ["BWD_HEAD_DIMS", "DKDV_ROWS", "Backward", "bwd_unit", "bwd_wg_unit"]

BWD_HEAD_DIMS = (64, 128)  # head_dim 256 would need 256 f32 accumulators of dK and dV per thread
_BWD_THREADS = 128
_CONVERT_THREADS = 256
# bwd_dkdv's compiled variants (warps, query rows per step, dQ by red.global.add.v4.f32): 4 warps only with
# 32-row steps (the 4-warp tile is for devices with 99 KB a block, where 64-row stages do not fit at D 128)
_DKDV_VARIANTS = ((4, 32, False), (4, 32, True), (8, 32, False), (8, 32, True), (8, 64, False), (8, 64, True))
DKDV_ROWS = (32, 64)  # bwd_dkdv's query rows per step (flash_attn_varlen_backward's dkdv_rows)


def bwd_unit(kind: str) -> FamilySpec:
    """The backward's unit for one element type (float16 or bfloat16)."""
    t = _CTYPE[kind]
    kernels = [KernelSpec(f"bwd_preprocess<{t}, {d}>", "BwdPreParams") for d in BWD_HEAD_DIMS]
    kernels += [KernelSpec(_dkdv_name(t, d, kw, qr, red4), "BwdParams") for d in BWD_HEAD_DIMS
                for kw, qr, red4 in _DKDV_VARIANTS]
    kernels += [KernelSpec(f"bwd_dq<{t}, {d}>", "BwdParams") for d in BWD_HEAD_DIMS]
    kernels.append(KernelSpec(f"bwd_dq_convert<{t}>", "BwdConvertParams"))
    return FamilySpec(f"attention_bwd_{_SHORT[kind]}", tuple(kernels), source="attention/varlen_bwd.cu",
                      params_header="attention/bwd_params.cuh")


def bwd_wg_unit(kind: str) -> FamilySpec:
    """The unit of bwd_dkdv_wg (Hopper wgmma, varlen_bwd_wg.cuh) for one element type: built for sm_90a on sm_90
    devices (dispatch's _SM90A_UNITS), a stub elsewhere."""
    t = _CTYPE[kind]
    kernels = tuple(KernelSpec(f"bwd_dkdv_wg<{t}, {d}>", "BwdParams") for d in BWD_HEAD_DIMS)
    return FamilySpec(f"attention_bwd_wg_{_SHORT[kind]}", kernels, source="attention/varlen_bwd_wg.cu",
                      params_header="attention/bwd_params.cuh")


def _dkdv_name(t: str, d: int, kw: int, qr: int, red4: bool) -> str:
    return f"bwd_dkdv<{t}, {d}, {kw}, {qr}, {'true' if red4 else 'false'}>"


def _bwd_shape(d: int, kw: int, bm: int = 32) -> dict:
    """Tiles and dynamic shared bytes of the backward kernels at head_dim d, bwd_dkdv with kw warps and bm query
    rows a step (BwdShape<d, kw, bm> in varlen_bwd.cuh; bwd_dq's tiles: BwdShape<d>)."""
    ld, bn, qm = d + 8, 16 * kw, 64
    qn = 64 if d <= 64 else 32
    return dict(kw=kw, bn=bn, bm=bm, qm=qm, qn=qn, dkdv_smem=((2 * bn + 4 * bm) * ld + bn * (bm + 8)) * 2,
                dq_smem=(2 * qm + 4 * qn) * ld * 2)


def _bwd_wg_shape(d: int) -> dict:
    """bwd_dkdv_wg's threads, keys of a block, query rows a step and dynamic shared bytes at head_dim d
    (BwdWgShape<d> in varlen_bwd_wg.cuh): 1 KB of alignment slack, K and V, two stages of Q and dO, dS^T."""
    bn, bm = 128, 64
    return dict(threads=256, bn=bn, bm=bm, smem=1024 + 2 * bn * d * 2 + 4 * bm * d * 2 + bn * bm * 2)


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
                                   deterministic: bool = False, dkdv_rows: int | None = None,
                                   dq_vector_atomics: bool | None = None, wgmma: bool | None = None, stream=None):
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
        dq_accum. Workspaces and outputs left None are allocated (cukern.interop). Returns (dq, dk, dv).

        Kernel variants (the same gradients up to rounding): ``dkdv_rows``, bwd_dkdv's query rows per step, 32
        or 64 (None: 64 where an 8-warp block's 64-row stages fit a block's shared memory, sm_80 and sm_90 at
        either head_dim, sm_86 / sm_89 at 64, else 32; 64 where it does not fit: ValueError).
        ``dq_vector_atomics`` (atomic mode): True adds dQ with red.global.add.v4.f32, one instruction per 4
        values (sm_90 only, else ValueError); False: scalar f32 atomics; None: the vector form on sm_90.
        ``wgmma``: True runs ``bwd_dkdv_wg`` (Hopper warpgroup MMA, varlen_bwd_wg.cuh: 128-key tiles of two
        warpgroups, 64-row steps, dQ by red.global.add.v4.f32, or by ``bwd_dq`` with ``deterministic=True``) in
        place of ``bwd_dkdv`` (sm_90 only, else ValueError; ``dkdv_rows`` must then be None or 64 and
        ``dq_vector_atomics`` None or True); False: ``bwd_dkdv``; None: ``bwd_dkdv_wg`` on sm_90 unless
        ``dkdv_rows=32`` or ``dq_vector_atomics=False`` ask for a ``bwd_dkdv`` tile, else ``bwd_dkdv``. The
        defaults are the fastest measured (docs/notes/attention.md)."""
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
        wg = self._dkdv_wgmma(kind, wgmma, dkdv_rows, dq_vector_atomics)
        sh = _bwd_shape(d, *((8, 64) if wg else self._dkdv_tile(d, dkdv_rows)))
        red4 = self._dq_red4(kind, dq_vector_atomics) and not deterministic
        n_k_tiles = -(-max_seqlen_k // (_bwd_wg_shape(d)["bn"] if wg else sh["bn"]))
        n_q_tiles = -(-max_seqlen_q // sh["qm"])
        if deterministic and n_q_tiles > 65535:
            raise ValueError(f"deterministic=True takes at most {65535 * sh['qm']} query rows per sequence, "
                             f"got max_seqlen_q {max_seqlen_q}")
        if n_k_tiles >= 2**31:
            raise ValueError(f"max_seqlen_k {max_seqlen_k} is too large")
        self._bwd_launch(kind, d, dq, dk, dv, delta, dq_accum, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                         b, h, hk, n_k_tiles, n_q_tiles, causal, fields, bool(deterministic), sh, red4, wg, stream)
        return dq, dk, dv

    def _dkdv_warps(self, d: int) -> int:
        """bwd_dkdv's warps: 8 (128-key tiles: every staged Q / dO tile and dQ atomic serves twice the keys of
        4 warps'; measured in docs/notes/attention.md) where their shared memory fits a block, else 4
        (head_dim 128 on sm_86 / sm_89, 99 KB a block)."""
        return 8 if self._dkdv_fits(d, 8, 32) else 4

    def _dkdv_fits(self, d: int, kw: int, bm: int) -> bool:
        """Whether bwd_dkdv's kw-warp, bm-row tile (dynamic and static shared bytes) fits a block."""
        sh = _bwd_shape(d, kw, bm)
        static = 2 * 2 * bm * 4  # lse_s and del_s: 2 stages of BM f32 each
        return sh["dkdv_smem"] + static <= self.max_shared_optin()

    def _dkdv_tile(self, d: int, rows) -> tuple[int, int]:
        """bwd_dkdv's (warps, query rows per step) for flash_attn_varlen_backward's ``dkdv_rows``."""
        if rows is None:
            rows = 64 if self._dkdv_fits(d, 8, 64) else 32
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows not in DKDV_ROWS:
            raise ValueError(f"dkdv_rows must be None or one of {DKDV_ROWS}, got {rows!r}")
        if rows == 32:
            return self._dkdv_warps(d), 32
        if not self._dkdv_fits(d, 8, 64):
            raise ValueError(f"dkdv_rows=64 at head_dim {d} needs {_bwd_shape(d, 8, 64)['dkdv_smem']} bytes of "
                             f"shared memory a block, more than this device's {self.max_shared_optin()}")
        return 8, 64

    def _dq_red4(self, kind: str, vector_atomics) -> bool:
        """Whether bwd_dkdv adds dQ with red.global.add.v4.f32 (flash_attn_varlen_backward's
        ``dq_vector_atomics``)."""
        if vector_atomics is not None and not isinstance(vector_atomics, (bool, np.bool_)):
            raise TypeError(f"dq_vector_atomics must be None, True or False, got {vector_atomics!r}")
        sm90 = self._units[f"attention_bwd_{_SHORT[kind]}"].is_sm90()
        if vector_atomics is None:
            return sm90
        if not vector_atomics:
            return False
        if not sm90:
            raise ValueError("dq_vector_atomics=True needs an sm_90 (Hopper) device")
        return True

    def _dkdv_wgmma(self, kind: str, wgmma, rows, vector_atomics) -> bool:
        """Whether dK and dV come from bwd_dkdv_wg (flash_attn_varlen_backward's ``wgmma``)."""
        if wgmma is not None and not isinstance(wgmma, (bool, np.bool_)):
            raise TypeError(f"wgmma must be None, True or False, got {wgmma!r}")
        if wgmma is None:  # the default: bwd_dkdv_wg on sm_90 where the other keywords allow it (the faster one)
            return (self._units[f"attention_bwd_wg_{_SHORT[kind]}"].is_sm90() and rows in (None, 64)
                    and vector_atomics is not False)
        if not wgmma:
            return False
        if not self._units[f"attention_bwd_wg_{_SHORT[kind]}"].is_sm90():
            raise ValueError("wgmma=True needs an sm_90 (Hopper) device")
        if rows is not None and rows != 64:
            raise ValueError(f"wgmma=True runs 64-row steps: dkdv_rows must be None or 64, got {rows!r}")
        if vector_atomics is not None and not vector_atomics:
            raise ValueError("wgmma=True adds dQ with red.global.add.v4.f32: dq_vector_atomics must be None or True")
        return True

    def _bwd_launch(self, kind, d, dq, dk, dv, delta, dq_accum, dout, q, k, v, out, lse, cu_q, cu_k, b, h, hk,
                    n_k_tiles, n_q_tiles, causal, fields, deterministic, sh, red4, wg, stream):
        unit = self._units[f"attention_bwd_{_SHORT[kind]}"]
        t = _CTYPE[kind]
        total_q = q.shape[0]
        n_rows = total_q * h
        rows_per_block = (_BWD_THREADS // 32) * (32 // (d // 8))
        pre = unit.struct("BwdPreParams").pack(n_rows=n_rows, zero_dq=int(not deterministic))
        acc = dq if deterministic else dq_accum  # (unused by the preprocess when deterministic)
        unit._launch(f"bwd_preprocess<{t}, {d}>", -(-n_rows // rows_per_block), _BWD_THREADS, (delta, acc, dout, out),
                     pre, stream=stream)
        common = dict(n_seqs=b, n_heads=h, n_kv_heads=hk, group=h // hk, causal=int(causal), **fields)
        p = unit.struct("BwdParams").pack(n_tiles=n_k_tiles, dq_atomic=int(not deterministic), **common)
        dkdv_args = (dk, dv, acc, q, k, v, dout, lse, delta, cu_q, cu_k)
        if wg:
            shw = _bwd_wg_shape(d)
            self._units[f"attention_bwd_wg_{_SHORT[kind]}"]._launch(
                f"bwd_dkdv_wg<{t}, {d}>", (n_k_tiles, hk, b), shw["threads"], dkdv_args, p, stream=stream,
                shared_mem=shw["smem"])
        else:
            unit._launch(_dkdv_name(t, d, sh["kw"], sh["bm"], red4), (n_k_tiles, hk, b), 32 * sh["kw"], dkdv_args,
                         p, stream=stream, shared_mem=sh["dkdv_smem"])
        if deterministic:
            p = unit.struct("BwdParams").pack(n_tiles=n_q_tiles, dq_atomic=0, **common)
            unit._launch(f"bwd_dq<{t}, {d}>", (h, b, n_q_tiles), _BWD_THREADS,
                         (dq, q, k, v, dout, lse, delta, cu_q, cu_k), p, stream=stream, shared_mem=sh["dq_smem"])
        else:
            n4 = total_q * h * d // 4
            blocks = min(-(-n4 // _CONVERT_THREADS), 8 * 65535)
            p = unit.struct("BwdConvertParams").pack(n4=n4, scale=fields["scale"])
            unit._launch(f"bwd_dq_convert<{t}>", blocks, _CONVERT_THREADS, (dq, dq_accum), p, stream=stream)
