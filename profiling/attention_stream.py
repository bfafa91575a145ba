"""How fast can a kernel only read the K/V bytes of a decode step? A plain read-streaming kernel (16-byte
loads, 8 in flight per thread) over buffers of decode's sizes, timed in CUDA graphs with the buffers rotating
so that L2 never holds the one being read. Two access patterns at the same grid:
  contig: each block reads one contiguous range (all KV heads of a key range);
  head:   as decode does, block b reads the 256-byte slices of KV head b % 8 of its key range (rows of
          8 heads x 128 f16 = 2 KB: one head's slices sit at a 2 KB stride).
Scratch tool for the decode bandwidth question (is 80% of copy reachable at B1 KV8k at all?).

H100, 2026-11-26 (copy 2,966 GB/s; best grid of 132 ... 1056 blocks x 256 threads, % of copy):
  B1 KV2k 32/8 D128 = B1 KV8k 8/1 D256, 8.4 MB:   contig 4.31 us (66%), head 4.76 us (59%); 132 blocks 56% / 53%
  B1 KV8k 32/8 D128, 33.6 MB:                     contig 12.71 us (89%), head 12.80 us (88%); 132 blocks 77% / 69%
  B1 KV32k 32/8 D128, 134 MB:                     contig 45.34 us (100%), head 45.59 us (99%); 132 blocks 83% / 77%
So at 8.4 MB (one KV head of 256 at 8k keys) no kernel reads its bytes at 80% of copy; at 33.6 MB a bare
stream reaches 88-89%; from ~134 MB reads run at the copy rate (torch SDPA's B1 KV128k decode: 100.5%).

Run: PYTHONPATH=. python profiling/attention_stream.py  (STREAM_KV=2k,8k,32k,128k; 2k is the bytes of 8/1 D256 at KV8k; STREAM_GRIDS=128,132,264 blocks)
"""
from __future__ import annotations

import math
import os

import cupy

from cukern.benchmark import measure_ceilings, time_graph_us

_SRC = r"""
extern "C" __global__ void stream_read(const uint4* __restrict__ buf, unsigned long long n16, int mode, int heads,
                                       unsigned int* __restrict__ sink) {
    unsigned int acc = 0;
    const int U = 8;
    if (mode == 0) {
        const unsigned long long per = (n16 + gridDim.x - 1) / gridDim.x;
        const unsigned long long start = blockIdx.x * per, end = min(n16, start + per);
        for (unsigned long long i = start + threadIdx.x; i < end; i += (unsigned long long)blockDim.x * U) {
            uint4 v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const unsigned long long j = i + (unsigned long long)u * blockDim.x;
                v[u] = j < end ? __ldg(buf + j) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
    } else {
        const unsigned long long row16 = (unsigned long long)heads * 16;  // vectors per row
        const unsigned long long rows = n16 / row16;
        const unsigned int h = blockIdx.x % heads, nb = gridDim.x / heads, b = blockIdx.x / heads;
        const unsigned long long per = (rows + nb - 1) / nb;
        const unsigned long long r0 = b * per, r1 = min(rows, r0 + per);
        const unsigned int c = threadIdx.x % 16, rstep = blockDim.x / 16;
        for (unsigned long long r = r0 + threadIdx.x / 16; r < r1; r += (unsigned long long)rstep * U) {
            uint4 v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const unsigned long long rr = r + (unsigned long long)u * rstep;
                v[u] = rr < r1 ? __ldg(buf + rr * row16 + h * 16 + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads; (practically) never taken
}
"""


def main() -> None:
    kern = cupy.RawKernel(_SRC, "stream_read")
    ceil = measure_ceilings()
    print(f"copy ceiling {ceil.copy_gbs:,.0f} GB/s (read + write)")
    sink = cupy.zeros(1, cupy.uint32)
    sizes = {"2k": 2048, "8k": 8192, "32k": 32768, "128k": 131072}
    grids = [(int(g), 256) for g in os.environ.get("STREAM_GRIDS", "128,264,528,1056").split(",")]
    for kv in os.environ.get("STREAM_KV", "8k,32k").split(","):
        label, nbytes = f"B1 KV{kv} K+V", sizes[kv] * 8 * 128 * 2 * 2
        n_sets = max(2, math.ceil(200e6 / nbytes) + 1)
        bufs = [cupy.random.default_rng(i).integers(0, 2**31, nbytes // 4, dtype=cupy.int32) for i in range(n_sets)]
        n16 = nbytes // 16
        for mode, name in ((0, "contig"), (1, "head")):
            for blocks, threads in grids:
                k = {"i": 0}

                def step():
                    k["i"] += 1
                    kern((blocks,), (threads,), (bufs[k["i"] % n_sets], cupy.uint64(n16), cupy.int32(mode),
                                                 cupy.int32(8), sink))
                us = time_graph_us(step, n_inner=4 * n_sets, n_repeat=10)
                gbs = nbytes / us / 1e3
                print(f"{label:14s} {nbytes / 1e6:6.1f} MB {name:6s} grid {blocks:5d}x{threads:3d}: {us:8.2f} us "
                      f"{gbs:7,.0f} GB/s {100 * gbs / ceil.copy_gbs:4.0f}% of copy", flush=True)
        del bufs


if __name__ == "__main__":
    main()
