"""Probe for issue #5's softmax_topk row: the lane-group kernel (softmax_topk_lanes) against the
thread-per-token and warp-per-token ones over token counts, expert counts and k. Prints device time per
call (CUDA graph of 16 calls for large counts, 50 for small), GB/s from the counted bytes, % of the copy
ceiling, and the kernels' registers / local memory."""
import cupy

import cukern.elementwise as ew
from cukern.benchmark import measure_ceilings, rotating, time_graph_us

d = ew.ElementwiseDispatch()
ceil = measure_ceilings()
print(f"copy ceiling {ceil.copy_gbs:,.0f} GB/s")
rng = cupy.random.default_rng(0)


def attrs(name):
    try:
        f = d._function(name)
        print(f"  {name}: regs {f.num_regs}, local {f.local_size_bytes} B, max threads {f.max_threads_per_block}")
    except Exception as e:  # noqa: BLE001
        print(f"  {name}: {e}")


def row(label, us, nbytes):
    gbs = nbytes / us / 1e3
    print(f"{label:52s} {us:9.2f} us {gbs:8.0f} GB/s {100 * gbs / ceil.copy_gbs:5.0f}%", flush=True)


KERNELS = {"lanes": (True, 1 << 40), "thread": (False, 1), "warp": (False, 1 << 40)}
for E, k, counts in ((128, 8, (1, 64, 4096, 32768, 262144)), (128, 4, (32768, 262144)), (64, 8, (262144,)),
                     (256, 8, (131072,)), (128, 16, (262144,))):
    for n in counts:
        _, lnxt = rotating(max(1, min(16, (200 << 20) // (n * E * 4))),
                           lambda i: (rng.standard_normal((n, E), dtype=cupy.float32) * 3,
                                      cupy.empty((n, k), cupy.int32), cupy.empty((n, k), cupy.float32)))
        inner = {} if n < 2048 else dict(n_inner=16, n_repeat=10)
        nbytes = n * (E + 2 * k) * 4
        for label, (lanes, thr) in KERNELS.items():
            if label == "thread" and (n < 32768 or E > 128 or k > 8):
                continue
            ew._TOPK_USE_LANES, ew._TOPK_THREAD_MIN_TOKENS = lanes, thr
            us = time_graph_us(lambda: (lambda s: d.softmax_topk(s[0], s[1], s[2], k=k))(lnxt()), **inner)
            row(f"softmax_topk {label:6s} {n}x{E} k={k}", us, nbytes)
ew._TOPK_USE_LANES, ew._TOPK_THREAD_MIN_TOKENS = True, 32768
for name in ("softmax_topk_lanes<4, 2>", "softmax_topk_lanes<4, 1>", "softmax_topk_lanes<8, 4>",
             "softmax_topk_thread<128, 8>", "softmax_topk_reg<4>"):
    attrs(name)

# ---- router_matvec at the bench's large size: a small f32 GEMM against cuBLAS sgemm (cupy.matmul)
for n, H, E in ((8192, 2048, 128), (2048, 2048, 128), (8192, 4096, 64)):
    _, xnxt = rotating(4, lambda i: rng.standard_normal((n, H), dtype=cupy.float32))
    W = rng.standard_normal((E, H), dtype=cupy.float32) * 0.02
    lg, lg2 = cupy.empty((n, E), cupy.float32), cupy.empty((n, E), cupy.float32)
    fl = 2 * n * E * H
    us = time_graph_us(lambda: d.router_matvec(xnxt(), W, lg), n_inner=16, n_repeat=10)
    us_blas = time_graph_us(lambda: cupy.matmul(xnxt(), W.T, out=lg2), n_inner=16, n_repeat=10)
    print(f"router {n}x{H} @ {E}: cukern {us:8.2f} us {fl / us / 1e6:6.1f} TFLOP/s; cupy.matmul {us_blas:8.2f} us "
          f"{fl / us_blas / 1e6:6.1f} TFLOP/s; x cuBLAS {us_blas / us:.2f}", flush=True)
