// moe_gemm_f16: grouped expert GEMMs for prefill, D[slot] = W[expert(slot)] x[row(slot)] for every
// slot of a MoeRoute (dmmv's moe_route_pack: slot ids grouped per expert in `packed`, bucket b's
// slots at packed[offsets[b] .. offsets[b + 1]); bucket n_experts, up to n_slots, the slots whose id
// was out of range), on gemm_f16's tiles and mma.sync code path (gemm.cuh, dequant_tile.cuh).
//
// Grid (max_tiles, ceil(m / BR)): x walks the slot tiles of every bucket in turn, BT slots each
// (a bucket's last tile partly filled: its empty rows are zero-filled and never stored), sized by
// the host for the worst case, floor(n_slots / BT) + min(n_slots, n_experts + 1) tiles; a CTA
// finds its bucket from the device offsets (a block scan of ceil(count / BT) over the buckets) and
// exits when its tile index is past the route's tiles. No host round trip: graph-capturable.
// The B tile's token rows are gathered through the slot list (row slot / top_k, or the slot with
// x_per_slot) by the same 16-byte cp.async gemm_f16 issues: no gather copy. A tile of the invalid
// bucket writes zeros to its slots' rows (as moe_dmmv_packed does); the route flagged them.
//
// GLU (64 gate + 64 up rows per CTA): act(gate + b_g) * (up + b_u) stored as f16 (the down GEMM's
// activations), act = silu, gelu_tanh or gpt-oss's clamped swiglu_oai. Otherwise f32 stored
// (mode 1: added) at the slot's row of d: the slot order moe_dmmv_packed writes.
//
// Traffic per CTA: 128 weight rows x k (raw bytes of one expert, coalesced), BT gathered rows x k
// of x; the expert's W is read once per slot tile (ceil(count / BT) times), x once per row tile.
// FLOPs: 2 * n_slots * m * k (x2 with GLU) plus the padding of each expert's last tile.
#pragma once

#include "common/reduce.cuh"
#include "matmul/gemm.cuh"

namespace cukern {
namespace mm {

template <bool GLU> struct MoeOut { using T = float; };
template <> struct MoeOut<true> { using T = __half; };

CUKERN_DEVICE float moe_act(float g, float u, const MoeGemmParams& p) {
    if (p.mode == 4) {  // swiglu_oai
        const float gc = fminf(g, p.limit), uc = fminf(fmaxf(u, -p.limit), p.limit);
        return gc / (1.0f + __expf(-p.alpha * gc)) * (uc + 1.0f);
    }
    return (p.mode == 3 ? gelu_tanh(g) : silu(g)) * u;
}

}  // namespace mm
}  // namespace cukern

template <int QT, int BT, bool GLU, typename TB>
__global__ void __launch_bounds__(cukern::mm::kThreads, cukern::mm::Cfg<BT>::kMinBlocks) moe_gemm_f16(
    typename cukern::mm::MoeOut<GLU>::T* __restrict__ d,  // [n_slots, d_stride] out: f32 (glu: f16), row = slot
    const uint8_t* __restrict__ w,     // raw GGUF expert tensor [n_experts, m, k] (glu: gate) from w + w_offset
    const uint8_t* __restrict__ w2,    // glu: the up tensor from w2 + w2_offset; else unused
    const TB* __restrict__ x,          // [n_tokens or n_slots, x_stride] f32 or f16, 16-byte aligned rows
    const int* __restrict__ offsets,   // [n_experts + 1] first packed position per bucket (MoeRoute.offsets)
    const int* __restrict__ packed,    // [n_slots] slot ids grouped by bucket (MoeRoute.packed)
    const float* __restrict__ bias_g,  // glu, has_bias: gate bias, [n_experts] x [m] at bias_expert / bias_row
    const float* __restrict__ bias_u,  // glu, has_bias: up bias, same layout; else unused
    const MoeGemmParams p) {           // dynamic shared memory: gemm_smem_bytes(BT, sizeof(TB), Raw<QT>::kStride)
    using namespace cukern;
    using namespace cukern::mm;
    using C = Cfg<BT>;
    using TD = typename MoeOut<GLU>::T;
    constexpr int NMAT = GLU ? 2 : 1, BR = kRows / NMAT;
    constexpr int WTT = BT / C::kWT, WRR = BR / C::kWR;
    constexpr int MT = WTT / 16, NR = WRR / 8;
    static_assert(MT >= 1 && NR >= 1 && (NR % 2 == 0 || NR == 1), "warp tile");
    constexpr bool F32 = sizeof(TB) == 4;
    constexpr int VEC = 16 / sizeof(TB), PER_TOK = BK / VEC, CH = BT * PER_TOK;
    constexpr int CPT = (CH + kThreads - 1) / kThreads;
    constexpr int RSTRIDE = Raw<QT>::kStride, SPS = SUPER / BK;

    extern __shared__ __align__(16) uint8_t smem[];
    auto sw = reinterpret_cast<__half(*)[kRows][LDS]>(smem);
    auto sb = reinterpret_cast<__half(*)[BT][LDS]>(smem + 2 * kRows * LDS * 2);
    uint8_t* sraw = smem + 2 * (kRows + BT) * LDS * 2;
    float* stage32 = reinterpret_cast<float*>(sraw + kRows * RSTRIDE);
    __shared__ int s_scan[32], s_bucket, s_tile;
    __shared__ int s_slot[BT], s_xrow[BT];  // tile row -> slot (-1: empty) and its row of x
    if (threadIdx.x == 0 && dynamic_smem_size() < gemm_smem_bytes(BT, sizeof(TB), RSTRIDE)) __trap();

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    // ---- this CTA's bucket and tile within it: scan of ceil(count / BT) over the buckets, each
    // thread a run of `per` consecutive buckets
    {
        const int n_buckets = (int)p.n_experts + 1, per = (n_buckets + kThreads - 1) / kThreads;
        const int b0 = min(tid * per, n_buckets), b1 = min(b0 + per, n_buckets);
        auto count = [&](int b) { return (b < (int)p.n_experts ? offsets[b + 1] : (int)p.n_slots) - offsets[b]; };
        int mine = 0;
        for (int b = b0; b < b1; ++b) mine += (count(b) + BT - 1) / BT;
        if (tid == 0) s_bucket = -1;
        int total;
        int first = block_exclusive_scan(mine, s_scan, &total);  // its barriers order s_bucket's reset
        const int tile = (int)blockIdx.x;
        if (tile >= first && tile < first + mine) {
            for (int b = b0; b < b1; ++b) {
                const int c = (count(b) + BT - 1) / BT;
                if (tile < first + c) {
                    s_bucket = b, s_tile = tile - first;
                    break;
                }
                first += c;
            }
        }
        __syncthreads();
    }
    const int bucket = s_bucket;
    if (bucket < 0) return;  // past the route's tiles (the grid is sized for the worst case)
    if (tid < BT) {
        const int pos = offsets[bucket] + s_tile * BT + tid;
        const int end = bucket < (int)p.n_experts ? offsets[bucket + 1] : (int)p.n_slots;
        const int slot = pos < end ? packed[pos] : -1;
        s_slot[tid] = slot;
        s_xrow[tid] = slot < 0 ? 0 : (p.x_per_slot ? slot : slot / (int)p.top_k);
    }
    __syncthreads();
    const uint32_t r0 = blockIdx.y * BR;
    if (bucket == (int)p.n_experts) {  // slots with an out-of-range expert id: zeros
        for (int i = tid; i < BT * BR; i += kThreads) {
            const int slot = s_slot[i / BR];
            const uint32_t row = r0 + i % BR;
            if (slot >= 0 && row < p.m) d[(size_t)slot * p.d_stride + row] = TD(0.0f);
        }
        return;
    }
    const uint32_t n_segs = p.k / SEG;
    const int n_stages = (int)((n_segs + 1) / 2);
    const size_t expert_off = (size_t)bucket * p.expert_bytes;

    auto rowptr = [&](int row) {  // row of the tile -> its raw GGUF row of this expert (past m: row m-1)
        const uint32_t grow = min(r0 + row % BR, p.m - 1);
        return (row / BR ? w2 + p.w2_offset : w + p.w_offset) + expert_off + (size_t)grow * p.row_bytes;
    };
    const int wrow_tile = tid / 2, wpart = tid % 2;
    const uint8_t* myraw = sraw + wrow_tile * RSTRIDE;
    auto load_raw = [&](int S) {
        const uint32_t e0 = SUPER * S, nel = min((uint32_t)SUPER, p.k - e0);
        myraw = sraw + wrow_tile * RSTRIDE + copy_raw<RSTRIDE>(sraw, rowptr, e0 / QTraits<QT>::kElems * QTraits<QT>::kBytes,
                                                               nel / QTraits<QT>::kElems * QTraits<QT>::kBytes, p.raw16 != 0);
    };
    auto dequant = [&](int t, int buf) { dequant_stage<QT>(sw[buf][wrow_tile], myraw, t, n_segs, wpart); };
    // B chunk c of a stage: tile row c / PER_TOK (gathered: x row s_xrow), element (c % PER_TOK) * VEC
    auto issue_b = [&](int t, int buf) {
#pragma unroll
        for (int i = 0; i < CPT; ++i) {
            const int c = tid + i * kThreads;
            if (CH % kThreads == 0 || c < CH) {
                const int tk = c / PER_TOK, e = (c % PER_TOK) * VEC;
                const uint32_t kel = t * BK + e;
                const bool ok = s_slot[tk] >= 0 && kel < n_segs * SEG;
                const TB* src = ok ? x + (size_t)s_xrow[tk] * p.x_stride + kel : x;
                void* dst = F32 ? (void*)(stage32 + tk * BK + e) : (void*)&sb[buf][tk][e];
                cp_async16(dst, src, ok ? 16u : 0u);
            }
        }
        cp_async_commit();
    };
    auto finish_b = [&](int buf) {
        if (F32) finish_b_stage<CH, PER_TOK, VEC>(sb[buf], stage32, tid);
    };

    const int wt = warp / C::kWR, wr = warp % C::kWR;
    float acc[NMAT][MT][NR][4] = {};
    gemm_mainloop<SPS, MT, BR, WRR, WTT>(acc, sw, sb, n_stages, wr, wt, lane, load_raw, issue_b, dequant, finish_b);

    // epilogue: c0, c1 = (tile row g, rows 2tq, 2tq+1); c2, c3 = (tile row g+8, same rows)
    const int g = lane >> 2, tq = lane & 3;
    const bool vec = ((p.d_stride | reinterpret_cast<unsigned long long>(d) / sizeof(TD)) & 1) == 0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int slot = s_slot[wt * WTT + mt * 16 + g + 8 * half];
            if (slot < 0) continue;
            TD* col = d + (size_t)slot * p.d_stride;
#pragma unroll
            for (int nr = 0; nr < NR; ++nr) {
                const uint32_t row = r0 + wr * WRR + nr * 8 + 2 * tq;
                if (row >= p.m) continue;
                const bool both = row + 1 < p.m;
                float v0 = acc[0][mt][nr][2 * half], v1 = acc[0][mt][nr][2 * half + 1];
                if constexpr (GLU) {
                    float u0 = acc[1][mt][nr][2 * half], u1 = acc[1][mt][nr][2 * half + 1];
                    if (p.has_bias) {
                        const size_t b0 = (size_t)bucket * p.bias_expert + (size_t)row * p.bias_row;
                        v0 += bias_g[b0], u0 += bias_u[b0];
                        if (both) v1 += bias_g[b0 + p.bias_row], u1 += bias_u[b0 + p.bias_row];
                    }
                    v0 = moe_act(v0, u0, p);
                    v1 = moe_act(v1, u1, p);
                    if (both && vec) {
                        *reinterpret_cast<__half2*>(col + row) = __floats2half2_rn(v0, v1);
                    } else {
                        col[row] = __float2half_rn(v0);
                        if (both) col[row + 1] = __float2half_rn(v1);
                    }
                } else {
                    if (both && vec) {
                        float2 r = make_float2(v0, v1);
                        if (p.mode == 1) {
                            const float2 old = *reinterpret_cast<const float2*>(col + row);
                            r.x += old.x, r.y += old.y;
                        }
                        *reinterpret_cast<float2*>(col + row) = r;
                    } else {
                        col[row] = p.mode == 1 ? col[row] + v0 : v0;
                        if (both) col[row + 1] = p.mode == 1 ? col[row + 1] + v1 : v1;
                    }
                }
            }
        }
    }
}
