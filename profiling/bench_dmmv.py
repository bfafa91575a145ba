"""dmmv family benchmark: quantized matvec GB/s (bytes actually read: the quantized weights, x and
y) against the copy ceiling measured in the same run, and the ratio to cuBLAS f16 GEMV on the
dequantized matrix (torch.mv, also measured here).

Every kernel is timed as a decode loop runs it: 50 calls captured into one CUDA graph and replayed,
each call on the next of several weight copies (> 200 MB together) so that the weights come from
HBM, not from the 50 MB L2. The peer rotates two f16 copies the same way. "pdl" rows launch with
programmatic dependent launch (each call overlaps the previous one's tail, as in a decode loop);
"pdl q8x" rows read x already quantized (QuantizedX, bytes counted as read), and the quantize_x
rows give what that quantization costs once per input the matvecs share. "ffn down" rows time the
two kernels between the FFN's gate/up and its output: the elementwise SwiGLU and the matvec on f32 x,
against quantize_glu (SwiGLU written as the QuantizedX) and the matvec on that.

Run: PYTHONPATH=. python profiling/bench_dmmv.py [--quick] [--json out.json]
"""

from __future__ import annotations

import sys

import cupy
import numpy as np

from cukern import traffic
from cukern.benchmark import Row, measure_ceilings, rotating, script_main, time_graph_us, time_torch_graph_us
from cukern.dmmv import Q8_TYPES, QTYPES, DmmvDispatch, NormedX, QuantizedX, QWeight, qtype_id, row_bytes
from cukern.elementwise import ElementwiseDispatch

try:
    import torch
except ImportError:  # the peer is optional; rows then show no ratio
    torch = None

ROTATE_BYTES = 200 << 20  # > 4x L2
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (262144, 640), (151936, 2048)]
TYPES = ["Q4_0", "Q5_0", "Q8_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"]
QUICK_TYPES = ["Q4_0", "Q5_0", "Q8_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K"]


def _weights(qt: int, m: int, k: int, n_experts: int = 0):
    """Rotating sets of random raw weights (bit patterns only matter for speed, not validity)."""
    nbytes = row_bytes(qt, k) * m * max(1, n_experts)
    n_sets = max(1, min(8, -(-ROTATE_BYTES // nbytes)))
    rng = cupy.random.default_rng(qt)

    def make(i):
        buf = rng.integers(0, 256, nbytes, dtype=cupy.uint8)
        return QWeight(buf, qt, m, k, n_experts=n_experts)
    return rotating(n_sets, make), nbytes


def _moe_weight(qt: int, n_e: int, m: int, k: int) -> tuple[QWeight, int]:
    """n_e random experts of m x k in one buffer, and the bytes of one expert."""
    ebytes = row_bytes(qt, k) * m
    buf = cupy.random.default_rng(1).integers(0, 256, ebytes * n_e, dtype=cupy.uint8)
    return QWeight(buf, qt, m, k, n_experts=n_e), ebytes


def _rotating_ids(rs: np.random.Generator, n_e: int, top_k: int):
    """A cursor over 16 routings of one token ([1, top_k] distinct expert ids), so that timed calls
    read different experts."""
    return rotating(16, lambda i: cupy.asarray(rs.permutation(n_e)[:top_k].astype(np.int32).reshape(1, top_k)))[1]


def _peer_gemv_us(m: int, k: int) -> float | None:
    """cuBLAS f16 GEMV (torch.mv) on an m x k matrix, rotating copies."""
    if torch is None:
        return None
    n_sets = max(1, min(4, -(-ROTATE_BYTES // (2 * m * k))))
    if 2 * m * k * n_sets > (8 << 30):
        return None
    ws = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(n_sets)]
    x = torch.randn(k, device="cuda", dtype=torch.float16)
    y = torch.empty(m, device="cuda", dtype=torch.float16)
    state = {"i": 0}

    def run():
        torch.mv(ws[state["i"] % n_sets], x, out=y)
        state["i"] += 1
    us = time_torch_graph_us(run)
    del ws
    torch.cuda.empty_cache()
    return us


def bench(quick: bool = False) -> tuple[list, object]:
    d = DmmvDispatch()
    d_pdl = DmmvDispatch(pdl=True)  # "pdl" rows: each launch overlaps the previous one's tail
    d_f32 = DmmvDispatch(int8=False)  # the f32 path, the peer of the fused rows it used to run
    ceil = measure_ceilings()
    rows: list[Row] = []
    shapes = [(14336, 4096), (4096, 14336)] if quick else SHAPES
    types = QUICK_TYPES if quick else TYPES

    def row(kernel, shape, us, nbytes, peer_us=None, peer="cuBLAS f16 GEMV (torch.mv)"):
        gbs = nbytes / (us * 1e-6) / 1e9
        rows.append(Row("dmmv", kernel, shape, us, gbs=gbs, pct_ceiling=gbs / ceil.copy_gbs,
                        peer=peer if peer_us else "", peer_us=peer_us))

    for m, k in shapes:
        peer_us = _peer_gemv_us(m, k)
        for name in types:
            qt = qtype_id(name)
            if k % QTYPES[qt][1]:
                continue  # k = 640 is not a whole number of K-quant super-blocks
            (sets, nxt), wbytes = _weights(qt, m, k)
            x = cupy.random.standard_normal(k, dtype=cupy.float32)
            y = cupy.empty(m, cupy.float32)
            us = time_graph_us(lambda: d.dmmv(nxt(), x, y))
            row(f"dmmv {name}", f"{m}x{k}", us, traffic.dmmv(wbytes, m, k), peer_us)
            if qt in Q8_TYPES:  # the int8 path, where pdl applies
                us = time_graph_us(lambda: d_pdl.dmmv(nxt(), x, y))
                row(f"dmmv {name} pdl", f"{m}x{k}", us, traffic.dmmv(wbytes, m, k), peer_us)
                # x quantized once (QuantizedX) for the matvecs that share it: its bytes are read instead
                qx = d_pdl.quantize_x(x, QuantizedX.empty(x.shape, qt))
                us = time_graph_us(lambda: d_pdl.dmmv(nxt(), qx, y))
                row(f"dmmv {name} pdl q8x", f"{m}x{k}", us, traffic.dmmv_prequantized(wbytes, m, qx.buf.nbytes), peer_us)
            del sets
            cupy.get_default_memory_pool().free_all_blocks()

    # an LM head (Gemma 3's 262144 x 640 Q8_0): the GGUF blocks on the f32 path against the SplitQ8 copy
    # (quants and scales apart, 16-byte loads), one column and eight; pdl as in a decode step
    m, k = 262144, 640
    qt = qtype_id("Q8_0")
    (sets, nxt), wbytes = _weights(qt, m, k)
    d_f32_pdl = DmmvDispatch(int8=False, pdl=True)
    split = [d.split_q8_0(w) for w in sets]
    ring = iter(range(1 << 60))
    peer_us = _peer_gemv_us(m, k)
    for n in (1, 8):
        x = cupy.random.standard_normal((n, k), dtype=cupy.float32)
        y = cupy.empty((n, m), cupy.float32)
        nbytes = traffic.dmmv(wbytes, m, k, n)
        us_gguf = time_graph_us(lambda: d_f32_pdl.dmmv(nxt(), x, y))
        row(f"lm head Q8_0 f32 path pdl n={n}", f"{m}x{k}", us_gguf, nbytes, peer_us if n == 1 else None)
        us = time_graph_us(lambda: d_f32_pdl.dmmv(split[next(ring) % len(split)], x, y))
        row(f"lm head Q8_0 split pdl n={n}", f"{m}x{k}", us, nbytes, us_gguf, peer="GGUF blocks, f32 path")
    del sets, split
    cupy.get_default_memory_pool().free_all_blocks()

    # a decoder layer's residual add + norm before its FFN (Gemma 3 270M: 640 -> 2 x 2048 Q5_0): the
    # elementwise post_norm_residual_rms_norm then dmmv_glu, against dmmv_glu on a NormedX (every block
    # makes its x); pdl, weights rotating; bytes: the weights, proj, residual, and the outputs
    ew = ElementwiseDispatch(pdl=True)
    m, k = 2048, 640
    qt = qtype_id("Q5_0")
    (gsets, gnext), wbytes = _weights(qt, m, k)
    (usets, unext), _ = _weights(qt, m, k)
    proj, res = (cupy.random.standard_normal((1, k), dtype=cupy.float32) for _ in range(2))
    wp, wn = (cupy.random.standard_normal(k, dtype=cupy.float32) for _ in range(2))
    res2, h, y = cupy.empty((1, k), cupy.float32), cupy.empty((1, k), cupy.float32), cupy.empty((1, m), cupy.float32)
    nbytes = traffic.dmmv_glu_normed(wbytes, m, k)
    us_two = time_graph_us(lambda: (ew.post_norm_residual_rms_norm(proj, res2, wp, wn, h),
                                    d_f32_pdl.dmmv_glu(gnext(), unext(), h, y)))
    row("norm + glu Q5_0 two launches pdl", f"2x{m}x{k}", us_two, nbytes)
    nx = NormedX(res, wn, proj, wp, res2)
    us = time_graph_us(lambda: d_f32_pdl.dmmv_glu(gnext(), unext(), nx, y))
    row("norm + glu Q5_0 NormedX pdl", f"2x{m}x{k}", us, nbytes, us_two, peer="norm kernel + dmmv_glu")
    del gsets, usets
    cupy.get_default_memory_pool().free_all_blocks()

    # the quantization a QuantizedX costs, once per input shared by several matvecs
    for k in sorted({k for _, k in shapes}):
        x = cupy.random.standard_normal(k, dtype=cupy.float32)
        qx = QuantizedX.empty((k,), "Q4_K")
        us = time_graph_us(lambda: d_pdl.quantize_x(x, qx))
        row(f"quantize_x pdl k={k}", f"1x{k}", us, traffic.quantize_x(k, qx.buf.nbytes))

    # the FFN's down projection after gate and up, two kernels either way: the elementwise SwiGLU then
    # the matvec on its f32 output, against quantize_glu (the activation written as a QuantizedX) then
    # the matvec on it; bytes: the weights, gate and up, y
    ew = ElementwiseDispatch()
    m, k = 4096, 14336
    for name in (["MXFP4", "Q4_K"] if quick else ["MXFP4", "Q4_K", "Q6_K", "Q8_0"]):
        qt = qtype_id(name)
        (sets, nxt), wbytes = _weights(qt, m, k)
        gate, up = (cupy.random.standard_normal(k, dtype=cupy.float32) for _ in range(2))
        h, y = cupy.empty(k, cupy.float32), cupy.empty(m, cupy.float32)
        qx = QuantizedX.empty((k,), qt)
        nbytes = traffic.ffn_down(wbytes, m, k)
        f32_us = time_graph_us(lambda: (ew.swiglu(gate[None], up[None], h[None]), d_pdl.dmmv(nxt(), h, y)))
        row(f"ffn down {name} swiglu+dmmv pdl", f"{m}x{k}", f32_us, nbytes)
        us = time_graph_us(lambda: (d_pdl.quantize_glu(gate, up, qx), d_pdl.dmmv(nxt(), qx, y)))
        row(f"ffn down {name} quantize_glu+dmmv q8x", f"{m}x{k}", us, nbytes, f32_us, peer="swiglu + f32-x dmmv")
        del sets
        cupy.get_default_memory_pool().free_all_blocks()

    # batched columns: weights read once for all of them
    m, k = 4096, 14336
    for name in (["Q4_K"] if quick else ["Q4_K", "Q8_0", "Q6_K"]):
        qt = qtype_id(name)
        (sets, nxt), wbytes = _weights(qt, m, k)
        for n in (2, 4, 8):
            x = cupy.random.standard_normal((n, k), dtype=cupy.float32)
            y = cupy.empty((n, m), cupy.float32)
            us = time_graph_us(lambda: d.dmmv_batch(nxt(), x, y))
            row(f"dmmv_batch {name} n={n}", f"{m}x{k}", us, traffic.dmmv(wbytes, m, k, n))
        del sets
        cupy.get_default_memory_pool().free_all_blocks()

    # fused gate + up + SwiGLU (two matrices, one input): the int8 path (dmmv_q8_two) against the
    # f32 path's fused kernel (DmmvDispatch(int8=False), what dmmv_glu ran before 2026-11-25)
    m, k = 14336, 4096
    for name in (["Q4_K", "MXFP4"] if quick else ["Q4_K", "Q8_0", "Q6_K", "MXFP4"]):
        qt = qtype_id(name)
        (sets, nxt), wbytes = _weights(qt, m, k)
        x = cupy.random.standard_normal(k, dtype=cupy.float32)
        y = cupy.empty(m, cupy.float32)
        nbytes = traffic.dmmv_glu(wbytes, m, k)
        f32_us = time_graph_us(lambda: d_f32.dmmv_glu(nxt(), nxt(), x, y, act="swiglu"))
        row(f"dmmv_glu {name} f32 path", f"2x{m}x{k}", f32_us, nbytes)
        us = time_graph_us(lambda: d.dmmv_glu(nxt(), nxt(), x, y, act="swiglu"))
        row(f"dmmv_glu {name}", f"2x{m}x{k}", us, nbytes, f32_us, peer="f32-path dmmv_glu")
        us = time_graph_us(lambda: d_pdl.dmmv_glu(nxt(), nxt(), x, y, act="swiglu"))
        row(f"dmmv_glu {name} pdl", f"2x{m}x{k}", us, nbytes, f32_us, peer="f32-path dmmv_glu")
        del sets
        cupy.get_default_memory_pool().free_all_blocks()

    # MoE: 128 experts of 2048 x 7168 (Q4_K: 8.3 MB each), top-8, one token; expert ids rotate
    n_e, top_k, m, k = 128, 8, 2048, 7168
    for name in (["Q4_K", "MXFP4"] if quick else ["Q4_K", "Q8_0", "MXFP4", "Q6_K"]):
        qt = qtype_id(name)
        w, ebytes = _moe_weight(qt, n_e, m, k)
        rs = np.random.default_rng(2)
        ids = _rotating_ids(rs, n_e, top_k)
        x = cupy.random.standard_normal((1, k), dtype=cupy.float32)
        y = cupy.empty((1, top_k, m), cupy.float32)
        us = time_graph_us(lambda: d.moe_dmmv(w, x, ids(), y))
        row(f"moe_dmmv {name} top{top_k}/{n_e}", f"{m}x{k}", us, traffic.moe_dmmv(ebytes, m, k, top_k))
        # gate + up + SwiGLU of the same slots: the int8 path (moe_dmmv_q8_glu) against the f32 path's
        # fused kernel (DmmvDispatch(int8=False), what moe_dmmv with w_up ran before 2026-11-25)
        wu, _ = _moe_weight(qt, n_e, m, k)
        nbytes = traffic.moe_dmmv(ebytes, m, k, top_k, glu=True)
        f32_us = time_graph_us(lambda: d_f32.moe_dmmv(w, x, ids(), y, w_up=wu))
        row(f"moe_dmmv glu {name} f32 path", f"2x{m}x{k}", f32_us, nbytes)
        us = time_graph_us(lambda: d.moe_dmmv(w, x, ids(), y, w_up=wu))
        row(f"moe_dmmv glu {name}", f"2x{m}x{k}", us, nbytes, f32_us, peer="f32-path moe_dmmv glu")
        del wu
        h = cupy.random.standard_normal((1, top_k, k), dtype=cupy.float32)
        wts = cupy.full((1, top_k), 0.125, cupy.float32)
        yd = cupy.empty((1, m), cupy.float32)
        nbytes = traffic.moe_down(ebytes, m, k, top_k)
        f32_us = time_graph_us(lambda: d_f32.moe_down(w, h, ids(), wts, yd))
        row(f"moe_down {name} top{top_k}/{n_e} f32 path", f"{m}x{k}", f32_us, nbytes)
        us = time_graph_us(lambda: d.moe_down(w, h, ids(), wts, yd))
        row(f"moe_down {name} top{top_k}/{n_e}", f"{m}x{k}", us, nbytes, f32_us, peer="f32-path moe_down")
        # token-batched: 16 tokens (128 slots) through route packing, weights once per expert chunk
        T = 16
        tid_sets = [cupy.asarray(np.stack([rs.permutation(n_e)[:top_k] for _ in range(T)]).astype(np.int32))
                    for _ in range(4)]
        xt = cupy.random.standard_normal((T, k), dtype=cupy.float32)
        yt = cupy.empty((T, top_k, m), cupy.float32)
        route = d.plan_moe_route(T, top_k, n_e)
        jt = {"i": 0}

        def packed_step():
            jt["i"] += 1
            tids = tid_sets[jt["i"] % len(tid_sets)]
            d.moe_route_pack(tids, route)
            d.moe_dmmv_packed(w, xt, tids, route, yt)
        us = time_graph_us(packed_step)
        n_active = sum(len(set(s.get().ravel().tolist())) for s in tid_sets) / len(tid_sets)  # experts read per call
        row(f"moe pack+packed {name} T={T}", f"{m}x{k}", us, traffic.moe_packed(ebytes, m, k, top_k, T, n_active))
        del w
        cupy.get_default_memory_pool().free_all_blocks()
    d.check_errors()
    return rows, ceil


def main(argv=None) -> int:
    return script_main(bench, __doc__, title='dmmv',
                       quick_help='the two 14336/4096 shapes and the required types only', argv=argv)


if __name__ == "__main__":
    sys.exit(main())
