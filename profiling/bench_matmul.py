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

FLOPs counted: 2 M N K per product. %ceil: of the cuBLAS f16 GEMM rate (8192^3) measured in this
run. Weights are rotated over enough copies to exceed the 50 MB L2 (8 at 4096x4096); from N = 512 the
gemm rows and deq+cuBLAS are timed in turns, three rounds, medians (their ratio is what the rows are
read for, and a GPU's clock drifts under minutes of tensor load); times below ~50 us are
replayed from a CUDA graph (launch cost excluded), both for cukern and for the dmmv peer; longer
ones, and the cuBLAS peers (which CuPy cannot capture), are timed over 10 eager calls issued back
to back between two events (``time_stream_us``: the host's launch cost is hidden where the GPU
work is longer, as in a prefill loop, instead of idling the GPU before each call).
Run: PYTHONPATH=. python profiling/bench_matmul.py [--quick] [--json out.json]
"""

from __future__ import annotations

import sys

import cupy

from cukern import traffic
from cukern.benchmark import (Ceilings, Row, measure_ceilings, measure_gemm_tflops, medians_in_turns, rotating,
                              script_main, time_graph_us, time_stream_us)
from cukern.dmmv import QTYPES, DmmvDispatch, QWeight
from cukern.matmul import MatmulDispatch

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (M, K)
TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q5_0"]
NS = [16, 64, 128, 512, 2048]
_BY_NAME = {v[0]: q for q, v in QTYPES.items()}
_L2_ROTATE = 160 << 20  # bytes of weights rotated through: > 3x the 50 MB L2 (at most 8 copies: > 70 MB)
_ROUNDS = 3  # rounds of the in-turns timing from N = 512


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
    return QWeight(raw.reshape(-1), q, m, k)


def _timer(us_hint: float):
    return time_graph_us if us_hint < 50 else time_stream_us


def bench(quick: bool = False) -> tuple[list, Ceilings]:
    mm, dm = MatmulDispatch(), DmmvDispatch()
    base = measure_ceilings()
    ceil = Ceilings(copy_gbs=base.copy_gbs, device=base.device, gemm_tflops=measure_gemm_tflops())
    rng = cupy.random.default_rng(0)
    rows = []
    shapes = [(14336, 4096)] if quick else SHAPES
    types = ["Q4_K", "Q8_0"] if quick else TYPES
    ns = [16, 512, 2048] if quick else NS
    for (m, k) in shapes:
        for name in types:
            w0 = random_weight_device(name, m, k, rng)
            n_sets = max(2, min(8, -(-_L2_ROTATE // w0.buf.nbytes)))
            weights = [w0] + [random_weight_device(name, m, k, rng) for _ in range(n_sets - 1)]
            dense = cupy.empty((m, k), cupy.float16)  # the peers' dequantized matrix
            mm.dequantize(weights[0], dense)
            packed = [mm.pack(w) for w in weights] if mm.packable(weights[0]) else None
            for n in ns:
                b16 = rng.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
                b32 = b16.astype(cupy.float32)
                d = cupy.empty((n, m), cupy.float32)
                d16 = cupy.empty((n, m), cupy.float16)
                _, nxt = rotating(n_sets, lambda i: weights[i])
                flops = traffic.gemm_flops(m, n, k)
                guess = flops / 150e12 * 1e6 + 5  # us, to choose event or graph timing
                timer = _timer(guess)
                # cukern's GEMMs and the first peer in turns (medians of _ROUNDS from N = 512, where the ratio
                # is close): clock drift under sustained tensor load then spreads over all of them
                timed = {"gemm": lambda: timer(lambda: mm.gemm(nxt(), b16, d)),
                         "deq": lambda: time_stream_us(lambda: (mm.dequantize(nxt(), dense),
                                                                cupy.matmul(b16, dense.T, out=d16)))}
                if packed and n >= mm.WG_MIN_N:  # the same product on the weights packed once at load
                    _, nxp = rotating(n_sets, lambda i: packed[i])
                    timed["packed"] = lambda: timer(lambda: mm.gemm(nxp(), b16, d))
                med = medians_in_turns(timed, _ROUNDS if n >= 512 else 1)
                us, peer_deq = med["gemm"], med["deq"]
                peer_blas = time_stream_us(lambda: cupy.matmul(b16, dense.T, out=d16))
                peers = {"cuBLAS f16 (pre-deq)": peer_blas}
                if n <= 64:
                    peers["dmmv batched (f32 x)"] = time_graph_us(lambda: dm.dmmv(nxt(), b32, d))
                tf = flops / (us * 1e-6) / 1e12
                rows.append(Row("matmul", f"gemm {name}", f"{m}x{k} N={n}", us, tflops=tf,
                                pct_ceiling=tf / ceil.gemm_tflops, peer="deq+cuBLAS f16", peer_us=peer_deq,
                                extra={"peers": peers}))
                if "packed" in med:
                    usp = med["packed"]
                    tfp = flops / (usp * 1e-6) / 1e12
                    rows.append(Row("matmul", f"gemm packed {name}", f"{m}x{k} N={n}", usp, tflops=tfp,
                                    pct_ceiling=tfp / ceil.gemm_tflops, peer="deq+cuBLAS f16", peer_us=peer_deq,
                                    extra={"peers": dict(peers)}))
                # int8 path: f32 activations quantized to Q8_1 (one pass), then the int8 GEMM
                qa = cupy.empty((n, k // 32 * 36), cupy.uint8)
                us8 = timer(lambda: (mm.quantize_q8_1(b32, qa), mm.gemm_q8(nxt(), qa, d)))
                tf8 = flops / (us8 * 1e-6) / 1e12
                rows.append(Row("matmul", f"quantize+gemm_q8 {name}", f"{m}x{k} N={n}", us8, tflops=tf8,
                                pct_ceiling=tf8 / ceil.gemm_tflops, peer="deq+cuBLAS f16", peer_us=peer_deq,
                                extra={"peers": dict(peers)}))
                if n == 512:  # the same product from f32 activations (converted to f16 in the kernel)
                    us32 = timer(lambda: mm.gemm(nxt(), b32, d))
                    tf32 = flops / (us32 * 1e-6) / 1e12
                    rows.append(Row("matmul", f"gemm {name} (f32 b)", f"{m}x{k} N={n}", us32, tflops=tf32,
                                    pct_ceiling=tf32 / ceil.gemm_tflops, peer="deq+cuBLAS f16", peer_us=peer_deq))
            weights = dense = w0 = packed = None  # let this type's copies go before the next one is built
            cupy.get_default_memory_pool().free_all_blocks()
    # fused gate+up+SwiGLU against two separate GEMMs + the elementwise product in cuBLAS terms
    m, k = (14336, 4096)
    for name in (["Q4_K"] if quick else ["Q4_K", "Q8_0"]):
        wg, wu = random_weight_device(name, m, k, rng), random_weight_device(name, m, k, rng)
        pg = mm.pack_glu(wg, wu) if mm.packable(wg) else None
        dense = cupy.empty((m, k), cupy.float16) if pg is not None else None
        for n in [64, 512]:
            b16 = rng.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
            d = cupy.empty((n, m), cupy.float32)
            flops = traffic.gemm_flops(m, n, k, glu=True)
            us = _timer(flops / 150e12 * 1e6)(lambda: mm.gemm_glu(wg, wu, b16, d))
            two = _timer(flops / 150e12 * 1e6)(lambda: (mm.gemm(wg, b16, d), mm.gemm(wu, b16, d)))
            tf = flops / (us * 1e-6) / 1e12
            rows.append(Row("matmul", f"gemm_glu {name}", f"2x{m}x{k} N={n}", us, tflops=tf,
                            pct_ceiling=tf / ceil.gemm_tflops, peer="2 x gemm_f16 (no act)", peer_us=two))
            if pg is not None and n >= mm.WG_MIN_N:  # both matrices packed once at load (pack_glu)
                d16 = cupy.empty((n, m), cupy.float16)
                med = medians_in_turns({
                    "packed": lambda: time_stream_us(lambda: mm.gemm_glu(pg, None, b16, d)),
                    "deq": lambda: time_stream_us(lambda: [(mm.dequantize(w, dense), cupy.matmul(b16, dense.T, out=d16))
                                                           for w in (wg, wu)])}, _ROUNDS)
                tfp = flops / (med["packed"] * 1e-6) / 1e12
                rows.append(Row("matmul", f"gemm_glu packed {name}", f"2x{m}x{k} N={n}", med["packed"], tflops=tfp,
                                pct_ceiling=tfp / ceil.gemm_tflops, peer="2 x deq+cuBLAS (no act)",
                                peer_us=med["deq"]))
            b32 = b16.astype(cupy.float32)
            qa = cupy.empty((n, k // 32 * 36), cupy.uint8)
            hq = cupy.empty((n, m // 32 * 36), cupy.uint8)
            us8 = _timer(flops / 150e12 * 1e6)(
                lambda: (mm.quantize_q8_1(b32, qa), mm.gemm_q8_glu(wg, wu, qa, hq, out_format="q8_1")))
            tf8 = flops / (us8 * 1e-6) / 1e12
            rows.append(Row("matmul", f"quantize+gemm_q8_glu->q8_1 {name}", f"2x{m}x{k} N={n}", us8, tflops=tf8,
                            pct_ceiling=tf8 / ceil.gemm_tflops, peer="gemm_glu (f16)", peer_us=us))
        wg = wu = pg = dense = None
        cupy.get_default_memory_pool().free_all_blocks()
    return rows, ceil


def main(argv=None) -> int:
    return script_main(bench, __doc__, title='matmul',
                       quick_help='one shape, two types, three N', argv=argv)


if __name__ == "__main__":
    sys.exit(main())
