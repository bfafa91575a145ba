"""Scratch probe (not part of the suite): does dequantizing the weight in row bands into a small
f16 staging buffer (written and re-read while it sits in L2), each band multiplied by cuBLAS as
soon as it is ready, beat the bench's dequantize + cuBLAS peer (the whole f16 matrix through HBM)
and the fused gemm_wgr at large N?

Variants per (shape, type, N), all timed like bench_matmul's peers (time_stream_us, rotating
weights):
  peer      MatmulDispatch.dequantize of the whole matrix, then cupy.matmul (f16 out, as the bench)
  gemm      MatmulDispatch.gemm (the fused kernel, f32 d)
  band/S    bands of S MB of f16 each: dequantize band i, cublasGemmEx into d's columns (f32 out),
            one stream
  band2/S   the same with the dequantization on a second stream, one band ahead of the GEMMs
            (two staging slots, events between them)

What it showed (H100, 2026-11-26, cuBLAS 749 TFLOP/s at 8192^3): no. The bands lose at every measured
point, so no dispatch path was built from them. At N = 2048:
  14336x4096 Q6_K: peer 427, gemm 552, band/16 450, band2/16 523 us;
  14336x4096 Q4_K: peer 394, gemm 465, band/16 434, band2/16 437 us;
  4096x14336 Q6_K: peer 384, gemm 527, band/16 573 us.
Smaller bands are bound by the host: each band costs a QWeight, a checked launch and a gemmEx, so band/4
takes ~440 us at 4096^2 whatever N is. The band GEMMs run below the whole-matrix GEMM's rate, and putting
the dequantization on a second stream made it slower: it competes with cuBLAS for the SMs.
At N = 512 the fused gemm (1.03-1.53x the peer) beats every band variant.

Run: PYTHONPATH=. python profiling/probe_matmul_blas.py [--shapes 14336x4096] [--types Q4_K] [--ns 2048]
"""
import argparse
import sys

import cupy
import numpy as np
from cupy_backends.cuda.libs import cublas

sys.path.insert(0, "profiling")
from bench_matmul import random_weight_device  # noqa: E402 (after the path insert)

from cukern.benchmark import measure_gemm_tflops, rotating, time_stream_us
from cukern.dmmv import QWeight
from cukern.matmul import MatmulDispatch

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336")
ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q5_0")
ap.add_argument("--ns", default="512,2048")
ap.add_argument("--bands", default="4,8,16")  # MB of f16 per band
args = ap.parse_args()

_R_16F, _R_32F, _COMPUTE_32F, _OP_N, _OP_T = 2, 0, 68, 0, 1
ONE, ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)


def gemm_band(b16, stage, d, r0, rows, m, k):
    """d[:, r0:r0 + rows] = b16 @ stage[:rows].T (f32 out, f32 accumulate): column-major C = A^T B."""
    n = b16.shape[0]
    cublas.gemmEx(cupy.cuda.device.get_cublas_handle(), _OP_T, _OP_N, rows, n, k,
                  ONE.ctypes.data, stage.data.ptr, _R_16F, k, b16.data.ptr, _R_16F, k,
                  ZERO.ctypes.data, d.data.ptr + 4 * r0, _R_32F, m, _COMPUTE_32F, -1)


def band_rows(m, k, mb):
    rows = max(128, (mb << 20) // (2 * k) // 128 * 128)
    return min(rows, m)


def banded(mm, w, b16, d, stages, rows, side=None, ev=None):
    m, k = w.m, w.k
    main = cupy.cuda.get_current_stream()
    if side is not None:
        ev["start"].record(main)
        side.wait_event(ev["start"])
    for i, r0 in enumerate(range(0, m, rows)):
        r = min(rows, m - r0)
        band = QWeight(w.buf, w.qtype, r, k, offset=w.offset + r0 * w.row_bytes)
        st = stages[i % 2][:r]
        if side is None:
            mm.dequantize(band, st)
            gemm_band(b16, st, d, r0, r, m, k)
        else:
            if i >= 2:
                side.wait_event(ev["gemm"][i % 2])
            mm.dequantize(band, st, stream=side)
            ev["deq"][i % 2].record(side)
            main.wait_event(ev["deq"][i % 2])
            gemm_band(b16, st, d, r0, r, m, k)
            ev["gemm"][i % 2].record(main)


def main():
    mm = MatmulDispatch()
    rng = cupy.random.default_rng(0)
    side = cupy.cuda.Stream(non_blocking=True)
    ev = {"start": cupy.cuda.Event(disable_timing=True),
          "deq": [cupy.cuda.Event(disable_timing=True) for _ in range(2)],
          "gemm": [cupy.cuda.Event(disable_timing=True) for _ in range(2)]}
    print(f"cuBLAS f16 8192^3: {measure_gemm_tflops():.0f} TFLOP/s")
    bands = [int(x) for x in args.bands.split(",")]
    hdr = f"{'shape':>12} {'type':>5} {'N':>5} {'peer':>8} {'gemm':>8}" + "".join(
        f" {'band/' + str(b):>9} {'band2/' + str(b):>9}" for b in bands)
    print(hdr + "   (us; ratio = peer / variant)")
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        for name in args.types.split(","):
            w0 = random_weight_device(name, m, k, rng)
            n_sets = max(2, min(4, -(-(160 << 20) // w0.buf.nbytes)))
            weights = [w0] + [random_weight_device(name, m, k, rng) for _ in range(n_sets - 1)]
            dense = cupy.empty((m, k), cupy.float16)
            for n in (int(v) for v in args.ns.split(",")):
                b16 = rng.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
                d = cupy.empty((n, m), cupy.float32)
                d16 = cupy.empty((n, m), cupy.float16)
                _, nxt = rotating(n_sets, lambda i: weights[i])
                # correctness of the banded product against the fused kernel's (same weights)
                ref = cupy.empty_like(d)
                mm.gemm(weights[0], b16, ref)
                peer = time_stream_us(lambda: (mm.dequantize(nxt(), dense), cupy.matmul(b16, dense.T, out=d16)))
                gemm = time_stream_us(lambda: mm.gemm(nxt(), b16, d))
                cells = []
                for mb in bands:
                    rows = band_rows(m, k, mb)
                    stages = [cupy.empty((rows, k), cupy.float16) for _ in range(2)]
                    for two in (False, True):
                        d.fill(np.nan)
                        banded(mm, weights[0], b16, d, stages, rows, side if two else None, ev)
                        err = float(cupy.abs(d - ref).max() / cupy.abs(ref).max())
                        t = time_stream_us(lambda: banded(mm, nxt(), b16, d, stages, rows,
                                                          side if two else None, ev))
                        cells.append(f" {t:7.1f}{'!' if not err < 2e-3 else ' '}{peer / t:4.2f}")
                print(f"{shape:>12} {name:>5} {n:5d} {peer:8.1f} {gemm:8.1f} ({peer / gemm:4.2f})" + "".join(cells),
                      flush=True)
            weights = dense = w0 = None
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
