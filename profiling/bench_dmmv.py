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
against quantize_glu (SwiGLU written as the QuantizedX) and the matvec on that. At Qwen3-Next's and
gpt-oss's shapes: dmmv_pair on a NormedX (the SSM alpha/beta projections) against rms_norm and two dmmv,
the packed down projection summed with ``weights=`` against the per-slot outputs then moe_weighted_sum,
and expert counts of one layer of a strided routing capture against the same ids contiguous. A row whose peer is
another row of the table ("f32 path", "two launches") takes that row's time.

The rows are the table of ``specs(quick)`` (bytes from cukern.traffic); ``s`` is one input set.
Run: PYTHONPATH=. python profiling/bench_dmmv.py [--quick] [--json out.json]
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import cupy
import numpy as np

from cukern import traffic
from cukern.benchmark import Peer, RowSpec, measure_ceilings, run_specs, script_main
from cukern.dmmv import Q8_TYPES, QTYPES, DmmvDispatch, MergedX, NormedX, QuantizedX, QWeight, qtype_id, row_bytes
from cukern.elementwise import ElementwiseDispatch

try:
    import torch
except ImportError:  # the peer is optional; rows then show no ratio
    torch = None

ROTATE_BYTES = 200 << 20  # > 4x L2
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (262144, 640), (151936, 2048)]
TYPES = ["Q4_0", "Q5_0", "Q8_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"]
QUICK_TYPES = ["Q4_0", "Q5_0", "Q8_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K"]
N_E, TOP_K, T = 128, 8, 16  # MoE: experts, experts per token, tokens of the packed rows
QWEN3_NEXT = dict(d_model=2048, n_v_heads=32, n_experts=512, top_k=10, ffn=512, n_layers=48)
GPT_OSS_20B = dict(d_model=2880, n_experts=32, top_k=4, ffn=2880)
LM_HEAD_COLS = (1, 2, 4, 8)  # columns of the LM head rows (a decode batch): 2, 4, 8 are dmmv_split_tc's widths


def specs(quick: bool) -> list[RowSpec]:
    """Every row, in the order it runs."""
    shapes = [(14336, 4096), (4096, 14336)] if quick else SHAPES
    out = [r for m, k in shapes for name in (QUICK_TYPES if quick else TYPES)
           if k % QTYPES[qtype_id(name)][1] == 0 for r in _matvec(name, m, k)]  # k = 640: no whole K-quant super-block
    out += [r for n in LM_HEAD_COLS for r in _lm_head(n)] + _norm_glu() + _merged_oproj()
    out += [_quantize_x(k) for k in sorted({k for _, k in shapes})]
    out += [r for name in (["MXFP4", "Q4_K"] if quick else ["MXFP4", "Q4_K", "Q6_K", "Q8_0"]) for r in _ffn_down(name)]
    out += [r for name in (["Q4_K"] if quick else ["Q4_K", "Q8_0", "Q6_K"]) for r in _batch(name)]
    out += [r for name in (["Q4_K", "MXFP4"] if quick else ["Q4_K", "Q8_0", "Q6_K", "MXFP4"]) for r in _glu(name)]
    out += [r for name in (["Q4_K", "MXFP4"] if quick else ["Q4_K", "Q8_0", "MXFP4", "Q6_K"]) for r in _moe(name)]
    out += [_ssm_alpha_beta()]
    if not quick:
        q, g = QWEN3_NEXT, GPT_OSS_20B
        out += [_moe_sum("Q4_K", q["d_model"], q["ffn"], q["n_experts"], q["top_k"]),
                _moe_sum("MXFP4", g["d_model"], g["ffn"], g["n_experts"], g["top_k"]), _count_experts()]
    return out


def _gemv(m, k):
    return Peer("cuBLAS f16 GEMV (torch.mv)", lambda s: torch.mv(s.w, s.x, out=s.y), how="torch_graph",
                inputs=(_gemv_sets, m, k))


def _matvec(name, m, k):
    g, shape, wb, gemv = (_matvec_sets, name, m, k), f"{m}x{k}", _w_bytes(name, m, k), (_gemv(m, k),)
    rows = [RowSpec(f"dmmv {name}", shape, g, lambda s: s.d.dmmv(s.w, s.x, s.y), (traffic.dmmv, wb, m, k), peers=gemv)]
    if qtype_id(name) in Q8_TYPES:  # the int8 path, where pdl applies; x quantized once (QuantizedX) for the
        rows += [                   # matvecs that share it: its bytes are read instead
            RowSpec(f"dmmv {name} pdl", shape, g, lambda s: s.d_pdl.dmmv(s.w, s.x, s.y), (traffic.dmmv, wb, m, k),
                    peers=gemv),
            RowSpec(f"dmmv {name} pdl q8x", shape, g, lambda s: s.d_pdl.dmmv(s.w, s.qx, s.y),
                    (traffic.dmmv_prequantized, wb, m, traffic.quantized_x_bytes(k)), peers=gemv)]
    return rows


def _lm_head(n, m=262144, k=640):
    """An LM head (Gemma 3's 262144 x 640 Q8_0): the GGUF blocks on the f32 path (what the model runs for
    n > 1) against the SplitQ8 copy (quants and scales apart, 16-byte loads: dmmv_split at one column,
    dmmv_split_tc on tensor cores at 2, 4 and 8), n columns; pdl as in a decode step."""
    g, shape, nbytes, f32 = (_lm_head_sets, m, k), f"{m}x{k}", (traffic.dmmv, _w_bytes("Q8_0", m, k), m, k, n), \
        f"lm head Q8_0 f32 path pdl n={n}"
    return [RowSpec(f32, shape, g, lambda s: s.d_f32_pdl.dmmv(s.w, s.x[n], s.y[n]), nbytes,
                    peers=(_gemv(m, k),) if n == 1 else ()),
            RowSpec(f"lm head Q8_0 split pdl n={n}", shape, g, lambda s: s.d_f32_pdl.dmmv(s.split, s.x[n], s.y[n]),
                    nbytes, peers=(Peer("GGUF blocks, f32 path", row=f32),))]


def _norm_glu(m=2048, k=640):
    """A decoder layer's residual add + norm before its FFN (Gemma 3 270M: 640 -> 2 x 2048 Q5_0): the
    elementwise post_norm_residual_rms_norm then dmmv_glu, against dmmv_glu on a NormedX (every block
    makes its x); bytes: the weights, proj, residual, and the outputs."""
    g, shape, nbytes = (_norm_glu_sets, m, k), f"2x{m}x{k}", (traffic.dmmv_glu_normed, _w_bytes("Q5_0", m, k), m, k)
    return [RowSpec("norm + glu Q5_0 two launches pdl", shape, g,
                    lambda s: (s.ew_pdl.post_norm_residual_rms_norm(s.proj, s.res2, s.wp, s.wn, s.h),
                               s.d_f32_pdl.dmmv_glu(s.wg, s.wu, s.h, s.y)), nbytes),
            RowSpec("norm + glu Q5_0 NormedX pdl", shape, g, lambda s: s.d_f32_pdl.dmmv_glu(s.wg, s.wu, s.nx, s.y), nbytes,
                    peers=(Peer("norm kernel + dmmv_glu", row="norm + glu Q5_0 two launches pdl"),))]


def _merged_oproj(m=640, heads=4, d=256, states=8):
    """A decode step's attention tail (Gemma 3 270M: 8 split states of 4 heads x 256, a 640 x 1024 Q4_K
    o-projection): merge_states then dmmv, against dmmv on a MergedX (every block merges the states)."""
    k = heads * d
    g, shape = (_merged_sets, m, heads, d, states), f"{m}x{k} s{states}"
    nbytes = (traffic.dmmv_merged, _w_bytes("Q4_K", m, k), m, states, heads, d)
    return [RowSpec("merge + o_proj Q4_K two launches pdl", shape, g,
                    lambda s: (s.attn.merge_states(s.o_part, s.lse, s.o), s.d_f32_pdl.dmmv(s.w, s.o.reshape(1, k), s.y)),
                    nbytes),
            RowSpec("merge + o_proj Q4_K MergedX pdl", shape, g, lambda s: s.d_f32_pdl.dmmv(s.w, s.mx, s.y), nbytes,
                    peers=(Peer("merge_states + dmmv", row="merge + o_proj Q4_K two launches pdl"),))]


def _quantize_x(k):
    """What a QuantizedX costs, once per input shared by several matvecs."""
    return RowSpec(f"quantize_x pdl k={k}", f"1x{k}", (_quantize_x_sets, k), lambda s: s.d_pdl.quantize_x(s.x, s.qx),
                   (traffic.quantize_x, k, traffic.quantized_x_bytes(k)))


def _ffn_down(name, m=4096, k=14336):
    """The FFN's down projection after gate and up, two kernels either way: the elementwise SwiGLU then the
    matvec on its f32 output, against quantize_glu (the activation written as a QuantizedX) then the
    matvec on it; bytes: the weights, gate and up, y."""
    g, shape, nbytes, f32 = (_ffn_down_sets, name, m, k), f"{m}x{k}", (traffic.ffn_down, _w_bytes(name, m, k), m, k), \
        f"ffn down {name} swiglu+dmmv pdl"
    return [RowSpec(f32, shape, g, lambda s: (s.ew.swiglu(s.gate[None], s.up[None], s.h[None]), s.d_pdl.dmmv(s.w, s.h, s.y)),
                    nbytes),
            RowSpec(f"ffn down {name} quantize_glu+dmmv q8x", shape, g,
                    lambda s: (s.d_pdl.quantize_glu(s.gate, s.up, s.qx), s.d_pdl.dmmv(s.w, s.qx, s.y)), nbytes,
                    peers=(Peer("swiglu + f32-x dmmv", row=f32),))]


def _batch(name, m=4096, k=14336):
    """Batched columns: the weights read once for all of them."""
    return [RowSpec(f"dmmv_batch {name} n={n}", f"{m}x{k}", (_batch_sets, name, m, k),
                    lambda s, n=n: s.d.dmmv_batch(s.w, s.x[n], s.y[n]), (traffic.dmmv, _w_bytes(name, m, k), m, k, n))
            for n in (2, 4, 8)]


def _glu(name, m=14336, k=4096):
    """Fused gate + up + SwiGLU (two matrices, one input): the int8 path (dmmv_q8_two) against the f32
    path's fused kernel (DmmvDispatch(int8=False))."""
    g, shape, nbytes, f32 = (_glu_sets, name, m, k), f"2x{m}x{k}", (traffic.dmmv_glu, _w_bytes(name, m, k), m, k), \
        f"dmmv_glu {name} f32 path"
    peer = (Peer("f32-path dmmv_glu", row=f32),)
    return [RowSpec(f32, shape, g, lambda s: s.d_f32.dmmv_glu(s.wg, s.wu, s.x, s.y, act="swiglu"), nbytes),
            RowSpec(f"dmmv_glu {name}", shape, g, lambda s: s.d.dmmv_glu(s.wg, s.wu, s.x, s.y, act="swiglu"), nbytes,
                    peers=peer),
            RowSpec(f"dmmv_glu {name} pdl", shape, g, lambda s: s.d_pdl.dmmv_glu(s.wg, s.wu, s.x, s.y, act="swiglu"),
                    nbytes, peers=peer)]


def _moe(name, m=2048, k=7168):
    """128 experts of 2048 x 7168 (Q4_K: 8.3 MB each), top-8, one token, the expert ids rotating; gate + up +
    SwiGLU of the same slots and the down projection, the int8 path against the f32 path's fused kernels;
    16 tokens (128 slots) through route packing, weights once per expert chunk."""
    g, eb, top = (_moe_sets, name, m, k), _w_bytes(name, m, k), f"top{TOP_K}/{N_E}"
    glu, down = f"moe_dmmv glu {name} f32 path", f"moe_down {name} {top} f32 path"
    return [
        RowSpec(f"moe_dmmv {name} {top}", f"{m}x{k}", g, lambda s: s.d.moe_dmmv(s.w, s.x, s.ids, s.y),
                (traffic.moe_dmmv, eb, m, k, TOP_K)),
        RowSpec(glu, f"2x{m}x{k}", g, lambda s: s.d_f32.moe_dmmv(s.w, s.x, s.ids, s.y, w_up=s.wu),
                (traffic.moe_dmmv, eb, m, k, TOP_K, {"glu": True})),
        RowSpec(f"moe_dmmv glu {name}", f"2x{m}x{k}", g, lambda s: s.d.moe_dmmv(s.w, s.x, s.ids, s.y, w_up=s.wu),
                (traffic.moe_dmmv, eb, m, k, TOP_K, {"glu": True}), peers=(Peer("f32-path moe_dmmv glu", row=glu),)),
        RowSpec(down, f"{m}x{k}", g, lambda s: s.d_f32.moe_down(s.w, s.h, s.ids, s.wts, s.yd),
                (traffic.moe_down, eb, m, k, TOP_K)),
        RowSpec(f"moe_down {name} {top}", f"{m}x{k}", g, lambda s: s.d.moe_down(s.w, s.h, s.ids, s.wts, s.yd),
                (traffic.moe_down, eb, m, k, TOP_K), peers=(Peer("f32-path moe_down", row=down),)),
        RowSpec(f"moe pack+packed {name} T={T}", f"{m}x{k}", g,
                lambda s: (s.d.moe_route_pack(s.tids, s.route), s.d.moe_dmmv_packed(s.w, s.xt, s.tids, s.route, s.yt)),
                (traffic.moe_packed, eb, m, k, TOP_K, T, _moe_n_active())),
    ]


def _ssm_alpha_beta(name="Q4_K"):
    """Qwen3-Next's SSM alpha and beta projections (2 x 32 x 2048) on one RMS norm of the hidden state:
    dmmv_pair on a NormedX (every block norms h; the f32 path) against rms_norm then two dmmv, on the
    int8 path (the default) and on the f32 path."""
    m, k = QWEN3_NEXT["n_v_heads"], QWEN3_NEXT["d_model"]
    nbytes = (traffic.dmmv_pair, _w_bytes(name, m, k), m, k, {"normed": True})
    return RowSpec(f"dmmv_pair NormedX {name} pdl", f"2x{m}x{k}", (_alpha_beta_sets, name, m, k),
                   lambda s: s.d_pdl.dmmv_pair(s.wa, s.wb, s.nx, s.ya, s.yb), nbytes,
                   peers=(Peer("rms_norm + 2 dmmv", lambda s: _alpha_beta_chain(s, s.d_pdl)),
                          Peer("rms_norm + 2 dmmv f32 path", lambda s: _alpha_beta_chain(s, s.d_f32_pdl))))


def _alpha_beta_chain(s, d):
    s.ew_pdl.rms_norm(s.h, s.wn, s.x)
    d.dmmv(s.wa, s.x, s.ya)
    d.dmmv(s.wb, s.x, s.yb)


def _moe_sum(name, m, k, n_e, top_k):
    """The packed down projection summed into y (T tokens; ``accumulate=True, weights=``: the weighted slots
    added with atomics) against the packed per-slot outputs then moe_weighted_sum; each set's route packed
    when built."""
    g = (_moe_sum_sets, name, m, k, n_e, top_k)
    nbytes = (traffic.moe_packed_sum, _w_bytes(name, m, k), m, k, top_k, T, _n_active(_moe_sum_routings(n_e, top_k)))
    return RowSpec(f"moe_dmmv_packed weights= {name} T={T}", f"{m}x{k} top{top_k}/{n_e}", g,
                   lambda s: s.d.moe_dmmv_packed(s.w, s.h, s.ids, s.route, s.y, accumulate=True, weights=s.wts), nbytes,
                   peers=(Peer("packed + moe_weighted_sum", _moe_sum_chain),))


def _moe_sum_chain(s):
    s.d.moe_dmmv_packed(s.w, s.h, s.ids, s.route, s.ys)
    s.ew.moe_weighted_sum(s.ys, s.wts, s.y, accumulate=True)


def _count_experts(n=4096):
    """Expert counts of one layer of a prefill's [tokens, layers, top_k] routing capture (Qwen3-Next: 48 layers,
    top-10 of 512), the layer rotating, against the same ids contiguous."""
    q = QWEN3_NEXT
    return RowSpec("moe_count_experts layer=", f"{n}x{q['n_layers']}x{q['top_k']} /{q['n_experts']}",
                   (_capture_sets, n), lambda s: s.d.moe_count_experts(s.capture, s.counts, layer=s.layer),
                   (traffic.count_experts, n, q["top_k"], q["n_experts"]),
                   peers=(Peer("contiguous ids", lambda s: s.d.moe_count_experts(s.ids, s.counts)),))


def _w_bytes(name, m, k) -> int:
    """The GGUF bytes of an m x k matrix of type ``name`` (QWeight.nbytes)."""
    return row_bytes(qtype_id(name), k) * m


# ------------------------------------------------------------------ input sets
def _weights(qt: int, m: int, k: int, n_experts: int = 0, max_sets: int = 8, seed=None) -> list:
    """Copies of random raw weights spanning ROTATE_BYTES (bit patterns only matter for speed, not validity)."""
    nbytes = row_bytes(qt, k) * m * max(1, n_experts)
    rng = cupy.random.default_rng(qt if seed is None else seed)
    return [QWeight(rng.integers(0, 256, nbytes, dtype=cupy.uint8), qt, m, k, n_experts=n_experts)
            for _ in range(max(1, min(max_sets, -(-ROTATE_BYTES // nbytes))))]


def _set(ctx, **fields) -> SimpleNamespace:
    """One input set: ``fields`` and the dispatches of ``ctx``."""
    return SimpleNamespace(**vars(ctx), **fields)


def _gemv_sets(ctx, m, k):
    """f16 copies of an m x k matrix for cuBLAS GEMV (torch.mv), rotating."""
    x = torch.randn(k, device="cuda", dtype=torch.float16)
    y = torch.empty(m, device="cuda", dtype=torch.float16)
    return [SimpleNamespace(w=torch.randn(m, k, device="cuda", dtype=torch.float16), x=x, y=y)
            for _ in range(max(1, min(4, -(-ROTATE_BYTES // (2 * m * k)))))]


def _matvec_sets(ctx, name, m, k):
    qt = qtype_id(name)
    x, y = cupy.random.standard_normal(k, dtype=cupy.float32), cupy.empty(m, cupy.float32)
    qx = ctx.d_pdl.quantize_x(x, QuantizedX.empty(x.shape, qt)) if qt in Q8_TYPES else None
    return [_set(ctx, w=w, x=x, y=y, qx=qx) for w in _weights(qt, m, k)]


def _lm_head_sets(ctx, m, k):
    ws = _weights(qtype_id("Q8_0"), m, k)
    x = {n: cupy.random.standard_normal((n, k), dtype=cupy.float32) for n in LM_HEAD_COLS}
    y = {n: cupy.empty((n, m), cupy.float32) for n in LM_HEAD_COLS}
    return [_set(ctx, w=w, split=ctx.d.split_q8_0(w), x=x, y=y) for w in ws]


def _norm_glu_sets(ctx, m, k):
    qt = qtype_id("Q5_0")
    gate, up = _weights(qt, m, k), _weights(qt, m, k)
    proj, res = (cupy.random.standard_normal((1, k), dtype=cupy.float32) for _ in range(2))
    wp, wn = (cupy.random.standard_normal(k, dtype=cupy.float32) for _ in range(2))
    res2, h, y = cupy.empty((1, k), cupy.float32), cupy.empty((1, k), cupy.float32), cupy.empty((1, m), cupy.float32)
    nx = NormedX(res, wn, proj, wp, res2)
    return [_set(ctx, wg=wg, wu=wu, proj=proj, res2=res2, wp=wp, wn=wn, h=h, y=y, nx=nx) for wg, wu in zip(gate, up)]


def _merged_sets(ctx, m, heads, d, states):
    from cukern.attention import AttentionDispatch
    o_part = cupy.random.standard_normal((1, states, heads, d), dtype=cupy.float32)
    lse = cupy.random.standard_normal((1, states, heads), dtype=cupy.float32) * 3
    o, y = cupy.empty((1, heads, d), cupy.float32), cupy.empty((1, m), cupy.float32)
    attn = AttentionDispatch(pdl=True)
    return [_set(ctx, w=w, o_part=o_part, lse=lse, o=o, y=y, mx=MergedX(o_part, lse), attn=attn)
            for w in _weights(qtype_id("Q4_K"), m, heads * d)]


def _quantize_x_sets(ctx, k):
    return [_set(ctx, x=cupy.random.standard_normal(k, dtype=cupy.float32), qx=QuantizedX.empty((k,), "Q4_K"))]


def _ffn_down_sets(ctx, name, m, k):
    qt = qtype_id(name)
    gate, up = (cupy.random.standard_normal(k, dtype=cupy.float32) for _ in range(2))
    h, y, qx = cupy.empty(k, cupy.float32), cupy.empty(m, cupy.float32), QuantizedX.empty((k,), qt)
    return [_set(ctx, w=w, gate=gate, up=up, h=h, y=y, qx=qx) for w in _weights(qt, m, k)]


def _batch_sets(ctx, name, m, k):
    x = {n: cupy.random.standard_normal((n, k), dtype=cupy.float32) for n in (2, 4, 8)}
    y = {n: cupy.empty((n, m), cupy.float32) for n in (2, 4, 8)}
    return [_set(ctx, w=w, x=x, y=y) for w in _weights(qtype_id(name), m, k)]


def _glu_sets(ctx, name, m, k):
    """Gate and up are consecutive copies: call j reads copies 2j and 2j + 1 (mod their number), so that no
    call reads a matrix the previous call left in L2."""
    ws = _weights(qtype_id(name), m, k)
    x, y = cupy.random.standard_normal(k, dtype=cupy.float32), cupy.empty(m, cupy.float32)
    n = len(ws)
    return [_set(ctx, wg=ws[2 * j % n], wu=ws[(2 * j + 1) % n], x=x, y=y) for j in range(n if n % 2 else n // 2)]


def _routings(n_e: int, top_k: int, n_tokens: int, count: int, seed: int) -> list:
    """``count`` routings of n_tokens tokens ([n_tokens, top_k] int32, distinct expert ids per token)."""
    rs = np.random.default_rng(seed)
    return [np.stack([rs.permutation(n_e)[:top_k] for _ in range(n_tokens)]).astype(np.int32) for _ in range(count)]


def _moe_routings() -> tuple[list, list]:
    """16 routings of one token and 4 of T tokens, so that timed calls read different experts."""
    return _routings(N_E, TOP_K, 1, 16, seed=2), _routings(N_E, TOP_K, T, 4, seed=3)


def _moe_sum_routings(n_e, top_k) -> list:
    return _routings(n_e, top_k, T, 4, seed=4)


def _n_active(routings) -> float:
    """Experts a packed call reads, on average over the routings."""
    return sum(len(set(t.ravel().tolist())) for t in routings) / len(routings)


def _moe_n_active() -> float:
    return _n_active(_moe_routings()[1])


def _moe_sets(ctx, name, m, k):
    qt = qtype_id(name)
    w, wu = (_weights(qt, m, k, n_experts=N_E, max_sets=1, seed=1)[0] for _ in range(2))
    one, tokens = _moe_routings()
    shared = dict(w=w, wu=wu, x=cupy.random.standard_normal((1, k), dtype=cupy.float32),
                  y=cupy.empty((1, TOP_K, m), cupy.float32),
                  h=cupy.random.standard_normal((1, TOP_K, k), dtype=cupy.float32),
                  wts=cupy.full((1, TOP_K), 0.125, cupy.float32), yd=cupy.empty((1, m), cupy.float32),
                  xt=cupy.random.standard_normal((T, k), dtype=cupy.float32), yt=cupy.empty((T, TOP_K, m), cupy.float32),
                  route=ctx.d.plan_moe_route(T, TOP_K, N_E))
    return [_set(ctx, ids=cupy.asarray(one[i]), tids=cupy.asarray(tokens[i % len(tokens)]), **shared)
            for i in range(len(one))]


def _alpha_beta_sets(ctx, name, m, k):
    qt = qtype_id(name)
    h, wn = cupy.random.standard_normal((1, k), dtype=cupy.float32), cupy.random.standard_normal(k, dtype=cupy.float32)
    shared = dict(h=h, wn=wn, nx=NormedX(h, wn), x=cupy.empty((1, k), cupy.float32), ya=cupy.empty((1, m), cupy.float32),
                  yb=cupy.empty((1, m), cupy.float32))
    ws = _weights(qt, m, k, max_sets=16)
    return [_set(ctx, wa=ws[2 * j % len(ws)], wb=ws[(2 * j + 1) % len(ws)], **shared) for j in range(len(ws) // 2)]


def _moe_sum_sets(ctx, name, m, k, n_e, top_k):
    """One set per routing of T tokens, its route packed here; h [T, top_k, k] per slot, y [T, m] summed into."""
    w = _weights(qtype_id(name), m, k, n_experts=n_e, max_sets=1, seed=1)[0]
    shared = dict(w=w, h=cupy.random.standard_normal((T, top_k, k), dtype=cupy.float32),
                  wts=cupy.full((T, top_k), 1.0 / top_k, cupy.float32), y=cupy.zeros((T, m), cupy.float32),
                  ys=cupy.empty((T, top_k, m), cupy.float32))
    sets = []
    for ids in _moe_sum_routings(n_e, top_k):
        ids = cupy.asarray(ids)
        sets.append(_set(ctx, ids=ids, route=ctx.d.moe_route_pack(ids, ctx.d.plan_moe_route(T, top_k, n_e)), **shared))
    return sets


def _capture_sets(ctx, n):
    """A [n, n_layers, top_k] capture; set i counts layer i (16 layers), ``ids`` that layer's ids contiguous."""
    q = QWEN3_NEXT
    capture = cupy.asarray(np.stack(_routings(q["n_experts"], q["top_k"], n, q["n_layers"], seed=5), axis=1))
    counts = cupy.empty(q["n_experts"], cupy.int32)
    return [_set(ctx, capture=capture, layer=i, ids=cupy.ascontiguousarray(capture[:, i]), counts=counts)
            for i in range(16)]


def bench(quick: bool = False) -> tuple[list, object]:
    # "pdl": each launch overlaps the previous one's tail; "f32": the f32 path, the fused rows' peer
    ctx = SimpleNamespace(d=DmmvDispatch(), d_pdl=DmmvDispatch(pdl=True),
                          d_f32=DmmvDispatch(int8=False), d_f32_pdl=DmmvDispatch(int8=False, pdl=True),
                          ew=ElementwiseDispatch(), ew_pdl=ElementwiseDispatch(pdl=True))
    ceil = measure_ceilings()
    rows = run_specs("dmmv", specs(quick), ceil, ctx)
    ctx.d.check_errors()
    return rows, ceil


def main(argv=None) -> int:
    return script_main(bench, __doc__, title='dmmv',
                       quick_help='the two 14336/4096 shapes and the required types only', argv=argv)


if __name__ == "__main__":
    sys.exit(main())
