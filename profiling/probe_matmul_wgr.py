"""Probe: gemm_wgr (Hopper wgmma, weights dequantized into registers) at each token tile against
gemm_f16 (mma.sync) as CUDA-graph replays (device time, no Python launch cost), and dequantize +
cuBLAS and cuBLAS alone over back-to-back eager calls (cuBLAS cannot be captured through CuPy),
plus variants of gemm_wgr that skip parts of the work (CUKERN_WGR_SKIP in gemm_wgr.cuh) to see what
limits it. Not the benchmark of record (bench_matmul.py is): a table for choosing tiles.
Run: PYTHONPATH=. python profiling/probe_matmul_wgr.py [--skips | --ab | --plans]
(PROBE_TYPES=Q8_0,Q4_K; PROBE_CASES=4096x4096x2048,...; PROBE_DEFINES=NAME=1;NAME2=0,NAME=2: one
variant of gemm_wgr<QT, 256> per comma-separated set of defines, timed beside the default;
PROBE_PACKED=1: --ab on packed weights)

Measured (H100, 2026-11-26, graph replays; the eager peers in the same run):
  14336x4096 N = 2048, 256-token tiles: Q8_0 427-486 us, Q4_K 460-518, Q6_K 527-561; deq + cuBLAS
  385-413, cuBLAS alone on the f16 matrix 328-343. Skip variants (Q4_K / Q8_0 / Q6_K): MMAs only
  296 / 295 / 297 us, no weights (MMAs + activation copies) 311 / 312 / 312, no dequantization
  346 / 383 / 371, no raw copies 434 / 402 / 447, no activation copies 449 / 415 / 508, no MMAs
  272 / 347 / 319.
  4096x4096 N = 512: 128-token tiles Q8_0 46 us, Q4_K 52-58, Q6_K 60-61; 256-token tiles (64 CTAs)
  55 / 58-64 / 64-66.
  2026-11-26, seventh session (--plans, 4096x4096 N = 512, medians of 4 rounds in turns, eager as the
  benchmark times them): _wgr_plan's 256/2 (tile / K slices) is the fastest plan for Q6_K (49.4 us,
  0.98x deq + cuBLAS), Q5_0 (45.7, 0.98x) and Q4_K (43.1, 1.05x); then 128/1 (54.9 / 49.4 / 42.7),
  256/4 (59.2 / 55.5 / 52.5), 256/1 (70.8 / 62.1 / 55.7). The two rows short of the peer need a faster
  kernel, not another plan.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import cupy

from cukern import matmul as M
from cukern.benchmark import medians_in_turns, rotating, time_graph_us, time_stream_us
from cukern.matmul import MatmulDispatch

sys.path.insert(0, "profiling")
from bench_matmul import _BY_NAME, random_weight_device  # noqa: E402

SKIPS = {1: "no dequant", 2: "no raw copy", 4: "no act copy", 8: "no MMA", 3: "no weights", 7: "MMA only"}


def _variant(mm: MatmulDispatch, q: int, defines: tuple[str, ...]) -> MatmulDispatch:
    """A dispatch whose gemm_wgr for type q (256-token tiles) is built with these defines."""
    base = M.FAMILIES[f"matmul_f16_{M.GEMM_QTYPES[q]}"]
    kernels = tuple(k for k in base.kernels if k.name.startswith("gemm_wgr<") and "256, false" in k.name)
    tag = "_".join(x.replace("=", "") for x in defines)
    spec = dataclasses.replace(base, name=f"{base.name}_{tag}", kernels=kernels, defines=defines)
    v = MatmulDispatch()
    v._units = dict(mm._units)
    v._units[q] = M._Unit(spec, sm90a=True)
    v.WG_TILE = 256
    return v


def _case(name: str, m: int, k: int, n: int, rng, mm: MatmulDispatch | None = None):
    """One shape's operands: a cursor over random weights of the type (enough sets, rotated, that L2 does
    not serve them; packed by mm.pack when mm is given), f16 activations b [n, k], the f32 output d, and
    the peers' dense f16 matrix and output."""
    n_sets = max(3, min(6, -(-(100 << 20) // (m * k))))
    ws = [random_weight_device(name, m, k, rng) for _ in range(n_sets)]
    if mm is not None:
        ws = [mm.pack(w) for w in ws]
    _, nxt = rotating(n_sets, lambda i: ws[i])
    b = rng.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
    return nxt, b, cupy.empty((n, m), cupy.float32), cupy.empty((m, k), cupy.float16), cupy.empty((n, m), cupy.float16)


def ab(mm: MatmulDispatch, cases, rounds: int = 6) -> None:
    """--ab: gemm_wgr<QT, 256> as built by default against each PROBE_DEFINES variant, measured in
    turns (the order rotating every round, so that clock drift under load spreads over all of them);
    median and best of the rounds. PROBE_PACKED=1: on packed weights (MatmulDispatch.pack)."""
    packed = os.environ.get("PROBE_PACKED") == "1"
    rng = cupy.random.default_rng(1)
    mm.WG_TILE = 256
    M._smem_wgr = lambda bt, qt, packed=False: 227 * 1024  # every variant's ring fits (defines may change its size)
    sets = [()] + [tuple(x.split(";")) for x in os.environ.get("PROBE_DEFINES", "").split(",") if x]
    for name in os.environ.get("PROBE_TYPES", "Q8_0,Q4_K,Q6_K,Q5_0").split(","):
        q = _BY_NAME[name]
        variants = [_variant(mm, q, s) if s else mm for s in sets]
        for (m, k, n) in cases:
            nxt, b, d, _, _ = _case(name, m, k, n, rng, mm if packed else None)
            times: list[list[float]] = [[] for _ in sets]
            for r in range(rounds):
                for i in [(r + j) % len(sets) for j in range(len(sets))]:
                    v = variants[i]
                    times[i].append(time_graph_us(lambda: v.gemm(nxt(), b, d, wgmma=True), n_inner=10, n_repeat=5))
            cells = [f"{';'.join(s) or 'default'} {sorted(t)[len(t) // 2]:.1f} (best {min(t):.1f})"
                     for s, t in zip(sets, times)]
            print(f"{name}{' packed' if packed else ''} {m}x{k} N={n}: " + " | ".join(cells) + " us", flush=True)
            nxt = b = d = None
            cupy.get_default_memory_pool().free_all_blocks()


def plans(mm: MatmulDispatch, cases, rounds: int = 4) -> None:
    """--plans: gemm_wgr at every (token tile, K slices) of PROBE_SPLITS (default 1-4) beside the plan
    _wgr_plan picks and dequantize + cuBLAS, all as the benchmark times them (10 eager calls back to
    back), in turns; medians of the rounds."""
    rng = cupy.random.default_rng(1)
    splits = [int(x) for x in os.environ.get("PROBE_SPLITS", "1,2,3,4").split(",")]
    for name in os.environ.get("PROBE_TYPES", "Q6_K,Q5_0").split(","):
        for (m, k, n) in cases:
            nxt, b, d, dense, d16 = _case(name, m, k, n, rng)
            picked = mm._wgr_plan(n, -(-m // M._ROW_TILE), k, True)

            def run(bt, split):
                mm.WG_TILE = bt
                try:
                    return time_stream_us(lambda: mm.gemm(nxt(), b, d, wgmma=True, split_k=split))
                finally:
                    mm.WG_TILE = None
            fns = {f"{bt}/{s}": (lambda bt=bt, s=s: run(bt, s)) for bt in M._WG_TILES for s in splits}
            fns["deq+cuBLAS"] = lambda: time_stream_us(lambda: (mm.dequantize(nxt(), dense),
                                                                cupy.matmul(b, dense.T, out=d16)))
            med = medians_in_turns(fns, rounds)
            peer = med.pop("deq+cuBLAS")
            print(f"{name} {m}x{k} N={n} (plan {picked[0]}/{picked[1]}): deq+cuBLAS {peer:.1f} us | "
                  + " | ".join(f"{key} {us:.1f} ({peer / us:.2f}x)" for key, us in med.items()), flush=True)
            nxt = b = d = dense = d16 = None
            cupy.get_default_memory_pool().free_all_blocks()


def main() -> None:
    mm = MatmulDispatch()
    rng = cupy.random.default_rng(1)
    cases = [(4096, 4096, n) for n in (512, 2048)] + [(14336, 4096, 2048)]
    if os.environ.get("PROBE_CASES"):  # "MxKxN,..."
        cases = [tuple(int(v) for v in c.split("x")) for c in os.environ["PROBE_CASES"].split(",")]
    if "--ab" in sys.argv:
        return ab(mm, cases, int(os.environ.get("PROBE_ROUNDS", "6")))
    if "--plans" in sys.argv:
        return plans(mm, cases)
    for name in os.environ.get("PROBE_TYPES", "Q8_0,Q4_K,Q6_K,Q5_0").split(","):
        q = _BY_NAME[name]
        for (m, k, n) in cases:
            nxt, b, d, dense, d16 = _case(name, m, k, n, rng)
            tf = lambda us: 2 * m * n * k / us / 1e6  # noqa: E731
            t = {"default": time_graph_us(lambda: mm.gemm(nxt(), b, d), n_inner=10, n_repeat=10)}
            for bt in M._WG_TILES:
                mm.WG_TILE = bt
                t[f"wgr{bt}"] = time_graph_us(lambda: mm.gemm(nxt(), b, d, wgmma=True), n_inner=10, n_repeat=10)
            mm.WG_TILE = None
            t["mma.sync"] = time_graph_us(lambda: mm.gemm(nxt(), b, d, wgmma=False), n_inner=10, n_repeat=10)
            t["default eager"] = time_stream_us(lambda: mm.gemm(nxt(), b, d))
            t["deq+cuBLAS eager"] = time_stream_us(lambda: (mm.dequantize(nxt(), dense),
                                                            cupy.matmul(b, dense.T, out=d16)))
            t["cuBLAS eager"] = time_stream_us(lambda: cupy.matmul(b, dense.T, out=d16))
            if n == 2048 and "--skips" in sys.argv:
                for skip, what in SKIPS.items():
                    v = _variant(mm, q, (f"CUKERN_WGR_SKIP={skip}",))
                    t[f"wgr {what}"] = time_graph_us(lambda: v.gemm(nxt(), b, d, wgmma=True), n_inner=10, n_repeat=10)
            for defs in filter(None, os.environ.get("PROBE_DEFINES", "").split(",")):  # "A=1;B=2,C=1"
                v = _variant(mm, q, tuple(defs.split(";")))
                t[defs] = time_graph_us(lambda: v.gemm(nxt(), b, d, wgmma=True), n_inner=10, n_repeat=10)
            print(f"{name} {m}x{k} N={n}: " + " | ".join(f"{key} {us:.1f} us {tf(us):.0f} TF" for key, us in t.items())
                  + f" | eager: gemm vs deq+cuBLAS {t['deq+cuBLAS eager'] / t['default eager']:.2f}x", flush=True)
            nxt = b = d = dense = d16 = None
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
