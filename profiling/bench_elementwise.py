"""Elementwise family benchmark: GB/s against the copy ceiling measured in the same run, and the
ratio to the torch op a user would otherwise call (also measured here).

Bytes counted: every input read once, every output written once.
Run: PYTHONPATH=. python profiling/bench_elementwise.py [--json out.json]
"""

from __future__ import annotations

import argparse
import sys

import cupy

from cukern.benchmark import (Row, host_us_per_call, measure_ceilings, print_table, rotating, rows_to_json,
                              time_graph_us, time_torch_graph_us, time_us)
from cukern.elementwise import ElementwiseDispatch

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the peer is optional; rows then show no ratio
    torch = None


def _t(a):
    return torch.from_dlpack(a) if torch is not None else None


def bench(quick: bool = False) -> tuple[list, object]:
    d = ElementwiseDispatch()
    ceil = measure_ceilings()
    rows = []
    rng = cupy.random.default_rng(0)
    norm_shapes = [(1, 4096), (16, 4096)] + ([] if quick else [(8192, 4096)])
    for n_rows, n_cols in norm_shapes:
        nbytes_io = n_rows * n_cols * 4
        n_sets = max(1, min(16, (200 << 20) // (3 * nbytes_io)))  # rotate through > 4x L2
        sets, nxt = rotating(n_sets, lambda i: (rng.standard_normal((n_rows, n_cols), dtype=cupy.float32),
                                                rng.standard_normal(n_cols, dtype=cupy.float32),
                                                cupy.empty((n_rows, n_cols), cupy.float32)))
        # decode-sized launches are timed as a decode loop runs them: replayed from a CUDA graph
        small = nbytes_io < (1 << 20)
        timer = time_graph_us if small else time_us
        us = timer(lambda: d.rms_norm(*nxt(), eps=1e-6))
        peer_us = None
        if torch is not None:
            tsets = [(_t(x), _t(w)) for x, w, _ in sets]
            k = {"i": 0}

            def peer():
                x, w = tsets[k["i"] % n_sets]
                k["i"] += 1
                F.rms_norm(x, (n_cols,), w, eps=1e-6)
            peer_us = (time_torch_graph_us if small else time_us)(peer)
        gbs = (2 * nbytes_io + n_cols * 4) / (us * 1e-6) / 1e9
        rows.append(Row("elementwise", "rms_norm" + (" (graph)" if small else ""), f"{n_rows}x{n_cols}", us, gbs=gbs, pct_ceiling=gbs / ceil.copy_gbs,
                        peer="torch F.rms_norm", peer_us=peer_us))

    n = (1 << 22) if quick else (1 << 25)  # 16 MB or 128 MB per operand
    a, b, out = (rng.standard_normal(n, dtype=cupy.float32) for _ in range(3))
    us = time_us(lambda: d.add_scaled(a, b, out, alpha=0.5))
    peer_us = time_us(lambda: torch.add(_t(a), _t(b), alpha=0.5, out=_t(out))) if torch is not None else None
    gbs = 3 * n * 4 / (us * 1e-6) / 1e9
    rows.append(Row("elementwise", "add_scaled", f"{n}", us, gbs=gbs, pct_ceiling=gbs / ceil.copy_gbs,
                    peer="torch.add(alpha)", peer_us=peer_us))
    us = time_us(lambda: d.scale(a, out, alpha=0.5))
    peer_us = time_us(lambda: torch.mul(_t(a), 0.5, out=_t(out))) if torch is not None else None
    gbs = 2 * n * 4 / (us * 1e-6) / 1e9
    rows.append(Row("elementwise", "scale", f"{n}", us, gbs=gbs, pct_ceiling=gbs / ceil.copy_gbs,
                    peer="torch.mul", peer_us=peer_us))

    # host cost of one dispatch (validate, pack, launch) against a bare CuPy elementwise call
    a, out = a[:1024], out[:1024]
    host = host_us_per_call(lambda: d.scale(a, out, alpha=0.5))
    peer_host = host_us_per_call(lambda: cupy.multiply(a, 0.5, out=out))
    rows.append(Row("elementwise", "scale: host us per call", "1024", host, peer="cupy.multiply(out=)",
                    peer_us=peer_host))
    return rows, ceil


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--quick", action="store_true", help="small sizes only")
    args = ap.parse_args(argv)
    rows, ceil = bench(args.quick)
    print_table(rows, ceil, "elementwise")
    if args.json:
        with open(args.json, "w") as f:
            f.write(rows_to_json(rows, ceil))
    return 0


if __name__ == "__main__":
    sys.exit(main())
