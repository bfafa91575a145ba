"""Elementwise family benchmark: one row per kernel at decode size and at a large size (>= 64 MB moved),
with GB/s from the counted bytes, % of the copy ceiling measured in this run, and the ratio to a peer
measured in this run: the torch op a user would call instead, or, for a fusion, the chain of unfused
cukern kernels it replaces ("x peer" > 1: cukern / the fusion is faster).

Both sizes are timed as CUDA-graph replays (decode: 50 calls per graph, large: _LARGE_INNER calls, the
peer likewise): an eager event pair around one call also counts the host's Python dispatch (~20 us,
a large share of a 50-200 us kernel), so it understates the kernel's bandwidth. The graph's calls
rotate through the input sets as the eager calls would.

Bytes counted: every input read once, every output written once (weights and tables included).
Run: PYTHONPATH=. python profiling/bench_elementwise.py [--quick] [--json out.json]
"""

from __future__ import annotations

import sys

import cupy

from cukern import traffic
from cukern.benchmark import (Row, host_us_per_call, measure_ceilings, rotating, script_main, time_graph_us,
                              time_torch_graph_us, time_us)
from cukern.elementwise import ElementwiseDispatch, contiguous_page_table  # noqa: F401

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the torch peer is optional; its rows then show no ratio
    torch = None

_L2_ROTATE_BYTES = 200 << 20  # rotate input sets until they span 4x the 50 MB L2
_KV_REGIONS = 4  # cache regions the KV-writing rows rotate over
_LARGE_INNER = 16  # calls per graph at the large size: >= the most input sets, so every replay rotates them all


def _t(a):
    return torch.from_dlpack(a)


class Bench:
    def __init__(self, quick: bool):
        self.d = ElementwiseDispatch()
        self.ceil = measure_ceilings()
        self.rows: list[Row] = []
        self.rng = cupy.random.default_rng(0)
        self.quick = quick

    def randn(self, *shape, scale=1.0):
        return self.rng.standard_normal(shape, dtype=cupy.float32) * scale

    def sets(self, nbytes, make):
        """Input sets to rotate through: enough to span _L2_ROTATE_BYTES (at most 16)."""
        return rotating(max(1, min(16, _L2_ROTATE_BYTES // max(nbytes, 1))), make)

    def row(self, kernel, shape, fn, *, nbytes=None, flops=None, decode=False, peer="", peer_fn=None,
            peer_is_torch=True, peer_eager=False):
        """peer_eager: the peer cannot be captured in a graph (CuPy refuses cuBLAS calls during capture): time
        _LARGE_INNER back-to-back eager calls between two events, per call."""
        inner = {} if decode else dict(n_inner=_LARGE_INNER, n_repeat=10)
        timer = lambda f: time_graph_us(f, **inner)  # noqa: E731
        try:
            us = timer(fn)
        except Exception as e:  # report and go on: one broken row must not hide the others
            print(f"row {kernel} {shape} failed: {type(e).__name__}: {e}", file=sys.stderr)
            return
        peer_us = None
        if peer_fn is not None and (torch is not None or not peer_is_torch):
            peer_timer = (lambda f: time_torch_graph_us(f, **inner)) if peer_is_torch else timer
            if peer_eager:
                peer_timer = lambda f: time_us(lambda: [f() for _ in range(_LARGE_INNER)],  # noqa: E731
                                               n_warmup=3, n_repeat=10) / _LARGE_INNER
            try:
                peer_us = peer_timer(peer_fn)
            except Exception as e:
                print(f"peer of {kernel} {shape} failed: {type(e).__name__}: {e}", file=sys.stderr)
        gbs = nbytes / (us * 1e-6) / 1e9 if nbytes else None
        self.rows.append(Row("elementwise", kernel + (" (graph)" if decode else ""), shape, us, gbs=gbs,
                             tflops=flops / (us * 1e-6) / 1e12 if flops else None,
                             pct_ceiling=gbs / self.ceil.copy_gbs if gbs else None, peer=peer, peer_us=peer_us))


def _sizes(b: Bench):
    """(label, n_tokens, decode?) pairs: one decode token, and a large prefill batch."""
    return [("decode", 1, True), ("large", 2048 if b.quick else 8192, False)]


def bench_norms(b: Bench):
    d = b.d
    H = 4096
    for _, n, decode in _sizes(b):
        nb = n * H * 4
        shape = f"{n}x{H}"
        sets, nxt = b.sets(3 * nb, lambda i: (b.randn(n, H), b.randn(n, H), b.randn(H), b.randn(H),
                                               cupy.empty((n, H), cupy.float32),
                                               cupy.empty((n, H * 36 // 32), cupy.uint8)))
        tsets = [tuple(_t(a) for a in s[:5]) for s in sets] if torch is not None else None
        cur = {"i": 0}

        def tnext():
            s = tsets[cur["i"] % len(tsets)]
            cur["i"] += 1
            return s

        def chain_res(x, r, w, out):  # residual += x; out = rms_norm(residual)
            d.add(r, x, r)
            d.rms_norm(r, w, out)

        b.row("rms_norm", shape, lambda: (lambda s: d.rms_norm(s[0], s[2], s[4]))(nxt()), nbytes=traffic.rows("rms_norm", n, H),
              decode=decode, peer="torch F.rms_norm",
              peer_fn=lambda: (lambda s: F.rms_norm(s[0], (H,), s[2], eps=1e-6))(tnext()))
        b.row("residual_rms_norm", shape, lambda: (lambda s: d.residual_rms_norm(s[0], s[1], s[2], s[4]))(nxt()),
              nbytes=traffic.rows("residual_rms_norm", n, H), decode=decode, peer="chain add+rms_norm",
              peer_fn=lambda: (lambda s: chain_res(s[0], s[1], s[2], s[4]))(nxt()), peer_is_torch=False)
        b.row("post_norm_residual_rms_norm", shape,
              lambda: (lambda s: d.post_norm_residual_rms_norm(s[0], s[1], s[2], s[3], s[4]))(nxt()),
              nbytes=traffic.rows("post_norm_residual_rms_norm", n, H), decode=decode, peer="chain rms_norm+add+rms_norm",
              peer_fn=lambda: (lambda s: (d.rms_norm(s[0], s[2], s[4]), d.add(s[1], s[4], s[1]),
                                          d.rms_norm(s[1], s[3], s[4])))(nxt()), peer_is_torch=False)
        b.row("rms_norm_accumulate", shape, lambda: (lambda s: d.rms_norm_accumulate(s[0], s[2], s[1]))(nxt()),
              nbytes=traffic.rows("rms_norm_accumulate", n, H), decode=decode, peer="chain rms_norm+add",
              peer_fn=lambda: (lambda s: (d.rms_norm(s[0], s[2], s[4]), d.add(s[1], s[4], s[1])))(nxt()),
              peer_is_torch=False)
        b.row("residual_rms_norm_q8_1", shape, lambda: (lambda s: d.residual_rms_norm_q8_1(s[0], s[1], s[2], s[5]))(nxt()),
              nbytes=traffic.residual_rms_norm_q8_1(n, H), decode=decode, peer="chain residual_rms_norm+quantize",
              peer_fn=lambda: (lambda s: (d.residual_rms_norm(s[0], s[1], s[2], s[4]),
                                          d.quantize_q8_1(s[4], s[5])))(nxt()), peer_is_torch=False)
        b.row("quantize_q8_1", shape, lambda: (lambda s: d.quantize_q8_1(s[0], s[5]))(nxt()),
              nbytes=traffic.quantize_q8_1(n, H), decode=decode)


def bench_heads(b: Bench):
    """Per-head norms, RoPE and their fusions with the KV write: 32 query heads, 8 KV heads, head_dim 128."""
    d = b.d
    nq, nkv, hd = 32, 8, 128
    for _, n, decode in _sizes(b):
        n = n if decode else 2 * n  # the KV rows (8 heads) move >= 64 MB too
        shape = f"{n}x{nq}x{hd}"
        nb = n * nq * hd * 4
        pos = cupy.zeros(1, cupy.int32)
        pos_tok = cupy.arange(n, dtype=cupy.int32)
        seq = cupy.zeros(1, cupy.int32)
        page_size = 16
        # the KV writes rotate over _KV_REGIONS regions of the caches (4 x 32 MB at the large size), so that
        # repeated writes of the same lines cannot merge in the 50 MB L2 and flatter the written bytes
        max_pages = -(-(_KV_REGIONS * n + 1) // page_size)
        page_table = cupy.arange(max_pages, dtype=cupy.int32).reshape(1, max_pages)
        kc = cupy.zeros((max_pages, page_size, nkv, hd), cupy.float16)
        vc = cupy.zeros_like(kc)
        _, kvpos = rotating(_KV_REGIONS, lambda i: cupy.full(1, i * n, cupy.int32))  # first position per region
        kv_region = {"i": 0}

        def kv_rows():  # the torch peer's slice of rows of the next region
            i = kv_region["i"] % _KV_REGIONS
            kv_region["i"] += 1
            return slice(i * n, (i + 1) * n)
        sets, nxt = b.sets(2 * nb, lambda i: (b.randn(n, nq, hd), cupy.empty((n, nq, hd), cupy.float32),
                                               b.randn(n, nkv, hd), b.randn(n, nkv, hd),
                                               cupy.empty((n, nkv, hd), cupy.float32), b.randn(hd), b.randn(hd),
                                               b.randn(n, nq, 2 * hd), b.randn(n, nq, hd)))
        inv = 1e6 ** (-torch.arange(0, hd, 2, dtype=torch.float64, device="cuda") / hd) if torch else None
        if torch is not None:
            ang = torch.arange(n, dtype=torch.float64, device="cuda")[:, None] * inv[None, :]
            cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None, :]
            sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None, :]
        tsets = [tuple(_t(a) for a in s) for s in sets] if torch is not None else None
        cur = {"i": 0}

        def tnext():
            s = tsets[cur["i"] % len(tsets)]
            cur["i"] += 1
            return s

        def torch_rope(x, out):
            x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
            torch.add(x * cos, torch.cat([-x2, x1], -1) * sin, out=out)

        b.row("head_rms_norm", shape, lambda: (lambda s: d.head_rms_norm(s[0], s[5], s[1]))(nxt()),
              nbytes=traffic.rows("head_rms_norm", n, nq * hd), decode=decode, peer="torch F.rms_norm",
              peer_fn=lambda: (lambda s: F.rms_norm(s[0], (hd,), s[5], eps=1e-6))(tnext()))
        b.row("rope neox", shape, lambda: (lambda s: d.rope(s[0], pos, s[1], freq_base=1e6))(nxt()),
              nbytes=traffic.rows("rope", n, nq * hd), decode=decode, peer="torch rope (eager)",
              peer_fn=lambda: (lambda s: torch_rope(s[0], s[1]))(tnext()))
        b.row("rms_norm_rope", shape, lambda: (lambda s: d.rms_norm_rope(s[0], s[5], pos, s[1], freq_base=1e6))(nxt()),
              nbytes=traffic.rows("rms_norm_rope", n, nq * hd), decode=decode, peer="chain head_rms_norm+rope",
              peer_fn=lambda: (lambda s: (d.head_rms_norm(s[0], s[5], s[1]),
                                          d.rope(s[1], pos, s[1], freq_base=1e6)))(nxt()), peer_is_torch=False)
        qkv_bytes = traffic.qk_norm_rope_kv_write(n, nq, nkv, hd)

        def qkv_chain(s, kp):
            d.head_rms_norm(s[0], s[5], s[1])
            d.rope(s[1], kp, s[1], freq_base=1e6)
            d.head_rms_norm(s[2], s[6], s[4])
            d.rope(s[4], kp, s[4], freq_base=1e6)
            d.kv_write(s[4], kc, page_table, kp, seq)
            d.kv_write(s[3], vc, page_table, kp, seq)

        b.row("qk_norm_rope_kv_write", f"{n}x({nq}+2x{nkv})x{hd}",
              lambda: (lambda s: d.qk_norm_rope_kv_write(s[0], s[2], s[3], s[5], s[6], s[1], kc, vc, page_table,
                                                         kvpos(), seq, freq_base=1e6))(nxt()),
              nbytes=qkv_bytes, decode=decode, peer="chain 2x(norm+rope)+2 kv_write",
              peer_fn=lambda: qkv_chain(nxt(), kvpos()), peer_is_torch=False)
        b.row("k_norm_rope_kv_write", f"{n}x{nkv}x{hd}",
              lambda: (lambda s: d.k_norm_rope_kv_write(s[2], s[6], kc, page_table, kvpos(), seq, freq_base=1e6))(nxt()),
              nbytes=traffic.kv_write(n, nkv, hd), decode=decode, peer="chain norm+rope+kv_write",
              peer_fn=lambda: (lambda s, kp: (d.head_rms_norm(s[2], s[6], s[4]), d.rope(s[4], kp, s[4], freq_base=1e6),
                                              d.kv_write(s[4], kc, page_table, kp, seq)))(nxt(), kvpos()),
              peer_is_torch=False)
        kc_t = _t(kc) if torch is not None else None
        b.row("kv_write (f16 cache)", f"{n}x{nkv}x{hd}",
              lambda: (lambda s: d.kv_write(s[3], kc, page_table, kvpos(), seq))(nxt()), nbytes=traffic.kv_write(n, nkv, hd),
              decode=decode, peer="torch cache[idx] = k.half()",
              peer_fn=lambda: (lambda s: kc_t.view(-1, nkv, hd).__setitem__(kv_rows(), s[3].half()))(tnext()))
        b.row("rope per_token positions", shape,
              lambda: (lambda s: d.rope(s[0], pos_tok, s[1], freq_base=1e6, pos_mode="per_token"))(nxt()),
              nbytes=traffic.rows("rope_per_token", n, nq * hd), decode=decode)
        b.row("deinterleave", f"{n}x{nq}x(2x{hd})", lambda: (lambda s: d.deinterleave(s[7], s[0], s[1]))(nxt()),
              nbytes=traffic.rows("deinterleave", n, nq * hd), decode=decode, peer="torch split+copy",
              peer_fn=lambda: (lambda s: (s[0].copy_(s[7][..., :hd]), s[1].copy_(s[7][..., hd:])))(tnext()))
        b.row("gated_rms_norm", shape, lambda: (lambda s: d.gated_rms_norm(s[0], s[8], s[5], s[1], group_size=hd))(nxt()),
              nbytes=traffic.rows("gated_rms_norm", n, nq * hd), decode=decode, peer="chain head_rms_norm+swiglu",
              peer_fn=lambda: (lambda s: (d.head_rms_norm(s[0], s[5], s[1]),
                                          d.swiglu(s[8].reshape(n, -1), s[1].reshape(n, -1),
                                                   s[1].reshape(n, -1))))(nxt()), peer_is_torch=False)
        b.row("group_norm (l2)", shape, lambda: (lambda s: d.group_norm(s[0], s[1], group_size=hd, l2=True))(nxt()),
              nbytes=traffic.rows("group_norm", n, nq * hd), decode=decode, peer="torch F.normalize",
              peer_fn=lambda: (lambda s: F.normalize(s[0], dim=-1))(tnext()))


def bench_activations(b: Bench):
    d = b.d
    ff = 14336
    for _, n, decode in _sizes(b):
        n = n if decode else n // 2
        shape = f"{n}x{ff}"
        nb = n * ff * 4
        sets, nxt = b.sets(3 * nb, lambda i: (b.randn(n, ff), b.randn(n, ff), cupy.empty((n, ff), cupy.float32),
                                               b.randn(ff + 64)))
        tsets = [tuple(_t(a) for a in s) for s in sets] if torch is not None else None
        cur = {"i": 0}

        def tnext():
            s = tsets[cur["i"] % len(tsets)]
            cur["i"] += 1
            return s

        def oai(g, u):
            gg = g.clamp(max=7.0)
            return gg * torch.sigmoid(1.702 * gg) * (u.clamp(-7.0, 7.0) + 1)

        for name, fn, pfn, peer in [
            ("swiglu", lambda s: d.swiglu(s[0], s[1], s[2]), lambda s: F.silu(s[0]) * s[1], "torch silu*mul"),
            ("swiglu_oai", lambda s: d.swiglu_oai(s[0], s[1], s[2]), lambda s: oai(s[0], s[1]), "torch eager"),
            ("geglu", lambda s: d.geglu(s[0], s[1], s[2]), lambda s: F.gelu(s[0], approximate="tanh") * s[1],
             "torch gelu*mul"),
            ("sigmoid_mul", lambda s: d.sigmoid_mul(s[0], s[1], s[2]), lambda s: s[0] * torch.sigmoid(s[1]),
             "torch x*sigmoid(g)"),
            ("add", lambda s: d.add(s[0], s[1], s[2]), lambda s: torch.add(s[0], s[1], out=s[2]), "torch.add"),
            ("add_scaled", lambda s: d.add_scaled(s[0], s[1], s[2], alpha=0.5),
             lambda s: torch.add(s[0], s[1], alpha=0.5, out=s[2]), "torch.add(alpha)"),
        ]:
            b.row(name, shape, lambda fn=fn: fn(nxt()), nbytes=traffic.rows("binary", n, ff), decode=decode, peer=peer,
                  peer_fn=lambda pfn=pfn: pfn(tnext()))
        b.row("scale_accumulate", shape, lambda: (lambda s: d.scale_accumulate(s[2], s[1], 0.5))(nxt()),
              nbytes=traffic.rows("binary", n, ff), decode=decode, peer="torch.add_(alpha)",
              peer_fn=lambda: (lambda s: s[2].add_(s[1], alpha=0.5))(tnext()))
        b.row("scale", shape, lambda: (lambda s: d.scale(s[0], s[2], alpha=0.5))(nxt()), nbytes=traffic.rows("scale", n, ff),
              decode=decode, peer="torch.mul", peer_fn=lambda: (lambda s: torch.mul(s[0], 0.5, out=s[2]))(tnext()))
        b.row("bias_add", shape, lambda: (lambda s: d.bias_add(s[0], s[3], s[2], offset=64))(nxt()),
              nbytes=traffic.rows("bias_add", n, ff), decode=decode, peer="torch x + b",
              peer_fn=lambda: (lambda s: torch.add(s[0], s[3][64:], out=s[2]))(tnext()))


def bench_moe(b: Bench):
    d = b.d
    E, k, H = 128, 8, 2048
    for _, n, decode in _sizes(b):
        n_tok_topk = n if decode else n * 32
        logits_sets, lnxt = b.sets(n_tok_topk * E * 4, lambda i: (b.randn(n_tok_topk, E),
                                                                  cupy.empty((n_tok_topk, k), cupy.int32),
                                                                  cupy.empty((n_tok_topk, k), cupy.float32)))

        def torch_topk(lg):
            p = torch.softmax(lg, -1)
            w, i = torch.topk(p, k, -1)
            return w / w.sum(-1, keepdim=True), i
        tl = [tuple(_t(a) for a in s) for s in logits_sets] if torch is not None else None
        cur = {"i": 0}

        def tl_next():
            s = tl[cur["i"] % len(tl)]
            cur["i"] += 1
            return s
        b.row("softmax_topk", f"{n_tok_topk}x{E} k={k}",
              lambda: (lambda s: d.softmax_topk(s[0], s[1], s[2], k=k))(lnxt()),
              nbytes=traffic.softmax_topk(n_tok_topk, E, k), decode=decode, peer="torch softmax+topk+renorm",
              peer_fn=lambda: torch_topk(tl_next()[0]))

        n_sum = n if decode else n // 2
        es, enxt = b.sets(n_sum * k * H * 4 * 2, lambda i: (b.randn(n_sum, k, 2 * H), b.randn(n_sum, k),
                                                             cupy.empty((n_sum, 2 * H), cupy.float32)))
        te = [tuple(_t(a) for a in s) for s in es] if torch is not None else None
        ce = {"i": 0}

        def te_next():
            s = te[ce["i"] % len(te)]
            ce["i"] += 1
            return s
        b.row("moe_weighted_sum", f"{n_sum}x{k}x{2 * H}", lambda: (lambda s: d.moe_weighted_sum(s[0], s[1], s[2]))(enxt()),
              nbytes=traffic.moe_weighted_sum(n_sum, k, 2 * H), decode=decode, peer="torch (e*w).sum(1)",
              peer_fn=lambda: (lambda s: torch.sum(s[0] * s[1][..., None], 1, out=s[2]))(te_next()))

        # router: x [n, H] f32, W [E, H] f32 (1 MiB); the fused version adds the RMS norm. One token is a
        # matvec (bandwidth-bound: GB/s, % of copy); a token batch is a small f32 GEMM (compute-bound: TFLOP/s
        # and the ratio to cuBLAS sgemm through cupy.matmul, no bandwidth claim)
        xs, xnxt = b.sets(n * H * 4, lambda i: (b.randn(n, H), cupy.empty((n, H), cupy.float32)))
        W, wn, lg = b.randn(E, H, scale=0.02), b.randn(H), cupy.empty((n, E), cupy.float32)
        lg_peer = cupy.empty((n, E), cupy.float32)
        flops = traffic.router_flops(n, H, E)
        gemm = "" if decode else " [f32 GEMM]"
        if decode:  # one token: the torch peer (cuBLAS too) in a graph, as eager calls would time the host
            peer = dict(peer="torch x @ W.T (cuBLAS)",
                        peer_fn=(lambda xt=_t(xs[0][0]), Wt=_t(W): torch.matmul(xt, Wt.T)) if torch else None)
        else:
            peer = dict(peer="cuBLAS sgemm (cupy.matmul)", peer_fn=lambda: cupy.matmul(xnxt()[0], W.T, out=lg_peer),
                        peer_is_torch=False, peer_eager=True)
        b.row("router_matvec" + gemm, f"{n}x{H} @ {E}x{H}", lambda: d.router_matvec(xnxt()[0], W, lg),
              nbytes=traffic.router_matvec(n, H, E) if decode else None, flops=flops, decode=decode, **peer)
        b.row("router_rms_norm_matvec" + gemm, f"{n}x{H} @ {E}x{H}",
              lambda: d.router_rms_norm_matvec(xnxt()[0], wn, W, lg),
              nbytes=traffic.router_matvec(n, H, E, norm=True) if decode else None, flops=flops, decode=decode,
              peer="chain rms_norm+router_matvec",
              peer_fn=lambda: (lambda s: (d.rms_norm(s[0], wn, s[1]), d.router_matvec(s[1], W, lg)))(xnxt()),
              peer_is_torch=False)


def bench_shared_expert(b: Bench):
    d = b.d
    H = 4096
    for _, n, decode in _sizes(b):
        nb = n * H * 4
        sets, nxt = b.sets(3 * nb, lambda i: (b.randn(n, H), b.randn(n, H), b.randn(n)))
        tsets = [tuple(_t(a) for a in s) for s in sets] if torch is not None else None
        cur = {"i": 0}

        def tnext():
            s = tsets[cur["i"] % len(tsets)]
            cur["i"] += 1
            return s
        b.row("shared_expert_accumulate", f"{n}x{H}", lambda: (lambda s: d.shared_expert_accumulate(s[0], s[1], s[2]))(nxt()),
              nbytes=traffic.rows("shared_expert_accumulate", n, H), decode=decode, peer="torch h += sigmoid(g)*s",
              peer_fn=lambda: (lambda s: s[0].add_(torch.sigmoid(s[2])[:, None] * s[1]))(tnext()))


def bench_ssm(b: Bench):
    d = b.d
    C, K = 8192, 4
    n_qk, n_v, dk, dv = 16, 32, 128, 128
    for _, n, decode in _sizes(b):
        nb = n * C * 4
        sets, nxt = b.sets(2 * nb, lambda i: (b.randn(n, C), cupy.empty((n, C), cupy.float32)))
        state, w = b.randn(K - 1, C), b.randn(C, K)
        b.row("conv1d_silu (K=4)", f"{n}x{C}", lambda: (lambda s: d.conv1d_silu(s[0], state, w, s[1]))(nxt()),
              nbytes=traffic.conv1d_silu(n, C, state.nbytes, w.nbytes), decode=decode)
        n_tok = n if decode else (256 if b.quick else 1024)
        q = b.randn(n_tok, n_qk, dk) * (dk ** -0.5)
        kk = b.randn(n_tok, n_qk, dk) * (dk ** -0.5)
        v = b.randn(n_tok, n_v, dv)
        g = -cupy.abs(b.randn(n_tok, n_v)) * 0.1
        beta = cupy.abs(b.randn(n_tok, n_v)) * 0.3
        S = b.randn(n_v, dk, dv) * 0.1
        o = cupy.empty((n_tok, n_v, dv), cupy.float32)
        nbytes = traffic.deltanet(S.nbytes, q.nbytes, kk.nbytes, v.nbytes, o.nbytes)
        b.row("deltanet_tiled", f"{n_tok} tok {n_v}x{dk}x{dv}", lambda: d.deltanet(q, kk, v, g, beta, S, o, tiled=True),
              nbytes=nbytes, decode=decode, peer="deltanet (baseline)",
              peer_fn=lambda: d.deltanet(q, kk, v, g, beta, S, o, tiled=False), peer_is_torch=False)


def bench(quick: bool = False) -> tuple[list, object]:
    b = Bench(quick)
    for part in (bench_norms, bench_heads, bench_activations, bench_moe, bench_shared_expert, bench_ssm):
        part(b)
    # host cost of one dispatch (validate, pack, launch) against a bare CuPy elementwise call
    a, out = b.randn(1024), cupy.empty(1024, cupy.float32)
    host = host_us_per_call(lambda: b.d.scale(a, out, alpha=0.5))
    peer_host = host_us_per_call(lambda: cupy.multiply(a, 0.5, out=out))
    b.rows.append(Row("elementwise", "scale: host us per call", "1024", host, peer="cupy.multiply(out=)",
                      peer_us=peer_host))
    return b.rows, b.ceil


def main(argv=None) -> int:
    return script_main(bench, __doc__, title='elementwise',
                       quick_help='smaller large sizes', argv=argv)


if __name__ == "__main__":
    sys.exit(main())
