// Vectorised RoPE kernels: rope / rms_norm_rope and the fused Q/K norm + RoPE + KV write, for the common
// head sizes. The host takes them when head_dim = 8 * LPH with LPH in {4, 8, 16, 32} (head_dim 32..256),
// rope_dim % 8 == 0 and every array is 16-byte aligned; rope.cuh's kernels serve every other shape.
//
// A head row (one head of one token) is LPH consecutive lanes of a warp; lane u of the group owns one
// 8-element unit of the row, two float4s at element offsets (a, b):
//   rotary unit u < rope_dim / 8 (pairs 4u .. 4u + 3):
//     NeoX         a = 4u, b = rope_dim / 2 + 4u     pair 4u + e = (A[e], B[e])
//     interleaved  a = 8u, b = 8u + 4                pairs (A.x, A.y), (A.z, A.w), (B.x, B.y), (B.z, B.w)
//   copied unit:   a = rope_dim + 8 (u - rope_dim / 8), b = a + 4
// A thread reads and writes only its own unit, so out may alias x. Its inverse frequencies (f64) stay in
// registers for the whole block; per row it takes the 4 angles pos * inv through rope_sincos (f64 reduction,
// one f32 sincospif each: 4 per 8 elements, no table, no shared memory, no block barrier); rope_vec takes
// them while the row's loads are in flight. The norm's sum of squares is reduced over the row's LPH lanes
// with shuffles. A thread takes VEC_ROWS rows, rows slot + k * (ROPE_BLOCK / LPH) of its block, and loads
// all of them before using any.
// Byte traffic: every element read once and written once; weights and positions hit L1/L2.
#pragma once

#include "common/pdl.cuh"
#include "common/types.cuh"
#include "common/kv_cache.cuh"
#include "elementwise/params.cuh"
#include "elementwise/rope.cuh"
#include "elementwise/kv.cuh"
#include "elementwise/convert.cuh"

namespace cukern {
namespace ew {

constexpr int VEC_ROWS = 2;  // head rows per thread

// One lane's unit of a head row: its element offsets and, for a rotary unit, its 4 inverse frequencies.
struct RopeUnit {
    uint32_t a, b;  // element offsets of the unit's two float4s in the row
    bool rot;       // four rotary pairs (else eight copied elements)
    double inv[4];  // inverse frequencies of pairs 4u .. 4u + 3 (rot only)

    CUKERN_DEVICE RopeUnit(uint32_t u, uint32_t rope_dim, bool neox, bool use_freqs, double ratio,
                           const float* __restrict__ freqs) {
        const uint32_t n_rot = rope_dim / 8;
        rot = u < n_rot;
        if (rot) {
            a = neox ? 4 * u : 8 * u;
            b = neox ? rope_dim / 2 + 4 * u : 8 * u + 4;
            inv[0] = rope_inv_freq(4 * u, use_freqs, ratio, freqs);
#pragma unroll
            for (int e = 1; e < 4; ++e)
                inv[e] = use_freqs ? (double)freqs[4 * u + e] : inv[e - 1] * ratio;
        } else {
            a = rope_dim + 8 * (u - n_rot);
            b = a + 4;
#pragma unroll
            for (int e = 0; e < 4; ++e) inv[e] = 0.0;
        }
    }
};

// Rotate the unit's 4 pairs by the angles whose cos/sin are c, s.
CUKERN_DEVICE void rotate_unit(float4& A, float4& B, const float (&c)[4], const float (&s)[4], bool neox) {
    auto rot = [](float& x, float& y, float cc, float ss) {
        const float r = x * cc - y * ss;
        y = x * ss + y * cc;
        x = r;
    };
    if (neox) {
        rot(A.x, B.x, c[0], s[0]); rot(A.y, B.y, c[1], s[1]);
        rot(A.z, B.z, c[2], s[2]); rot(A.w, B.w, c[3], s[3]);
    } else {
        rot(A.x, A.y, c[0], s[0]); rot(A.z, A.w, c[1], s[1]);
        rot(B.x, B.y, c[2], s[2]); rot(B.z, B.w, c[3], s[3]);
    }
}

// Sum over the LPH lanes of a row group (every lane of the group gets the sum). The group's lanes are
// converged: they share a row, so they take the same branches.
template <int LPH>
CUKERN_DEVICE float group_sum(float x) {
    const uint32_t lane = threadIdx.x % WARP;
    const uint32_t mask = LPH == WARP ? 0xffffffffu : (((1u << LPH) - 1u) << (lane & ~(uint32_t)(LPH - 1)));
#pragma unroll
    for (int o = LPH / 2; o > 0; o >>= 1) x += __shfl_xor_sync(mask, x, o);
    return x;
}

// A, B *= rsqrt(mean of the row's squares + eps) * (w + off), w at the unit's element offsets a, b
// (w == nullptr: unit weight, no offset).
template <int LPH>
CUKERN_DEVICE void norm_unit(float4& A, float4& B, uint32_t a, uint32_t b, const float* __restrict__ w, float eps,
                             float off, uint32_t head_dim) {
    const float ss = A.x * A.x + A.y * A.y + A.z * A.z + A.w * A.w + B.x * B.x + B.y * B.y + B.z * B.z + B.w * B.w;
    const float s = rsqrtf(group_sum<LPH>(ss) / (float)head_dim + eps);
    if (w == nullptr) {
        A.x *= s; A.y *= s; A.z *= s; A.w *= s;
        B.x *= s; B.y *= s; B.z *= s; B.w *= s;
        return;
    }
    const float4 wa = __ldg(reinterpret_cast<const float4*>(w + a));
    const float4 wb = __ldg(reinterpret_cast<const float4*>(w + b));
    A.x *= s * (wa.x + off); A.y *= s * (wa.y + off); A.z *= s * (wa.z + off); A.w *= s * (wa.w + off);
    B.x *= s * (wb.x + off); B.y *= s * (wb.y + off); B.z *= s * (wb.z + off); B.w *= s * (wb.w + off);
}

}  // namespace ew
}  // namespace cukern

// out[t, h] = rope(x[t, h]) or, with NORM, rope(rms_norm(x[t, h]) * (w + weight_offset)); every pos_mode.
// T: storage type of x and out (float, __half, __nv_bfloat16: 4-element loads of 16 or 8 bytes); w, freqs f32.
// p.tokens_per_block is unused here. grid: (ceil(n_tokens * n_heads / (ROPE_BLOCK / LPH * VEC_ROWS))),
// block: ROPE_BLOCK, no dynamic shared memory.
template <bool NORM, int LPH, typename T = float>
__global__ void __launch_bounds__(cukern::ew::ROPE_BLOCK) rope_vec(
    T* out,                                // [n_tokens, n_heads, 8 * LPH] (may alias x)
    const T* x,                            // [n_tokens, n_heads, 8 * LPH]
    const float* __restrict__ w,           // NORM: [head_dim] norm weight (else unread)
    const float* __restrict__ freqs,       // use_freqs: [rope_dim / 2] inverse frequencies (else unread)
    const int32_t* __restrict__ positions, // pos_mode 0: [1]; 1: [n_tokens]; 2, 3: [4, n_tokens]
    const RopeParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    constexpr uint32_t SLOTS = ew::ROPE_BLOCK / LPH, HD = 8 * LPH;  // rows per block pass, head_dim
    const uint32_t u = threadIdx.x % LPH, slot = threadIdx.x / LPH;
    const ew::RopeUnit un(u, p.rope_dim, p.neox, p.use_freqs, p.inv_ratio, freqs);
    uint32_t sec[4] = {0, 0, 0, 0};  // position row of each pair (multi-section modes)
    if (p.pos_mode >= 2 && un.rot) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sec[e] = ew::rope_section(4 * u + e, p.sections, p.pos_mode);
    }
    const uint64_t n_rows = (uint64_t)p.n_tokens * p.n_heads;
    const uint64_t r0 = (uint64_t)blockIdx.x * SLOTS * ew::VEC_ROWS + slot;
    float4 A[ew::VEC_ROWS], B[ew::VEC_ROWS];
#pragma unroll
    for (int k = 0; k < ew::VEC_ROWS; ++k) {
        const uint64_t r = r0 + k * SLOTS;
        if (r < n_rows) {
            A[k] = ew::ld4(x + r * HD, un.a);
            B[k] = ew::ld4(x + r * HD, un.b);
        }
    }
    float c[ew::VEC_ROWS][4], s[ew::VEC_ROWS][4];  // while the loads are in flight: the rows' cos/sin
#pragma unroll
    for (int k = 0; k < ew::VEC_ROWS; ++k) {
        const uint64_t r = r0 + k * SLOTS;
        if (r >= n_rows || !un.rot) break;
        const uint32_t t = (uint32_t)(r / p.n_heads);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int32_t pos;
            if (p.pos_mode == 0) pos = positions[0] + (int32_t)t;
            else if (p.pos_mode == 1) pos = positions[t];
            else pos = positions[sec[e] * p.n_tokens + t];
            ew::rope_sincos(pos, un.inv[e], p.attn_scale, s[k][e], c[k][e]);
        }
    }
#pragma unroll
    for (int k = 0; k < ew::VEC_ROWS; ++k) {
        const uint64_t r = r0 + k * SLOTS;
        if (r >= n_rows) break;  // uniform over the row's lanes
        if (NORM) ew::norm_unit<LPH>(A[k], B[k], un.a, un.b, w, p.eps, p.weight_offset, HD);
        if (un.rot) ew::rotate_unit(A[k], B[k], c[k], s[k], p.neox);
        ew::st4(out + r * HD, un.a, A[k]);
        ew::st4(out + r * HD, un.b, B[k]);
    }
}

// qk_norm_rope_kv (rope.cuh) for head_dim = 8 * LPH: per token, rows q heads | k heads | v heads (HAS_Q,
// HAS_V), each row one LPH-lane group. V rows are copied or, with v_norm, RMS-normed (units at 8u, 8u + 4).
// pos_mode 0 or 1. The host instantiates HAS_V = true with HAS_Q true (Q, K and V) or false (K and V); the
// K-only path is k_norm_rope_kv_vec below. QO: q_out's type, f32 or
// the cache's (a prompt chunk's Q rounded once, here, for the tensor-core prefill attention).
// grid: (ceil(n_tokens * rows per token / (ROPE_BLOCK / LPH * VEC_ROWS))), block: ROPE_BLOCK.
template <typename KV, bool HAS_Q, bool HAS_V, int LPH, typename QO = float>
__global__ void __launch_bounds__(cukern::ew::ROPE_BLOCK) qk_norm_rope_kv_vec(
    QO* __restrict__ q_out,                 // HAS_Q: [n_tokens, n_q_heads, head_dim] (else unread)
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
    constexpr uint32_t SLOTS = ew::ROPE_BLOCK / LPH, HD = 8 * LPH;
    const uint32_t u = threadIdx.x % LPH, slot = threadIdx.x / LPH;
    const ew::RopeUnit un(u, p.rope_dim, p.neox, p.use_freqs, p.inv_ratio, freqs);
    const uint32_t nq = HAS_Q ? p.n_q_heads : 0, nkv = p.n_kv_heads;
    const uint32_t per_tok = nq + nkv * (HAS_V ? 2 : 1);  // rows per token
    const uint32_t row_elems = nkv * HD;
    const uint64_t n_rows = (uint64_t)p.n_tokens * per_tok;
    const uint64_t r0 = (uint64_t)blockIdx.x * SLOTS * ew::VEC_ROWS + slot;
    float4 A[ew::VEC_ROWS], B[ew::VEC_ROWS];
#pragma unroll
    for (int j = 0; j < ew::VEC_ROWS; ++j) {
        const uint64_t r = r0 + j * SLOTS;
        if (r >= n_rows) continue;
        const uint32_t t = (uint32_t)(r / per_tok), i = (uint32_t)(r % per_tok);  // token, row in the token
        if (HAS_Q && i < nq) {
            const float* src = q + ((uint64_t)t * nq + i) * HD;
            A[j] = ew::ld4(src, un.a);
            B[j] = ew::ld4(src, un.b);
        } else if (i < nq + nkv) {
            const float* src = k + ((uint64_t)t * nkv + (i - nq)) * HD;
            A[j] = ew::ld4(src, un.a);
            B[j] = ew::ld4(src, un.b);
        } else {
            const float* src = v + ((uint64_t)t * nkv + (i - nq - nkv)) * HD;
            A[j] = ew::ld4(src, 8 * u);
            B[j] = ew::ld4(src, 8 * u + 4);
        }
    }
#pragma unroll
    for (int j = 0; j < ew::VEC_ROWS; ++j) {
        const uint64_t r = r0 + j * SLOTS;
        if (r >= n_rows) break;  // uniform over the row's lanes
        const uint32_t t = (uint32_t)(r / per_tok), i = (uint32_t)(r % per_tok);
        const int32_t pos = p.pos_mode == 0 ? positions[0] + (int32_t)t : positions[t];
        const bool is_q = HAS_Q && i < nq, is_v = !is_q && i >= nq + nkv;
        if (!is_v) {
            if (p.norm) ew::norm_unit<LPH>(A[j], B[j], un.a, un.b, is_q ? wq : wk, p.eps, p.weight_offset, HD);
            if (un.rot) {
                float c[4], s[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) ew::rope_sincos(pos, un.inv[e], p.attn_scale, s[e], c[e]);
                ew::rotate_unit(A[j], B[j], c, s, p.neox);
            }
        } else if (p.v_norm) {
            ew::norm_unit<LPH>(A[j], B[j], 8 * u, 8 * u + 4, p.v_norm == 2 ? wv : nullptr, p.eps, p.weight_offset, HD);
        }
        if (is_q) {
            QO* dst = q_out + ((uint64_t)t * nq + i) * HD;
            ew::st4(dst, un.a, A[j]);
            ew::st4(dst, un.b, B[j]);
            continue;
        }
        const int32_t seq = p.pos_mode == 0 ? seq_ids[0] : seq_ids[t];
        const uint64_t row = kv_row_offset(page_table + (uint64_t)seq * p.max_pages, (uint32_t)pos, p.page_size,
                                           row_elems);
        if (!is_v) {
            KV* dst = k_cache + row + (uint64_t)(i - nq) * HD;
            ew::st4(dst, un.a, A[j]);
            ew::st4(dst, un.b, B[j]);
        } else {
            KV* dst = v_cache + row + (uint64_t)(i - nq - nkv) * HD;
            ew::st4(dst, 8 * u, A[j]);
            ew::st4(dst, 8 * u + 4, B[j]);
        }
    }
}

// The K-only sibling of qk_norm_rope_kv_vec: K cache row = rope(rms_norm(k) * (wk + off)) (norm optional),
// pos_mode 0 or 1. A thread takes ROWS consecutive head rows (of one token when n_kv_heads % ROWS == 0),
// loads all of them, and while the loads are in flight takes the token's cos/sin and cache row once; a row
// of another token (n_kv_heads % ROWS != 0) takes its own. grid: (ceil(n_tokens * n_kv_heads /
// (ROPE_BLOCK / LPH * ROWS))), block: ROPE_BLOCK.
template <typename KV, int LPH, int ROWS>
__global__ void __launch_bounds__(cukern::ew::ROPE_BLOCK) k_norm_rope_kv_vec(
    KV* __restrict__ k_cache,               // [n_pages, page_size, n_kv_heads, head_dim]
    const float* __restrict__ k,            // [n_tokens, n_kv_heads, head_dim]
    const float* __restrict__ wk,           // norm: [head_dim] (else unread)
    const float* __restrict__ freqs,        // use_freqs: [rope_dim / 2] (else unread)
    const int32_t* __restrict__ positions,  // pos_mode 0: [1] (first token's position); 1: [n_tokens]
    const int32_t* __restrict__ seq_ids,    // pos_mode 0: [1]; 1: [n_tokens]: page_table row of each token
    const int32_t* __restrict__ page_table, // [n_seqs, max_pages] int32
    const QkvRopeParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    constexpr uint32_t SLOTS = ew::ROPE_BLOCK / LPH, HD = 8 * LPH;
    const uint32_t u = threadIdx.x % LPH, slot = threadIdx.x / LPH;
    const uint32_t nkv = p.n_kv_heads;
    const uint64_t n_rows = (uint64_t)p.n_tokens * nkv;
    const uint64_t r0 = ((uint64_t)blockIdx.x * SLOTS + slot) * ROWS;
    if (r0 >= n_rows) return;  // whole row groups
    // the unit's offsets first (RopeUnit's), so that the loads go out before its f64 frequency chain
    const uint32_t n_rot = p.rope_dim / 8;
    const uint32_t a = u < n_rot ? (p.neox ? 4 * u : 8 * u) : p.rope_dim + 8 * (u - n_rot);
    const uint32_t b = u < n_rot ? (p.neox ? p.rope_dim / 2 + 4 * u : 8 * u + 4) : a + 4;
    float4 A[ROWS], B[ROWS];
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
        if (r0 + j < n_rows) {
            A[j] = ew::ld4(k + (r0 + j) * HD, a);
            B[j] = ew::ld4(k + (r0 + j) * HD, b);
        }
    }
    const ew::RopeUnit un(u, p.rope_dim, p.neox, p.use_freqs, p.inv_ratio, freqs);
    uint32_t t = (uint32_t)(r0 / nkv), head = (uint32_t)(r0 % nkv);  // of row r0 + j, stepped below
    float c[4], s[4];  // cos/sin of the unit's pairs at the token's position
    uint64_t row = 0;  // the token's cache row
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
        if (r0 + j >= n_rows) break;  // uniform over the row's lanes
        if (j == 0 || head == 0) {  // the first row, or the first row of the next token
            const int32_t pos = p.pos_mode == 0 ? positions[0] + (int32_t)t : positions[t];
            const int32_t seq = p.pos_mode == 0 ? seq_ids[0] : seq_ids[t];
            row = kv_row_offset(page_table + (uint64_t)seq * p.max_pages, (uint32_t)pos, p.page_size, nkv * HD);
            if (un.rot) {
#pragma unroll
                for (int e = 0; e < 4; ++e) ew::rope_sincos(pos, un.inv[e], p.attn_scale, s[e], c[e]);
            }
        }
        if (p.norm) ew::norm_unit<LPH>(A[j], B[j], a, b, wk, p.eps, p.weight_offset, HD);
        if (un.rot) ew::rotate_unit(A[j], B[j], c, s, p.neox);
        KV* dst = k_cache + row + (uint64_t)head * HD;
        ew::st4(dst, a, A[j]);
        ew::st4(dst, b, B[j]);
        if (++head == nkv) { head = 0; ++t; }
    }
}
