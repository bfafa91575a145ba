"""Float64 NumPy references for the elementwise family (cukern/elementwise.py).

Each function takes host arrays, computes in float64 and returns new arrays (state-updating
kernels return the new state too). They follow the definitions in the dispatch docstrings.
"""

from __future__ import annotations

import numpy as np

Q8_1_BLOCK = 32


def _f64(a):
    return np.asarray(a, dtype=np.float64)


# ------------------------------------------------------------------------------------------- norms

def rms_norm(x, w, *, eps: float = 1e-6, weight_offset: float = 0.0) -> np.ndarray:
    x = _f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (_f64(w) + weight_offset)


def residual_rms_norm(x, residual, w, *, eps: float = 1e-6, weight_offset: float = 0.0):
    """Returns (out, new_residual)."""
    r = _f64(residual) + _f64(x)
    return rms_norm(r, w, eps=eps, weight_offset=weight_offset), r


def post_norm_residual_rms_norm(x, residual, w_post, w, *, eps: float = 1e-6, weight_offset: float = 0.0):
    """Returns (out, new_residual)."""
    r = _f64(residual) + rms_norm(x, w_post, eps=eps, weight_offset=weight_offset)
    return rms_norm(r, w, eps=eps, weight_offset=weight_offset), r


def rms_norm_accumulate(src, w, hidden, *, eps: float = 1e-6, weight_offset: float = 0.0):
    return _f64(hidden) + rms_norm(src, w, eps=eps, weight_offset=weight_offset)


def quantize_q8_1(x):
    """GGUF block_q8_1 of the rows of x ([n_rows, n_cols], n_cols % 32 == 0): returns (d, s, qs) with
    d, s: [n_rows, n_cols // 32] float64 (before their f16 rounding) and qs: [n_rows, n_cols] int."""
    x = _f64(x)
    n_rows, n_cols = x.shape
    b = x.reshape(n_rows, n_cols // Q8_1_BLOCK, Q8_1_BLOCK)
    d = np.abs(b).max(axis=-1) / 127.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    v = b * inv[..., None]
    qs = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int64)
    s = d * qs.sum(axis=-1)
    return d, s, qs.reshape(n_rows, n_cols)


def unpack_q8_1(raw, n_cols):
    """Split [n_rows, n_cols // 32 * 36] uint8 rows into (d, s, qs) as float32, float32, int8."""
    raw = np.asarray(raw, dtype=np.uint8)
    n_rows = raw.shape[0]
    blocks = raw.reshape(n_rows, n_cols // Q8_1_BLOCK, 36)
    ds = blocks[..., :4].copy().view(np.float16).reshape(n_rows, n_cols // Q8_1_BLOCK, 2).astype(np.float32)
    qs = blocks[..., 4:].copy().view(np.int8).reshape(n_rows, n_cols)
    return ds[..., 0], ds[..., 1], qs


def group_norm(x, *, group_size: int, w=None, l2: bool = False, z=None, eps: float = 1e-6,
               weight_offset: float = 0.0) -> np.ndarray:
    x = _f64(x)
    g = x.reshape(-1, group_size)
    ss = np.sum(g * g, axis=-1, keepdims=True)
    y = g / np.sqrt((ss if l2 else ss / group_size) + eps)
    if w is not None:
        y = y * (_f64(w) + weight_offset)
    if z is not None:
        zz = _f64(z).reshape(-1, group_size)
        y = y * zz / (1.0 + np.exp(-zz))
    return y.reshape(x.shape)


# ------------------------------------------------------------------------------------- activations

def add_scaled(a, b, *, alpha: float = 1.0) -> np.ndarray:
    return _f64(a) + alpha * _f64(b)


def scale(a, *, alpha: float) -> np.ndarray:
    return alpha * _f64(a)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-_f64(x)))


def sigmoid_mul(x, g):
    return _f64(x) * sigmoid(g)


def bias_add(x, bias, *, offset: int = 0):
    x = _f64(x)
    return x + _f64(bias)[offset:offset + x.shape[-1]]


def swiglu(gate, up):
    g = _f64(gate)
    return g * sigmoid(g) * _f64(up)


def swiglu_oai(gate, up, *, alpha: float = 1.702, limit: float = 7.0):
    g = np.minimum(_f64(gate), limit)
    u = np.clip(_f64(up), -limit, limit)
    return g * sigmoid(alpha * g) * (u + 1.0)


def gelu_tanh(x):
    x = _f64(x)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def geglu(gate, up):
    return gelu_tanh(gate) * _f64(up)


# -------------------------------------------------------------------------------------------- RoPE

def rope_positions(positions, n_tokens, pos_mode, sections, n_pairs):
    """[n_tokens, n_pairs] integer position of every (token, rotary pair)."""
    p = np.asarray(positions, dtype=np.int64)
    t = np.arange(n_tokens)
    if pos_mode == "consecutive":
        return np.repeat((p[0] + t)[:, None], n_pairs, axis=1)
    if pos_mode == "per_token":
        return np.repeat(p[:n_tokens, None], n_pairs, axis=1)
    s0, s1, s2, s3 = sections
    total = s0 + s1 + s2 + s3
    sec = np.empty(n_pairs, dtype=np.int64)
    for j in range(n_pairs):
        s = j % total
        if pos_mode == "mrope":
            sec[j] = 0 if s < s0 else 1 if s < s0 + s1 else 2 if s < s0 + s1 + s2 else 3
        else:  # imrope: t, h, w interleaved while each section lasts
            if s % 3 == 0 and s < 3 * s0:
                sec[j] = 0
            elif s % 3 == 1 and s < 3 * s1:
                sec[j] = 1
            elif s % 3 == 2 and s < 3 * s2:
                sec[j] = 2
            else:
                sec[j] = 3
    return p[sec][:, :n_tokens].T  # p: [4, n_tokens] -> [n_pairs, n_tokens] -> transpose


def rope(x, positions, *, rope_dim=None, neox=True, freq_base=10000.0, freqs=None, attn_scale=1.0,
         pos_mode="consecutive", sections=None):
    """x: [n_tokens, n_heads, head_dim]; the rotated pairs times attn_scale, the tail copied."""
    x = _f64(x)
    n_tokens, _, head_dim = x.shape
    rope_dim = head_dim if rope_dim is None else rope_dim
    half = rope_dim // 2
    j = np.arange(half)
    inv = _f64(freqs) if freqs is not None else float(freq_base) ** (-2.0 * j / rope_dim)
    ang = rope_positions(positions, n_tokens, pos_mode, sections, half) * inv[None, :]  # [n_tokens, half]
    c, s = attn_scale * np.cos(ang)[:, None, :], attn_scale * np.sin(ang)[:, None, :]
    out = x.copy()
    if neox:
        i0, i1 = j, j + half
    else:
        i0, i1 = 2 * j, 2 * j + 1
    x0, x1 = x[..., i0], x[..., i1]
    out[..., i0] = x0 * c - x1 * s
    out[..., i1] = x0 * s + x1 * c
    return out


def rms_norm_rope(x, w, positions, *, eps=1e-6, weight_offset=0.0, **rope_kw):
    return rope(rms_norm(x, w, eps=eps, weight_offset=weight_offset), positions, **rope_kw)


def yarn_angles(positions, n_dims, *, base, factor, original_context, beta_fast=32.0, beta_slow=1.0,
                ext_factor=1.0, attn_factor=1.0):
    """YaRN evaluated per (position, pair) as llama.cpp's rope_yarn states it: (angles [n_pos, n_dims // 2],
    mscale). The angle mixes the extrapolated one (pos * base^(-2j / n_dims)) and the interpolated one
    (that over factor) by a ramp between the correction dims, the pairs whose wavelength fits beta_fast
    and beta_slow times into the original context (floor and ceil, clamped to [0, n_dims - 1])."""
    pos = np.asarray(positions, dtype=np.float64)
    bounds = []
    for beta, rnd in ((beta_fast, np.floor), (beta_slow, np.ceil)):
        # solve original_context / wavelength(j) = beta, wavelength(j) = 2 pi base^(2j / n_dims), for j
        bounds.append(rnd(n_dims * np.log(original_context / (2 * np.pi * beta)) / (2 * np.log(base))))
    low, high = max(0.0, bounds[0]), min(n_dims - 1.0, bounds[1])
    angles = np.empty((pos.size, n_dims // 2))
    for i0 in range(0, n_dims, 2):
        theta_extrap = pos * np.power(float(base), -i0 / n_dims)
        theta_interp = theta_extrap / factor
        y = (i0 // 2 - low) / max(0.001, high - low)
        ramp_mix = (1.0 - min(1.0, max(0.0, y))) * ext_factor
        angles[:, i0 // 2] = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix
    mscale = attn_factor * (1.0 + 0.1 * np.log(factor)) if ext_factor != 0 else attn_factor
    return angles, float(mscale)


# --------------------------------------------------------------------------------------- KV writes

def kv_write(src, cache, page_table, positions, seq_ids, *, pos_mode="consecutive"):
    """Returns the cache (a copy, float64) after writing src [n_tokens, n_kv_heads, head_dim]."""
    out = _f64(cache).copy()
    src = _f64(src)
    pt = np.asarray(page_table)
    page_size = cache.shape[1]
    for t in range(src.shape[0]):
        pos = positions[0] + t if pos_mode == "consecutive" else positions[t]
        seq = seq_ids[0] if pos_mode == "consecutive" else seq_ids[t]
        out[pt[seq, pos // page_size], pos % page_size] = src[t]
    return out


def qkv_rope_kv_write(k, k_cache, v_cache, page_table, positions, seq_ids, *, q=None, v=None, wq=None, wk=None,
                      v_norm=False, wv=None, eps=1e-6, weight_offset=0.0, pos_mode="consecutive", **rope_kw):
    """The fused writers (qk_norm_rope_kv_write, k_norm_rope_kv_write): (q_out or None, K cache, V cache or
    None), caches float64 copies. Q and K: rope(rms_norm(.) * (w + off)) (w None: no norm); V: copied, or with
    v_norm rms_norm(v) (times wv + off when wv is given). rope_kw: rope's rope_dim, neox, freq_base, freqs,
    attn_scale."""
    n_tokens, _, hd = k.shape
    tok_pos = np.asarray(positions)[:n_tokens] if pos_mode == "per_token" else positions[0] + np.arange(n_tokens)

    def rot(x, w):
        x = group_norm(x, group_size=hd, w=w, eps=eps, weight_offset=weight_offset) if w is not None else x
        return rope(x, tok_pos, pos_mode="per_token", **rope_kw)

    q_out = rot(q, wq) if q is not None else None
    k_out = kv_write(rot(k, wk), k_cache, page_table, positions, seq_ids, pos_mode=pos_mode)
    if v is None:
        return q_out, k_out, None
    if v_norm:
        v = group_norm(v, group_size=hd, w=wv, eps=eps, weight_offset=weight_offset if wv is not None else 0.0)
    return q_out, k_out, kv_write(v, v_cache, page_table, positions, seq_ids, pos_mode=pos_mode)


def deinterleave(x):
    x = _f64(x)
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


# --------------------------------------------------------------------------------------------- MoE

def softmax_topk(logits, k, *, renorm=True, scale=1.0):
    """Returns (ids [n_tokens, k] int, weights [n_tokens, k]); ties go to the lower expert id."""
    lg = _f64(logits)
    p = np.exp(lg - lg.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-lg, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=-1)
    if renorm:
        w = w / w.sum(axis=-1, keepdims=True)
    return ids, scale * w


def route_slot(ids, weights):
    """The packed route slot of (ids [n_tokens, k], weights [n_tokens, k]): uint32 [n_tokens, 2k], the ids
    and then the f32 weights' bits (cukern.routing.RouteSlot)."""
    return np.concatenate([np.asarray(ids, np.int32).view(np.uint32),
                           np.asarray(weights, np.float32).view(np.uint32)], axis=1)


def moe_weighted_sum(expert_out, weights, out=None):
    s = np.einsum("tjc,tj->tc", _f64(expert_out), _f64(weights))
    return s if out is None else _f64(out) + s


def shared_expert_accumulate(hidden, shared_out, gate_logit):
    return _f64(hidden) + sigmoid(gate_logit)[:, None] * _f64(shared_out)


def router_matvec(x, W, *, scale=1.0):
    return scale * _f64(x) @ _f64(W).T


def router_rms_norm_matvec(x, w_norm, W, *, eps=1e-6, weight_offset=0.0, scale=1.0):
    return scale * rms_norm(x, w_norm, eps=eps, weight_offset=weight_offset) @ _f64(W).T


# ---------------------------------------------------------------------------------- SSM / DeltaNet

def conv1d_silu(x, state, w, *, state_offset=None):
    """Returns (y, new_state). x [n_tokens, C], state [K-1, C], w [C, K]. state_offset None: state rows
    oldest first; an int: the rows are a ring whose oldest entry is row state_offset, and new_state is
    the ring after the call (oldest entry at row (state_offset + n_tokens) % (K - 1))."""
    if state_offset is not None:
        y, st = conv1d_silu(x, np.roll(_f64(state), -state_offset, axis=0), w)
        return y, np.roll(st, (state_offset + np.shape(x)[0]) % (np.shape(w)[1] - 1), axis=0)
    x, st, w = _f64(x), _f64(state), _f64(w)
    K = w.shape[1]
    seq = np.concatenate([st, x], axis=0)  # [K - 1 + n_tokens, C]
    n = x.shape[0]
    acc = np.zeros_like(x)
    for j in range(K):
        acc += w[:, j][None, :] * seq[j:j + n]
    return acc / (1.0 + np.exp(-acc)), seq[-(K - 1):].copy()


def deltanet(q, k, v, g, beta, state, *, q_scale=None, qk_l2norm=False, norm_eps=1e-6):
    """Returns (o [n_tokens, n_v, dv], new_state [n_v, dk, dv]). qk_l2norm: q and k heads first scaled by
    rsqrt(sum(x^2) + norm_eps)."""
    q, k, v, g, beta = map(_f64, (q, k, v, g, beta))
    if qk_l2norm:
        q, k = (a / np.sqrt((a * a).sum(-1, keepdims=True) + norm_eps) for a in (q, k))
    S = _f64(state).copy()
    n_tokens, n_qk, dk = q.shape
    n_v = v.shape[1]
    q_scale = dk ** -0.5 if q_scale is None else q_scale
    rep = n_v // n_qk
    o = np.zeros_like(v)
    for t in range(n_tokens):
        for h in range(n_v):
            hq = h // rep
            S[h] *= np.exp(g[t, h])
            delta = beta[t, h] * (v[t, h] - S[h].T @ k[t, hq])
            S[h] += np.outer(k[t, hq], delta)
            o[t, h] = S[h].T @ (q_scale * q[t, hq])
    return o, S


def deltanet_gates(ba, a, dt_bias, *, group: int):
    """Returns (g, beta) [n_tokens, n_v]: ba [n_tokens, 2 n_v] per key head [b(group) | alpha(group)]."""
    ba, a, dt = _f64(ba), _f64(a), _f64(dt_bias)
    n, n_v = ba.shape[0], ba.shape[1] // 2
    per = ba.reshape(n, n_v // group, 2, group)
    b, alpha = per[:, :, 0].reshape(n, n_v), per[:, :, 1].reshape(n, n_v)
    x = alpha + dt
    soft = np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))
    return a * soft, 1.0 / (1.0 + np.exp(-b))
