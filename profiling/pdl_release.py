"""How long after a kernel's last block leaves does the next kernel's pdl_wait return? A chain of launches
of one small kernel with programmatic dependent launch, captured in a CUDA graph: every block calls
griddepcontrol.launch_dependents at entry, waits, records %globaltimer after the wait, spins for a set time
(work), optionally stores a few KB and does one gpu-scope acq_rel atomic (what decode_tc's split merge ends
with), and records its leaving time (atomicMax over the blocks). The gap between launch i's last leave and
launch i + 1's earliest return from the wait is the release latency that a decode step pays once.
Options: 200 KB of dynamic shared memory a block (one block per SM, so the next launch's blocks start as these
leave, as decode_tc w8 does), block 0 ending a few us after the others (a merging block), and 64-200 KB a
block read or prefetched into L2 before the wait (the reads are one dependent load after another per thread,
so that variant mostly measures its own slow prologue).

H100, 2026-11-26: the release costs 0.42-0.58 us (median) in every variant, up to 2.4 us at worst with 200 KB a
block before the wait. Scratch tool for the B1 KV8k decode question; a single decode launch's clocks had
suggested ~3.9 us, but the pair of clocked launches mid-graph (attention_blocks.py BLOCKS_PAIR=1) measures
0.38-0.48 us there too: the step's cost is before the last block leaves, not after.

Run: PYTHONPATH=. python profiling/pdl_release.py
"""
from __future__ import annotations

import cupy
import numpy as np

from cukern import dispatch
from cukern.streams import capture_graph

_SRC = r"""
extern "C" __global__ void chain(unsigned long long* clocks, float* sink, int idx, long long spin_ns, int store,
                                 int atomic, int* counter, const uint4* buf, unsigned long long buf16, int pre_kb,
                                 int prefetch, long long tail_ns) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    // pre_kb KB per block read (or prefetched into L2) from DRAM before the wait, as a decode's prologue does
    unsigned int acc = 0;
    const unsigned long long per = (unsigned long long)pre_kb * 64;  // 16-byte vectors per block
    const unsigned long long base = (((unsigned long long)idx * gridDim.x + blockIdx.x) * per) % (buf16 - per);
    for (unsigned long long i = threadIdx.x * (prefetch ? 8 : 1); i < per; i += blockDim.x * (prefetch ? 8 : 1)) {
        if (prefetch) asm volatile("prefetch.global.L2 [%0];" ::"l"(buf + base + i) : "memory");
        else { uint4 v = __ldcg(buf + base + i); acc ^= v.x; }
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (acc == 0x12345678u) sink[0] = 1.0f;
    unsigned long long t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    if (threadIdx.x == 0) atomicMin(clocks + 2 * idx, t0);
    unsigned long long t = t0;
    const long long work = spin_ns + (blockIdx.x == 0 ? tail_ns : 0);  // block 0 ends last, as a merging block
    while ((long long)(t - t0) < work) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (store) sink[(blockIdx.x * blockDim.x + threadIdx.x) % (1 << 20)] = (float)t;
    __syncthreads();
    if (atomic && threadIdx.x == 0) {
        int old;
        asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
        sink[blockIdx.x] = (float)old;
    }
    unsigned long long t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    if (threadIdx.x == 0) atomicMax(clocks + 2 * idx + 1, t1);
}
"""


def _release(kern, bufs, blocks, threads, spin_us, store, atomic, pre_kb, prefetch, smem_kb, tail_us, n=24):
    """Median (and range of) last leave -> next wait return, and the step, over replays of n chained launches."""
    clocks, sink, counter, buf = bufs

    def launches(stream):
        for i in range(n):
            args = [clocks, sink, np.int32(i), np.int64(spin_us * 1000), np.int32(store), np.int32(atomic), counter,
                    buf, np.uint64(buf.size // 16), np.int32(pre_kb), np.int32(prefetch), np.int64(tail_us * 1000)]
            dispatch._launch_pdl("chain", kern, (blocks, 1, 1), (threads, 1, 1), args, smem_kb * 1024)
    graph = capture_graph(launches)
    gaps, steps = [], []
    for _ in range(5):
        c = np.empty(2 * n, np.uint64)
        c[0::2], c[1::2] = np.iinfo(np.uint64).max, 0
        clocks.set(c)
        graph.replay(cupy.cuda.get_current_stream())
        cupy.cuda.get_current_stream().synchronize()
        t = clocks.get().astype(np.int64).reshape(n, 2)
        gaps += list((t[1:, 0] - t[:-1, 1]) / 1e3)[4:]
        steps += list((t[1:, 0] - t[:-1, 0]) / 1e3)[4:]
    return np.median(gaps), min(gaps), max(gaps), np.median(steps)


def main():
    kern = cupy.RawKernel(_SRC, "chain")
    bufs = (cupy.empty(2 * 24, cupy.uint64), cupy.zeros(1 << 20, cupy.float32), cupy.zeros(1, cupy.int32),
            cupy.empty(1 << 30, cupy.uint8))
    kern.max_dynamic_shared_size_bytes = 200 * 1024
    cases = [(b, t, w, s, a, 0, 0, 0, 0) for b, t in ((1, 32), (128, 256)) for w in (0, 5) for s, a in ((0, 0), (1, 1))]
    # as decode_tc w8 at B1 KV8k: one 200 KB block per SM (the next launch's blocks start as these leave), one
    # block ending 3 us after the others, the next launch's prologue reading or prefetching 0-200 KB a block
    cases += [(128, 256, 5, 1, 1, kb, pf, smem, tail) for smem in (0, 200) for tail in (0, 3)
              for kb, pf in ((0, 0), (64, 0), (200, 0), (200, 1))]
    for blocks, threads, spin_us, store, atomic, pre_kb, prefetch, smem_kb, tail_us in cases:
        med, lo, hi, step = _release(kern, bufs, blocks, threads, spin_us, store, atomic, pre_kb, prefetch, smem_kb,
                                     tail_us)
        print(f"{blocks:4d} blocks x {threads:3d} ({smem_kb:3d} KB), work {spin_us} us (+{tail_us} block 0), store "
              f"{store}, atomic {atomic}, {pre_kb:3d} KB a block {'prefetched' if prefetch else 'read'} before the "
              f"wait: last leave -> next wait returns {med:.2f} us ({lo:.2f} - {hi:.2f}); step {step:.2f} us",
              flush=True)

if __name__ == "__main__":
    main()
