"""gemm_wgr on weights repacked once at load (MatmulDispatch.pack, cuda_src/matmul/packed_wgr.cuh: each
lane's quants of a stage contiguous, the scales precomputed as f16, tile-major so that one bulk copy moves
a super-stage) against gemm_wgr on the GGUF bytes and dequantize + cuBLAS, in turns (medians of the rounds).
First checks the device packer against cukern.reference.matmul.pack_wgr (bit for bit) and the packed GEMM
against the float64 product of the packed values.

Run: PYTHONPATH=. python profiling/probe_matmul_packed.py   (PROBE_TYPES=Q4_K,Q8_0,Q6_K,Q5_0;
PROBE_CASES=MxKxN,...; PROBE_ROUNDS=4; PROBE_SPLIT=2: K slices of both gemm_wgr paths; PROBE_TILE=128: their token tile)

2026-11-26, ninth session (H100, graph replays, 256-token tiles, one K slice; x = deq + cuBLAS time / ours):
  * Q4_K repacked but read row by row (copy_raw's 16-byte cp.async by three producer warps, as the GGUF
    bytes are): 14336x4096 N = 2048 479 -> 439 us, 4096x14336 440 -> 382; Q6_K (one byte a quant) 596-618
    -> 478-495, 554-568 -> 453-467; Q8_0 (the same bytes, conversion without 2-byte loads) 511 -> 494-504:
    the conversion's instructions per stage (Q4_K ~190 -> ~110-160, Q6_K ~275 -> ~106-135) were part of the
    cost, but not the copies.
  * Tile-major (one cp.async.bulk of 20-40 KB per super-stage, issued by one thread), N = 2048:
      Q4_K 1.00-1.15x, Q8_0 1.13-1.29x, Q6_K 1.11-1.27x, Q5_0 1.08-1.16x over the three shapes (two runs);
      the GGUF path beside it 0.83-0.91, 0.82-0.93, 0.69-0.76, 0.80-0.90.
    N = 512, two K slices: 4096x4096 Q4_K 1.22x, Q8_0 1.43, Q6_K 1.30, Q5_0 1.23; 4096x14336 1.51 / 1.68 /
    1.56 / 1.50; one slice at 4096x4096 (64 CTAs): 0.93-0.94, 1.17-1.22, 1.05-1.07, 1.02.
    Those runs rotated three weight sets: at 4096x4096 (three packed copies ~31 MB) L2 held them. With
    enough sets (as now), 4096x4096 N = 2048: Q4_K 114.6 us (1.05x), Q5_0 108.5 (1.16x); 128-token tiles
    149.0 / 134.3 (0.81x / 0.91x); N = 1024 1.40x / 1.29x. Two K slices or three at N = 2048: 0.67-0.82x.
  * bench_matmul.py (eager timing of both sides, measured one after the other) put packed 4096x4096 Q4_K
    N = 2048 at 0.98x and 0.91x in two runs (114.6 / 123.5 us): the one shape where the packed path is not
    clearly ahead (256 CTAs, two waves; each CTA's fill and epilogue are not overlapped).
2026-11-26, tenth session (H100):
  * d by tensor stores (gemm_wgr.cuh's epilogue) instead of element stores: packed 4096x4096 N = 512 -5%,
    N = 2048 unchanged; bench_matmul (in turns, three rounds) then put every packed row at N = 512 and
    2048 at 1.01-1.7x deq + cuBLAS, Q4_K the closest (4096x4096 N = 2048 1.01x, 14336x4096 1.01x).
  * "packed eager" (10 eager calls, as the benchmark times N >= 512) against graph replays, 4096x4096 N =
    2048: Q4_K 119.2 / 116.9 us, Q5_0 118.5 / 118.3: the launch path is not what separates the two.
  * Q4_K's conversion with one shift a word instead of three (bits 4-7 of each half taken under the
    magic 0x5400, 64 + q with mantissa step 1/16; SASS -8 integer instructions per lane and stage), by
    probe_matmul_wgr.py --ab in turns: 4096x4096 N = 2048 105.5 / 105.3 us, 14336x4096 404 / 414,
    4096x14336 364 / 365, N = 512 40.2 / 39.9: within the spread, not kept. The Q4_K layout's gap to the
    byte layouts (3-6% at N = 2048) is not its conversion's instruction count.
  * It was the fifth activation slot, which Q4_K's smaller raw ring left room for (the byte layouts had
    four): capped at four (probe_matmul_wgr.py --ab PROBE_PACKED=1, a CUKERN_WGR_MAX_STAGES macro while
    measured), Q4_K 4096x4096 N = 2048 111.0 -> 104.0 us, 14336x4096 390 -> 364, 4096x14336 379 -> 349,
    N = 512 -3 to -4%; kept (gemm_wgr_stages), and bench_matmul then put every packed row at 1.05x or more.
  * Knock-outs on packed weights (14336x4096 N = 2048, medians of 4): Q4_K 359 us whole, 376 without the
    conversion, 383 without the raw copies, 371 MMAs only; Q8_0 354 / 339 / 381 / 369. The medians of the
    lighter variants are no faster than the whole kernel (their bests are, by ~10%): at this rate the
    GPU's clock under sustained tensor load moves the time as much as the work removed.
"""
from __future__ import annotations

import os
import sys

import cupy
import numpy as np

from cukern.benchmark import medians_in_turns, rotating, time_graph_us, time_stream_us
from cukern.matmul import MatmulDispatch
from cukern.reference.matmul import pack_wgr

sys.path.insert(0, "profiling")
from bench_matmul import _BY_NAME, random_weight_device


def check(mm: MatmulDispatch, name: str, rng) -> None:
    for m, k, n, split in [(300, 512, 70, 1), (128, 4096, 256, 1), (1000, 1024, 513, 1), (200, 2048, 300, 3)]:
        w = random_weight_device(name, m, k, rng)
        pw = mm.pack(w)
        want_bytes, vals = pack_wgr(w.buf.get(), _BY_NAME[name], m, k)
        assert np.array_equal(pw.buf.get(), want_bytes), f"{name}: device packer differs from the reference"
        b = rng.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
        d = cupy.full((n, m), cupy.nan, cupy.float32)
        mm.gemm(pw, b, d, split_k=split)
        want = b.get().astype(np.float64) @ vals.astype(np.float64).T
        err = float(np.abs(d.get() - want).max() / np.abs(want).max())
        print(f"check {name} {m}x{k} N={n} split {split}: max |err| / max |ref| {err:.2e}", flush=True)
        assert err < 1e-4, "packed gemm_wgr disagrees with its reference"


def time_case(mm, rng, name: str, m: int, k: int, n: int, rounds: int, split: int) -> None:
    """One shape: the three paths over rotating weights (enough copies that L2 does not serve them)."""
    n_sets = max(3, min(6, -(-(150 << 20) // (m * k))))  # weights + packed copies well past the 50 MB L2
    ws = [random_weight_device(name, m, k, rng) for _ in range(n_sets)]
    pws = [mm.pack(w) for w in ws]
    _, nxt = rotating(n_sets, lambda i: ws[i])
    _, nxp = rotating(n_sets, lambda i: pws[i])
    b = rng.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
    d = cupy.empty((n, m), cupy.float32)
    dense, d16 = cupy.empty((m, k), cupy.float16), cupy.empty((n, m), cupy.float16)
    fns = {
        "gemm_wgr GGUF": lambda: time_graph_us(lambda: mm.gemm(nxt(), b, d, wgmma=True, split_k=split),
                                               n_inner=10, n_repeat=5),
        "packed": lambda: time_graph_us(lambda: mm.gemm(nxp(), b, d, split_k=split), n_inner=10, n_repeat=5),
        "packed eager": lambda: time_stream_us(lambda: mm.gemm(nxp(), b, d, split_k=split)),
        "deq+cuBLAS": lambda: time_stream_us(lambda: (mm.dequantize(nxt(), dense), cupy.matmul(b, dense.T, out=d16))),
    }
    med = medians_in_turns(fns, rounds)
    peer = med["deq+cuBLAS"]
    print(f"{name} {m}x{k} N={n}{f' split {split}' if split > 1 else ''}: "
          + " | ".join(f"{key} {us:.1f} us ({peer / us:.2f}x peer)" for key, us in med.items()), flush=True)


def main() -> None:
    rng = cupy.random.default_rng(1)
    mm = MatmulDispatch()
    mm.WG_TILE = int(os.environ.get("PROBE_TILE", "256"))  # token tile of both gemm_wgr paths
    names = os.environ.get("PROBE_TYPES", "Q4_K,Q8_0,Q6_K,Q5_0").split(",")
    for name in names:
        check(mm, name, rng)
    cases = [(4096, 4096, 512), (4096, 4096, 2048), (14336, 4096, 2048), (4096, 14336, 2048)]
    if os.environ.get("PROBE_CASES"):
        cases = [tuple(int(v) for v in c.split("x")) for c in os.environ["PROBE_CASES"].split(",")]
    rounds = int(os.environ.get("PROBE_ROUNDS", "4"))
    split = int(os.environ.get("PROBE_SPLIT", "1"))
    for name in names:
        for m, k, n in cases:
            time_case(mm, rng, name, m, k, n, rounds, split)
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
