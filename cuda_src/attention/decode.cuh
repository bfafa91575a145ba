// Split-KV ("flash-decoding") attention of single query tokens over the paged KV cache.
//
// Grid: (n_splits, n_kv_heads * n_head_blocks, n_queries); block: DECODE_WARPS warps.
// A block reads one chunk of one sequence's K/V for one KV head and serves G query heads
// of its group from that single pass (GQA). Each warp reads keys with 16-byte loads:
// LPK lanes cover one key row of D elements (VPL vectors each), so a warp reads KPW keys
// per load; a batch is U such loads of K and of V, and the next batch is in flight while one is
// used (a two-stage register pipeline, so the page-table lookups run ahead too). Each key
// group of a warp keeps its own online-softmax state (m, l, acc[D/LPK]); states are merged
// across the warp with shuffles and across warps through shared memory at the end.
//
// Bytes: every visible K and V row once per (KV head, head block), q once, O (or the partial
// O and LSE of each split) once. With n_splits > 1 the partial results are normalised
// (O_i = acc_i / l_i, LSE_i natural log) and merge_states combines them (and adds the sinks).
#pragma once

#include "common/kv_cache.cuh"
#include "common/types.cuh"
#include "attention/common.cuh"
#include "attention/params.cuh"

namespace cukern {
namespace attn {

constexpr int DECODE_WARPS = 4;

// How a warp covers a K/V row of D elements of T with 16-byte loads.
template <typename T, int D>
struct DecodeShape {
    static constexpr int VEC = vec_elems<T>();                      // elements per 16-byte load
    static constexpr int NV = D / VEC;                              // loads per row
    static constexpr int LPK = (NV & -NV) < 32 ? (NV & -NV) : 32;   // lanes per key: largest power of 2 dividing NV
    static constexpr int VPL = NV / LPK;                            // loads per lane per key
    static constexpr int E = VPL * VEC;                             // elements per lane per key
    static constexpr int KPW = 32 / LPK;                            // keys one warp reads at once
    static_assert(D % VEC == 0, "head_dim must be a multiple of the 16-byte vector");
};

// Position of query `qi` and its slot; the visible keys are [lo, hi).
struct QueryRange {
    int32_t slot;
    int32_t lo;
    int32_t hi;
};

CUKERN_DEVICE QueryRange decode_range(const int32_t* __restrict__ lengths, const int32_t* __restrict__ seq_ids,
                                      const int32_t* __restrict__ q_indptr, uint32_t qi, const DecodeParams& p) {
    uint32_t s = qi;
    int32_t back = 0;  // queries after this one in its sequence
    if (p.batched) {   // largest s with q_indptr[s] <= qi
        uint32_t a = 0, b = p.n_seqs;  // invariant: q_indptr[a] <= qi < q_indptr[b]
        while (b - a > 1) {
            const uint32_t mid = (a + b) / 2;
            if ((uint32_t)q_indptr[mid] <= qi) a = mid; else b = mid;
        }
        s = a;
        back = q_indptr[s + 1] - 1 - (int32_t)qi;
    }
    QueryRange r;
    r.slot = seq_ids[s];
    const int32_t kv_len = lengths[r.slot];
    const int32_t qpos = kv_len - 1 - back;  // the last query of a sequence is its last cached token
    r.hi = p.batched && !p.causal ? kv_len : qpos + 1;
    r.lo = p.window_left >= 0 ? max(0, qpos - p.window_left) : 0;
    return r;
}

}  // namespace attn
}  // namespace cukern

// One chunk of the visible keys of one query, for the G query heads [h0, h0 + G) of one KV head.
template <typename T, int D, int G>
__global__ void __launch_bounds__(cukern::attn::DECODE_WARPS * 32) decode(
    float* __restrict__ o,                   // n_splits == 1: [n_queries, n_heads, D] final output;
                                             // else [n_queries, n_splits, n_heads, D] normalised partial O
    float* __restrict__ lse,                 // [n_queries, n_splits, n_heads] natural-log LSE (write_lse; sinks
                                             // included when n_splits == 1)
    const float* __restrict__ q,             // [n_queries, n_heads, D]
    const T* __restrict__ k_pool,            // [n_pages, page_size, n_kv_heads, D]
    const T* __restrict__ v_pool,            // [n_pages, page_size, n_kv_heads, D]
    const int32_t* __restrict__ page_table,  // [n_slots, max_pages]
    const int32_t* __restrict__ lengths,     // [n_slots] cached tokens per slot
    const int32_t* __restrict__ seq_ids,     // [n_seqs] slot of each sequence
    const int32_t* __restrict__ q_indptr,    // [n_seqs + 1] query rows of each sequence (batched mode only)
    const float* __restrict__ sinks,         // [n_heads] sink logits (has_sinks only)
    const DecodeParams p) {
    using namespace cukern;
    using namespace cukern::attn;
    using S = DecodeShape<T, D>;
    constexpr int WARPS = DECODE_WARPS;
    constexpr int U = (G >= 8 ? 2 : 4) / S::VPL > 0 ? (G >= 8 ? 2 : 4) / S::VPL : 1;  // key steps per batch (x2 in flight)
    constexpr int STEP = WARPS * S::KPW;  // keys the block covers per unrolled slot

    __shared__ float sm_m[WARPS][G];
    __shared__ float sm_l[WARPS][G];
    __shared__ float sm_acc[G][D];

    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int sub = lane / S::LPK;  // key of the warp's KPW this lane reads: 0 .. KPW-1
    const int gl = lane % S::LPK;   // lane within that key's group: 0 .. LPK-1

    const uint32_t qi = blockIdx.z;
    const uint32_t split = blockIdx.x;
    const uint32_t kvh = blockIdx.y / p.n_head_blocks;
    const uint32_t hb = blockIdx.y % p.n_head_blocks;
    const uint32_t h0 = kvh * p.group + hb * G;                 // first query head of this block
    const int n_h = min(G, (int)(p.group - hb * G));            // heads of this block that exist

    const QueryRange r = decode_range(lengths, seq_ids, q_indptr, qi, p);
    const int32_t c0 = r.lo + (int32_t)(split * p.chunk);
    const int32_t c1 = split + 1 == p.n_splits ? r.hi : min(r.hi, c0 + (int32_t)p.chunk);

    // q of the block's heads, the elements this lane multiplies: (gl + i * LPK) * VEC + e
    float qf[G][S::E];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float* qh = q + ((uint64_t)qi * p.n_heads + h0 + min(g, n_h - 1)) * D;
#pragma unroll
        for (int i = 0; i < S::VPL; ++i) {
            const float4* src = reinterpret_cast<const float4*>(qh + (gl + i * S::LPK) * S::VEC);
#pragma unroll
            for (int e4 = 0; e4 < S::VEC / 4; ++e4) {
                const float4 v = src[e4];
                qf[g][i * S::VEC + 4 * e4 + 0] = v.x;
                qf[g][i * S::VEC + 4 * e4 + 1] = v.y;
                qf[g][i * S::VEC + 4 * e4 + 2] = v.z;
                qf[g][i * S::VEC + 4 * e4 + 3] = v.w;
            }
        }
    }

    float m[G], l[G], acc[G][S::E];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < S::E; ++e) acc[g][e] = 0.0f;
    }

    const int32_t* pt = page_table + (uint64_t)r.slot * p.max_pages;
    const uint64_t row_elems = (uint64_t)p.n_kv_heads * D;

    // Software pipeline: the loads of the next U key steps are in flight while these are used.
    // All U page-table lookups first, then all 2 U VPL loads: no load waits on another's latency.
    // Keys past the chunk read the chunk's last key (a valid row) and are masked in process().
    auto load = [&](int32_t base, uint4 (&kr)[U][S::VPL], uint4 (&vr)[U][S::VPL]) {
        uint64_t off[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int32_t j = min(base + u * STEP + sub, c1 - 1);
            off[u] = paged_row(pt, (uint32_t)j, p.page_size, p.page_shift) * row_elems + (uint64_t)kvh * D;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int i = 0; i < S::VPL; ++i) {
                kr[u][i] = load16(k_pool + off[u] + (gl + i * S::LPK) * S::VEC);
                vr[u][i] = load16(v_pool + off[u] + (gl + i * S::LPK) * S::VEC);
            }
        }
    };
    auto process = [&](int32_t base, const uint4 (&kr)[U][S::VPL], const uint4 (&vr)[U][S::VPL]) {
        // scores of the U keys for every head (each key group reduces over its LPK lanes)
        float sc[U][G];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float kf[S::E];
#pragma unroll
            for (int i = 0; i < S::VPL; ++i) widen(kr[u][i], (const T*)nullptr, kf + i * S::VEC);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < S::E; ++e) d = fmaf(qf[g][e], kf[e], d);
#pragma unroll
                for (int off = S::LPK / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
                sc[u][g] = d;
            }
        }
        to_logits2<U * G>(&sc[0][0], p.scale_log2, p.softcap, p.inv_softcap);
#pragma unroll
        for (int u = 0; u < U; ++u) {  // keys past the chunk (loaded as its last key) weigh nothing
            if (base + u * STEP + sub >= c1) {
#pragma unroll
                for (int g = 0; g < G; ++g) sc[u][g] = -INFINITY;
            }
        }
        // online softmax: one rescale per U keys
        float mu[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = m[g];
#pragma unroll
            for (int u = 0; u < U; ++u) mx = fmaxf(mx, sc[u][g]);
            mu[g] = safe_max(mx);
            const float corr = fast_exp2(m[g] - mu[g]);
            m[g] = mx;
            l[g] *= corr;
#pragma unroll
            for (int e = 0; e < S::E; ++e) acc[g][e] *= corr;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float vf[S::E];
#pragma unroll
            for (int i = 0; i < S::VPL; ++i) widen(vr[u][i], (const T*)nullptr, vf + i * S::VEC);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float pu = fast_exp2(sc[u][g] - mu[g]);
                l[g] += pu;
#pragma unroll
                for (int e = 0; e < S::E; ++e) acc[g][e] = fmaf(pu, vf[e], acc[g][e]);
            }
        }
    };
    constexpr int32_t STRIDE = STEP * U;  // keys of one batch of the block
    uint4 ka[U][S::VPL], va[U][S::VPL], kb[U][S::VPL], vb[U][S::VPL];
    int32_t base = c0 + warp * S::KPW;
    if (base < c1) load(base, ka, va);
    for (; base < c1; base += 2 * STRIDE) {
        if (base + STRIDE < c1) load(base + STRIDE, kb, vb);
        process(base, ka, va);
        if (base + STRIDE >= c1) break;
        if (base + 2 * STRIDE < c1) load(base + 2 * STRIDE, ka, va);
        process(base + STRIDE, kb, vb);
    }

    // merge the KPW key groups of the warp (lanes with equal gl hold the same elements)
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float mw = m[g];
#pragma unroll
        for (int off = S::LPK; off < 32; off <<= 1) mw = fmaxf(mw, __shfl_xor_sync(0xffffffffu, mw, off));
        const float f = exp2f(m[g] - safe_max(mw));
        l[g] *= f;
#pragma unroll
        for (int e = 0; e < S::E; ++e) acc[g][e] *= f;
#pragma unroll
        for (int off = S::LPK; off < 32; off <<= 1) {
            l[g] += __shfl_xor_sync(0xffffffffu, l[g], off);
#pragma unroll
            for (int e = 0; e < S::E; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], off);
        }
        m[g] = mw;
    }
    // merge the warps through shared memory
    for (int i = threadIdx.x; i < G * D; i += WARPS * 32) (&sm_acc[0][0])[i] = 0.0f;
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            sm_m[warp][g] = m[g];
            sm_l[warp][g] = l[g];
        }
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float mx = -INFINITY;  // block maximum of head g
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w][g]);
        if (sub == 0) {
            const float f = exp2f(m[g] - safe_max(mx));
#pragma unroll
            for (int i = 0; i < S::VPL; ++i)
#pragma unroll
                for (int e = 0; e < S::VEC; ++e)
                    atomicAdd(&sm_acc[g][(gl + i * S::LPK) * S::VEC + e], acc[g][i * S::VEC + e] * f);
        }
    }
    __syncthreads();
    const bool final_out = p.n_splits == 1;
    for (int idx = threadIdx.x; idx < n_h * D; idx += WARPS * 32) {
        const int g = idx / D, d = idx % D;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w][g]);
        float L = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) L += sm_l[w][g] * exp2f(sm_m[w][g] - safe_max(mx));
        float a = sm_acc[g][d];
        if (final_out && p.has_sinks) {  // the sink joins the denominator once, here or in the merge
            const float s2 = sinks[h0 + g] * LOG2E;
            const float m2 = fmaxf(mx, s2);
            const float f = exp2f(mx - m2);
            L = L * f + exp2f(s2 - m2);
            a *= f;
            mx = m2;
        }
        const uint64_t row = ((uint64_t)qi * p.n_splits + split) * p.n_heads + h0 + g;
        o[row * D + d] = L > 0.0f ? a / L : 0.0f;
        if (d == 0 && p.write_lse) lse[row] = L > 0.0f ? (mx + log2f(L)) * LN2 : -INFINITY;
    }
}
