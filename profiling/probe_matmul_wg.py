"""Probe: gemm_wg (Hopper wgmma) with each token tile and warpgroup count, against gemm_f16
(mma.sync) as CUDA-graph replays (device time, no Python launch cost), and dequantize + cuBLAS
and cuBLAS alone timed eagerly (cuBLAS cannot be captured through CuPy), plus variants of gemm_wg
that skip parts of the work (CUKERN_WG_SKIP in gemm_wg.cuh) to see what limits it. Not the
benchmark of record (bench_matmul.py is): a table for choosing tiles.
Run: PYTHONPATH=. python profiling/probe_matmul_wg.py [--no-wg] [--skips wg|wgr]
(PROBE_TYPES=Q8_0,Q4_K; PROBE_CASES=4096x4096x2048,...)
"""

from __future__ import annotations

import dataclasses
import os
import sys

import cupy

from cukern import matmul as M
from cukern.benchmark import rotating, time_graph_us, time_us
from cukern.matmul import MatmulDispatch

sys.path.insert(0, "profiling")
from bench_matmul import _BY_NAME, random_weight_device  # noqa: E402

# --skips wg|wgr: that kernel's variants that skip parts of the work (at N = 2048)
SKIP_VARIANTS = sys.argv[sys.argv.index("--skips") + 1] if "--skips" in sys.argv else None
SKIPS = {1: "no dequant", 2: "no raw copy", 4: "no act copy", 8: "no MMA", 3: "no weights", 7: "MMA only"}


def _variant(mm: MatmulDispatch, q: int, skip: int, kern: str) -> MatmulDispatch:
    """A dispatch whose gemm_wg or gemm_wgr (kern) for type q (256-token tiles) is built with
    CUKERN_WG_SKIP / CUKERN_WGR_SKIP = skip."""
    base = M.FAMILIES[f"matmul_f16_{M.GEMM_QTYPES[q]}"]
    kernels = tuple(k for k in base.kernels if k.name.startswith(f"gemm_{kern}<") and "256, false" in k.name)
    spec = dataclasses.replace(base, name=f"{base.name}_{kern}skip{skip}", kernels=kernels,
                               defines=(f"CUKERN_{kern.upper()}_SKIP={skip}",))
    v = MatmulDispatch()
    v.WG_KERNEL = kern
    v._units = dict(mm._units)
    v._units[q] = M._Unit(spec, sm90a=True)
    return v


def main() -> None:
    mm = MatmulDispatch()
    rng = cupy.random.default_rng(1)
    cases = [(4096, 4096, n) for n in (512, 2048)] + [(14336, 4096, 2048)]
    if os.environ.get("PROBE_CASES"):  # "MxKxN,..."
        cases = [tuple(int(v) for v in c.split("x")) for c in os.environ["PROBE_CASES"].split(",")]
    for name in os.environ.get("PROBE_TYPES", "Q8_0,Q4_K,Q6_K,Q5_0").split(","):
        q = _BY_NAME[name]
        for (m, k, n) in cases:
            ws = [random_weight_device(name, m, k, rng) for _ in range(3)]
            dense = cupy.empty((m, k), cupy.float16)
            b = rng.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
            d = cupy.empty((n, m), cupy.float32)
            d16 = cupy.empty((n, m), cupy.float16)
            _, nxt = rotating(3, lambda i: ws[i])
            tf = lambda us: 2 * m * n * k / us / 1e6  # noqa: E731
            t = {}
            t["default"] = time_graph_us(lambda: mm.gemm(nxt(), b, d), n_inner=10, n_repeat=10)
            for kern, groups in (("wgr", (None,)), ("wg", M._WG_GROUPS))[:1 if "--no-wg" in sys.argv else 2]:
                mm.WG_KERNEL = kern
                for wgs in groups:
                    for bt in M._WG_TILES:
                        mm.WG_TILE = bt
                        mm.WG_GROUPS = wgs
                        t[f"{kern}{bt}x{wgs or 3}"] = time_graph_us(lambda: mm.gemm(nxt(), b, d, wgmma=True),
                                                                   n_inner=10, n_repeat=10)
            del mm.WG_TILE, mm.WG_GROUPS, mm.WG_KERNEL
            t["mma.sync"] = time_graph_us(lambda: mm.gemm(nxt(), b, d, wgmma=False), n_inner=10, n_repeat=10)
            t["wg eager"] = time_us(lambda: mm.gemm(nxt(), b, d), n_warmup=3, n_repeat=20)
            t["deq+cuBLAS eager"] = time_us(lambda: (mm.dequantize(nxt(), dense), cupy.matmul(b, dense.T, out=d16)),
                                            n_warmup=3, n_repeat=20)
            t["cuBLAS eager"] = time_us(lambda: cupy.matmul(b, dense.T, out=d16), n_warmup=3, n_repeat=20)
            if n == 2048 and SKIP_VARIANTS:
                for skip, what in SKIPS.items():
                    v = _variant(mm, q, skip, SKIP_VARIANTS)
                    v.WG_TILE = 256
                    t[f"{SKIP_VARIANTS} {what}"] = time_graph_us(lambda: v.gemm(nxt(), b, d, wgmma=True),
                                                                 n_inner=10, n_repeat=10)
            print(f"{name} {m}x{k} N={n}: " + " | ".join(f"{key} {us:.1f} us {tf(us):.0f} TF" for key, us in t.items())
                  + f" | eager: wg vs deq+cuBLAS {t['deq+cuBLAS eager'] / t['wg eager']:.2f}x", flush=True)
            ws = dense = None
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
