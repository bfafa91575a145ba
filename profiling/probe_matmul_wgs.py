"""Scratch probe (not part of the suite): gemm_wgs (cuda_src/matmul/gemm_wgs.cuh, Q8_0 only), the weight
dequantized by a warpgroup of its own into a swizzled f16 ring that the two consumer warpgroups read
with wgmma SS, against gemm_wgr (the dequantization in the consumers' registers) and the bench's
dequantize + cuBLAS peer, at N = 512 and 2048. "skip" is gemm_wgs with the conversion replaced by
constants (CUKERN_WGS_SKIP=1), "handoff" with the dequantizers only handing the A slots over (2), "mma"
without the consumers waiting for them either (6): the pipeline's own limits.

Run: PYTHONPATH=. python profiling/probe_matmul_wgs.py [--shapes 14336x4096] [--ns 2048]
"""
import argparse
import sys

import cupy
import numpy as np

sys.path.insert(0, "profiling")
from bench_matmul import random_weight_device  # noqa: E402 (after the path insert)

from cukern.benchmark import rotating, time_graph_us, time_stream_us
from cukern.dispatch import tensor_map_2d
from cukern.matmul import MatmulDispatch, _Unit
from cukern.runtime import FamilySpec, KernelSpec

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336")
ap.add_argument("--ns", default="512,2048")
args = ap.parse_args()

QT, BN, THREADS = 8, 256, 384
SMEM = 1024 + 4 * BN * 128 + 4 * 128 * 128 + 3 * 128 * 17 * 4 + 2 * 8 * 8  # gemm_wgs_smem_bytes(256)
KERNEL = f"gemm_wgs<{QT}, {BN}>"


def unit(name, defines=()):
    return _Unit(FamilySpec(name, (KernelSpec(KERNEL, "GemmParams"),), source="matmul/probe_wgs.cu",
                            params_header="matmul/params.cuh", defines=defines), sm90a=True)


def main():
    mm = MatmulDispatch()
    units = {"wgs": unit("matmul_wgs_probe"), "skip": unit("matmul_wgs_probe_skip", ("CUKERN_WGS_SKIP=1",)),
             "handoff": unit("matmul_wgs_probe_h", ("CUKERN_WGS_SKIP=2",)),
             "mma": unit("matmul_wgs_probe_m", ("CUKERN_WGS_SKIP=6",))}
    rng = cupy.random.default_rng(0)
    print(f"{'shape':>12} {'N':>5} {'peer':>8} {'wgr':>8} {'wgs':>8} {'skip':>8} {'handoff':>8} {'mma':>8}  err(wgs vs wgr)  "
          "(us; ratios peer / kernel)", flush=True)
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        w0 = random_weight_device("Q8_0", m, k, rng)
        n_sets = max(2, min(4, -(-(160 << 20) // w0.buf.nbytes)))
        weights = [w0] + [random_weight_device("Q8_0", m, k, rng) for _ in range(n_sets - 1)]
        assert w0.row_bytes % 4 == 0
        dense = cupy.empty((m, k), cupy.float16)
        for n in (int(v) for v in args.ns.split(",")):
            b16 = rng.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
            d = cupy.empty((n, m), cupy.float32)
            d16 = cupy.empty((n, m), cupy.float16)
            _, nxt = rotating(n_sets, lambda i: weights[i])
            tmap = tensor_map_2d(b16, (64, BN))
            grid = (-(-n // BN), -(-m // 128), 1)

            def launch(u, w):
                p = mm.struct_of(QT).pack(w_offset=w.offset, w2_offset=0, row_bytes=w.row_bytes, b_stride=k, d_stride=m,
                                          m=m, n=n, k=k, k_split=k, mode=0, atomic=0, raw16=0)
                return u._launch(KERNEL, grid, THREADS, (d, w.buf, tmap), p, shared_mem=SMEM)

            ref = cupy.empty_like(d)
            mm.gemm(weights[0], b16, ref)
            d.fill(np.nan)
            launch(units["wgs"], weights[0])
            err = float(cupy.nanmax(cupy.abs(d - ref)) / cupy.abs(ref).max()) if not bool(cupy.isnan(d).any()) \
                else float("nan")
            timer = time_graph_us if n <= 512 else time_stream_us
            peer = time_stream_us(lambda: (mm.dequantize(nxt(), dense), cupy.matmul(b16, dense.T, out=d16)))
            t_wgr = timer(lambda: mm.gemm(nxt(), b16, d))
            t_wgs = timer(lambda: launch(units["wgs"], nxt()))
            t_skip = timer(lambda: launch(units["skip"], nxt()))
            t_h = timer(lambda: launch(units["handoff"], nxt()))
            t_m = timer(lambda: launch(units["mma"], nxt()))
            print(f"{shape:>12} {n:5d} {peer:8.1f} {t_wgr:8.1f} {t_wgs:8.1f} {t_skip:8.1f} {t_h:8.1f} {t_m:8.1f}  {err:.2e}   "
                  f"wgr {peer / t_wgr:.2f}  wgs {peer / t_wgs:.2f}  skip {peer / t_skip:.2f}", flush=True)
        weights = dense = w0 = None
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
