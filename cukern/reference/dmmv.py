"""Float64 references for the dmmv family (cukern/dmmv/), and random valid GGUF weights.

The ``gguf`` package's NumPy dequantization is the reference of record for every block format:
:func:`dequantize` calls it and widens to float64. :func:`random_weight` builds random *valid*
blocks byte by byte (random quant bits, scales of a sensible magnitude), which covers the types
gguf cannot quantize (the K-quants) and exercises every bit pattern of the others.
"""

from __future__ import annotations

import numpy as np

# GGML type id -> (name, elements per block, bytes per block); mirrors cukern.dmmv.QTYPES
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 2: ("Q4_0", 32, 18), 6: ("Q5_0", 32, 22),
         8: ("Q8_0", 32, 34), 39: ("MXFP4", 32, 17), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
         14: ("Q6_K", 256, 210)}


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(v.astype(np.float16)).view(np.uint8).reshape(v.shape + (2,))


def random_weight(qtype: int, m: int, k: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Raw GGUF bytes [m, row_bytes] (uint8) of a random valid m x k weight of ``qtype`` whose
    dequantized entries are of order ``scale`` / sqrt(k) ... ``scale`` (roughly unit rows)."""
    name, be, bb = TYPES[qtype]
    if be == 1:
        w = (rng.standard_normal((m, k)) * scale).astype(np.float32)
        if name == "F32":
            return w.view(np.uint8).reshape(m, 4 * k)
        if name == "F16":
            return w.astype(np.float16).view(np.uint8).reshape(m, 2 * k)
        bits = w.view(np.uint32)
        bf = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
        return bf.view(np.uint8).reshape(m, 2 * k)
    nb = k // be
    raw = rng.integers(0, 256, size=(m, nb, bb), dtype=np.uint8)
    d = lambda shape, mag: _f16_bytes(rng.uniform(0.5, 1.5, size=shape) * mag * rng.choice([-1, 1], size=shape))  # noqa: E731
    s = (m, nb)
    if name == "Q4_0":
        raw[..., 0:2] = d(s, scale / 8)
    elif name == "Q5_0":
        raw[..., 0:2] = d(s, scale / 16)
    elif name == "Q8_0":
        raw[..., 0:2] = d(s, scale / 127)
    elif name == "MXFP4":
        # e8m0 exponents around 2^-4 * scale: the E2M1 codes (up to 6, doubled in GGUF's table) times
        # 2^-9 ... 2^-2 keep the entries of order scale, as the other types' are
        raw[..., 0] = rng.integers(119, 127, size=s) + int(round(np.log2(scale)))
    elif name in ("Q4_K", "Q5_K"):
        raw[..., 0:2] = _f16_bytes(rng.uniform(0.5, 1.5, size=s) * scale / 63 / 16)
        raw[..., 2:4] = _f16_bytes(rng.uniform(0.0, 1.0, size=s) * scale / 63)
    elif name == "Q6_K":
        raw[..., 208:210] = d(s, scale / 32 / 128)
    return raw.reshape(m, nb * bb)


def dequantize(raw: np.ndarray, qtype: int, m: int, k: int) -> np.ndarray:
    """float64 [m, k] from raw GGUF bytes, through gguf.quants.dequantize."""
    import gguf
    from gguf.quants import dequantize as gguf_dequantize
    raw = np.ascontiguousarray(np.asarray(raw, dtype=np.uint8)).reshape(m, -1)
    out = gguf_dequantize(raw, gguf.GGMLQuantizationType(qtype))
    return np.asarray(out, dtype=np.float64).reshape(m, k)


def split_q8_0(raw: np.ndarray, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 bytes [m, k / 32 * 34] as (quants int8 [m, k], scales f16 [m, k / 32]): the layout of
    cukern.dmmv.SplitQ8, W[i, j] = scales[i, j // 32] * quants[i, j]."""
    blocks = np.ascontiguousarray(np.asarray(raw, dtype=np.uint8)).reshape(m, k // 32, 34)
    quants = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(m, k)
    scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).reshape(m, k // 32)
    return quants, scales


def split_dense(quants: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 [m, k] of a split Q8_0 matrix."""
    return np.repeat(scales.astype(np.float64), 32, axis=1) * quants.astype(np.float64)


def normed_x(residual, w, proj=None, w_post=None, *, eps: float = 1e-6, weight_offset: float = 0.0):
    """(x, r) of a cukern.dmmv.NormedX in float64: r = residual [+ proj | + rms_norm(proj) * (w_post + off)],
    x = rms_norm(r) * (w + off)."""
    def rms_norm(v, wt):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * (np.asarray(wt, np.float64) + weight_offset)
    r = np.asarray(residual, np.float64)
    if proj is not None:
        p = np.asarray(proj, np.float64)
        r = r + (p if w_post is None else rms_norm(p, w_post))
    return rms_norm(r, w), r


def merged_x(o_part, lse_part, sinks=None, sink_offset: int = 0) -> np.ndarray:
    """x of a cukern.dmmv.MergedX in float64: per head h, the states s weighed by exp(lse[s, h] - M_h)
    (M_h the largest LSE or sink), normalised by their sum plus exp(sink_h - M_h), sink_h =
    sinks[sink_offset + h] (NaN: none); a head with no keys and no sink (every LSE -inf) is 0.
    o_part [S, H, D], lse_part [S, H] -> x [H * D]."""
    o = np.asarray(o_part, np.float64)
    lse = np.asarray(lse_part, np.float64)
    s_, h, d = o.shape
    sink = np.full(h, -np.inf) if sinks is None else np.asarray(sinks, np.float64)[sink_offset:sink_offset + h]
    sink = np.where(np.isnan(sink), -np.inf, sink)
    mx = np.maximum(lse.max(axis=0), sink)
    mu = np.where(np.isneginf(mx), 0.0, mx)
    e = np.exp(lse - mu)                                        # [S, H]; -inf states weigh 0
    den = e.sum(axis=0) + np.exp(sink - mu)
    num = np.einsum("sh,shd->hd", e, np.where(e[..., None] > 0, o, 0.0))
    return np.where(den[:, None] > 0, num / np.where(den > 0, den, 1.0)[:, None], 0.0).reshape(h * d)


def quantize_q8_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q, d) of the int8 path's x^ (cuda_src/dmmv/q8.cuh), emulated bit for bit: per 32 elements
    along the last axis, d = max|x| * float32(1/127) in float32 (flushed to 0 below the smallest
    normal, as the kernels' FTZ arithmetic does; float32 [..., k / 32]), inv = 1/d in float32, and
    q = the exact product x * inv rounded once to the nearest integer, ties to even (the kernel's
    FMA), 0 for an all-zero block (int8 [..., k])."""
    x = np.asarray(x, dtype=np.float32)
    b = x.reshape(x.shape[:-1] + (-1, 32))
    amax = np.abs(b).max(axis=-1, keepdims=True)
    d = amax * (np.float32(1) / np.float32(127))
    d = np.where(d < np.finfo(np.float32).tiny, np.float32(0), d).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(b.astype(np.float64) * inv.astype(np.float64))  # f32 x f32 is exact in float64
    return q.astype(np.int8).reshape(x.shape), d[..., 0]


def quantize_q8(x: np.ndarray) -> np.ndarray:
    """x^ as float64: what the int8 path of the matvecs multiplies, d * q of :func:`quantize_q8_blocks`."""
    q, d = quantize_q8_blocks(x)
    shape = q.shape
    return (d[..., None].astype(np.float64) * q.reshape(shape[:-1] + (-1, 32)).astype(np.float64)).reshape(shape)


def decode_quantized_x(buf: np.ndarray, k: int, interleaved: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [n, k] int8 in element order, d [n, k / 32] float32, sums [n, k / 32, 2] int16 of q over each
    half of a block) from the bytes of a cukern.dmmv.QuantizedX ([n, col_bytes] uint8): per column,
    k bytes of q in two planes (bytes 0...15 of every 32, then bytes 16...31; interleaved: byte 2j of
    a block is element j, byte 2j + 1 element 16 + j), then k / 32 records (float32 d, int16 sums)."""
    buf = np.asarray(buf, dtype=np.uint8)
    n, nb = buf.shape[0], k // 32
    planes = buf[:, :k].view(np.int8).reshape(n, 2, nb, 16)
    blocks = planes.transpose(0, 2, 1, 3).reshape(n, nb, 32)  # bytes of each block in stored order
    if interleaved:
        blocks = np.concatenate([blocks[..., 0::2], blocks[..., 1::2]], axis=-1)
    info = np.ascontiguousarray(buf[:, k:k + 8 * nb]).reshape(n, nb, 8)
    d = np.ascontiguousarray(info[..., :4]).view(np.float32)[..., 0]
    sums = np.ascontiguousarray(info[..., 4:]).view(np.int16)
    return blocks.reshape(n, k), d, sums


def matvec(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y[..., i] = sum_j w[i, j] x[..., j] in float64 (x: [k] or [n, k])."""
    return np.asarray(x, dtype=np.float64) @ np.asarray(w, dtype=np.float64).T


def silu(g):
    return g / (1.0 + np.exp(-g))


def gelu_tanh(g):
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))


def sigmoid(g):
    return 1.0 / (1.0 + np.exp(-g))


def glu(w_gate, w_up, x, act: str = "swiglu") -> np.ndarray:
    g, u = matvec(w_gate, x), matvec(w_up, x)
    return (silu(g) if act in ("swiglu", "silu") else gelu_tanh(g)) * u


def moe(w_experts, x, ids, *, w_up=None, act: str = "swiglu") -> np.ndarray:
    """y[t, j] = W[ids[t, j]] x[t] (x [T, k]) or x[t, j] (x [T, top_k, k]); float64 [T, top_k, m].
    Invalid ids give zeros (as the kernels write)."""
    w_experts = np.asarray(w_experts, dtype=np.float64)
    n_e, m, _ = w_experts.shape
    T, top_k = ids.shape
    y = np.zeros((T, top_k, m))
    for t in range(T):
        for j in range(top_k):
            e = int(ids[t, j])
            if not 0 <= e < n_e:
                continue
            xv = x[t, j] if x.ndim == 3 else x[t]
            if w_up is None:
                y[t, j] = matvec(w_experts[e], xv)
            else:
                y[t, j] = glu(w_experts[e], np.asarray(w_up, dtype=np.float64)[e], xv, act)
    return y


def moe_down(w_experts, h, ids, weights) -> np.ndarray:
    """y[t] = sum_j weights[t, j] * W[ids[t, j]] h[t, j]; invalid ids contribute nothing."""
    w_experts = np.asarray(w_experts, dtype=np.float64)
    n_e, m, _ = w_experts.shape
    T, top_k = ids.shape
    y = np.zeros((T, m))
    for t in range(T):
        for j in range(top_k):
            e = int(ids[t, j])
            if 0 <= e < n_e:
                y[t] += float(weights[t, j]) * matvec(w_experts[e], h[t, j])
    return y


def route_counts(ids, n_experts: int) -> np.ndarray:
    ids = np.asarray(ids).ravel()
    ok = (ids >= 0) & (ids < n_experts)
    return np.bincount(ids[ok], minlength=n_experts).astype(np.int32)
