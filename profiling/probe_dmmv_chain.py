"""Probe: the int8 matvec on f32 x as one launch (each block quantizes x itself) against two
launches -- quantize_x into a QuantizedX, then the matvec that copies it -- chained under
programmatic dependent launch, graph-replayed with rotating weights, as bench_dmmv times its rows.
Would DmmvDispatch.dmmv on f32 x be faster as the chain at long k? % of the copy ceiling on the
bytes of the weights, x and y.
Run: PYTHONPATH=. python profiling/probe_dmmv_chain.py   (PROBE_TYPES=MXFP4,Q4_0 PROBE_SHAPES=4096x14336)

H100, 2026-11-26 (copy 2,887 GB/s; best of three graph timings): the one launch is faster
everywhere, so dmmv on f32 x stays one launch --
  4096x14336:  MXFP4 13.58 us (79.8%) vs 14.72 (73.6%); Q4_0 13.19 (87.0%) vs 13.85; Q4_K 13.25 vs 14.07
  14336x4096:  MXFP4 12.77 us (84.8%) vs 14.19 (76.3%); Q4_0 12.55 (91.4%) vs 14.39; Q4_K 12.58 vs 14.57
"""

from __future__ import annotations

import os
import sys

import cupy

from cukern.benchmark import measure_ceilings, time_graph_us
from cukern.dmmv import DmmvDispatch, QuantizedX, qtype_id

sys.path.insert(0, "profiling")
from bench_dmmv import _weights


def main() -> None:
    d = DmmvDispatch(pdl=True)
    ceil = measure_ceilings()
    print(f"copy {ceil.copy_gbs:,.0f} GB/s")
    for shape in os.environ.get("PROBE_SHAPES", "4096x14336,14336x4096").split(","):
        m, k = (int(v) for v in shape.split("x"))
        for name in os.environ.get("PROBE_TYPES", "MXFP4,Q4_0,Q4_K").split(","):
            qt = qtype_id(name)
            (sets, nxt), wbytes = _weights(qt, m, k)
            x = cupy.random.standard_normal(k, dtype=cupy.float32)
            y = cupy.empty(m, cupy.float32)
            qx = QuantizedX.empty(x.shape, qt)
            nbytes = wbytes + 4 * (k + m)
            cells = []
            for label, fn in (("one launch", lambda: d.dmmv(nxt(), x, y)),
                              ("quantize_x + q8x", lambda: (d.quantize_x(x, qx), d.dmmv(nxt(), qx, y)))):
                best = min(time_graph_us(fn) for _ in range(3))
                cells.append(f"{label} {best:.2f} us {nbytes / best / 1e3 / ceil.copy_gbs:.1%}")
            print(f"{name} {m}x{k}: " + " | ".join(cells), flush=True)
            del sets
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
