"""Scratch sweep (not part of the suite): the int8 dmmv path (cuda_src/dmmv/q8.cuh) per streaming
shape (LU units per lane, ST ring slots, CR contiguous rows) and warps per block, for the required
types at the two 14336/4096 shapes; % of the copy ceiling measured in the same run."""
import itertools

import cupy

import cukern.dmmv as D
from cukern.benchmark import measure_ceilings, time_graph_us
from cukern.runtime import FamilySpec, KernelSpec
from profiling.bench_dmmv import _weights

TYPES = ["Q4_0", "Q5_0", "Q8_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K"]
CFGS = list(itertools.product((1, 2), (2, 3, 4), (0, 1)))
names = sorted({D._q8_kernel(D.qtype_id(t), 1, c) for t in TYPES for c in CFGS})
unit = D._Unit(FamilySpec("dmmv_q8_tune", tuple(KernelSpec(n, "DmmvParams") for n in names),
                          source="dmmv/dmmv.cu", params_header="dmmv/params.cuh"))
ceil = measure_ceilings()
n_sm = cupy.cuda.Device().attributes["MultiProcessorCount"]
limit = cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
print(f"copy {ceil.copy_gbs:.0f} GB/s", flush=True)
d = D.DmmvDispatch()

for m, k in [(14336, 4096), (4096, 14336)]:
    for name in TYPES:
        qt = D.qtype_id(name)
        (sets, nxt), wb = _weights(qt, m, k)
        x = cupy.random.standard_normal(k, dtype=cupy.float32)
        y = cupy.empty(m, cupy.float32)
        res = []
        for cfg in CFGS:
            for nw in (16, 32):
                smem = D._q8_smem(qt, nw, 1, k, cfg)
                if smem > limit:
                    continue
                kern = D._q8_kernel(qt, 1, cfg)
                unit._function(kern, smem)
                p = d._params(w=nxt(), blocks1=0, y_stride=m)
                us = time_graph_us(lambda: unit._launch(kern, min(n_sm, -(-m // nw)), nw * 32,
                                                        (y, nxt().buf, x, y), p, shared_mem=smem))
                res.append((us, f"LU{cfg[0]}S{cfg[1]}C{cfg[2]}w{nw}"))
        res.sort()
        print(f"{m}x{k} {name:6s} " + " ".join(f"{t}:{wb / us / 1e3 / ceil.copy_gbs:.0%}" for us, t in res[:8]),
              flush=True)
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
