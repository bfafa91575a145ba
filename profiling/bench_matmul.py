"""Matmul family benchmark: quantized GEMM D = W B (W: M x K GGUF blocks, B: N token columns, f16)
against the pipelines a user would otherwise run, all measured in this run:

* ``deq+cuBLAS``: this family's dequantize-to-f16 kernel, then ``cupy.matmul`` (cuBLAS, f16 in,
  f32 accumulate) — the first peer, the one the "x peer" column of the first line compares with;
* ``cuBLAS f16 (pre-deq)``: ``cupy.matmul`` on an already-dequantized f16 matrix (a lower bound no
  quantized kernel is expected to beat at large N: it reads 2-4x the weight bytes but runs wgmma);
* ``dmmv batched`` (N <= 64): the dmmv family's matvec, 8 columns per launch.

Rows: ``gemm`` (f16 activations, f16 tensor cores: gemm_wgr on Hopper from N = 256, else gemm_f16) on the
GGUF bytes; on Hopper from N = 256 ``gemm packed`` (the same product on the weights repacked once at load,
``MatmulDispatch.pack``: the path for prefill; the packing is not timed, the peer's dequantization is, as
it runs on every call); ``quantize+gemm_q8`` (f32 activations quantized to Q8_1, then the int8
tensor-core GEMM; both launches timed), and at N = 512 the f16 path from f32 activations. The fused
gate+up GEMM (``gemm_glu``, 14336x4096 each) against two separate gemm launches, and at N = 512 on the pair
packed once at load (``pack_glu``) against dequantize + cuBLAS twice (without the activation: a lower bound).

FLOPs counted (cukern.traffic): 2 M N K per product. %ceil: of the cuBLAS f16 GEMM rate (8192^3) measured
in this run. Weights are rotated over enough copies to exceed the 50 MB L2 (8 at 4096x4096); from N = 512
the gemm rows and their peers are timed in turns, three rounds, medians (their ratio is what the rows are
read for, and a GPU's clock drifts under minutes of tensor load); times below ~50 us are
replayed from a CUDA graph (launch cost excluded), both for cukern and for the dmmv peer; longer
ones, and the cuBLAS peers (which CuPy cannot capture), are timed over 10 eager calls issued back
to back between two events (``time_stream_us``: the host's launch cost is hidden where the GPU
work is longer, as in a prefill loop, instead of idling the GPU before each call).
The rows are the table of ``specs(quick)``; ``s`` is one input set (a weight copy and the activations).
Run: PYTHONPATH=. python profiling/bench_matmul.py [--quick] [--json out.json]
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import cupy

from cukern import traffic
from cukern.benchmark import (Ceilings, Peer, RowSpec, Timing, measure_ceilings, measure_gemm_tflops, run_specs,
                              script_main)
from cukern.dmmv import QTYPES, DmmvDispatch, QWeight
from cukern.matmul import MatmulDispatch

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (M, K)
TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q5_0"]
NS = [16, 64, 128, 512, 2048]
_BY_NAME = {v[0]: q for q, v in QTYPES.items()}
_L2_ROTATE = 160 << 20  # bytes of weights rotated through: > 3x the 50 MB L2 (at most 8 copies: > 70 MB)
_ROUNDS = 3  # rounds of the in-turns timing from N = 512
WG_MIN_N = MatmulDispatch.WG_MIN_N
STREAM = Timing("stream")


def specs(quick: bool) -> list[RowSpec]:
    """Every row, in the order it runs."""
    shapes = [(14336, 4096)] if quick else SHAPES
    out = [r for m, k in shapes for name in (["Q4_K", "Q8_0"] if quick else TYPES)
           for n in ([16, 512, 2048] if quick else NS) for r in _gemm(name, m, k, n)]
    out += [r for name in (["Q4_K"] if quick else ["Q4_K", "Q8_0"]) for n in (64, 512) for r in _glu(name, n)]
    return out + [r for args in MOE_SHAPES for r in _moe(*args)]


def _gemm(name, m, k, n):
    """The gemm rows of one weight type, shape and N; the weights (rotating copies) shared over the N."""
    g, shape, flops = (_gemm_sets, name, m, k), f"{m}x{k} N={n}", (traffic.gemm_flops, m, n, k)
    timing, rounds = _timing(traffic.gemm_flops(m, n, k) / 150e12 * 1e6 + 5), _ROUNDS if n >= 512 else 1
    deq = Peer("deq+cuBLAS f16", lambda s: (s.mm.dequantize(s.w, s.dense), cupy.matmul(s.b16[n], s.dense.T, out=s.d16[n])),
               how="stream")
    peers = (deq, Peer("cuBLAS f16 (pre-deq)", lambda s: cupy.matmul(s.b16[n], s.dense.T, out=s.d16[n]), how="stream"))
    if n <= 64:
        peers += (Peer("dmmv batched (f32 x)", lambda s: s.dm.dmmv(s.w, s.b32[n], s.d[n]), how="graph"),)
    rows = [RowSpec(f"gemm {name}", shape, g, lambda s: s.mm.gemm(s.w, s.b16[n], s.d[n]), flops=flops, peers=peers,
                    timing=timing, rounds=rounds)]
    if n >= WG_MIN_N:  # the same product on the weights packed once at load (sm_90)
        rows.append(RowSpec(f"gemm packed {name}", shape, g, lambda s: s.mm.gemm(s.packed, s.b16[n], s.d[n]), flops=flops,
                            peers=peers, timing=timing, rounds=rounds, when=lambda s: s.packed is not None))
    # the int8 path: f32 activations quantized to Q8_1 (one pass), then the int8 GEMM
    rows.append(RowSpec(f"quantize+gemm_q8 {name}", shape, g,
                        lambda s: (s.mm.quantize_q8_1(s.b32[n], s.qa[n]), s.mm.gemm_q8(s.w, s.qa[n], s.d[n])), flops=flops,
                        peers=peers, timing=timing))
    if n == 512:  # the same product from f32 activations (converted to f16 in the kernel)
        rows.append(RowSpec(f"gemm {name} (f32 b)", shape, g, lambda s: s.mm.gemm(s.w, s.b32[n], s.d[n]), flops=flops,
                            peers=(deq,), timing=timing))
    return rows


def _glu(name, n, m=14336, k=4096):
    """Fused gate+up+SwiGLU against two separate GEMMs + the elementwise product in cuBLAS terms."""
    g, shape, flops = (_glu_sets, name, m, k), f"2x{m}x{k} N={n}", (traffic.gemm_flops, m, n, k, {"glu": True})
    timing = _timing(traffic.gemm_flops(m, n, k, glu=True) / 150e12 * 1e6)
    rows = [RowSpec(f"gemm_glu {name}", shape, g, lambda s: s.mm.gemm_glu(s.wg, s.wu, s.b16[n], s.d[n]), flops=flops,
                    peers=(Peer("2 x gemm_f16 (no act)", lambda s: (s.mm.gemm(s.wg, s.b16[n], s.d[n]),
                                                                     s.mm.gemm(s.wu, s.b16[n], s.d[n]))),), timing=timing)]
    if n >= WG_MIN_N:  # both matrices packed once at load (pack_glu)
        rows.append(RowSpec(f"gemm_glu packed {name}", shape, g, lambda s: s.mm.gemm_glu(s.pg, None, s.b16[n], s.d[n]),
                            flops=flops, peers=(Peer("2 x deq+cuBLAS (no act)", lambda s: _deq_blas_twice(s, n)),),
                            timing=STREAM, rounds=_ROUNDS, when=lambda s: s.pg is not None))
    rows.append(RowSpec(f"quantize+gemm_q8_glu->q8_1 {name}", shape, g,
                        lambda s: (s.mm.quantize_q8_1(s.b32[n], s.qa[n]),
                                   s.mm.gemm_q8_glu(s.wg, s.wu, s.qa[n], s.hq[n], out_format="q8_1")),
                        flops=flops, peers=(Peer("gemm_glu (f16)", row=f"gemm_glu {name}"),), timing=timing))
    return rows


def _timing(us_hint: float) -> Timing:
    """A graph replay for short products (launch cost excluded), back-to-back eager calls for long ones."""
    return Timing("graph") if us_hint < 50 else STREAM


def _deq_blas_twice(s, n):
    for w in (s.wg, s.wu):
        s.mm.dequantize(w, s.dense)
        cupy.matmul(s.b16[n], s.dense.T, out=s.d16[n])


# ------------------------------------------------------------------ input sets
def random_weight_device(name: str, m: int, k: int, rng: cupy.random.Generator) -> QWeight:
    """Random valid blocks built on the device (random quant bits, f16 scales of a sensible size)."""
    q = _BY_NAME[name]
    _, be, bb, _ = QTYPES[q]
    nb = k // be
    raw = rng.integers(0, 256, size=(m, nb, bb), dtype=cupy.uint8)

    def f16(lo, hi):
        return (lo + (hi - lo) * rng.random((m, nb), dtype=cupy.float32)).astype(cupy.float16).view(cupy.uint8) \
            .reshape(m, nb, 2)
    if name in ("Q4_0", "Q5_0", "Q8_0"):
        raw[..., 0:2] = f16(0.001, 0.01)
    elif name in ("Q4_K", "Q5_K"):
        raw[..., 0:2] = f16(0.0001, 0.001)
        raw[..., 2:4] = f16(0.0, 0.001)
    elif name == "Q6_K":
        raw[..., 208:210] = f16(0.00001, 0.0001)
    elif name == "MXFP4":
        raw[..., 0] = rng.integers(118, 127, size=(m, nb), dtype=cupy.uint8)  # E8M0: 2^-9 ... 2^-1
    return QWeight(raw.reshape(-1), q, m, k)


def _activations(ctx, m, k, ns) -> dict:
    """Per N: f16 and f32 activations (the same values), the f32 and f16 outputs, Q8_1 room for the
    activations and (m columns) for a GLU output."""
    b16 = {n: ctx.rng.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16) for n in ns}
    return dict(b16=b16, b32={n: b.astype(cupy.float32) for n, b in b16.items()},
                d={n: cupy.empty((n, m), cupy.float32) for n in ns}, d16={n: cupy.empty((n, m), cupy.float16) for n in ns},
                qa={n: cupy.empty((n, k // 32 * 36), cupy.uint8) for n in ns},
                hq={n: cupy.empty((n, m // 32 * 36), cupy.uint8) for n in ns})


def _gemm_sets(ctx, name, m, k):
    """Copies of one weight (and, where packable, their packed copies) spanning _L2_ROTATE, the peers'
    dequantized matrix, the activations of every N."""
    w0 = random_weight_device(name, m, k, ctx.rng)
    n_sets = max(2, min(8, -(-_L2_ROTATE // w0.buf.nbytes)))
    weights = [w0] + [random_weight_device(name, m, k, ctx.rng) for _ in range(n_sets - 1)]
    dense = cupy.empty((m, k), cupy.float16)
    ctx.mm.dequantize(weights[0], dense)
    packed = [ctx.mm.pack(w) for w in weights] if ctx.mm.packable(w0) else [None] * n_sets
    shared = dict(mm=ctx.mm, dm=ctx.dm, dense=dense, **_activations(ctx, m, k, NS))
    return [SimpleNamespace(w=w, packed=p, **shared) for w, p in zip(weights, packed)]


def _glu_sets(ctx, name, m, k):
    wg, wu = random_weight_device(name, m, k, ctx.rng), random_weight_device(name, m, k, ctx.rng)
    pg = ctx.mm.pack_glu(wg, wu) if ctx.mm.packable(wg) else None
    dense = cupy.empty((m, k), cupy.float16) if pg is not None else None
    return [SimpleNamespace(mm=ctx.mm, wg=wg, wu=wu, pg=pg, dense=dense, **_activations(ctx, m, k, (64, 512)))]


# ------------------------------------------------------------------ grouped expert GEMMs (MoE prefill)
# (model, type, n_experts, top_k, gate/up m, k): gpt-oss-20b's experts (2880x2880 MXFP4, 32 experts, top 4) and
# Qwen3-30B-A3B's (768x2048 Q4_K gate and up, 2048x768 down, 128 experts, top 8), at 1024 tokens
MOE_SHAPES = [("gpt-oss-20b", "MXFP4", 32, 4, 2880, 2880), ("Qwen3-30B-A3B", "Q4_K", 128, 8, 768, 2048)]
MOE_TOKENS = 1024


def _moe(model, name, n_e, top_k, m, k, n=MOE_TOKENS):
    """moe_gemm_glu (gate + up fused) and moe_gemm (down) against moe_dmmv_packed on the same route (built
    once, untimed), both from the tokens' activations (f16 for the GEMMs, f32 for the matvecs)."""
    g, slots = (_moe_sets, name, n_e, top_k, m, k, n), n * top_k
    shape_up, shape_down = f"{model} {n_e}x2x{m}x{k} top{top_k} N={n}", f"{model} {n_e}x{k}x{m} top{top_k} N={n}"
    t_up, t_down = (_timing(traffic.gemm_flops(m, slots, k, glu=glu) / 150e12 * 1e6) for glu in (True, False))
    up = Peer("moe_dmmv_packed glu", lambda s: s.dm.moe_dmmv_packed(s.wg, s.x32, s.ids, s.route, s.y_up, w_up=s.wu))
    down = Peer("moe_dmmv_packed", lambda s: s.dm.moe_dmmv_packed(s.wd, s.h32, s.ids, s.route, s.y_down))
    return [RowSpec(f"moe_gemm_glu {name}", shape_up, g, lambda s: s.mm.moe_gemm_glu(s.wg, s.wu, s.x16, s.route, s.h16),
                    flops=(traffic.gemm_flops, m, slots, k, {"glu": True}), peers=(up,), timing=t_up, rounds=_ROUNDS),
            RowSpec(f"moe_gemm {name}", shape_down, g, lambda s: s.mm.moe_gemm(s.wd, s.h16, s.route, s.d),
                    flops=(traffic.gemm_flops, k, slots, m), peers=(down,), timing=t_down, rounds=_ROUNDS)]


def _moe_sets(ctx, name, n_e, top_k, m, k, n):
    """Expert tensors gate, up [n_e, m, k] and down [n_e, k, m]; a route of n tokens, top_k distinct experts
    each (uniform), packed once; activations per token (x) and per slot (h)."""
    def experts(rows, cols):
        w = random_weight_device(name, n_e * rows, cols, ctx.rng)
        return QWeight(w.buf, w.qtype, rows, cols, n_experts=n_e)
    ids = cupy.argsort(ctx.rng.random((n, n_e), dtype=cupy.float32), axis=1)[:, :top_k].astype(cupy.int32)
    route = ctx.dm.plan_moe_route(n, top_k, n_e)
    ctx.dm.moe_route_pack(ids, route)
    x16 = ctx.rng.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
    h16 = (0.1 * ctx.rng.standard_normal((n * top_k, m), dtype=cupy.float32)).astype(cupy.float16)
    return [SimpleNamespace(mm=ctx.mm, dm=ctx.dm, wg=experts(m, k), wu=experts(m, k), wd=experts(k, m), ids=ids,
                            route=route, x16=x16, x32=x16.astype(cupy.float32), h16=h16,
                            h32=h16.astype(cupy.float32).reshape(n, top_k, m),
                            y_up=cupy.empty((n, top_k, m), cupy.float32), y_down=cupy.empty((n, top_k, k), cupy.float32),
                            d=cupy.empty((n * top_k, k), cupy.float32))]


def bench(quick: bool = False) -> tuple[list, Ceilings]:
    ctx = SimpleNamespace(mm=MatmulDispatch(), dm=DmmvDispatch(), rng=cupy.random.default_rng(0))
    base = measure_ceilings()
    ceil = Ceilings(copy_gbs=base.copy_gbs, device=base.device, gemm_tflops=measure_gemm_tflops())
    return run_specs("matmul", specs(quick), ceil, ctx), ceil


def main(argv=None) -> int:
    return script_main(bench, __doc__, title='matmul',
                       quick_help='one shape, two types, three N', argv=argv)


if __name__ == "__main__":
    sys.exit(main())
