// Tensor-core flash attention for many queries per sequence (FlashAttention-2 style).
//
// Grid: (n_q_tiles, n_heads, n_seqs); block: WARPS warps, 16 query rows each (BM = 16 * WARPS).
// Tiles are taken heaviest first (blockIdx.x = 0 is the last query tile), so the causal
// diagonal's long tiles start before the short ones. A block loads its Q tile once, then
// streams K/V tiles of BN keys through shared memory with cp.async (two stages: tile t + 1
// loads while tile t is used). Per tile and warp: S = Q K^T (mma.sync m16n8k16, f32
// accumulators), masks and the online softmax in registers (the row state of row g and
// g + 8 lives in the 4 lanes of a quad), P rounded to T and O += P V on the tensor cores.
//
// Keys come from the paged cache (PAGED: page table of the sequence's slot, kv_len = its
// cached length) or from packed contiguous K/V (varlen: rows cu_seqlens_k[s] ...). Query r
// of a sequence (0 <= r < q_len) sits at position kv_len - q_len + r: it sees keys
// j <= that position when causal, and j >= position - window_left when a window is set.
//
// FLOPs: 4 * q_len * (visible keys) * D per head. Bytes: Q, O once; K/V once per query tile.
// Shared memory rows are padded by 16 bytes, which keeps ldmatrix and cp.async free of
// bank conflicts for every head_dim that is a multiple of 16.
#pragma once

#include "common/kv_cache.cuh"
#include "common/mma.cuh"
#include "common/types.cuh"
#include "attention/common.cuh"
#include "attention/params.cuh"

namespace cukern {
namespace attn {

template <int D>
struct PrefillShape {
    static constexpr int WARPS = D <= 128 ? 8 : 4;   // query rows of a block: 16 per warp
    static constexpr int BM = 16 * WARPS;
    static constexpr int BN = D <= 128 ? 64 : 32;    // keys per K/V tile
    static constexpr int LD = D + 8;                 // shared row stride in elements (16-byte pad)
    static constexpr bool Q_IN_REGS = D <= 128;      // else Q fragments are re-read from shared memory
    static constexpr int SMEM_BYTES = (BM + 4 * BN) * LD * 2;  // Q + two stages of K and V
    static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
};

// Copy `rows` rows of D b16 elements into shared memory (row stride LD); row i's source is
// src(i), or zeros when src(i) is null (then the valid global address `any` is named, not read).
template <int D, int NTHREADS, typename T, typename Src>
CUKERN_DEVICE void load_tile(T* dst, int rows, Src src, const T* any) {
    constexpr int CPR = D / 8;  // 16-byte chunks per row
    constexpr int LD = D + 8;
    for (int c = threadIdx.x; c < rows * CPR; c += NTHREADS) {
        const int row = c / CPR, ch = c % CPR;
        const T* s = src(row);
        cp_async16(dst + row * LD + ch * 8, s ? s + ch * 8 : any, s ? 16u : 0u);
    }
}

}  // namespace attn
}  // namespace cukern

template <typename T, int D, bool PAGED>
__global__ void __launch_bounds__(cukern::attn::PrefillShape<D>::WARPS * 32) prefill(
    T* __restrict__ o,                       // [n_q_total, n_heads, D]
    float* __restrict__ lse,                 // [n_q_total, n_heads] natural-log LSE (write_lse only)
    const T* __restrict__ q,                 // [n_q_total, n_heads, D]
    const T* __restrict__ k,                 // PAGED: [n_pages, page_size, n_kv_heads, D]; else [n_k_total, n_kv_heads, D]
    const T* __restrict__ v,                 // same layout as k
    const int32_t* __restrict__ q_indptr,    // [n_seqs + 1] first query row of each sequence
    const int32_t* __restrict__ kv_info,     // PAGED: lengths [n_slots]; else cu_seqlens_k [n_seqs + 1]
    const int32_t* __restrict__ page_table,  // PAGED: [n_slots, max_pages]; else unused
    const int32_t* __restrict__ seq_ids,     // PAGED: [n_seqs] slot of each sequence; else unused
    const float* __restrict__ sinks,         // [n_heads] sink logits (has_sinks only)
    const PrefillParams p) {
    using namespace cukern;
    using namespace cukern::attn;
    using Sh = PrefillShape<D>;
    constexpr int WARPS = Sh::WARPS, BM = Sh::BM, BN = Sh::BN, LD = Sh::LD, NT = WARPS * 32;

    extern __shared__ uint4 smem_raw[];
    T* const Qs = reinterpret_cast<T*>(smem_raw);  // [BM][LD]
    T* const Ks = Qs + BM * LD;                    // [2][BN][LD]
    T* const Vs = Ks + 2 * BN * LD;                // [2][BN][LD]

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, tq = lane % 4;  // fragment row (0..7) and column pair (0..3)

    const uint32_t s = blockIdx.z, h = blockIdx.y;
    const int32_t q_start = q_indptr[s];
    const int32_t q_len = q_indptr[s + 1] - q_start;
    const int32_t r0 = (int32_t)(p.n_q_tiles - 1 - blockIdx.x) * BM;  // first query row of the tile
    if (r0 >= q_len) return;

    int32_t kv_len, k_start = 0;
    const int32_t* pt = nullptr;
    if (PAGED) {
        const int32_t slot = seq_ids[s];
        kv_len = kv_info[slot];
        pt = page_table + (uint64_t)slot * p.max_pages;
    } else {
        k_start = kv_info[s];
        kv_len = kv_info[s + 1] - k_start;
    }
    const uint32_t kvh = h / p.group;
    const uint64_t row_elems = (uint64_t)p.n_kv_heads * D;
    const int32_t offset = kv_len - q_len;  // position of query row r is offset + r
    const int32_t rows_here = min(BM, q_len - r0);
    const bool windowed = p.window_left >= 0;

    // keys any row of the block sees: [lo, hi)
    const int32_t hi = p.causal ? min(kv_len, offset + r0 + rows_here) : kv_len;
    const int32_t lo = windowed ? max(0, offset + r0 - p.window_left) : 0;
    const int32_t t_begin = lo / BN;
    const int32_t t_end = hi > lo ? (hi + BN - 1) / BN : t_begin;

    // this warp's rows: [wr0, wr0 + 16) (rows >= q_len compute garbage that is never stored)
    const int32_t wr0 = r0 + warp * 16;
    const bool warp_active = wr0 < q_len;
    const int32_t w_last = min(wr0 + 15, q_len - 1);  // last real row of the warp
    const int32_t w_hi = p.causal ? min(kv_len, offset + w_last + 1) : kv_len;
    const int32_t w_lo = windowed ? offset + wr0 - p.window_left : 0;

    auto kv_src = [&](const T* base, int32_t t) {
        return [=](int row) -> const T* {
            const int32_t j = t * BN + row;
            if (j >= kv_len) return nullptr;
            const uint64_t r = PAGED ? kv_row_index(pt, (uint32_t)j, p.page_size) : (uint64_t)(k_start + j);
            return base + r * row_elems + (uint64_t)kvh * D;
        };
    };

    load_tile<D, NT>(Qs, BM, [&](int row) -> const T* {
        const int32_t r = r0 + row;
        return r < q_len ? q + ((uint64_t)(q_start + r) * p.n_heads + h) * D : nullptr;
    }, q);
    if (t_begin < t_end) {
        load_tile<D, NT>(Ks, BN, kv_src(k, t_begin), k);
        load_tile<D, NT>(Vs, BN, kv_src(v, t_begin), v);
    }
    cp_async_commit();

    uint32_t qa[Sh::Q_IN_REGS ? D / 16 : 1][4];
    float oacc[D / 8][4];
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) oacc[dt][0] = oacc[dt][1] = oacc[dt][2] = oacc[dt][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    const T* q_row = Qs + (warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * LD + (lane / 16) * 8;  // ldmatrix A
    const int k_row = (lane % 8) + (lane / 16) * 8, k_col = ((lane / 8) % 2) * 8;                  // ldmatrix B (K)
    const int v_row = (lane % 8) + ((lane / 8) % 2) * 8, v_col = (lane / 16) * 8;                  // ldmatrix B^T (V)

    for (int32_t t = t_begin; t < t_end; ++t) {
        const int st = (t - t_begin) & 1;
        if (t + 1 < t_end) {
            load_tile<D, NT>(Ks + (st ^ 1) * BN * LD, BN, kv_src(k, t + 1), k);
            load_tile<D, NT>(Vs + (st ^ 1) * BN * LD, BN, kv_src(v, t + 1), v);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (Sh::Q_IN_REGS && t == t_begin) {
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qa[Sh::Q_IN_REGS ? kk : 0], q_row + kk * 16);
        }
        const int32_t j0 = t * BN;
        // skip tiles this warp sees nothing of (past its causal end, or before its window)
        const bool work = warp_active && j0 < w_hi && j0 + BN - 1 >= w_lo;
        if (work) {
            const T* Kt = Ks + st * BN * LD;
            const T* Vt = Vs + st * BN * LD;
            float sacc[BN / 8][4];
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) sacc[nt][0] = sacc[nt][1] = sacc[nt][2] = sacc[nt][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                uint32_t a[4];
                if (Sh::Q_IN_REGS) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) a[i] = qa[Sh::Q_IN_REGS ? kk : 0][i];
                } else {
                    ldmatrix_x4(a, q_row + kk * 16);
                }
#pragma unroll
                for (int n2 = 0; n2 < BN / 16; ++n2) {
                    uint32_t b[4];
                    ldmatrix_x4(b, Kt + (n2 * 16 + k_row) * LD + kk * 16 + k_col);
                    mma16816<T>(sacc[2 * n2], a, b[0], b[1]);
                    mma16816<T>(sacc[2 * n2 + 1], a, b[2], b[3]);
                }
            }
            // logits (base 2) and masks
            const bool need_mask = j0 + BN > kv_len || (p.causal && j0 + BN - 1 > offset + wr0) ||
                                   (windowed && j0 < offset + w_last - p.window_left);
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = logit2(sacc[nt][e], p.scale_log2, p.softcap, p.inv_softcap);
                    if (need_mask) {
                        const int32_t pos = offset + wr0 + g + (e >= 2 ? 8 : 0);
                        const int32_t j = j0 + nt * 8 + 2 * tq + (e & 1);
                        const bool ok = j < kv_len && (!p.causal || j <= pos) && (!windowed || j >= pos - p.window_left);
                        x = ok ? x : -INFINITY;
                    }
                    sacc[nt][e] = x;
                }
            }
            // online softmax of rows g (i = 0) and g + 8 (i = 1); l stays a per-lane partial sum
            float mu[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float mx = m[i];
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt) mx = fmaxf(mx, fmaxf(sacc[nt][2 * i], sacc[nt][2 * i + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                mu[i] = safe_max(mx);
                const float corr = exp2f(m[i] - mu[i]);
                m[i] = mx;
                l[i] *= corr;
#pragma unroll
                for (int dt = 0; dt < D / 8; ++dt) {
                    oacc[dt][2 * i] *= corr;
                    oacc[dt][2 * i + 1] *= corr;
                }
            }
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    sacc[nt][e] = exp2f(sacc[nt][e] - mu[e / 2]);
                    l[e / 2] += sacc[nt][e];
                }
            }
            // O += P V: the S accumulators of n-tiles 2 kk and 2 kk + 1 are the A fragment of k-step kk
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                uint32_t a[4];
                a[0] = pack2<T>(sacc[2 * kk][0], sacc[2 * kk][1]);
                a[1] = pack2<T>(sacc[2 * kk][2], sacc[2 * kk][3]);
                a[2] = pack2<T>(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1]);
                a[3] = pack2<T>(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3]);
#pragma unroll
                for (int d2 = 0; d2 < D / 16; ++d2) {
                    uint32_t b[4];
                    ldmatrix_x4_trans(b, Vt + (kk * 16 + v_row) * LD + d2 * 16 + v_col);
                    mma16816<T>(oacc[2 * d2], a, b[0], b[1]);
                    mma16816<T>(oacc[2 * d2 + 1], a, b[2], b[3]);
                }
            }
        }
        __syncthreads();  // every warp is done with stage st before the next iteration refills it
    }
    cp_async_wait<0>();  // no copy outlives the block (the Q tile when no K/V tile is visible)

    // normalise (the sink joins the denominator here, once) and store rows g and g + 8
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        float L = l[i];
        L += __shfl_xor_sync(0xffffffffu, L, 1);
        L += __shfl_xor_sync(0xffffffffu, L, 2);
        float M = m[i], f = 1.0f;
        if (p.has_sinks) {
            const float s2 = sinks[h] * LOG2E;
            const float m2 = fmaxf(M, s2);
            f = exp2f(M - m2);
            L = L * f + exp2f(s2 - m2);
            M = m2;
        }
        const float inv = L > 0.0f ? f / L : 0.0f;
        const int32_t r = wr0 + g + 8 * i;
        if (r < q_len) {
            T* orow = o + ((uint64_t)(q_start + r) * p.n_heads + h) * D + 2 * tq;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt)
                *reinterpret_cast<uint32_t*>(orow + dt * 8) = pack2<T>(oacc[dt][2 * i] * inv, oacc[dt][2 * i + 1] * inv);
            if (p.write_lse && tq == 0)
                lse[(uint64_t)(q_start + r) * p.n_heads + h] = L > 0.0f ? (M + log2f(L)) * LN2 : -INFINITY;
        }
    }
}
