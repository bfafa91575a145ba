// Rotary position embeddings, alone or fused with the per-head RMS norm and the KV-cache write.
//
// Layout: x [n_tokens, n_heads, head_dim]: f32, f16 or bf16 for rope / rms_norm_rope, f32 for the fused
// KV kernels; arithmetic in f32. The first rope_dim elements of a head rotate in pairs, NeoX
// (j, j + rope_dim/2) or interleaved (2j, 2j+1), j < rope_dim/2, by the angle pos * inv_freq[j],
// inv_freq[j] = freq_base^(-2j / rope_dim) or a caller's freqs[j] (scaled RoPE variants precompute
// them), cos and sin both times attn_scale (YaRN's mscale; 1 for plain RoPE); the remaining
// head_dim - rope_dim elements are copied unscaled.
// Positions: consecutive (positions[0] + t), per token (positions[t]), or per token and section
// (positions [4, n_tokens]: multi-section rotary, contiguous sections or IMRoPE's interleaved ones).
//
// A block loops over steps of tokens_per_block tokens (grid-stride). Its threads fill shared tables:
// inv_freq in f64 once per block, then per step cos/sin per (token, pair) with the angle reduced in f64
// before an f32 sincospif (rope_sincos: positions in the 10^5 range keep f32 accuracy). Then each
// warp takes G heads at a time: a lane loads its PPL pairs of each into registers (one read of x,
// all loads in flight), the norms (if any) reduce over the warp, and the rotated pairs are stored.
// Byte traffic: read and write every element once; weights and tables hit L1/L2.
// rope_vec.cuh has the vectorised versions the host prefers for head_dim 32, 64, 128 and 256.
#pragma once

#include "common/pdl.cuh"
#include "common/types.cuh"
#include "common/reduce.cuh"
#include "common/kv_cache.cuh"
#include "elementwise/params.cuh"

namespace cukern {
namespace ew {

constexpr int ROPE_BLOCK = 256;  // threads per block

// Which of the 4 position rows a rotary pair uses (pos_mode 2: contiguous sections t|h|w|e;
// pos_mode 3: IMRoPE, sections interleaved t,h,w,t,h,w,... while each lasts, then e).
CUKERN_DEVICE uint32_t rope_section(uint32_t pair, const uint32_t (&sec)[4], uint32_t pos_mode) {
    const uint32_t total = sec[0] + sec[1] + sec[2] + sec[3];
    const uint32_t s = pair % total;
    if (pos_mode == 2) {
        if (s < sec[0]) return 0;
        if (s < sec[0] + sec[1]) return 1;
        if (s < sec[0] + sec[1] + sec[2]) return 2;
        return 3;
    }
    if (s % 3 == 0 && s < 3 * sec[0]) return 0;
    if (s % 3 == 1 && s < 3 * sec[1]) return 1;
    if (s % 3 == 2 && s < 3 * sec[2]) return 2;
    return 3;
}

// scale * cos and scale * sin of pos * inv: the angle in half turns (pos * inv / pi, f64) is reduced to
// [-1, 1] before an f32 sincospif, which keeps f32 accuracy for positions ~1e5 and has no slow path for
// large arguments. scale: the params' attn_scale.
CUKERN_DEVICE void rope_sincos(int32_t pos, double inv, float scale, float& s, float& c) {
    double h = (double)pos * inv * 0.3183098861837907;  // 1 / pi
    h -= 2.0 * rint(0.5 * h);
    sincospif((float)h, &s, &c);
    s *= scale;
    c *= scale;
}

// inv_freq of pair j: freqs[j], or ratio^j by binary powering (<= 9 squarings for j < 512: a few f64 ulps,
// without the long latency of an f64 pow).
CUKERN_DEVICE double rope_inv_freq(uint32_t j, bool use_freqs, double ratio, const float* __restrict__ freqs) {
    if (use_freqs) return (double)freqs[j];
    double acc = 1.0, b = ratio;
    for (uint32_t e = j; e != 0; e >>= 1) {
        if (e & 1) acc *= b;
        b *= b;
    }
    return acc;
}

// Shared tables of one block, carved from dynamic shared memory:
//   inv [half] f64, then cos, sin [tokens_per_block, half] f32.
struct RopeTables {
    double* inv;
    float* cos_t;
    float* sin_t;

    CUKERN_DEVICE RopeTables(void* smem, uint32_t half, uint32_t n_tok) {
        inv = reinterpret_cast<double*>(smem);
        cos_t = reinterpret_cast<float*>(inv + half);
        sin_t = cos_t + n_tok * half;
    }

    // inv[j] = rope_inv_freq(j): freqs[j] or ratio^j
    CUKERN_DEVICE void fill_inv(uint32_t half, bool use_freqs, double ratio, const float* freqs) {
        for (uint32_t j = threadIdx.x; j < half; j += blockDim.x) inv[j] = rope_inv_freq(j, use_freqs, ratio, freqs);
    }

    // Entry idx = tt * half + j: scale * cos/sin of pos * inv[j].
    CUKERN_DEVICE void set(uint32_t idx, uint32_t j, int32_t pos, float scale) {
        rope_sincos(pos, inv[j], scale, sin_t[idx], cos_t[idx]);
    }
};

// Element indices of pair j (j < head_dim / 2): a rotary pair for j < half, else two copied tail elements.
CUKERN_DEVICE void rope_pair(uint32_t j, uint32_t half, uint32_t rope_dim, bool neox, uint32_t& i0, uint32_t& i1) {
    if (j < half) {
        i0 = neox ? j : 2 * j;
        i1 = neox ? j + half : 2 * j + 1;
    } else {  // the copied tail: elements rope_dim + 2 (j - half) and the next
        i0 = rope_dim + 2 * (j - half);
        i1 = i0 + 1;
    }
}

// G consecutive heads (n_live <= G of them real), one warp: out[g] = rotate(x[g] * s_g * (w + w_off)),
// s_g = rsqrt(mean(x[g]^2) + eps) when norm, else 1; w == nullptr: no weight; rope_dim = 0: no rotation
// (cos_t, sin_t unread). Heads are head_dim apart
// in x and in out. Lane l holds pairs j = l + 32 k, k < PPL (head_dim <= 64 * PPL) of every head: all
// G * PPL * 2 loads are issued before the first reduction, so a warp keeps that many in flight.
template <typename TO, int PPL, int G, typename TI = float>
CUKERN_DEVICE void rope_heads(TO* out, const TI* x, uint32_t n_live, const float* __restrict__ w, bool norm,
                              float eps, float w_off, const float* cos_t, const float* sin_t, uint32_t head_dim,
                              uint32_t rope_dim, bool neox) {
    const uint32_t lane = threadIdx.x % WARP, half = rope_dim / 2, n_pairs = head_dim / 2;
    float v0[G][PPL], v1[G][PPL], ss[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        ss[g] = 0.f;
#pragma unroll
        for (int k = 0; k < PPL; ++k) {
            const uint32_t j = lane + WARP * k;
            v0[g][k] = v1[g][k] = 0.f;
            if (g < n_live && j < n_pairs) {
                uint32_t i0, i1;
                rope_pair(j, half, rope_dim, neox, i0, i1);
                v0[g][k] = to_float(x[g * head_dim + i0]);
                v1[g][k] = to_float(x[g * head_dim + i1]);
                ss[g] += v0[g][k] * v0[g][k] + v1[g][k] * v1[g][k];
            }
        }
    }
    __syncwarp();  // out may alias x: every lane has read the heads before any lane writes them
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g >= n_live) break;  // warp-uniform
        const float s = norm ? rsqrtf(warp_sum(ss[g]) / (float)head_dim + eps) : 1.0f;
#pragma unroll
        for (int k = 0; k < PPL; ++k) {
            const uint32_t j = lane + WARP * k;
            if (j >= n_pairs) continue;
            uint32_t i0, i1;
            rope_pair(j, half, rope_dim, neox, i0, i1);
            float a = v0[g][k] * s, b = v1[g][k] * s;
            if (w != nullptr) {
                a *= __ldg(w + i0) + w_off;
                b *= __ldg(w + i1) + w_off;
            }
            if (j < half) {
                const float c = cos_t[j], sn = sin_t[j];
                const float r = a * c - b * sn;
                b = a * sn + b * c;
                a = r;
            }
            out[g * head_dim + i0] = from_float<TO>(a);
            out[g * head_dim + i1] = from_float<TO>(b);
        }
    }
}

// Copy n heads (n * head_dim contiguous values) with conversion, one warp, loads before stores.
template <typename TO>
CUKERN_DEVICE void copy_heads(TO* __restrict__ out, const float* __restrict__ x, uint32_t n) {
    for (uint32_t i0 = threadIdx.x % WARP; i0 < n; i0 += 4 * WARP) {
        float t[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) t[k] = i0 + k * WARP < n ? x[i0 + k * WARP] : 0.f;
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (i0 + k * WARP < n) out[i0 + k * WARP] = from_float<TO>(t[k]);
    }
}

}  // namespace ew
}  // namespace cukern

// out[t, h] = rope(x[t, h]) or, with NORM, rope(rms_norm(x[t, h]) * (w + weight_offset)).
// T: storage type of x and out (float, __half, __nv_bfloat16); w, freqs f32.
// grid: (<= ceil(n_tokens / tokens_per_block)), block: ROPE_BLOCK;
// dynamic shared memory: 8 * rope_dim/2 + 8 * tokens_per_block * rope_dim/2 bytes.
template <bool NORM, int PPL, int G, typename T = float>
__global__ void __launch_bounds__(cukern::ew::ROPE_BLOCK) rope(
    T* out,                                // [n_tokens, n_heads, head_dim] (may alias x)
    const T* x,                            // [n_tokens, n_heads, head_dim]
    const float* __restrict__ w,           // NORM: [head_dim] norm weight (else unread)
    const float* __restrict__ freqs,       // use_freqs: [rope_dim / 2] inverse frequencies (else unread)
    const int32_t* __restrict__ positions, // pos_mode 0: [1]; 1: [n_tokens]; 2, 3: [4, n_tokens]
    const RopeParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    extern __shared__ double rope_smem[];
    const uint32_t half = p.rope_dim / 2;
    ew::RopeTables tab(rope_smem, half, p.tokens_per_block);
    tab.fill_inv(half, p.use_freqs, p.inv_ratio, freqs);
    for (uint32_t t0 = blockIdx.x * p.tokens_per_block; t0 < p.n_tokens; t0 += gridDim.x * p.tokens_per_block) {
        const uint32_t n_tok = min(p.tokens_per_block, p.n_tokens - t0);  // tokens of this step
        __syncthreads();  // inv is written; the previous step's tables are no longer read
        for (uint32_t idx = threadIdx.x; idx < n_tok * half; idx += blockDim.x) {
            const uint32_t tt = idx / half, j = idx % half, t = t0 + tt;
            int32_t pos;
            if (p.pos_mode == 0) pos = positions[0] + (int32_t)t;
            else if (p.pos_mode == 1) pos = positions[t];
            else pos = positions[ew::rope_section(j, p.sections, p.pos_mode) * p.n_tokens + t];
            tab.set(idx, j, pos, p.attn_scale);
        }
        __syncthreads();
        const uint32_t groups = (p.n_heads + G - 1) / G;  // tasks per token: G heads each
        for (uint32_t task = threadIdx.x / WARP; task < n_tok * groups; task += blockDim.x / WARP) {
            const uint32_t tt = task / groups, h = (task % groups) * G;
            const uint64_t off = ((uint64_t)(t0 + tt) * p.n_heads + h) * p.head_dim;
            ew::rope_heads<T, PPL, G, T>(out + off, x + off, min((uint32_t)G, p.n_heads - h), NORM ? w : nullptr,
                                          NORM, p.eps, p.weight_offset, tab.cos_t + tt * half, tab.sin_t + tt * half,
                                          p.head_dim, p.rope_dim, p.neox);
        }
    }
}

// The attention block's prologue for one step: per token t,
//   q_out[t, h]               = rope(rms_norm(q[t, h]) * (wq + off))   h < n_q_heads     (HAS_Q)
//   K cache row (seq, pos)[h] = rope(rms_norm(k[t, h]) * (wk + off))   h < n_kv_heads
//   V cache row (seq, pos)[h] = v[t, h]                                h < n_kv_heads    (HAS_V)
//                               (v_norm 1: rms_norm(v[t, h]); 2: rms_norm(v[t, h]) * (wv + off))
// (norm = 0: no Q/K norm, rotation only). Caches use common/kv_cache.cuh's paged layout; a contiguous
// cache is one page per sequence. HAS_Q = false, HAS_V = true: the K + V write of a model whose Q is
// rotated apart; HAS_Q = HAS_V = false: K only. Byte traffic: q, k, v read once; q_out and the K/V rows
// written once. grid: (<= ceil(n_tokens / tokens_per_block)), block: ROPE_BLOCK; dynamic shared memory as rope.
template <typename KV, bool HAS_Q, bool HAS_V, int PPL, int G>
__global__ void __launch_bounds__(cukern::ew::ROPE_BLOCK) qk_norm_rope_kv(
    float* __restrict__ q_out,              // HAS_Q: [n_tokens, n_q_heads, head_dim] (else unread)
    KV* __restrict__ k_cache,               // [n_pages, page_size, n_kv_heads, head_dim]
    KV* __restrict__ v_cache,               // HAS_V: same layout as k_cache (else unread)
    const float* __restrict__ q,            // HAS_Q: [n_tokens, n_q_heads, head_dim]
    const float* __restrict__ k,            // [n_tokens, n_kv_heads, head_dim]
    const float* __restrict__ v,            // HAS_V: [n_tokens, n_kv_heads, head_dim]
    const float* __restrict__ wq,           // HAS_Q and norm: [head_dim]
    const float* __restrict__ wk,           // norm: [head_dim]
    const float* __restrict__ wv,           // HAS_V and v_norm 2: [head_dim]
    const float* __restrict__ freqs,        // use_freqs: [rope_dim / 2]
    const int32_t* __restrict__ positions,  // pos_mode 0: [1] (first token's position); 1: [n_tokens]
    const int32_t* __restrict__ seq_ids,    // pos_mode 0: [1]; 1: [n_tokens]: page_table row of each token
    const int32_t* __restrict__ page_table, // [n_seqs, max_pages] int32
    const QkvRopeParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    extern __shared__ double rope_smem[];
    const uint32_t half = p.rope_dim / 2;
    ew::RopeTables tab(rope_smem, half, p.tokens_per_block);
    tab.fill_inv(half, p.use_freqs, p.inv_ratio, freqs);
    // tasks per token: groups of G q heads, of G k heads, and (HAS_V) of G v heads
    const uint32_t q_groups = HAS_Q ? (p.n_q_heads + G - 1) / G : 0;
    const uint32_t kv_groups = (p.n_kv_heads + G - 1) / G;
    const uint32_t n_groups = q_groups + kv_groups * (HAS_V ? 2 : 1);
    const uint32_t row_elems = p.n_kv_heads * p.head_dim;
    for (uint32_t t0 = blockIdx.x * p.tokens_per_block; t0 < p.n_tokens; t0 += gridDim.x * p.tokens_per_block) {
        const uint32_t n_tok = min(p.tokens_per_block, p.n_tokens - t0);  // tokens of this step
        __syncthreads();  // inv is written; the previous step's tables are no longer read
        for (uint32_t idx = threadIdx.x; idx < n_tok * half; idx += blockDim.x) {
            const uint32_t t = t0 + idx / half;
            tab.set(idx, idx % half, p.pos_mode == 0 ? positions[0] + (int32_t)t : positions[t], p.attn_scale);
        }
        __syncthreads();
        for (uint32_t task = threadIdx.x / WARP; task < n_tok * n_groups; task += blockDim.x / WARP) {
            const uint32_t tt = task / n_groups, grp = task % n_groups, t = t0 + tt;
            const float* cos_t = tab.cos_t + tt * half;
            const float* sin_t = tab.sin_t + tt * half;
            if (HAS_Q && grp < q_groups) {
                const uint32_t h = grp * G;
                const uint64_t off = ((uint64_t)t * p.n_q_heads + h) * p.head_dim;
                ew::rope_heads<float, PPL, G>(q_out + off, q + off, min((uint32_t)G, p.n_q_heads - h),
                                              p.norm ? wq : nullptr, p.norm, p.eps, p.weight_offset, cos_t, sin_t,
                                              p.head_dim, p.rope_dim, p.neox);
                continue;
            }
            const int32_t pos = p.pos_mode == 0 ? positions[0] + (int32_t)t : positions[t];
            const int32_t seq = p.pos_mode == 0 ? seq_ids[0] : seq_ids[t];
            const uint64_t cache_row = kv_row_offset(page_table + (uint64_t)seq * p.max_pages, (uint32_t)pos,
                                                     p.page_size, row_elems);
            const uint32_t kgrp = grp - q_groups;
            const uint32_t h = (kgrp % kv_groups) * G, n_live = min((uint32_t)G, p.n_kv_heads - h);
            const uint64_t src = (uint64_t)t * row_elems + (uint64_t)h * p.head_dim;
            const uint64_t dst = cache_row + (uint64_t)h * p.head_dim;
            if (kgrp < kv_groups)
                ew::rope_heads<KV, PPL, G>(k_cache + dst, k + src, n_live, p.norm ? wk : nullptr, p.norm, p.eps,
                                           p.weight_offset, cos_t, sin_t, p.head_dim, p.rope_dim, p.neox);
            else if (p.v_norm)  // rope_dim 0: normed, not rotated
                ew::rope_heads<KV, PPL, G>(v_cache + dst, v + src, n_live, p.v_norm == 2 ? wv : nullptr, true, p.eps,
                                           p.weight_offset, cos_t, sin_t, p.head_dim, 0, p.neox);
            else
                ew::copy_heads<KV>(v_cache + dst, v + src, n_live * p.head_dim);
        }
    }
}
