"""Probe for issue #5's softmax_topk row: the thread-per-token kernel against the warp-per-token one over
token counts (where _TOPK_THREAD_MIN_TOKENS should sit). Prints device time per call (CUDA graph of 16
calls for large counts), GB/s from the counted bytes, and the kernels' registers / local memory."""
import cupy
import numpy as np

import cukern.elementwise as ew
from cukern.benchmark import measure_ceilings, rotating, time_graph_us

d = ew.ElementwiseDispatch()
ceil = measure_ceilings()
print(f"copy ceiling {ceil.copy_gbs:,.0f} GB/s")
rng = cupy.random.default_rng(0)


def attrs(unit, name):
    try:
        f = unit._function(name)
        print(f"  {name}: regs {f.num_regs}, local {f.local_size_bytes} B, max threads {f.max_threads_per_block}")
    except Exception as e:  # noqa: BLE001
        print(f"  {name}: {e}")


def row(label, us, nbytes):
    gbs = nbytes / us / 1e3
    print(f"{label:60s} {us:9.2f} us {gbs:8.0f} GB/s {100 * gbs / ceil.copy_gbs:5.0f}%")


# ---- softmax_topk
E = 128
for k in (8, 4):
    for n in (4096, 8192, 16384, 32768, 262144):
        _, lnxt = rotating(max(1, min(16, (200 << 20) // (n * E * 4))),
                           lambda i: (rng.standard_normal((n, E), dtype=cupy.float32) * 3,
                                      cupy.empty((n, k), cupy.int32), cupy.empty((n, k), cupy.float32)))
        inner = {} if n < 2048 else dict(n_inner=16, n_repeat=10)
        nbytes = n * (E + 2 * k) * 4
        saved = ew._TOPK_THREAD_MIN_TOKENS
        for label, thr in (("thread", 1), ("warp", 1 << 40)):
            ew._TOPK_THREAD_MIN_TOKENS = thr
            us = time_graph_us(lambda: (lambda s: d.softmax_topk(s[0], s[1], s[2], k=k))(lnxt()), **inner)
            row(f"softmax_topk {label} {n}x{E} k={k}", us, nbytes)
        ew._TOPK_THREAD_MIN_TOKENS = saved
for n_, k_ in ((128, 8), (128, 4), (64, 8), (64, 4)):
    attrs(d, f"softmax_topk_thread<{n_}, {k_}>")
attrs(d, "softmax_topk_reg<4>")
