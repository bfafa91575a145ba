"""Float64 references for the matmul family (cukern/matmul.py).

Weights: random valid GGUF blocks and gguf's own dequantization, shared with the dmmv family
(:func:`random_weight`, :func:`dequantize` are ``cukern.reference.dmmv``'s). A GEMM reference is
the float64 product of the dequantized matrix with the activations; :func:`gemm_f16_inputs` is the
same product on the f16-rounded operands the tensor-core path multiplies, which separates the
f16 input rounding (bounded by the issue's 2e-3) from kernel error (f32 accumulation only);
gemm_wgr's K-quant weights come from f16 arithmetic (:func:`wgr_values`), so its products are
checked against those values.

gemm_wgr's packed layouts (MatmulDispatch.pack, pack_glu): :func:`pack_wgr` (:func:`pack_wgr_glu`) builds
the bytes the device packer must write, bit for bit, and the f16 values the kernel computes from them.

Activation quantizers: :func:`quantize_q8_f32` repeats the kernel's f32 arithmetic (absmax / 127,
reciprocal, multiply, round half away from zero) so that the int8 values must agree exactly;
``cukern.reference.elementwise.quantize_q8_1`` is the float64 version of the same rule.
"""

from __future__ import annotations

import numpy as np

from cukern.qtypes import GGMLType
from cukern.reference.dmmv import TYPES, dequantize, gelu_tanh, random_weight, silu  # noqa: F401

Q8_1_BYTES, Q8_0_BYTES = 36, 34


def gemm(w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """d[c, i] = sum_j w[i, j] b[c, j] in float64: w [m, k] dense, b [n, k] -> [n, m]."""
    return np.asarray(b, dtype=np.float64) @ np.asarray(w, dtype=np.float64).T


def f16(a) -> np.ndarray:
    """a rounded to f16 (round to nearest even), back in float64."""
    return np.asarray(a).astype(np.float16).astype(np.float64)


def gemm_f16_inputs(w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The product of the f16-rounded operands in float64: what the f16 tensor-core path computes
    up to its f32 accumulation."""
    return gemm(f16(w), f16(b))


def _k45_scaled(raw: np.ndarray, qtype: int, m: int, k: int, mins: bool) -> np.ndarray:
    """d * sc (mins: dmin * m) of every 32-element sub-block of a Q4_K / Q5_K matrix, float64
    [m, k / 32]: the 6-bit scales and mins of the 12-byte field by k4_scale_min's rule."""
    blk = np.asarray(raw, np.uint8).reshape(m, k // 256, TYPES[qtype][2])
    scale = blk[..., 2:4] if mins else blk[..., 0:2]  # dmin or d (f16)
    scale = scale.copy().view(np.float16)[..., 0].astype(np.float64)
    s = blk[..., 4:16].astype(np.int64)
    v = np.empty((m, k // 256, 8), np.int64)
    for j in range(8):
        if j < 4:
            v[..., j] = s[..., j + 4 * mins] & 63
        else:
            v[..., j] = ((s[..., j + 4] >> 4 * mins) & 15) | ((s[..., j - 4 + 4 * mins] >> 6) << 4)
    return (scale[..., None] * v).reshape(m, k // 32)


def k_scales(raw: np.ndarray, qtype: int, m: int, k: int) -> np.ndarray:
    """a[i, sub] = d * sc of every sub-block of a K-quant matrix (Q4_K / Q5_K: 32 elements, 6-bit
    sc; Q6_K: 16 elements, int8 sc), float64 [m, k / 32] or [m, k / 16]."""
    name, _, bb = TYPES[qtype]
    if name == "Q6_K":
        blk = np.asarray(raw, np.uint8).reshape(m, k // 256, bb)
        d = blk[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float64)
        return (d[..., None] * blk[..., 192:208].view(np.int8)).reshape(m, k // 16)
    if name not in ("Q4_K", "Q5_K"):
        raise ValueError(f"{name} is not a K-quant")
    return _k45_scaled(raw, qtype, m, k, mins=False)


def wgr_values(raw: np.ndarray, qtype: int, m: int, k: int) -> np.ndarray:
    """The f16 weights gemm_wgr multiplies, float64 [m, k]: the _0 types as dequantize_f16 writes
    them (d (q - offset) rounded once); the K-quants as its f16 arithmetic makes them from the exact
    quants: Q4_K / Q5_K f16(f16(a q + hi) + lo) with a = d * sc exact, hi = f16(-c) and lo =
    f16(-c - hi) (c = dmin * m); Q6_K f16((q - 32) hi(a) + f16((q - 32) lo(a))), a split the
    same way."""
    dense = dequantize(raw, qtype, m, k)
    name = TYPES[qtype][0]
    if name not in ("Q4_K", "Q5_K", "Q6_K"):
        return f16(dense)
    a = k_scales(raw, qtype, m, k)
    a = np.repeat(a, k // a.shape[1], axis=1)
    c = np.repeat(k_mins(raw, qtype, m, k), 32, axis=1)  # zeros for Q6_K
    q = np.rint((dense + c) / np.where(a == 0, 1.0, a)) * (a != 0)  # Q6_K: q - 32
    if name == "Q6_K":
        a_hi = f16(a)
        return f16(q * a_hi + f16(q * f16(a - a_hi)))
    hi = f16(-c)
    return f16(f16(a * q + hi) + f16(-c - hi))  # a q + hi exact in float64, then each f16 rounding


def glu(w_gate, w_up, b, act: str = "swiglu", *, inputs=gemm) -> np.ndarray:
    """d[c] = act(W_gate b[c]) * (W_up b[c]); act "swiglu" (SiLU) or "geglu" (GELU-tanh)."""
    g, u = inputs(w_gate, b), inputs(w_up, b)
    return (silu(g) if act in ("swiglu", "silu") else gelu_tanh(g)) * u


def quantize_q8_f32(x: np.ndarray):
    """(d, qs) of 32-value blocks computed as the kernels do, in f32: d = absmax / 127 (f32),
    qs = round_half_away(x * (1 / d)) (0 when d == 0). x: [n_rows, n_cols] f32; returns
    d [n_rows, n_cols / 32] float32 (before its f16 rounding) and qs [n_rows, n_cols] int64."""
    x = np.asarray(x, dtype=np.float32)
    n_rows, n_cols = x.shape
    blk = x.reshape(n_rows, n_cols // 32, 32)
    d = (np.abs(blk).max(axis=-1) / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    v = (blk * inv[..., None]).astype(np.float32)
    qs = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int64)
    return d, qs.reshape(n_rows, n_cols)


def unpack_q8(raw: np.ndarray, n_cols: int, fmt: str):
    """Split rows of Q8_1 ("q8_1": half d, half s, int8 qs[32]) or Q8_0 ("q8_0": half d, int8
    qs[32]) blocks into (d, s or None, qs) as float64, float64, int64."""
    raw = np.asarray(raw, dtype=np.uint8)
    n_rows = raw.shape[0]
    bb = Q8_1_BYTES if fmt == "q8_1" else Q8_0_BYTES
    blocks = raw[:, : n_cols // 32 * bb].reshape(n_rows, n_cols // 32, bb)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    s = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64) if fmt == "q8_1" else None
    qs = blocks[..., bb - 32:].copy().view(np.int8).astype(np.int64).reshape(n_rows, n_cols)
    return d, s, qs


def dequantize_q8(d: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """The values a Q8 block row stands for: d[block] * qs, float64 [n_rows, n_cols]."""
    n_rows, n_cols = qs.shape
    return (np.asarray(d, np.float64)[..., None] * qs.reshape(n_rows, n_cols // 32, 32)).reshape(n_rows, n_cols)


def k_mins(raw: np.ndarray, qtype: int, m: int, k: int) -> np.ndarray:
    """c[i, seg] = dmin * m_seg of each 32-element sub-block of a Q4_K / Q5_K matrix (the offset
    the int8 path folds in through the activations' s), float64 [m, k / 32]; zeros for other types."""
    if TYPES[qtype][0] not in ("Q4_K", "Q5_K"):
        return np.zeros((m, k // 32))
    return _k45_scaled(raw, qtype, m, k, mins=True)


def gemm_q8_1(w_dense: np.ndarray, mins: np.ndarray, d: np.ndarray, s: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """The int8 path's exact math in float64: W against the Q8_1 activations (d, s, qs as stored,
    [n, k / 32], [n, k / 32], [n, k]), the Q4_K/Q5_K offset applied through the stored s:
    sum_seg (W_seg . qa_seg) da_seg + c_seg (da_seg sum(qa_seg) - s_seg)."""
    n, k = qs.shape
    x = dequantize_q8(d, qs)
    out = gemm(w_dense, x)
    drift = d * qs.reshape(n, k // 32, 32).sum(-1) - s  # [n, k / 32]: what using s instead changes
    return out + drift @ np.asarray(mins, np.float64).T


# ---------------------------------------------------------------------------- gemm_wgr packed layouts
def _pack_q4_k(raw: np.ndarray, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q4_K bytes of an m x k matrix -> (the packed bytes [m, k / 256 * 160], the f16 values the kernel
    computes from them [m, k])."""
    nb = k // 256
    blk = raw.reshape(m, nb, 144)
    s16 = k_scales(raw, GGMLType.Q4_K, m, k).reshape(m, nb, 8).astype(np.float16)  # d * sc exact, rounded once
    nm16 = (-k_mins(raw, GGMLType.Q4_K, m, k)).reshape(m, nb, 8).astype(np.float16)
    qs = blk[..., 16:144].reshape(m, nb, 4, 32)
    v = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.uint32)  # [m, nb, st, 64]: stage elements
    out = np.empty((m, nb, 160), np.uint8)
    words = np.zeros((m, nb, 4, 4, 2), np.uint32)  # [st, lane c, word h]
    for c in range(4):
        for j in range(8):
            e0 = 8 * j + 2 * c
            words[..., c, j // 4] |= (v[..., e0] << (4 * (j % 4))) | (v[..., e0 + 1] << (16 + 4 * (j % 4)))
    out[..., :128] = words.reshape(m, nb, 32).view(np.uint8).reshape(m, nb, 128)
    pairs = np.stack([s16, nm16], axis=-1)  # [m, nb, 8, 2] f16: (s, -m) per sub-block
    out[..., 128:] = pairs.view(np.uint8).reshape(m, nb, 32)
    # values: f16(q s - m), one rounding (the kernel's fma); sub-block of stage element e: 2 st + (e >= 32)
    q = v.reshape(m, nb, 4, 2, 32).astype(np.float64)
    vals = q * s16.reshape(m, nb, 4, 2, 1).astype(np.float64) + nm16.reshape(m, nb, 4, 2, 1).astype(np.float64)
    return out.reshape(m, -1), vals.astype(np.float16).reshape(m, k)


def _pack_q5_k(raw: np.ndarray, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q5_K bytes -> (packed [m, k / 256 * 288]: a byte per 5-bit quant, then the (s, -m) f16 pairs of
    the eight sub-blocks as Q4_K's; the f16 values f16(q s - m))."""
    nb = k // 256
    blk = raw.reshape(m, nb, 176)
    s16 = k_scales(raw, GGMLType.Q5_K, m, k).reshape(m, nb, 8).astype(np.float16)
    nm16 = (-k_mins(raw, GGMLType.Q5_K, m, k)).reshape(m, nb, 8).astype(np.float16)
    qh, qs = blk[..., 16:48].astype(np.uint32), blk[..., 48:176].astype(np.uint32)
    e = np.arange(256)
    j, lo = e // 32, e % 32  # sub-block; low nibbles of qs[32 (j // 2) + l] for even j, high for odd; bit j of qh[l]
    q = ((qs[..., 32 * (j // 2) + lo] >> (4 * (j % 2))) & 15) | (((qh[..., lo] >> j) & 1) << 4)
    out = np.empty((m, nb, 288), np.uint8)
    out[..., :256] = _lane_bytes(q.astype(np.uint8).reshape(m, nb, 4, 64))
    out[..., 256:] = np.stack([s16, nm16], axis=-1).view(np.uint8).reshape(m, nb, 32)
    vals = (q.reshape(m, nb, 8, 32).astype(np.float64) * s16[..., None].astype(np.float64)
            + nm16[..., None].astype(np.float64))
    return out.reshape(m, -1), vals.astype(np.float16).reshape(m, k)


def _lane_bytes(v: np.ndarray) -> np.ndarray:
    """Stage elements [..., 4, 64] (one byte each) -> [..., 256] bytes: stage st, lane c, then pairs 8 j + 2 c
    (+1), j = 0..7, in order (FragDeqPacked8's words)."""
    order = np.array([[8 * j + 2 * c + e for j in range(8) for e in (0, 1)] for c in range(4)]).reshape(-1)
    return v[..., order].reshape(v.shape[:-2] + (256,))


def _pack_q8_0(raw: np.ndarray, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 bytes -> (packed [m, k / 256 * 272], the f16 values q d)."""
    nb = k // 256
    blk = raw.reshape(m, nb, 8, 34)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0]  # [m, nb, 8]
    q = blk[..., 2:34].copy().view(np.int8)            # [m, nb, 8, 32]
    out = np.empty((m, nb, 272), np.uint8)
    out[..., :256] = _lane_bytes((q.view(np.uint8) ^ 0x80).reshape(m, nb, 4, 64))
    out[..., 256:] = d.view(np.uint8).reshape(m, nb, 16)
    vals = (q.astype(np.float64) * d[..., None].astype(np.float64)).astype(np.float16)
    return out.reshape(m, -1), vals.reshape(m, k)


def _pack_q4_5_0(raw: np.ndarray, m: int, k: int, high: bool) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q4_0 / Q5_0 (high) bytes -> (packed [m, k / 256 * 272], the f16 values d (q - 8) or d (q - 16))."""
    nb, bb = k // 256, 22 if high else 18
    blk = raw.reshape(m, nb, 8, bb)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0]
    qs = blk[..., bb - 16:bb].astype(np.uint32)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)
    if high:  # bit j of qh (4 bytes, little-endian) is element j's fifth bit
        qh = blk[..., 2:6].copy().view(np.uint32)
        q |= ((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4
    out = np.empty((m, nb, 272), np.uint8)
    out[..., :256] = _lane_bytes(q.astype(np.uint8).reshape(m, nb, 4, 64))
    out[..., 256:] = d.view(np.uint8).reshape(m, nb, 16)
    vals = ((q.astype(np.float64) - (16 if high else 8)) * d[..., None].astype(np.float64)).astype(np.float16)
    return out.reshape(m, -1), vals.reshape(m, k)


def _pack_q6_k(raw: np.ndarray, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q6_K bytes -> (packed [m, k / 256 * 288], the f16 values f16(d sc) (q - 32))."""
    nb = k // 256
    blk = raw.reshape(m, nb, 210)
    ql, qh = blk[..., 0:128].astype(np.uint32), blk[..., 128:192].astype(np.uint32)
    sc = blk[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = blk[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    q = np.empty((m, nb, 256), np.uint32)
    for n in range(2):
        lo, hi, h = ql[..., 64 * n:64 * n + 32], ql[..., 64 * n + 32:64 * n + 64], qh[..., 32 * n:32 * n + 32]
        q[..., 128 * n:128 * n + 32] = (lo & 0xF) | ((h & 3) << 4)
        q[..., 128 * n + 32:128 * n + 64] = (hi & 0xF) | (((h >> 2) & 3) << 4)
        q[..., 128 * n + 64:128 * n + 96] = (lo >> 4) | (((h >> 4) & 3) << 4)
        q[..., 128 * n + 96:128 * n + 128] = (hi >> 4) | (((h >> 6) & 3) << 4)
    s16 = (d[..., None] * sc).astype(np.float16)  # [m, nb, 16]
    out = np.empty((m, nb, 288), np.uint8)
    out[..., :256] = _lane_bytes(q.astype(np.uint8).reshape(m, nb, 4, 64))
    out[..., 256:] = s16.view(np.uint8).reshape(m, nb, 32)
    vals = ((q.astype(np.float64) - 32).reshape(m, nb, 16, 16) * s16[..., None].astype(np.float64)).astype(np.float16)
    return out.reshape(m, -1), vals.reshape(m, k)


# GGUF type name -> (row-major packer, bytes per row and 256 elements, tile-major row stride); packed_wgr.cuh
_PACKED = {"Q4_0": (lambda r, m, k: _pack_q4_5_0(r, m, k, False), 272, 320),
           "Q5_0": (lambda r, m, k: _pack_q4_5_0(r, m, k, True), 272, 320),
           "Q8_0": (_pack_q8_0, 272, 320), "Q4_K": (_pack_q4_k, 160, 160), "Q5_K": (_pack_q5_k, 288, 320),
           "Q6_K": (_pack_q6_k, 288, 320)}


def pack_wgr(raw: np.ndarray, qtype: int, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """gemm_wgr's packed layout of an m x k GGUF matrix (cuda_src/matmul/packed_wgr.cuh; MatmulDispatch.pack
    builds it on the device): (the bytes, tile-major: per (128-row tile, 256-element super-block) 128 rows of
    the stride, rows past m and the bytes past a row's data zero), and the f16 values the kernel computes
    from them [m, k]."""
    pack, nbytes, stride = _PACKED[TYPES[qtype][0]]
    packed, vals = pack(np.asarray(raw, np.uint8).reshape(-1), m, k)
    nb, mt = k // 256, -(-m // 128)
    rows = np.zeros((mt * 128, nb, stride), np.uint8)
    rows[:m, :, :nbytes] = packed.reshape(m, nb, nbytes)
    return _tile_major(rows, mt), vals


def pack_wgr_glu(raw_gate: np.ndarray, raw_up: np.ndarray, qtype: int, m: int,
                 k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The packed layout of a gated MLP's gate and up matrices (MatmulDispatch.pack_glu): each 128-row tile
    holds 64 rows of each, tile row r from matrix (r // 8) % 2, row 64 tile + 8 (r // 16) + r % 8. Returns
    (the bytes, the gate's f16 values, the up matrix's)."""
    pack, nbytes, stride = _PACKED[TYPES[qtype][0]]
    nb, mt = k // 256, -(-m // 64)
    rows = np.zeros((mt * 128, nb, stride), np.uint8)
    r = np.arange(mt * 128)
    src = 64 * (r // 128) + 8 * ((r % 128) // 16) + r % 8  # row of its matrix
    vals = []
    for mat, raw in enumerate((raw_gate, raw_up)):
        packed, v = pack(np.asarray(raw, np.uint8).reshape(-1), m, k)
        sel = ((r // 8) % 2 == mat) & (src < m)
        rows[sel, :, :nbytes] = packed.reshape(m, nb, nbytes)[src[sel]]
        vals.append(v)
    return _tile_major(rows, mt), vals[0], vals[1]


def _tile_major(rows: np.ndarray, mt: int) -> np.ndarray:
    """Tile rows [mt * 128, super-blocks, stride] -> the bytes chunk (tile, super-block) after chunk."""
    nb, stride = rows.shape[1:]
    return rows.reshape(mt, 128, nb, stride).transpose(0, 2, 1, 3).reshape(-1)

def moe_gemm(w: np.ndarray, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The grouped expert GEMM in float64: w [n_experts, m, k] (dequantized), ids [n_tokens, top_k], x
    [n_tokens, k] (one row per token) or [n_tokens * top_k, k] (one per slot). Returns y [n_slots, m],
    y[s] = w[ids.flat[s]] x[row(s)] gathered and multiplied expert by expert; zeros for ids out of range."""
    n_experts, m, _ = w.shape
    flat = np.asarray(ids).reshape(-1)
    rows = np.arange(flat.size) if x.shape[0] == flat.size else np.arange(flat.size) // ids.shape[1]
    xs = np.asarray(x, np.float64)
    y = np.zeros((flat.size, m))
    for e in range(n_experts):
        sel = np.nonzero(flat == e)[0]
        if sel.size:
            y[sel] = xs[rows[sel]] @ np.asarray(w[e], np.float64).T
    return y


def moe_glu(w_gate: np.ndarray, w_up: np.ndarray, x: np.ndarray, ids: np.ndarray, act: str = "silu", *,
            gate_bias: np.ndarray | None = None, up_bias: np.ndarray | None = None, alpha: float = 1.702,
            limit: float = 7.0) -> np.ndarray:
    """act(gate, up) of :func:`moe_gemm`'s products (+ the slot's expert biases [n_experts, m]), float64 [n_slots, m]."""
    g, u = moe_gemm(w_gate, x, ids), moe_gemm(w_up, x, ids)
    if gate_bias is not None:
        e = np.clip(np.asarray(ids).reshape(-1), 0, w_gate.shape[0] - 1)
        g, u = g + np.asarray(gate_bias, np.float64)[e], u + np.asarray(up_bias, np.float64)[e]
    if act in ("silu", "swiglu"):
        h = silu(g) * u
    elif act in ("gelu", "geglu"):
        h = gelu_tanh(g) * u
    else:
        gc, uc = np.minimum(g, limit), np.clip(u, -limit, limit)
        h = gc / (1.0 + np.exp(-alpha * gc)) * (uc + 1.0)
    flat = np.asarray(ids).reshape(-1)
    h[(flat < 0) | (flat >= w_gate.shape[0])] = 0.0  # slots of an out-of-range id: zeros
    return h
