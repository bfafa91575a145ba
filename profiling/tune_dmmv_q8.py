"""Scratch sweep (not part of the suite): the int8 dmmv path (cuda_src/dmmv/q8.cuh) per streaming
shape (LU units per lane, ST ring slots, BULK copies) and block shape (warps per block, blocks per
SM), for the required types at the two 14336/4096 shapes and MoE top-8/128 at 2048x7168; % of the
copy ceiling measured in the same run, the best few per row.

Run: PYTHONPATH=. python profiling/tune_dmmv_q8.py [--types Q4_K,MXFP4] [--moe-only]"""
import argparse
import itertools

import cupy
import numpy as np

import cukern.dmmv as D
from cukern.benchmark import measure_ceilings, time_graph_us
from cukern.runtime import FamilySpec, KernelSpec
from profiling.bench_dmmv import _moe_weight, _rotating_ids, _weights

ap = argparse.ArgumentParser()
ap.add_argument("--types", default="Q4_0,Q5_0,Q8_0,MXFP4,Q4_K,Q5_K,Q6_K")
ap.add_argument("--moe", default="Q4_K,MXFP4")
ap.add_argument("--lu", default="1,2")
ap.add_argument("--st", default="2,3,4,6")
ap.add_argument("--bulk", default="0,1")
ap.add_argument("--top", type=int, default=6)
ap.add_argument("--probe", action="store_true", help="the access-order probe (cuda_src/dmmv/probe.cu) instead")
args = ap.parse_args()
TYPES = [t for t in args.types.split(",") if t]
MOE = [t for t in args.moe.split(",") if t]
CFGS = list(itertools.product(*(tuple(int(v) for v in a.split(",")) for a in (args.lu, args.st, args.bulk))))
BLOCKS = ((32, 1), (16, 2))  # (warps per block, blocks per SM)

def probe():
    """Time per access order (0 per-warp shares, 1 round-robin in the block, 2 round-robin over the grid),
    with and without the dot products, and Q4_0 over m (fixed cost = intercept)."""
    lu, st = 2, 3
    names = [f"dmmv_q8_probe<{D.qtype_id(t)}, {lu}, {st}, {o}, {c}>" for t in TYPES for o in (0, 1, 2) for c in (0, 1)]
    pu = D._Unit(FamilySpec("dmmv_probe", tuple(KernelSpec(n, "DmmvParams") for n in names),
                            source="dmmv/probe.cu", params_header="dmmv/params.cuh"))
    ceil = measure_ceilings()
    n_sm = cupy.cuda.Device().attributes["MultiProcessorCount"]
    print(f"copy {ceil.copy_gbs:.0f} GB/s, {n_sm} SMs", flush=True)
    d = D.DmmvDispatch()
    y = cupy.empty(64 * 1024, cupy.float32)
    shapes = [(14336, 4096), (4096, 14336)]
    for (m, k), name in itertools.product(shapes, TYPES):
        qt = D.qtype_id(name)
        (sets, nxt), wb = _weights(qt, m, k)
        x = cupy.random.standard_normal(k, dtype=cupy.float32)
        out = []
        for (nw, bps), o, c in itertools.product(((16, 2), (32, 1)), (0, 1, 2), (0, 1)):
            kern = f"dmmv_q8_probe<{qt}, {lu}, {st}, {o}, {c}>"
            smem = D._q8_smem(qt, nw, 1, k, (lu, st, 1))
            pu._function(kern, smem)
            p = d._params(w=nxt(), y_stride=m)
            us = time_graph_us(lambda: pu._launch(kern, min(m, n_sm * bps), nw * 32, (y, nxt().buf, x), p,
                                                  shared_mem=smem))
            out.append(f"w{nw}o{o}c{c}:{wb / us / 1e3 / ceil.copy_gbs:.0%}({us:.1f})")
        print(f"{m}x{k} {name:6s} " + " ".join(out), flush=True)
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
    qt, k = 2, 4096
    for o, c in ((0, 1), (2, 1), (2, 0)):
        kern = f"dmmv_q8_probe<{qt}, {lu}, {st}, {o}, {c}>"
        pts = []
        for m in (3584, 7168, 14336, 28672, 57344):
            (sets, nxt), wb = _weights(qt, m, k)
            x = cupy.random.standard_normal(k, dtype=cupy.float32)
            smem = D._q8_smem(qt, 16, 1, k, (lu, st, 1))
            p = d._params(w=nxt(), y_stride=m)
            us = time_graph_us(lambda: pu._launch(kern, min(m, n_sm * 2), 16 * 32, (y, nxt().buf, x), p,
                                                  shared_mem=smem))
            pts.append((wb, us))
            del sets
            cupy.get_default_memory_pool().free_all_blocks()
        b, a = np.polyfit([q[0] for q in pts], [q[1] for q in pts], 1)
        print(f"Q4_0 k=4096 o{o}c{c} over m: " + " ".join(f"{q[0] / 1e6:.0f}MB:{q[1]:.1f}us" for q in pts)
              + f"  fit: {a:.2f} us + bytes / {1e-3 / b:.0f} GB/s", flush=True)


if args.probe:
    probe()
    raise SystemExit(0)

qts = [D.qtype_id(t) for t in TYPES]
unit = D._Unit(FamilySpec("dmmv_q8_tune", tuple(KernelSpec(D._q8_kernel(q, 1, c), "DmmvParams")
                                               for q in qts for c in CFGS),
                          source="dmmv/dmmv.cu", params_header="dmmv/params.cuh")) if qts else None
mqts = [D.qtype_id(t) for t in MOE]
moe_unit = D._Unit(FamilySpec("dmmv_moe_q8_tune", tuple(KernelSpec(D._q8_kernel(q, None, c), "MoeParams")
                                                       for q in mqts for c in CFGS),
                              source="dmmv/moe.cu", params_header="dmmv/params.cuh")) if mqts else None
ceil = measure_ceilings()
n_sm = cupy.cuda.Device().attributes["MultiProcessorCount"]
limit = cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
per_sm = cupy.cuda.Device().attributes["MaxSharedMemoryPerMultiprocessor"]
print(f"copy {ceil.copy_gbs:.0f} GB/s, {n_sm} SMs", flush=True)
d = D.DmmvDispatch()


def fits(qt, cfg, nw, bps, nc, k):
    smem = D._q8_smem(qt, nw, nc, k, cfg)
    return smem if smem <= limit and bps * (smem + 1024) <= per_sm else None


def report(label, nbytes, res):
    res.sort()
    print(f"{label} " + " ".join(f"{t}:{nbytes / us / 1e3 / ceil.copy_gbs:.0%}({us:.1f})" for us, t in res[:args.top]),
          flush=True)


for (m, k), name in itertools.product([(14336, 4096), (4096, 14336)], TYPES):
    qt = D.qtype_id(name)
    (sets, nxt), wb = _weights(qt, m, k)
    x = cupy.random.standard_normal(k, dtype=cupy.float32)
    y = cupy.empty(m, cupy.float32)
    res = []
    for cfg, (nw, bps) in itertools.product(CFGS, BLOCKS):
        smem = fits(qt, cfg, nw, bps, 1, k)
        if smem is None:
            continue
        kern = D._q8_kernel(qt, 1, cfg)
        unit._function(kern, smem)
        p = d._params(w=nxt(), blocks1=0, y_stride=m)
        g = min(m, n_sm * bps)
        us = time_graph_us(lambda: unit._launch(kern, g, nw * 32, (y, nxt().buf, x, y), p, shared_mem=smem))
        res.append((us, f"L{cfg[0]}S{cfg[1]}B{cfg[2]}w{nw}x{bps}"))
    report(f"{m}x{k} {name:6s}", wb + 4 * (m + k), res)
    del sets
    cupy.get_default_memory_pool().free_all_blocks()

n_e, top_k, m, k = 128, 8, 2048, 7168
for name in MOE:
    qt = D.qtype_id(name)
    w, ebytes = _moe_weight(qt, n_e, m, k)
    ids = _rotating_ids(np.random.default_rng(2), n_e, top_k)
    x = cupy.random.standard_normal((1, k), dtype=cupy.float32)
    y = cupy.empty((1, top_k, m), cupy.float32)
    p = d._moe_params(w, top_k=top_k, n_slots=top_k, x_per_slot=False)
    res = []
    for cfg, (nw, bps) in itertools.product(CFGS, BLOCKS):
        smem = fits(qt, cfg, nw, bps, 1, k)
        if smem is None:
            continue
        kern = D._q8_kernel(qt, None, cfg)
        moe_unit._function(kern, smem)
        per_slot = max(1, min(m, n_sm * bps // top_k))
        us = time_graph_us(lambda: moe_unit._launch(kern, (per_slot, top_k), nw * 32, (y, d.error_flag, w.buf, x, ids()),
                                                    p, shared_mem=smem))
        res.append((us, f"L{cfg[0]}S{cfg[1]}B{cfg[2]}w{nw}x{bps}"))
    report(f"moe {name:6s}", top_k * ebytes + 4 * (k + top_k * m), res)
    del w
    cupy.get_default_memory_pool().free_all_blocks()
d.check_errors()
