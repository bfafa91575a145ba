// Rotary position embeddings, alone or fused with the per-head RMS norm and the KV-cache write.
//
// Layout: x [n_tokens, n_heads, head_dim] f32. The first rope_dim elements of a head rotate in
// pairs, NeoX (j, j + rope_dim/2) or interleaved (2j, 2j+1), j < rope_dim/2, by the angle
// pos * inv_freq[j], inv_freq[j] = freq_base^(-2j / rope_dim) or a caller's freqs[j] (scaled
// RoPE variants precompute them); the remaining head_dim - rope_dim elements are copied.
// Positions: consecutive (positions[0] + t), per token (positions[t]), or per token and section
// (positions [4, n_tokens]: multi-section rotary, contiguous sections or IMRoPE's interleaved ones).
//
// One block per token: its threads first fill a cos/sin table of rope_dim/2 entries in shared
// memory (angles reduced mod 2*pi in f64, so positions in the 10^5 range keep f32 accuracy), then
// each warp takes whole heads. Byte traffic: read and write every element once (weights hit L2).
#pragma once

#include "common/types.cuh"
#include "common/reduce.cuh"
#include "common/kv_cache.cuh"
#include "elementwise/params.cuh"

namespace cukern {
namespace ew {

constexpr int ROPE_BLOCK = 256;       // threads per token block
constexpr int ROPE_MAX_PAIRS = 512;   // rope_dim / 2 <= 512 (head_dim <= 1024)

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

// cos/sin of pos * inv_freq, with the angle reduced to [-pi, pi] in f64 before the f32 sincos.
CUKERN_DEVICE void rope_cos_sin(int32_t pos, uint32_t pair, uint32_t rope_dim, bool use_freqs, float freq_base,
                                const float* freqs, float* c, float* s) {
    const double inv = use_freqs ? (double)freqs[pair] : pow((double)freq_base, -2.0 * pair / rope_dim);
    double a = (double)pos * inv;
    a -= 6.283185307179586 * rint(a * 0.15915494309189535);
    sincosf((float)a, s, c);
}

// One head: out = rotate(x * scale * (w + w_off)); w == nullptr: no weight. Lanes take pairs.
template <typename TO>
CUKERN_DEVICE void rope_head(TO* __restrict__ out, const float* __restrict__ x, const float* __restrict__ w,
                             float scale, float w_off, const float* cos_t, const float* sin_t,
                             uint32_t head_dim, uint32_t rope_dim, bool neox) {
    const uint32_t half = rope_dim / 2;
    for (uint32_t j = threadIdx.x % WARP; j < head_dim / 2; j += WARP) {
        uint32_t i0, i1;
        if (j < half) {
            i0 = neox ? j : 2 * j;
            i1 = neox ? j + half : 2 * j + 1;
        } else {  // the copied tail: elements rope_dim + 2 (j - half) and the next
            i0 = rope_dim + 2 * (j - half);
            i1 = i0 + 1;
        }
        float v0 = x[i0] * scale, v1 = x[i1] * scale;
        if (w != nullptr) {
            v0 *= w[i0] + w_off;
            v1 *= w[i1] + w_off;
        }
        if (j < half) {
            const float c = cos_t[j], s = sin_t[j];
            const float r0 = v0 * c - v1 * s;
            v1 = v0 * s + v1 * c;
            v0 = r0;
        }
        out[i0] = from_float<TO>(v0);
        out[i1] = from_float<TO>(v1);
    }
}

// rsqrt(mean(x^2) + eps) of one head, across the warp.
CUKERN_DEVICE float head_rms_scale(const float* __restrict__ x, uint32_t head_dim, float eps) {
    float acc = 0.f;
    for (uint32_t i = threadIdx.x % WARP; i < head_dim; i += WARP) acc += x[i] * x[i];
    return rsqrtf(warp_sum(acc) / (float)head_dim + eps);
}

}  // namespace ew
}  // namespace cukern

// out[t, h] = rope(x[t, h]) or, with NORM, rope(rms_norm(x[t, h]) * (w + weight_offset)).
// grid: (n_tokens), block: ROPE_BLOCK.
template <bool NORM>
__global__ void __launch_bounds__(cukern::ew::ROPE_BLOCK) rope(
    float* out,                            // [n_tokens, n_heads, head_dim] (may alias x)
    const float* x,                        // [n_tokens, n_heads, head_dim]
    const float* __restrict__ w,           // NORM: [head_dim] norm weight (else unread)
    const float* __restrict__ freqs,       // use_freqs: [rope_dim / 2] inverse frequencies (else unread)
    const int32_t* __restrict__ positions, // pos_mode 0: [1]; 1: [n_tokens]; 2, 3: [4, n_tokens]
    const RopeParams p) {
    using namespace cukern;
    __shared__ float cos_t[ew::ROPE_MAX_PAIRS], sin_t[ew::ROPE_MAX_PAIRS];
    const uint32_t t = blockIdx.x;
    for (uint32_t j = threadIdx.x; j < p.rope_dim / 2; j += blockDim.x) {
        int32_t pos;
        if (p.pos_mode == 0) pos = positions[0] + (int32_t)t;
        else if (p.pos_mode == 1) pos = positions[t];
        else pos = positions[ew::rope_section(j, p.sections, p.pos_mode) * p.n_tokens + t];
        ew::rope_cos_sin(pos, j, p.rope_dim, p.use_freqs, p.freq_base, freqs, &cos_t[j], &sin_t[j]);
    }
    __syncthreads();
    for (uint32_t h = threadIdx.x / WARP; h < p.n_heads; h += blockDim.x / WARP) {
        const uint64_t off = ((uint64_t)t * p.n_heads + h) * p.head_dim;
        const float scale = NORM ? ew::head_rms_scale(x + off, p.head_dim, p.eps) : 1.0f;
        __syncwarp();  // in place: every lane has read the head before any lane writes it
        ew::rope_head<float>(out + off, x + off, NORM ? w : nullptr, scale, p.weight_offset, cos_t, sin_t,
                             p.head_dim, p.rope_dim, p.neox);
    }
}

// The attention block's prologue for one step: per token t,
//   q_out[t, h]          = rope(rms_norm(q[t, h]) * (wq + off))      h < n_q_heads     (HAS_Q)
//   K cache row (seq, pos)[h] = rope(rms_norm(k[t, h]) * (wk + off)) h < n_kv_heads
//   V cache row (seq, pos)[h] = v[t, h]                              h < n_kv_heads    (HAS_V)
// (norm = 0: no norm, rotation only). Caches use common/kv_cache.cuh's paged layout; a contiguous
// cache is one page per sequence. The K-only sibling (HAS_Q = HAS_V = false) serves models whose
// V comes from elsewhere. grid: (n_tokens), block: ROPE_BLOCK.
template <typename KV, bool HAS_Q, bool HAS_V>
__global__ void __launch_bounds__(cukern::ew::ROPE_BLOCK) qk_norm_rope_kv(
    float* __restrict__ q_out,              // HAS_Q: [n_tokens, n_q_heads, head_dim] (else unread)
    KV* __restrict__ k_cache,               // [n_pages, page_size, n_kv_heads, head_dim]
    KV* __restrict__ v_cache,               // HAS_V: same layout as k_cache (else unread)
    const float* __restrict__ q,            // HAS_Q: [n_tokens, n_q_heads, head_dim]
    const float* __restrict__ k,            // [n_tokens, n_kv_heads, head_dim]
    const float* __restrict__ v,            // HAS_V: [n_tokens, n_kv_heads, head_dim]
    const float* __restrict__ wq,           // HAS_Q and norm: [head_dim]
    const float* __restrict__ wk,           // norm: [head_dim]
    const float* __restrict__ freqs,        // use_freqs: [rope_dim / 2]
    const int32_t* __restrict__ positions,  // pos_mode 0: [1] (first token's position); 1: [n_tokens]
    const int32_t* __restrict__ seq_ids,    // pos_mode 0: [1]; 1: [n_tokens]: page_table row of each token
    const int32_t* __restrict__ page_table, // [n_seqs, max_pages] int32
    const QkvRopeParams p) {
    using namespace cukern;
    __shared__ float cos_t[ew::ROPE_MAX_PAIRS], sin_t[ew::ROPE_MAX_PAIRS];
    const uint32_t t = blockIdx.x;
    const int32_t pos = p.pos_mode == 0 ? positions[0] + (int32_t)t : positions[t];
    const int32_t seq = p.pos_mode == 0 ? seq_ids[0] : seq_ids[t];
    for (uint32_t j = threadIdx.x; j < p.rope_dim / 2; j += blockDim.x)
        ew::rope_cos_sin(pos, j, p.rope_dim, p.use_freqs, p.freq_base, freqs, &cos_t[j], &sin_t[j]);
    __syncthreads();
    const uint32_t n_q = HAS_Q ? p.n_q_heads : 0;
    const uint32_t n_heads = n_q + p.n_kv_heads * (HAS_V ? 2 : 1);
    const uint32_t row_elems = p.n_kv_heads * p.head_dim;
    const uint64_t cache_row = kv_row_offset(page_table + (uint64_t)seq * p.max_pages, (uint32_t)pos,
                                             p.page_size, row_elems);
    for (uint32_t h = threadIdx.x / WARP; h < n_heads; h += blockDim.x / WARP) {
        if (HAS_Q && h < n_q) {
            const uint64_t off = ((uint64_t)t * p.n_q_heads + h) * p.head_dim;
            const float s = p.norm ? ew::head_rms_scale(q + off, p.head_dim, p.eps) : 1.0f;
            ew::rope_head<float>(q_out + off, q + off, p.norm ? wq : nullptr, s, p.weight_offset, cos_t, sin_t,
                                 p.head_dim, p.rope_dim, p.neox);
        } else if (h < n_q + p.n_kv_heads) {
            const uint32_t hk = h - n_q;
            const float* kh = k + (uint64_t)t * row_elems + (uint64_t)hk * p.head_dim;
            const float s = p.norm ? ew::head_rms_scale(kh, p.head_dim, p.eps) : 1.0f;
            ew::rope_head<KV>(k_cache + cache_row + (uint64_t)hk * p.head_dim, kh, p.norm ? wk : nullptr, s,
                              p.weight_offset, cos_t, sin_t, p.head_dim, p.rope_dim, p.neox);
        } else {
            const uint32_t hv = h - n_q - p.n_kv_heads;
            const float* vh = v + (uint64_t)t * row_elems + (uint64_t)hv * p.head_dim;
            KV* dst = v_cache + cache_row + (uint64_t)hv * p.head_dim;
            for (uint32_t i = threadIdx.x % WARP; i < p.head_dim; i += WARP) dst[i] = from_float<KV>(vh[i]);
        }
    }
}
