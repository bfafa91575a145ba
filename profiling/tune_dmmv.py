"""Scratch sweep (not part of the suite): dmmv GB/s per variant (rows per block R, loop V) and
warps per block, for the required types at the two 14336/4096 shapes."""
import cupy
import cukern.dmmv as D
from cukern.benchmark import measure_ceilings, time_graph_us
from cukern.runtime import FamilySpec, KernelSpec
from profiling.bench_dmmv import _weights

TYPES = ["Q4_0", "Q5_0", "Q8_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K", "F16"]
VARIANTS = [(1, 2, 0), (1, 2, 1), (1, 4, 0), (1, 4, 1), (1, 1, 1)]  # (NC, R, V)
BATCH = [(n, r, v) for n in (2, 4, 8) for r, v in ((2, 0), (1, 0), (2, 1), (1, 1))]
names = [f"dmmv<{D.qtype_id(t)}, {n}, {r}, {v}>" for t in TYPES for n, r, v in VARIANTS]
names += [f"dmmv<12, {n}, {r}, {v}>" for n, r, v in BATCH]
unit = D._Unit(FamilySpec("dmmv_tune", tuple(KernelSpec(n, "DmmvParams") for n in names),
                          source="dmmv/dmmv.cu", params_header="dmmv/params.cuh"))
ceil = measure_ceilings()
print(f"copy {ceil.copy_gbs:.0f} GB/s")
d = D.DmmvDispatch()


def launch(w, x, y, n, r, v, nw):
    blocks = -(-w.m // r)
    p = d._params(w, blocks1=blocks, y_stride=w.m)
    unit._launch(f"dmmv<{w.qtype}, {n}, {r}, {v}>", blocks, nw * 32, (y, y, w.buf, w.buf, x, y), p)


for m, k in [(14336, 4096), (4096, 14336)]:
    for name in TYPES:
        qt = D.qtype_id(name)
        (sets, nxt), wb = _weights(qt, m, k)
        x = cupy.random.standard_normal(k, dtype=cupy.float32)
        y = cupy.empty(m, cupy.float32)
        best = []
        for n, r, v in VARIANTS:
            for nw in (2, 4, 8):
                us = time_graph_us(lambda: launch(nxt(), x, y, n, r, v, nw))
                best.append((us, f"R{r}V{v}w{nw}"))
        best.sort()
        print(f"{m}x{k} {name:6s} " + " ".join(f"{t}:{wb/us/1e3/ceil.copy_gbs:.0%}" for us, t in best[:6]),
              flush=True)
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
m, k = 4096, 14336
(sets, nxt), wb = _weights(12, m, k)
for n in (2, 4, 8):
    x = cupy.random.standard_normal((n, k), dtype=cupy.float32)
    y = cupy.empty((n, m), cupy.float32)
    res = []
    for nn, r, v in BATCH:
        if nn != n:
            continue
        for nw in (2, 4, 8):
            us = time_graph_us(lambda: launch(nxt(), x, y, n, r, v, nw))
            res.append((us, f"R{r}V{v}w{nw}"))
    res.sort()
    print(f"batch Q4_K n={n} " + " ".join(f"{t}:{us:.1f}us/{wb/us/1e3/ceil.copy_gbs:.0%}" for us, t in res[:6]), flush=True)
