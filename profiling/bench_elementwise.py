"""Elementwise family benchmark: one row per kernel at decode size and at a large size (>= 64 MB moved),
with GB/s from the counted bytes, % of the copy ceiling measured in this run, and the ratio to a peer
measured in this run: the torch op a user would call instead, or, for a fusion, the chain of unfused
cukern kernels it replaces ("x peer" > 1: cukern / the fusion is faster).

Both sizes are timed as CUDA-graph replays (decode: 50 calls per graph, large: _LARGE_INNER calls, the
peer likewise): an eager event pair around one call also counts the host's Python dispatch (~20 us,
a large share of a 50-200 us kernel), so it understates the kernel's bandwidth. The graph's calls
rotate through the input sets as the eager calls would.

The fusions' groups (``_kv_fusions``, ``_moe_ssm_fusions``) time each fused launch against its chain of
unfused launches (or a variant against its base: the bf16 cache against f16, YaRN's table against the plain
rope) at the heads of Llama-8B, Gemma 3 and gpt-oss and Qwen3-Next's SSM sizes.

Bytes counted (cukern.traffic): every input read once, every output written once (weights and tables
included). The rows are the table of ``specs(quick)``; each ``s`` is one input set (``s.t``: its torch
views), built by the ``_*_sets`` functions below.
Run: PYTHONPATH=. python profiling/bench_elementwise.py [--quick] [--json out.json]
"""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import cupy

from cukern import traffic
from cukern.benchmark import Peer, RowSpec, Timing, measure_ceilings, run_specs, script_main
from cukern.elementwise import ElementwiseDispatch, RouteSlot, yarn_freqs

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the torch peer is optional; its rows then show no ratio
    torch = None

_L2_ROTATE_BYTES = 200 << 20  # rotate input sets until they span 4x the 50 MB L2
_KV_REGIONS = 4  # cache regions the KV-writing rows rotate over
_LARGE_INNER = 16  # calls per graph at the large size: >= the most input sets, so every replay rotates them all
H, FF = 4096, 14336  # norm width, FFN width
NQ, NKV, HD = 32, 8, 128  # query heads, KV heads, head_dim
E, TOP_K, HE = 128, 8, 2048  # experts, experts per token, MoE width
C, K_CONV = 8192, 4  # SSM channels, conv width
N_QK, N_V, DK, DV = 16, 32, 128, 128  # DeltaNet heads and head dims
ROPE = dict(freq_base=1e6)
GEMMA3 = (16, 8, 256)  # Gemma 3 12B: query heads, KV heads, head_dim (the V-norm rows)
GPT_OSS = (64, 8, 64)  # gpt-oss: query heads, KV heads, head_dim (the YaRN rows)
YARN = dict(base=150000.0, factor=32.0, original_context=4096)  # gpt-oss's rope.scaling


def specs(quick: bool) -> list[RowSpec]:
    """Every row, in the order it runs: each group at one decode token, then at a large prefill batch
    (``n``; a group moves >= 64 MB there with the token count it derives from n). The fusions' groups
    (one launch against its chain of unfused launches) keep one decode row with ``quick``."""
    out = []
    for group in (_norms, _heads, _activations, _moe, _shared_expert, _ssm, _kv_fusions, _moe_ssm_fusions):
        for n, decode in ((1, True), (2048 if quick else 8192, False)):
            out += group(_row_maker(decode), n, decode, quick)
    return out + [RowSpec("scale: host us per call", "1024", (_host_sets,), lambda s: s.d.scale(s.a, s.out, alpha=0.5),
                          peers=(Peer("cupy.multiply(out=)", lambda s: cupy.multiply(s.a, 0.5, out=s.out)),),
                          timing=Timing("host"))]  # host cost of one dispatch: validate, pack, launch


def _norms(row, n, decode, quick):
    g, shape = (_norm_sets, n), f"{n}x{H}"
    return [
        row("rms_norm", shape, g, lambda s: s.d.rms_norm(s.x, s.w1, s.out), (traffic.rows, "rms_norm", n, H),
            _torch("torch F.rms_norm", lambda t: F.rms_norm(t.x, (H,), t.w1, eps=1e-6))),
        row("residual_rms_norm", shape, g, lambda s: s.d.residual_rms_norm(s.x, s.r, s.w1, s.out),
            (traffic.rows, "residual_rms_norm", n, H),
            Peer("chain add+rms_norm", lambda s: (s.d.add(s.r, s.x, s.r), s.d.rms_norm(s.r, s.w1, s.out)))),
        row("post_norm_residual_rms_norm", shape, g, lambda s: s.d.post_norm_residual_rms_norm(s.x, s.r, s.w1, s.w2, s.out),
            (traffic.rows, "post_norm_residual_rms_norm", n, H),
            Peer("chain rms_norm+add+rms_norm", lambda s: (s.d.rms_norm(s.x, s.w1, s.out), s.d.add(s.r, s.out, s.r),
                                                         s.d.rms_norm(s.r, s.w2, s.out)))),
        row("rms_norm_accumulate", shape, g, lambda s: s.d.rms_norm_accumulate(s.x, s.w1, s.r),
            (traffic.rows, "rms_norm_accumulate", n, H),
            Peer("chain rms_norm+add", lambda s: (s.d.rms_norm(s.x, s.w1, s.out), s.d.add(s.r, s.out, s.r)))),
        row("residual_rms_norm_q8_1", shape, g, lambda s: s.d.residual_rms_norm_q8_1(s.x, s.r, s.w1, s.q8),
            (traffic.residual_rms_norm_q8_1, n, H),
            Peer("chain residual_rms_norm+quantize", lambda s: (s.d.residual_rms_norm(s.x, s.r, s.w1, s.out),
                                                              s.d.quantize_q8_1(s.out, s.q8)))),
        row("quantize_q8_1", shape, g, lambda s: s.d.quantize_q8_1(s.x, s.q8), (traffic.quantize_q8_1, n, H)),
    ]


def _heads(row, n, decode, quick):
    """Per-head norms, RoPE and their fusions with the KV write (at the large size twice the tokens, so that
    the 8 KV heads' rows move >= 64 MB too)."""
    n = n if decode else 2 * n
    g, shape, kv_shape, w = (_head_sets, n), f"{n}x{NQ}x{HD}", f"{n}x{NKV}x{HD}", NQ * HD
    return [
        row("head_rms_norm", shape, g, lambda s: s.d.head_rms_norm(s.x, s.wq, s.out), (traffic.rows, "head_rms_norm", n, w),
            _torch("torch F.rms_norm", lambda t: F.rms_norm(t.x, (HD,), t.wq, eps=1e-6))),
        row("rope neox", shape, g, lambda s: s.d.rope(s.x, s.pos, s.out, **ROPE), (traffic.rows, "rope", n, w),
            _torch("torch rope (eager)", lambda t: _torch_rope(t.x, t.out, t.cos, t.sin))),
        row("rms_norm_rope", shape, g, lambda s: s.d.rms_norm_rope(s.x, s.wq, s.pos, s.out, **ROPE),
            (traffic.rows, "rms_norm_rope", n, w),
            Peer("chain head_rms_norm+rope", lambda s: (s.d.head_rms_norm(s.x, s.wq, s.out),
                                                       s.d.rope(s.out, s.pos, s.out, **ROPE)))),
        row("qk_norm_rope_kv_write", f"{n}x({NQ}+2x{NKV})x{HD}", g,
            lambda s: _qkv_write(s, s.v, s.kc, s.vc),
            (traffic.qk_norm_rope_kv_write, n, NQ, NKV, HD), Peer("chain 2x(norm+rope)+2 kv_write", _qkv_chain)),
        row("k_norm_rope_kv_write", kv_shape, g, _k_write,
            (traffic.kv_write, n, NKV, HD),
            Peer("chain norm+rope+kv_write", lambda s: (s.d.head_rms_norm(s.k, s.wk, s.kout),
                                                       s.d.rope(s.kout, s.kvpos, s.kout, **ROPE),
                                                       s.d.kv_write(s.kout, s.kc, s.pages, s.kvpos, s.seq)))),
        row("kv_write (f16 cache)", kv_shape, g, lambda s: s.d.kv_write(s.v, s.kc, s.pages, s.kvpos, s.seq),
            (traffic.kv_write, n, NKV, HD),
            _torch("torch cache[idx] = k.half()", lambda t: t.kc.view(-1, NKV, HD).__setitem__(t.kv_rows, t.v.half()))),
        row("rope per_token positions", shape, g,
            lambda s: s.d.rope(s.x, s.pos_tok, s.out, pos_mode="per_token", **ROPE), (traffic.rows, "rope_per_token", n, w)),
        row("deinterleave", f"{n}x{NQ}x(2x{HD})", g, lambda s: s.d.deinterleave(s.xi, s.x, s.out),
            (traffic.rows, "deinterleave", n, w),
            _torch("torch split+copy", lambda t: (t.x.copy_(t.xi[..., :HD]), t.out.copy_(t.xi[..., HD:])))),
        row("gated_rms_norm", shape, g, lambda s: s.d.gated_rms_norm(s.x, s.z, s.wq, s.out, group_size=HD),
            (traffic.rows, "gated_rms_norm", n, w),
            Peer("chain head_rms_norm+swiglu", lambda s: (s.d.head_rms_norm(s.x, s.wq, s.out),
                                                         s.d.swiglu(*(a.reshape(len(a), -1)
                                                                      for a in (s.z, s.out, s.out)))))),
        row("group_norm (l2)", shape, g, lambda s: s.d.group_norm(s.x, s.out, group_size=HD, l2=True),
            (traffic.rows, "group_norm", n, w), _torch("torch F.normalize", lambda t: F.normalize(t.x, dim=-1))),
    ]


def _activations(row, n, decode, quick):
    n = n if decode else n // 2
    g, shape, binary = (_activation_sets, n), f"{n}x{FF}", (traffic.rows, "binary", n, FF)
    return [
        row("swiglu", shape, g, lambda s: s.d.swiglu(s.a, s.b, s.out), binary,
            _torch("torch silu*mul", lambda t: F.silu(t.a) * t.b)),
        row("swiglu_oai", shape, g, lambda s: s.d.swiglu_oai(s.a, s.b, s.out), binary,
            _torch("torch eager", lambda t: _torch_swiglu_oai(t.a, t.b))),
        row("geglu", shape, g, lambda s: s.d.geglu(s.a, s.b, s.out), binary,
            _torch("torch gelu*mul", lambda t: F.gelu(t.a, approximate="tanh") * t.b)),
        row("sigmoid_mul", shape, g, lambda s: s.d.sigmoid_mul(s.a, s.b, s.out), binary,
            _torch("torch x*sigmoid(g)", lambda t: t.a * torch.sigmoid(t.b))),
        row("add", shape, g, lambda s: s.d.add(s.a, s.b, s.out), binary,
            _torch("torch.add", lambda t: torch.add(t.a, t.b, out=t.out))),
        row("add_scaled", shape, g, lambda s: s.d.add_scaled(s.a, s.b, s.out, alpha=0.5), binary,
            _torch("torch.add(alpha)", lambda t: torch.add(t.a, t.b, alpha=0.5, out=t.out))),
        row("scale_accumulate", shape, g, lambda s: s.d.scale_accumulate(s.out, s.b, 0.5), binary,
            _torch("torch.add_(alpha)", lambda t: t.out.add_(t.b, alpha=0.5))),
        row("scale", shape, g, lambda s: s.d.scale(s.a, s.out, alpha=0.5), (traffic.rows, "scale", n, FF),
            _torch("torch.mul", lambda t: torch.mul(t.a, 0.5, out=t.out))),
        row("bias_add", shape, g, lambda s: s.d.bias_add(s.a, s.bias, s.out, offset=64), (traffic.rows, "bias_add", n, FF),
            _torch("torch x + b", lambda t: torch.add(t.a, t.bias[64:], out=t.out))),
    ]


def _moe(row, n, decode, quick):
    """Routing and the weighted sum (32x / half the tokens at the large size), and the router: one token is
    a matvec (bandwidth-bound: GB/s, % of copy); a token batch a small f32 GEMM (compute-bound: TFLOP/s and
    the ratio to cuBLAS sgemm through cupy.matmul, no bandwidth claim)."""
    n_topk, n_sum = (n, n) if decode else (32 * n, n // 2)
    route, gemm = f"{n}x{HE} @ {E}x{HE}", "" if decode else " [f32 GEMM]"
    flops = (traffic.router_flops, n, HE, E)
    if decode:  # one token: the torch peer (cuBLAS too) in a graph, as eager calls would time the host
        blas = _torch("torch x @ W.T (cuBLAS)", lambda t: torch.matmul(t.x0, t.W.T))
    else:  # CuPy refuses cuBLAS calls during a capture: back-to-back eager calls
        blas = Peer("cuBLAS sgemm (cupy.matmul)", lambda s: cupy.matmul(s.x, s.W.T, out=s.lg_peer), how="stream")
    return [
        row("softmax_topk", f"{n_topk}x{E} k={TOP_K}", (_topk_sets, n_topk),
            lambda s: s.d.softmax_topk(s.logits, s.ids, s.w, k=TOP_K), (traffic.softmax_topk, n_topk, E, TOP_K),
            _torch("torch softmax+topk+renorm", lambda t: _torch_topk(t.logits))),
        row("moe_weighted_sum", f"{n_sum}x{TOP_K}x{2 * HE}", (_weighted_sum_sets, n_sum),
            lambda s: s.d.moe_weighted_sum(s.e, s.w, s.out), (traffic.moe_weighted_sum, n_sum, TOP_K, 2 * HE),
            _torch("torch (e*w).sum(1)", lambda t: torch.sum(t.e * t.w[..., None], 1, out=t.out))),
        row("router_matvec" + gemm, route, (_router_sets, n), lambda s: s.d.router_matvec(s.x, s.W, s.lg),
            (traffic.router_matvec, n, HE, E) if decode else (), blas, flops=flops),
        row("router_rms_norm_matvec" + gemm, route, (_router_sets, n),
            lambda s: s.d.router_rms_norm_matvec(s.x, s.wn, s.W, s.lg),
            (traffic.router_matvec, n, HE, E, {"norm": True}) if decode else (),
            Peer("chain rms_norm+router_matvec", lambda s: (s.d.rms_norm(s.x, s.wn, s.h),
                                                           s.d.router_matvec(s.h, s.W, s.lg))), flops=flops),
    ]


def _shared_expert(row, n, decode, quick):
    return [row("shared_expert_accumulate", f"{n}x{H}", (_shared_expert_sets, n),
                lambda s: s.d.shared_expert_accumulate(s.h, s.x, s.g), (traffic.rows, "shared_expert_accumulate", n, H),
                _torch("torch h += sigmoid(g)*s", lambda t: t.h.add_(torch.sigmoid(t.g)[:, None] * t.x)))]


def _ssm(row, n, decode, quick):
    n_tok = n if decode else (256 if quick else 1024)
    return [
        row(f"conv1d_silu (K={K_CONV})", f"{n}x{C}", (_conv_sets, n), lambda s: s.d.conv1d_silu(s.x, s.state, s.w, s.y),
            (traffic.conv1d_silu, n, C, K_CONV)),
        row("deltanet_tiled", f"{n_tok} tok {N_V}x{DK}x{DV}", (_deltanet_sets, n_tok),
            lambda s: s.d.deltanet(s.q, s.k, s.v, s.g, s.beta, s.S, s.o, tiled=True),
            (traffic.deltanet, n_tok, N_QK, N_V, DK, DV),
            Peer("deltanet (baseline)", lambda s: s.d.deltanet(s.q, s.k, s.v, s.g, s.beta, s.S, s.o, tiled=False))),
    ]


def _kv_fusions(row, n, decode, quick):
    """K and V written in one launch (V copied, or RMS-normed: v_norm at Gemma 3's heads) against the K write
    then the V's norm and kv_write; the bf16 cache beside the f16 rows above; YaRN's table and scale
    against the plain rope at gpt-oss's heads (~1.0x: what the table costs). Tokens as in _heads."""
    n = n if decode else 2 * n
    g, vn, chain_v = (_head_sets, n), (_head_sets, n, GEMMA3), Peer("chain k_norm_rope_kv_write+kv_write", _kv_chain)
    rows = [row("k_norm_rope_kv_write +V", f"{n}x(2x{NKV})x{HD}", g, lambda s: _k_write(s, v=s.v, v_cache=s.vc),
                (traffic.kv_pair_write, n, NKV, HD), chain_v)]
    if quick:
        return rows if decode else []
    nq, nkv, hd = GEMMA3
    qkv_shape, w = f"{n}x({NQ}+2x{NKV})x{HD}", GPT_OSS[0] * GPT_OSS[2]
    return rows + [
        row("k_norm_rope_kv_write +V v_norm", f"{n}x(2x{nkv})x{hd}", vn,
            lambda s: _k_write(s, v=s.v, v_cache=s.vc, v_norm=True, wv=s.wk), (traffic.kv_pair_write, n, nkv, hd),
            Peer("chain k_write+norm+kv_write", lambda s: (_k_write(s), s.d.head_rms_norm(s.v, s.wk, s.vout),
                                                          s.d.kv_write(s.vout, s.vc, s.pages, s.kvpos, s.seq)))),
        row("qk_norm_rope_kv_write v_norm", f"{n}x({nq}+2x{nkv})x{hd}", vn,
            lambda s: _qkv_write(s, s.v, s.kc, s.vc, v_norm=True, wv=s.wk), (traffic.qk_norm_rope_kv_write, n, nq, nkv, hd),
            Peer("chain v norm+qk_norm_rope_kv_write", lambda s: (s.d.head_rms_norm(s.v, s.wk, s.vout),
                                                                 _qkv_write(s, s.vout, s.kc, s.vc)))),
        row("kv_write (bf16 cache)", f"{n}x{NKV}x{HD}", g, lambda s: s.d.kv_write(s.v, s.kb, s.pages, s.kvpos, s.seq),
            (traffic.kv_write, n, NKV, HD), Peer("f16 cache", row=row.named("kv_write (f16 cache)"))),
        row("qk_norm_rope_kv_write (bf16 cache)", qkv_shape, g, lambda s: _qkv_write(s, s.v, s.kb, s.vb),
            (traffic.qk_norm_rope_kv_write, n, NQ, NKV, HD), Peer("f16 cache", row=row.named("qk_norm_rope_kv_write"))),
        row("rope neox yarn", f"{n}x{GPT_OSS[0]}x{GPT_OSS[2]}", (_head_sets, n, GPT_OSS),
            lambda s: s.d.rope(s.x, s.pos, s.out, freqs=s.freqs, attn_scale=s.attn_scale), (traffic.rows, "rope", n, w),
            Peer("rope (freq_base)", lambda s: s.d.rope(s.x, s.pos, s.out, freq_base=YARN["base"]))),
    ]


def _moe_ssm_fusions(row, n, decode, quick):
    """The router's top-k into a RouteSlot against separate ids and weights; the ring conv state (and in
    place) against the shifting one; DeltaNet with the q/k L2 norms in the kernel against the norms as two
    launches; DeltaNet's gates. Tokens as in _moe and _ssm (the gates: as softmax_topk)."""
    if quick:
        return []
    n_topk, n_tok = (n, n) if decode else (32 * n, 1024)
    topk_shape, conv, conv_shape = f"{n_topk}x{E} k={TOP_K}", f"conv1d_silu (K={K_CONV})", f"{n}x{C}"
    ring = (traffic.conv1d_silu, n, C, K_CONV, {"ring": True})
    rows = [
        row("softmax_topk slot", topk_shape, (_topk_sets, n_topk),
            lambda s: s.d.softmax_topk(s.logits, k=TOP_K, slot=s.slot),
            (traffic.softmax_topk, n_topk, E, TOP_K), Peer("ids, weights apart", row=row.named("softmax_topk"))),
        row(f"conv1d_silu ring (K={K_CONV})", conv_shape, (_conv_sets, n),
            lambda s: s.d.conv1d_silu(s.x, s.state, s.w, s.y, state_offset=1), ring,
            Peer("shifting state", row=row.named(conv))),
        row(f"conv1d_silu ring in place (K={K_CONV})", conv_shape, (_conv_sets, n),
            lambda s: s.d.conv1d_silu(s.xh, s.state, s.w_hold, s.xh, state_offset=1), ring,
            Peer("shifting state", row=row.named(conv))),
        row("deltanet_gates", f"{n_topk}x{N_V} group={N_V // N_QK}", (_gate_sets, n_topk),
            lambda s: s.d.deltanet_gates(s.ba, s.a, s.dt_bias, s.g, s.beta, group=N_V // N_QK),
            (traffic.deltanet_gates, n_topk, N_V), _torch("torch sigmoid, softplus", _torch_gates)),
    ]
    for tiled, name in ((True, "deltanet_tiled"), (False, "deltanet (baseline)")):
        rows.append(row(f"{name} qk_l2norm", f"{n_tok} tok {N_V}x{DK}x{DV}", (_deltanet_sets, n_tok),
                        lambda s, tiled=tiled: s.d.deltanet(s.q, s.k, s.v, s.g, s.beta, s.S, s.o, qk_l2norm=True,
                                                            tiled=tiled),
                        (traffic.deltanet, n_tok, N_QK, N_V, DK, DV),
                        Peer(f"chain 2 group_norm(l2)+{name}", lambda s, tiled=tiled: _l2_deltanet_chain(s, tiled))))
    return rows


def _row_maker(decode: bool):
    """RowSpec for one size: decode rows are named "(graph)"; large rows replay _LARGE_INNER calls per graph."""
    timing = Timing() if decode else Timing(n_inner=_LARGE_INNER, n_repeat=10)

    def row(kernel, shape, inputs, call, nbytes=(), peer=None, flops=()):
        return RowSpec(row.named(kernel), shape, inputs, call, nbytes, flops, (peer,) if peer else (), timing)
    row.named = lambda kernel: kernel + (" (graph)" if decode else "")  # a row's name, for Peer(row=)
    return row


def _torch(name, call):
    """A torch peer, called on the set's torch views, timed through torch's graph API."""
    return Peer(name, lambda s: call(s.t), how="torch_graph")


def _torch_rope(x, out, cos, sin):
    x1, x2 = x[..., :HD // 2], x[..., HD // 2:]
    torch.add(x * cos, torch.cat([-x2, x1], -1) * sin, out=out)


def _torch_swiglu_oai(g, u):
    gg = g.clamp(max=7.0)
    return gg * torch.sigmoid(1.702 * gg) * (u.clamp(-7.0, 7.0) + 1)


def _torch_topk(logits):
    p = torch.softmax(logits, -1)
    w, i = torch.topk(p, TOP_K, -1)
    return w / w.sum(-1, keepdim=True), i


def _qkv_chain(s):
    d = s.d
    d.head_rms_norm(s.x, s.wq, s.out)
    d.rope(s.out, s.kvpos, s.out, **ROPE)
    d.head_rms_norm(s.k, s.wk, s.kout)
    d.rope(s.kout, s.kvpos, s.kout, **ROPE)
    d.kv_write(s.kout, s.kc, s.pages, s.kvpos, s.seq)
    d.kv_write(s.v, s.vc, s.pages, s.kvpos, s.seq)


def _k_write(s, **kw):
    s.d.k_norm_rope_kv_write(s.k, s.wk, s.kc, s.pages, s.kvpos, s.seq, **kw, **ROPE)


def _kv_chain(s):
    _k_write(s)
    s.d.kv_write(s.v, s.vc, s.pages, s.kvpos, s.seq)


def _qkv_write(s, v, kc, vc, **kw):
    s.d.qk_norm_rope_kv_write(s.x, s.k, v, s.wq, s.wk, s.out, kc, vc, s.pages, s.kvpos, s.seq, **kw, **ROPE)


def _l2_deltanet_chain(s, tiled):
    s.d.group_norm(s.q, s.qn, group_size=DK, l2=True)
    s.d.group_norm(s.k, s.kn, group_size=DK, l2=True)
    s.d.deltanet(s.qn, s.kn, s.v, s.g, s.beta, s.S, s.o, tiled=tiled)


def _torch_gates(t):
    """beta = sigmoid(b), g = a * softplus(alpha + dt_bias) from ba's per-key-head [b | alpha] groups."""
    ba = t.ba.view(len(t.ba), N_QK, 2, N_V // N_QK)
    torch.sigmoid(ba[:, :, 0].reshape(-1, N_V), out=t.beta)
    torch.mul(t.a, F.softplus(ba[:, :, 1].reshape(-1, N_V) + t.dt_bias), out=t.g)


# ------------------------------------------------------------------ input sets
def _sets(ctx, nbytes, make, shared=None, extra=({},)) -> list:
    """Input sets to rotate through: enough arrays ``make(i)`` to span _L2_ROTATE_BYTES (at most 16), each
    set with ``shared`` and the dispatch; with ``extra`` (a second rotation: fields of their own) set i
    takes the arrays i % n and the fields i % len(extra), over every pair the two rotations make. ``s.t``:
    torch views of a set's arrays (but the uint16 bits of bf16 caches), where torch is installed."""
    n_sets = max(1, min(16, _L2_ROTATE_BYTES // max(nbytes, 1)))
    arrays = [make(i) for i in range(n_sets)]
    sets = [SimpleNamespace(d=ctx.d, **arrays[i % n_sets], **(shared or {}), **extra[i % len(extra)])
            for i in range(math.lcm(n_sets, len(extra)))]
    for s in sets:
        s.t = SimpleNamespace(**{k: torch.from_dlpack(v) if isinstance(v, cupy.ndarray) and v.dtype != cupy.uint16 else v
                                 for k, v in vars(s).items()}) if torch is not None else None  # uint16: bf16 bits
    return sets


def _norm_sets(ctx, n):
    return _sets(ctx, 3 * n * H * 4, lambda i: dict(
        x=ctx.randn(n, H), r=ctx.randn(n, H), w1=ctx.randn(H), w2=ctx.randn(H),
        out=cupy.empty((n, H), cupy.float32), q8=cupy.empty((n, H * 36 // 32), cupy.uint8)))


def _head_sets(ctx, n, heads=(NQ, NKV, HD)):
    """The KV writes rotate over _KV_REGIONS regions of the caches (4 x 32 MB at the large size), so that
    repeated writes of the same lines cannot merge in the 50 MB L2 and flatter the written bytes: a set's
    ``kvpos`` is its region's first position, ``kv_rows`` its rows (for torch). ``heads``: (query heads,
    KV heads, head_dim); f16 caches ``kc``/``vc``, bf16 ``kb``/``vb`` (uint16 bits); ``freqs``/``attn_scale``:
    gpt-oss's YaRN table at this head_dim."""
    nq, nkv, hd = heads
    page_size = 16
    max_pages = -(-(_KV_REGIONS * n + 1) // page_size)
    kc = cupy.zeros((max_pages, page_size, nkv, hd), cupy.float16)
    freqs, attn_scale = yarn_freqs(hd, **YARN)
    shared = dict(pos=cupy.zeros(1, cupy.int32), pos_tok=cupy.arange(n, dtype=cupy.int32), seq=cupy.zeros(1, cupy.int32),
                  pages=cupy.arange(max_pages, dtype=cupy.int32).reshape(1, max_pages), kc=kc, vc=cupy.zeros_like(kc),
                  kb=cupy.zeros(kc.shape, cupy.uint16), vb=cupy.zeros(kc.shape, cupy.uint16),
                  freqs=cupy.asarray(freqs), attn_scale=attn_scale)
    if torch is not None:
        inv = 1e6 ** (-torch.arange(0, hd, 2, dtype=torch.float64, device="cuda") / hd)
        ang = torch.arange(n, dtype=torch.float64, device="cuda")[:, None] * inv[None, :]
        shared.update(cos=torch.cat([ang.cos(), ang.cos()], -1).float()[:, None, :],
                      sin=torch.cat([ang.sin(), ang.sin()], -1).float()[:, None, :])
    regions = [dict(kvpos=cupy.full(1, r * n, cupy.int32), kv_rows=slice(r * n, (r + 1) * n)) for r in range(_KV_REGIONS)]
    f32 = cupy.float32

    def make(i):
        kv = dict(k=ctx.randn(n, nkv, hd), v=ctx.randn(n, nkv, hd), kout=cupy.empty((n, nkv, hd), f32),
                  vout=cupy.empty((n, nkv, hd), f32))
        extra = dict(xi=ctx.randn(n, nq, 2 * hd), z=ctx.randn(n, nq, hd)) if heads == (NQ, NKV, HD) else {}
        return dict(x=ctx.randn(n, nq, hd), out=cupy.empty((n, nq, hd), f32), wq=ctx.randn(hd), wk=ctx.randn(hd), **kv,
                    **extra)
    return _sets(ctx, 2 * n * nq * hd * 4, make, shared, regions)


def _activation_sets(ctx, n):
    return _sets(ctx, 3 * n * FF * 4, lambda i: dict(a=ctx.randn(n, FF), b=ctx.randn(n, FF),
                                                     out=cupy.empty((n, FF), cupy.float32), bias=ctx.randn(FF + 64)))


def _topk_sets(ctx, n):
    return _sets(ctx, n * E * 4, lambda i: dict(logits=ctx.randn(n, E), ids=cupy.empty((n, TOP_K), cupy.int32),
                                                w=cupy.empty((n, TOP_K), cupy.float32),
                                                slot=RouteSlot(cupy.empty((n, 2 * TOP_K), cupy.uint32), TOP_K)))


def _weighted_sum_sets(ctx, n):
    return _sets(ctx, n * TOP_K * HE * 4 * 2, lambda i: dict(e=ctx.randn(n, TOP_K, 2 * HE), w=ctx.randn(n, TOP_K),
                                                            out=cupy.empty((n, 2 * HE), cupy.float32)))


def _router_sets(ctx, n):
    """x [n, HE] f32 rotating; W [E, HE] f32 (1 MiB) and the norm's weight shared; ``x0``: the first set's x,
    the decode peer's input."""
    shared = dict(W=ctx.randn(E, HE, scale=0.02), wn=ctx.randn(HE), lg=cupy.empty((n, E), cupy.float32),
                  lg_peer=cupy.empty((n, E), cupy.float32))
    sets = _sets(ctx, n * HE * 4, lambda i: dict(x=ctx.randn(n, HE), h=cupy.empty((n, HE), cupy.float32)), shared)
    for s in sets:
        s.x0 = sets[0].x
        if s.t is not None:
            s.t.x0 = sets[0].t.x
    return sets


def _shared_expert_sets(ctx, n):
    return _sets(ctx, 3 * n * H * 4, lambda i: dict(h=ctx.randn(n, H), x=ctx.randn(n, H), g=ctx.randn(n)))


def _conv_sets(ctx, n):
    """``xh`` and ``w_hold`` for the in-place calls, which rewrite their input at every call: inputs >= 30 and
    taps (0.004, -0.004, 0, 1), so that silu(acc) = acc and acc ~ x, the values neither decay nor grow over
    the repeated calls (decaying values reach denormals, which send the division in silu down its slow path;
    docs/notes/elementwise.md)."""
    w_hold = cupy.zeros((C, K_CONV), cupy.float32)
    w_hold[:, 0], w_hold[:, 1], w_hold[:, -1] = 0.004, -0.004, 1.0
    shared = dict(state=ctx.randn(K_CONV - 1, C), w=ctx.randn(C, K_CONV), w_hold=w_hold)
    return _sets(ctx, 3 * n * C * 4, lambda i: dict(x=ctx.randn(n, C), y=cupy.empty((n, C), cupy.float32),
                                                    xh=30.0 + 10.0 * cupy.abs(ctx.randn(n, C))), shared)


def _deltanet_sets(ctx, n):
    return [SimpleNamespace(d=ctx.d, q=ctx.randn(n, N_QK, DK) * (DK ** -0.5), k=ctx.randn(n, N_QK, DK) * (DK ** -0.5),
                            v=ctx.randn(n, N_V, DV), g=-cupy.abs(ctx.randn(n, N_V)) * 0.1,
                            beta=cupy.abs(ctx.randn(n, N_V)) * 0.3, S=ctx.randn(N_V, DK, DV) * 0.1,
                            o=cupy.empty((n, N_V, DV), cupy.float32), qn=cupy.empty((n, N_QK, DK), cupy.float32),
                            kn=cupy.empty((n, N_QK, DK), cupy.float32))]


def _gate_sets(ctx, n):
    """ba [n, 2 N_V] logits rotating; a (-exp(A_log)) and dt_bias shared."""
    shared = dict(a=-cupy.exp(ctx.randn(N_V)), dt_bias=ctx.randn(N_V))
    return _sets(ctx, 4 * n * N_V * 4, lambda i: dict(ba=ctx.randn(n, 2 * N_V), g=cupy.empty((n, N_V), cupy.float32),
                                                     beta=cupy.empty((n, N_V), cupy.float32)), shared)


def _host_sets(ctx):
    return [SimpleNamespace(d=ctx.d, a=ctx.randn(1024), out=cupy.empty(1024, cupy.float32))]


def bench(quick: bool = False) -> tuple[list, object]:
    rng = cupy.random.default_rng(0)
    ctx = SimpleNamespace(d=ElementwiseDispatch(),
                          randn=lambda *shape, scale=1.0: rng.standard_normal(shape, dtype=cupy.float32) * scale)
    ceil = measure_ceilings()
    return run_specs("elementwise", specs(quick), ceil, ctx), ceil


def main(argv=None) -> int:
    return script_main(bench, __doc__, title='elementwise',
                       quick_help='smaller large sizes', argv=argv)


if __name__ == "__main__":
    sys.exit(main())
