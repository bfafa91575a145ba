"""Probe for issue #5's softmax_topk row: the lane-group kernel (softmax_topk_lanes) against the
warp-per-token one over token counts, expert counts and k (where _TOPK_LANES_MIN_TOKENS should sit). Prints device time per
call (CUDA graph of 16 calls for large counts, 50 for small), GB/s from the counted bytes, % of the copy
ceiling, and the kernels' registers / local memory."""
import cupy

import cukern.elementwise as ew
from cukern.benchmark import measure_ceilings, rotating, time_graph_us, time_us

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


KERNELS = {"lanes": 1, "warp": 1 << 40}  # _TOPK_LANES_MIN_TOKENS
for E, k, counts in ((128, 8, (1, 64, 4096, 8192, 16384, 262144)), (128, 4, (8192, 262144)), (64, 8, (262144,)),
                     (256, 8, (131072,)), (128, 16, (262144,))):
    for n in counts:
        _, lnxt = rotating(max(1, min(16, (200 << 20) // (n * E * 4))),
                           lambda i: (rng.standard_normal((n, E), dtype=cupy.float32) * 3,
                                      cupy.empty((n, k), cupy.int32), cupy.empty((n, k), cupy.float32)))
        inner = {} if n < 2048 else dict(n_inner=16, n_repeat=10)
        nbytes = n * (E + 2 * k) * 4
        for label, min_tokens in KERNELS.items():
            ew._TOPK_LANES_MIN_TOKENS = min_tokens
            us = time_graph_us(lambda: (lambda s: d.softmax_topk(s[0], s[1], s[2], k=k))(lnxt()), **inner)
            row(f"softmax_topk {label:6s} {n}x{E} k={k}", us, nbytes)
ew._TOPK_LANES_MIN_TOKENS = 8192
for name in ("softmax_topk_lanes<4, 2>", "softmax_topk_lanes<4, 4>", "softmax_topk_lanes<8, 4>", "softmax_topk_reg<4>"):
    attrs(name)

# ---- router_matvec token batches: a small f32 GEMM; router_gemm and the old tiled kernel against cuBLAS sgemm
# (cupy.matmul: CuPy refuses cuBLAS calls during graph capture, so 16 eager calls between two events, per call)
for n, H, E in ((8192, 2048, 128), (2048, 2048, 128), (512, 2048, 128), (8192, 4096, 64), (8192, 2880, 32)):
    _, xnxt = rotating(4, lambda i: rng.standard_normal((n, H), dtype=cupy.float32))
    W = rng.standard_normal((E, H), dtype=cupy.float32) * 0.02
    wn = rng.standard_normal(H, dtype=cupy.float32)
    lg, lg2 = cupy.empty((n, E), cupy.float32), cupy.empty((n, E), cupy.float32)
    fl = 2 * n * E * H
    res = {}
    for label, min_tok in (("gemm", 1), ("old", 1 << 40)):
        ew._ROUTER_GEMM_MIN_TOKENS, ew._ROUTER_GEMM_MIN_EXPERTS = min_tok, 1
        res[label] = time_graph_us(lambda: d.router_matvec(xnxt(), W, lg), n_inner=16, n_repeat=10)
        res[label + "+norm"] = time_graph_us(lambda: d.router_rms_norm_matvec(xnxt(), wn, W, lg), n_inner=16,
                                             n_repeat=10)
    ew._ROUTER_GEMM_MIN_TOKENS, ew._ROUTER_GEMM_MIN_EXPERTS = 4096, 64
    res["cublas"] = time_us(lambda: [cupy.matmul(xnxt(), W.T, out=lg2) for _ in range(16)], n_warmup=3,
                            n_repeat=10) / 16
    print(f"router {n}x{H} @ {E}: " + ", ".join(f"{k} {v:.2f} us {fl / v / 1e6:.1f} TF/s" for k, v in res.items())
          + f"; gemm x cuBLAS {res['cublas'] / res['gemm']:.2f}", flush=True)
for name in ("router_gemm<false, 32, 4>", "router_gemm<true, 32, 4>", "router_matvec<8, 8, 64>"):
    attrs(name)
