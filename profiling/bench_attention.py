"""Attention family benchmark: decode GB/s against the copy ceiling, prefill / varlen (forward and backward)
TFLOP/s against torch SDPA's flash and cuDNN backends, all measured in the same run.

Counted work:
* decode: bytes of K and V read (every cached token of every KV head once) + Q read + O written;
  % is of the device-to-device copy bandwidth measured in this run; the peer is
  ``torch.nn.functional.scaled_dot_product_attention`` (its default backend choice, contiguous
  f16 K/V, ``enable_gqa``), both timed through CUDA graphs of back-to-back calls, as a decode loop
  runs them; K/V rotate over enough layers to exceed the 50 MB L2 several times. "pdl" rows:
  the same plan launched by ``AttentionDispatch(pdl=True)`` (each call overlaps the previous one's
  tail); "contiguous" rows: ``flash_attn_decode_contiguous`` over head-major K/V (the SDPA peer's own
  tensors, read in place) against the paged decode of the same shape and SDPA; "sinks" rows: the paged
  decode with a sinks buffer of every layer (NaN heads) at the layer's ``sink_offset`` against the same
  decode without;
* prefill / varlen: causal FLOPs 2 * B * H * L^2 * D (QK^T and PV over the lower triangle), or
  4 * B * H * L^2 * D non-causal; % is of the fastest torch SDPA backend in this run (flash =
  FlashAttention-2, cuDNN), "x peer" is the ratio to the flash backend; "varlen f32" (the SIMT kernel) against
  SDPA's f32 backends (efficient, math; given K/V of as many heads as the queries), "upper_left" (torch's
  ``is_causal`` alignment) against SDPA's ``is_causal``. Ours and the peers are
  timed in alternating rounds (the minimum of each over the rounds), so a clock drift during the
  run reaches every side alike;
* varlen backward (dQ by f32 atomics: the default, on sm_90 the wgmma bwd_dkdv_wg, and ``wgmma=False``,
  the mma.sync bwd_dkdv, the default elsewhere; and the deterministic mode): 2.5x the forward's FLOPs
  (traffic.attention_backward_flops), against the backward of SDPA's flash and cuDNN backends
  (``torch.autograd.grad`` of an output their forward made once).

The rows are the table of ``specs(quick, only)`` (bytes and FLOPs from cukern.traffic); ``s`` is one
input set (a decode set per cache layer, the rotation).

Run: PYTHONPATH=. python profiling/bench_attention.py [--quick] [--only decode|prefill] [--json out.json]
(``--only prefill``: the prefill and varlen rows)
"""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import cupy
import numpy as np

from cukern import traffic
from cukern.attention import AttentionDispatch, PagedKVCache
from cukern.benchmark import Peer, RowSpec, Timing, measure_ceilings, run_specs, script_main

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # the peer is optional; rows then show no ratio
    torch = None

_L2_BYTES = 50 << 20
_ROUNDS = 3  # alternating timing rounds of ours and the peers (decode, prefill, varlen); each keeps its best
QUICK_DECODE = [(1, 8192, 32, 8, 128), (1, 32768, 32, 8, 128), (1, 131072, 32, 8, 128), (32, 4096, 32, 8, 128),
                (1, 8192, 8, 1, 256), (1, 8192, 4, 1, 256), (1, 512, 4, 1, 256)]  # the last: Gemma 3 270M's step
DECODE = [(1, 1024, 32, 8, 128), (1, 8192, 32, 8, 128), (1, 32768, 32, 8, 128), (1, 131072, 32, 8, 128),
          (8, 4096, 32, 8, 128), (32, 4096, 32, 8, 128), (64, 4096, 32, 8, 128), (1, 32768, 8, 1, 256),
          (1, 8192, 8, 1, 256), (1, 8192, 4, 1, 256), (1, 512, 4, 1, 256), (32, 4096, 4, 1, 256)]  # (B, KV, H, HK, D)
QUICK_PREFILL = [(4, 4096, 32, 32, 128), (1, 1024, 32, 32, 128), (4, 4096, 16, 16, 256)]
PREFILL = [(16, 512, 32, 32, 128), (8, 1024, 32, 32, 128), (4, 2048, 32, 32, 128), (4, 4096, 32, 32, 128),
           (2, 8192, 32, 32, 128), (1, 16384, 32, 32, 128), (8, 1024, 16, 16, 256), (4, 4096, 16, 16, 256),
           (1, 16384, 16, 16, 256)]  # (B, L, H, HK, D)
VARLEN = [(4, 4096, 32, 32, 128, True), (4, 4096, 32, 8, 128, False)]  # the first alone with --quick
VARLEN_BWD = [(4, 4096, 32, 32, 128, True), (4, 4096, 32, 32, 128, False)]  # the first alone with --quick
SPLITS = (16, 48, 64)  # the split-count sweep at the headline decode shape (the default is its row above)
# the contiguous decode (Llama-8B, Gemma 3 1B, gpt-oss, a batch; the first alone with --quick); the sink rows at
# gpt-oss's heads
CONTIGUOUS = [(1, 8192, 32, 8, 128), (1, 8192, 4, 1, 256), (1, 8192, 64, 8, 64), (8, 4096, 32, 8, 128)]
SINKS = [(1, 8192, 64, 8, 64), (8, 4096, 64, 8, 64)]
VARLEN_F32 = [(4, 1024, 32, 8, 128, True)]  # f32 q/k/v (the SIMT kernel) against SDPA's f32 backends
UPPER_LEFT = [(4, 4096, 32, 8, 128, True)]  # causal_variant="upper_left" against SDPA's is_causal


def specs(quick: bool, only: str | None = None) -> list[RowSpec]:
    """Every row, in the order it runs (``only``: "decode", or "prefill" for the prefill and varlen rows)."""
    out = []
    if only != "prefill":
        out += [r for shape in (QUICK_DECODE if quick else DECODE) for r in _decode(*shape)]
        out += [r for n in SPLITS for r in _decode(1, 8192, 32, 8, 128, n_splits=n)]
        variants = CONTIGUOUS[:1] if quick else CONTIGUOUS + [s for s in SINKS if s not in CONTIGUOUS]
        out += [r for shape in variants for r in _decode_variants(*shape, contiguous=shape in CONTIGUOUS,
                                                                  sinks=not quick and shape in SINKS)]
    if only != "decode":
        out += [_tc("prefill paged f16", _prefill_sets, b, L, h, hk, d, True)
                for b, L, h, hk, d in (QUICK_PREFILL if quick else PREFILL)]
        out += [_tc("varlen f16 (+lse)", _varlen_sets, *shape) for shape in VARLEN[:1 if quick else None]]
        out += [r for shape in VARLEN_BWD[:1 if quick else None] for r in _bwd(*shape)]
        out += [_tc("varlen f32 (+lse)", _varlen_sets, *shape, "float32", backends=("efficient", "math"))
                for shape in ([] if quick else VARLEN_F32)]
        out += [_tc("varlen f16 upper_left (+lse)", _varlen_sets, *shape, "float16", "upper_left")
                for shape in ([] if quick else UPPER_LEFT)]
    return out


def _decode(b, kv_len, h, hk, d, n_splits=None):
    """A decode shape: the plan launched by AttentionDispatch() and by AttentionDispatch(pdl=True) (each
    call overlapping the previous one's tail), timed through CUDA graphs of back-to-back calls over
    rotating layers, with torch SDPA at the same shape as the peer of both, all in alternating rounds;
    a sweep row (``n_splits`` forced) alone, without peer."""
    g = (_decode_sets, b, kv_len, h, hk, d, n_splits)
    shape = f"B{b} KV{kv_len} {h}/{hk} D{d} s{{n_splits}} w{{warps}}"  # the plan's, once made
    timing = Timing(n_inner=max(8, 2 * _layers(b, kv_len, hk, d)))
    nbytes = (traffic.attention_decode, b, kv_len, h, hk, d)
    if n_splits is not None:
        return [RowSpec(f"decode splits={n_splits} (graph)", shape, g, _decode_call, nbytes, timing=timing)]
    sdpa = (Peer("torch SDPA (default)", lambda s: F.scaled_dot_product_attention(s.tq, s.tk, s.tv, enable_gqa=s.gqa),
                 how="torch_graph_or_eager"),)
    return [RowSpec("decode (graph)", shape, g, _decode_call, nbytes, peers=sdpa, timing=timing, rounds=_ROUNDS, pick=min),
            RowSpec("decode pdl (graph)", shape, g, lambda s: s.attn_pdl.flash_attn_decode(s.plan, s.layer, s.q, s.out),
                    nbytes, peers=sdpa, timing=timing, rounds=_ROUNDS, pick=min)]


_BACKENDS = {"flash": ("SDPA flash", "FLASH_ATTENTION"), "cudnn": ("SDPA cuDNN", "CUDNN_ATTENTION"),
             "efficient": ("SDPA efficient", "EFFICIENT_ATTENTION"), "math": ("SDPA math", "MATH")}


def _tc(kernel, inputs, b, L, h, hk, d, causal, *extra, backends=("flash", "cudnn")):
    """Our kernel and torch SDPA's ``backends`` at one shape, timed in alternating rounds; % ceil is of the
    fastest backend (its time / ours), "x peer" the ratio to the first. ``extra``: more arguments of
    ``inputs`` (the varlen's dtype and causal variant)."""
    return RowSpec(kernel, f"B{b} L{L} {h}/{hk} D{d}{' causal' if causal else ''}",
                   (inputs, b, L, h, hk, d, causal, *extra), lambda s: s.run(),
                   flops=(traffic.attention_prefill_flops, b, h, L, d, causal),
                   peers=tuple(Peer(_BACKENDS[n][0], lambda s, n=n: _sdpa(s, getattr(SDPBackend, _BACKENDS[n][1])),
                                    torch=True) for n in backends),
                   timing=Timing("eager", n_warmup=3, n_repeat=10), rounds=_ROUNDS, pick=min, ceiling="peers")


def _decode_variants(b, kv_len, h, hk, d, *, contiguous, sinks):
    """The decode over head-major contiguous K/V (flash_attn_decode_contiguous) against the paged decode of the
    same shape and torch SDPA on the same contiguous K/V; with ``sinks`` the paged decode with a sinks buffer
    of every layer (every fourth head NaN: none) at the layer's ``sink_offset`` against the decode without."""
    g, timing = (_variant_sets, b, kv_len, h, hk, d), Timing(n_inner=max(8, 2 * _layers(b, kv_len, hk, d)))
    nbytes, kw = (traffic.attention_decode, b, kv_len, h, hk, d), dict(timing=timing, rounds=_ROUNDS, pick=min)
    rows = []
    if contiguous:
        sdpa = Peer("torch SDPA (default)", lambda s: F.scaled_dot_product_attention(s.tq, s.tk, s.tv, enable_gqa=s.gqa),
                    how="torch_graph_or_eager")
        rows.append(RowSpec("decode contiguous (graph)", f"B{b} KV{kv_len} {h}/{hk} D{d} s{{c_splits}} w{{c_warps}}", g,
                            lambda s: s.attn.flash_attn_decode_contiguous(s.cplan, s.q, s.k, s.v, s.lengths, s.out), nbytes,
                            peers=(Peer("paged flash_attn_decode", _decode_call), sdpa), **kw))
    if sinks:
        rows.append(RowSpec("decode sinks (graph)", f"B{b} KV{kv_len} {h}/{hk} D{d} s{{n_splits}} w{{warps}}", g,
                            lambda s: s.attn.flash_attn_decode(s.plan, s.layer, s.q, s.out, sinks=s.sinks,
                                                               sink_offset=s.layer * h), nbytes,
                            peers=(Peer("decode without sinks", _decode_call),), **kw))
    return rows


def _bwd(b, L, h, hk, d, causal):
    """The varlen backward (dQ with atomics, and deterministic) against the backward of torch SDPA's flash and
    cuDNN backends (their forward run once under the backend, the backward timed through autograd.grad);
    FLOPs 2.5x the forward's."""
    shape = f"B{b} L{L} {h}/{hk} D{d}{' causal' if causal else ''}"
    peers = (Peer("SDPA flash bwd", lambda s: _sdpa_bwd(s, "flash"), torch=True),
             Peer("SDPA cuDNN bwd", lambda s: _sdpa_bwd(s, "cudnn"), torch=True))
    kw = dict(flops=(traffic.attention_backward_flops, b, h, L, d, causal), peers=peers,
              timing=Timing("eager", n_warmup=3, n_repeat=10), rounds=_ROUNDS, pick=min, ceiling="peers")
    g = (_varlen_bwd_sets, b, L, h, hk, d, causal)
    # the default (bwd_dkdv_wg on sm_90) and the mma.sync bwd_dkdv (the default elsewhere: the same kernel twice there)
    return [RowSpec("varlen bwd f16", shape, g, lambda s: s.run(False), **kw),
            RowSpec("varlen bwd mma.sync f16", shape, g, lambda s: s.run(False, wgmma=False), **kw),
            RowSpec("varlen bwd deterministic f16", shape, g, lambda s: s.run(True), **kw)]


def _sdpa_bwd(s, backend: str):
    out = s.tout[backend]
    if out is None:
        raise RuntimeError(f"torch SDPA's {backend} backend did not run this shape's forward")
    torch.autograd.grad(out, (s.tq, s.tk, s.tv), s.tdo, retain_graph=True)


def _decode_call(s):
    s.attn.flash_attn_decode(s.plan, s.layer, s.q, s.out)


def _sdpa(s, backend):
    with sdpa_kernel(backend):
        F.scaled_dot_product_attention(s.tq, s.tk, s.tv, is_causal=s.causal, enable_gqa=s.gqa)


def _layers(b, kv_len, hk, d) -> int:
    """Cache layers to rotate over: enough to exceed the L2 four times (at most 16)."""
    return max(1, min(16, math.ceil(4 * _L2_BYTES / traffic.kv_cache(b, kv_len, hk, d))))


# ------------------------------------------------------------------ input sets
def _fill_pools(cache: PagedKVCache, rng) -> None:
    for pool in (*cache.k_pools, *cache.v_pools):
        pool[...] = rng.standard_normal(pool.shape, dtype=cupy.float32).astype(pool.dtype)


def _decode_sets(ctx, b, kv_len, h, hk, d, n_splits):
    """One set per cache layer (page size 16); torch's contiguous f16 K/V per layer for the peer."""
    n_layers, page = _layers(b, kv_len, hk, d), 16
    cache = PagedKVCache(n_layers, b * -(-kv_len // page), page, hk, d, max_seqs=b)
    _fill_pools(cache, ctx.rng)
    slots = [cache.add(kv_len) for _ in range(b)]
    plan = ctx.attn.plan_decode(cache, slots, h, n_splits=n_splits)
    q = ctx.rng.standard_normal((b, h, d), dtype=cupy.float32)
    shared = dict(attn=ctx.attn, attn_pdl=ctx.attn_pdl, cache=cache, plan=plan, q=q, out=cupy.empty_like(q),
                  n_splits=plan.n_splits, warps=plan.warps, gqa=hk != h)
    tkv = [(None, None)] * n_layers
    if torch is not None and n_splits is None:
        shared["tq"] = torch.randn(b, h, 1, d, device="cuda", dtype=torch.float16)
        tkv = [(torch.randn(b, hk, kv_len, d, device="cuda", dtype=torch.float16),
                torch.randn(b, hk, kv_len, d, device="cuda", dtype=torch.float16)) for _ in range(n_layers)]
    return [SimpleNamespace(layer=i, tk=tkv[i][0], tv=tkv[i][1], **shared) for i in range(n_layers)]


def _variant_sets(ctx, b, kv_len, h, hk, d):
    """The decode sets (one per cache layer) with, per layer, contiguous K/V [b, hk, kv_len, d] f16 (the SDPA
    peer's tensors, read in place) and the contiguous plan; a sinks buffer of every layer's heads."""
    sets = _decode_sets(ctx, b, kv_len, h, hk, d, None)
    cplan = ctx.attn.plan_decode_contiguous(b, h, hk, d, kv_len)
    sinks = ctx.rng.standard_normal(len(sets) * h, dtype=cupy.float32)
    sinks[::4] = cupy.nan
    for s in sets:
        if s.tk is not None:
            k, v = cupy.from_dlpack(s.tk), cupy.from_dlpack(s.tv)
        else:
            k, v = (ctx.rng.standard_normal((b, hk, kv_len, d), dtype=cupy.float32).astype(cupy.float16) for _ in "kv")
        s.__dict__.update(k=k, v=v, cplan=cplan, lengths=cupy.full(b, kv_len, cupy.int32), c_splits=cplan.n_splits,
                          c_warps=cplan.warps, sinks=sinks)
    return sets


def _sdpa_inputs(b, L, h, hk, d, causal, dtype="float16") -> dict:
    """torch's q, k, v ([B, H, L, D] of ``dtype``) for the SDPA peers; f32: K/V of H heads (no enable_gqa,
    which the efficient backend does not take)."""
    if torch is None:
        return {}
    dt, hk = getattr(torch, dtype), hk if dtype == "float16" else h
    return dict(tq=torch.randn(b, h, L, d, device="cuda", dtype=dt), tk=torch.randn(b, hk, L, d, device="cuda", dtype=dt),
                tv=torch.randn(b, hk, L, d, device="cuda", dtype=dt), causal=causal, gqa=hk != h)


def _prefill_sets(ctx, b, L, h, hk, d, causal):
    """A paged batched prefill of b sequences of L tokens (page size 64)."""
    page = 64
    cache = PagedKVCache(1, b * -(-L // page), page, hk, d, max_seqs=b)
    _fill_pools(cache, ctx.rng)
    slots = [cache.add(L) for _ in range(b)]
    plan = ctx.attn.plan_batched(cache, slots, [L] * b)
    q = ctx.rng.standard_normal((b * L, h, d), dtype=cupy.float32).astype(cupy.float16)
    out = cupy.empty_like(q)
    return [SimpleNamespace(cache=cache, run=lambda: ctx.attn.flash_attn_batched(plan, 0, q, out, causal=causal),
                            **_sdpa_inputs(b, L, h, hk, d, causal))]


def _varlen_sets(ctx, b, L, h, hk, d, causal, dtype="float16", variant="lower_right"):
    """A varlen forward (with LSE) of b packed sequences of L tokens of ``dtype``, causal by ``variant``."""
    q, k, v = (ctx.rng.standard_normal((b * L, n, d), dtype=cupy.float32).astype(dtype) for n in (h, hk, hk))
    cu = cupy.asarray(np.arange(b + 1, dtype=np.int32) * L)
    out, lse = cupy.empty_like(q), cupy.empty((b * L, h), cupy.float32)
    return [SimpleNamespace(run=lambda: ctx.attn.flash_attn_varlen(q, k, v, cu, cu, out, max_seqlen_q=L, causal=causal,
                                                                   causal_variant=variant, lse=lse),
                            **_sdpa_inputs(b, L, h, hk, d, causal, dtype))]


def _varlen_bwd_sets(ctx, b, L, h, hk, d, causal):
    """A varlen backward of b packed sequences of L tokens from our forward's output and LSE (outputs and
    workspaces allocated once); torch's q, k, v with gradients and each backend's forward output for the peers."""
    q, k, v, do = (ctx.rng.standard_normal((b * L, n, d), dtype=cupy.float32).astype(cupy.float16)
                   for n in (h, hk, hk, h))
    cu = cupy.asarray(np.arange(b + 1, dtype=np.int32) * L)
    out, lse = cupy.empty_like(q), cupy.empty((b * L, h), cupy.float32)
    ctx.attn.flash_attn_varlen(q, k, v, cu, cu, out, max_seqlen_q=L, causal=causal, lse=lse)
    grads = dict(dq=cupy.empty_like(q), dk=cupy.empty_like(k), dv=cupy.empty_like(v), delta=cupy.empty_like(lse),
                 dq_accum=cupy.empty(q.shape, cupy.float32))

    def run(deterministic: bool, wgmma: bool | None = None):
        ctx.attn.flash_attn_varlen_backward(do, q, k, v, out, lse, cu, cu, L, L, causal=causal,
                                            deterministic=deterministic, wgmma=wgmma, **grads)

    peer = {}
    if torch is not None:
        peer = _sdpa_inputs(b, L, h, hk, d, causal)
        for name in ("tq", "tk", "tv"):
            peer[name].requires_grad_()
        peer["tdo"] = torch.randn(b, h, L, d, device="cuda", dtype=torch.float16)
        peer["tout"] = {}
        for backend, which in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(which):
                    peer["tout"][backend] = F.scaled_dot_product_attention(
                        peer["tq"], peer["tk"], peer["tv"], is_causal=causal, enable_gqa=hk != h)
            except RuntimeError as e:
                print(f"note: torch SDPA {backend} forward failed ({e}); its backward peer is left out")
                peer["tout"][backend] = None
    return [SimpleNamespace(run=run, **peer)]


def _print_row(r) -> None:
    """Each row as it comes (a run cut short still shows what it measured)."""
    extra = f" peer {r.peer_us:.2f} us" if r.peer_us else ""
    rate = f"{r.gbs:,.0f} GB/s" if r.gbs else f"{r.tflops:.1f} TFLOP/s"
    print(f"row: {r.kernel} {r.shape}: {r.us:.2f} us {rate}{extra}", flush=True)


def bench(quick: bool = False, only: str | None = None) -> tuple[list, object]:
    ctx = SimpleNamespace(attn=AttentionDispatch(), attn_pdl=AttentionDispatch(pdl=True), rng=cupy.random.default_rng(0))
    ceil = measure_ceilings()
    rows = run_specs("attention", specs(quick, only), ceil, ctx, on_row=_print_row)
    if torch is None:
        print("note: torch is not installed here: the peer columns are empty")
    return rows, ceil


TITLE = 'attention (decode: % of copy bandwidth; prefill/varlen: % of the fastest torch SDPA)'


def main(argv=None) -> int:
    return script_main(bench, __doc__, title=TITLE, quick_help='a few shapes only', argv=argv,
                       add_args=lambda ap: ap.add_argument("--only", choices=("decode", "prefill"),
                                                           help="only the decode rows, or the prefill and varlen rows"),
                       bench_kwargs=lambda args: {"only": args.only})


if __name__ == "__main__":
    sys.exit(main())
