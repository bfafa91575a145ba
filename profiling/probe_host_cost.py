"""Probe: what one eager ``MatmulDispatch.gemm`` call costs the host, against its device time.

A prefill loop issues its GEMMs eagerly; where the Python dispatch takes longer than the kernel,
back-to-back calls leave the GPU idle and the eager time is the host's. Per case this prints the
host time per call (50 calls issued, before the synchronise), the eager back-to-back device time
(``time_stream_us``, as bench_matmul times rows above ~50 us), the CUDA-graph replay time (no host
cost) and dequantize + cuBLAS over back-to-back calls; then a cProfile of the first case's calls.
Run: PYTHONPATH=. python profiling/probe_host_cost.py   (PROBE_CASES=Q4_K:4096x4096x512,...)
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

import cupy

from cukern.benchmark import rotating, time_graph_us, time_stream_us
from cukern.matmul import MatmulDispatch

sys.path.insert(0, "profiling")
from bench_matmul import random_weight_device

_CASES = "Q4_K:4096x4096x512,Q6_K:4096x4096x512,Q5_0:4096x4096x512,Q8_0:4096x4096x512,Q4_K:14336x4096x512"


def _case(mm: MatmulDispatch, name: str, m: int, k: int, n: int, rng):
    """(gemm call, dequantize + cuBLAS call) over three rotating weights."""
    ws = [random_weight_device(name, m, k, rng) for _ in range(3)]
    _, nxt = rotating(len(ws), lambda i: ws[i])
    b16 = rng.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
    d = cupy.empty((n, m), cupy.float32)
    dense, d16 = cupy.empty((m, k), cupy.float16), cupy.empty((n, m), cupy.float16)
    return (lambda: mm.gemm(nxt(), b16, d),
            lambda: (mm.dequantize(nxt(), dense), cupy.matmul(b16, dense.T, out=d16)))


def main() -> None:
    mm = MatmulDispatch()
    rng = cupy.random.default_rng(0)
    first = None
    print(f"{'case':28s} {'host/call':>9s} {'eager':>8s} {'graph':>8s} {'deq+cuBLAS':>10s}  (us)")
    for case in os.environ.get("PROBE_CASES", _CASES).split(","):
        name, shape = case.split(":")
        call, peer_call = _case(mm, name, *(int(v) for v in shape.split("x")), rng)
        for _ in range(3):
            call()
        cupy.cuda.Device().synchronize()
        t = time.perf_counter()
        for _ in range(50):
            call()
        host = (time.perf_counter() - t) / 50 * 1e6
        cupy.cuda.Device().synchronize()
        eager, graph, peer = time_stream_us(call), time_graph_us(call), time_stream_us(peer_call)
        print(f"{case:28s} {host:9.1f} {eager:8.1f} {graph:8.1f} {peer:10.1f}", flush=True)
        first = first or call
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        first()
    prof.disable()
    cupy.cuda.Device().synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
