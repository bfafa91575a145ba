// gemm_f16: D = W B for N token columns on f16 tensor cores (mma.sync m16n8k16, f32 accumulate).
//
// Roles: the MMA's A operand is the activation tile (tokens x k, row-major = B's natural
// layout), its B operand the weight tile (weight rows x k, "col"), so a thread's accumulator
// pairs are two adjacent weight rows of one token: adjacent floats of a D column.
//
// CTA tile: BT tokens x BR weight rows (x 2 matrices for the fused gate+up GLU), K in 32-element
// stages, double-buffered in shared memory with a register prefetch: while the warps multiply
// stage s, each thread holds the raw GGUF bytes (and the B values) of stage s+1 in registers, then
// dequantizes/converts them into the other buffer; one barrier per stage. Ragged M: rows past m
// are read as row m-1 and never stored; ragged N: tokens past n are zeros and never stored.
// Split K (blockIdx.z) adds partial sums with atomics into a D the host zeroed (or accumulates).
//
// Traffic per CTA and stage: BR (x2) rows x 32 weights (raw bytes), BT x 32 activations; W is
// re-read once per token tile, B once per row tile (both mostly from L2).
#pragma once

#include "common/mma.cuh"
#include "matmul/dequant_tile.cuh"
#include "matmul/params.cuh"

namespace cukern {
namespace mm {

constexpr int BK = 32;        // K elements per stage (one quant block / K-quant sub-block)
constexpr int LDS = BK + 8;   // halves per shared row: 80 bytes, ldmatrix rows hit distinct banks

// Threads and warp grid per token tile: WT warps along tokens x WR warps along weight rows.
template <int BT> struct Cfg;
// kMinBlocks: CTAs per SM the register allocation must allow (2 x 40 KB of shared memory at BT 128).
template <> struct Cfg<128> { static constexpr int kThreads = 256, kWT = 2, kWR = 4, kMinBlocks = 2; };
template <> struct Cfg<64> { static constexpr int kThreads = 128, kWT = 1, kWR = 4, kMinBlocks = 3; };
template <> struct Cfg<32> { static constexpr int kThreads = 128, kWT = 1, kWR = 4, kMinBlocks = 4; };
template <> struct Cfg<16> { static constexpr int kThreads = 128, kWT = 1, kWR = 4, kMinBlocks = 4; };

CUKERN_DEVICE float silu(float x) { return x / (1.0f + __expf(-x)); }
CUKERN_DEVICE float gelu_tanh(float x) {
    const float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + tanhf(k0 * (x + 0.044715f * x * x * x)));
}

// Activations: 16-byte vectors of B (4 f32 or 8 f16), converted to f16 in shared memory.
CUKERN_DEVICE uint4 zero4() { return make_uint4(0, 0, 0, 0); }
CUKERN_DEVICE void store_b(__half* dst, uint4 v, const float*) {  // 4 f32 -> 4 halves
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<__half>(__uint_as_float(v.x), __uint_as_float(v.y)),
                                                pack2<__half>(__uint_as_float(v.z), __uint_as_float(v.w)));
}
CUKERN_DEVICE void store_b(__half* dst, uint4 v, const __half*) { *reinterpret_cast<uint4*>(dst) = v; }

// Write two adjacent outputs (rows row, row+1 of token column `col`) under the epilogue.
CUKERN_DEVICE void put2(float* col, uint32_t row, float v0, float v1, const GemmParams& p, bool vec) {
    float* o = col + row;
    const bool both = row + 1 < p.m;
    if (p.atomic) {
        atomicAdd(o, v0);
        if (both) atomicAdd(o + 1, v1);
    } else if (both && vec) {
        float2 r = make_float2(v0, v1);
        if (p.mode == 1) {
            const float2 old = *reinterpret_cast<const float2*>(o);
            r.x += old.x, r.y += old.y;
        }
        *reinterpret_cast<float2*>(o) = r;
    } else {
        o[0] = p.mode == 1 ? o[0] + v0 : v0;
        if (both) o[1] = p.mode == 1 ? o[1] + v1 : v1;
    }
}

}  // namespace mm
}  // namespace cukern

template <int QT, int BT, bool GLU, typename TB>
__global__ void __launch_bounds__(cukern::mm::Cfg<BT>::kThreads, cukern::mm::Cfg<BT>::kMinBlocks) gemm_f16(
    float* __restrict__ d,             // [n, d_stride] f32 out: d[c * d_stride + r], r < m
    const uint8_t* __restrict__ w,     // raw GGUF bytes: W (glu: gate) = m rows from w + w_offset
    const uint8_t* __restrict__ w2,    // glu: the up matrix, m rows from w2 + w2_offset; else unused
    const TB* __restrict__ b,          // [n, b_stride] f32 or f16 columns, 16-byte aligned rows, k used
    const GemmParams p) {
    using namespace cukern;
    using namespace cukern::mm;
    using C = Cfg<BT>;
    constexpr int NMAT = GLU ? 2 : 1, BR = GLU ? 64 : 128, ROWS = NMAT * BR;
    constexpr int WTT = BT / C::kWT, WRR = BR / C::kWR;  // tokens, rows (per matrix) of one warp
    constexpr int MT = WTT / 16, NR = WRR / 8;           // m16 tiles (tokens), n8 tiles (rows)
    static_assert(MT >= 1 && NR % 2 == 0, "warp tile");
    constexpr int WU = ROWS * 2 / C::kThreads;           // weight units (half segments) per thread
    static_assert(WU * C::kThreads == ROWS * 2, "weight units");
    constexpr int VEC = 16 / sizeof(TB), PER_TOK = BK / VEC, BU = BT * PER_TOK;
    constexpr int BUT = (BU + C::kThreads - 1) / C::kThreads;  // B vectors per thread (some idle at BT 16)

    __shared__ __align__(16) __half sw[2][ROWS][LDS];
    __shared__ __align__(16) __half sb[2][BT][LDS];

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wt = warp / C::kWR, wr = warp % C::kWR;
    const uint32_t t0 = blockIdx.x * BT, r0 = blockIdx.y * BR;
    const uint32_t kbeg = blockIdx.z * p.k_split;
    const int n_stages = (int)((min(p.k, kbeg + p.k_split) - kbeg) / BK);
    const uint32_t kb0 = kbeg / BK;

    // this thread's weight units: (row of the tile, part)
    const uint8_t* wrow[WU];
    int wpart[WU], wdst[WU];
#pragma unroll
    for (int i = 0; i < WU; ++i) {
        const int u = tid + i * C::kThreads, row = u / 2, mat = row / BR;
        const uint32_t grow = min(r0 + row % BR, p.m - 1);  // past m: a valid row, never stored
        wrow[i] = (mat ? w2 + p.w2_offset : w + p.w_offset) + (size_t)grow * p.row_bytes;
        wpart[i] = u % 2;
        wdst[i] = row;
    }
    typename Deq<QT>::Raw wraw[WU];
    uint4 braw[BUT];

    auto load_stage = [&](int s) {
#pragma unroll
        for (int i = 0; i < WU; ++i) Deq<QT>::load(wraw[i], wrow[i], kb0 + s, wpart[i]);
#pragma unroll
        for (int i = 0; i < BUT; ++i) {
            const int u = tid + i * C::kThreads;
            const uint32_t tok = t0 + u / PER_TOK;
            braw[i] = zero4();
            if (u < BU && tok < p.n)
                braw[i] = *reinterpret_cast<const uint4*>(b + (size_t)tok * p.b_stride + kbeg + s * BK + (u % PER_TOK) * VEC);
        }
    };
    auto store_stage = [&](int buf) {
#pragma unroll
        for (int i = 0; i < WU; ++i) Deq<QT>::store(wraw[i], &sw[buf][wdst[i]][0], wpart[i]);
#pragma unroll
        for (int i = 0; i < BUT; ++i) {
            const int u = tid + i * C::kThreads;
            if (u < BU) store_b(&sb[buf][u / PER_TOK][(u % PER_TOK) * VEC], braw[i], b);
        }
    };

    float acc[NMAT][MT][NR][4] = {};
    if (n_stages > 0) {
        load_stage(0);
        store_stage(0);
    }
    __syncthreads();
    for (int s = 0; s < n_stages; ++s) {
        const int buf = s & 1;
        if (s + 1 < n_stages) load_stage(s + 1);
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            uint32_t af[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldmatrix_x4(af[mt], &sb[buf][wt * WTT + mt * 16 + (lane & 15)][kk * 16 + (lane >> 4) * 8]);
#pragma unroll
            for (int mat = 0; mat < NMAT; ++mat) {
#pragma unroll
                for (int np = 0; np < NR / 2; ++np) {
                    uint32_t bf[4];  // n8 tiles 2np (bf[0], bf[1]) and 2np+1 (bf[2], bf[3])
                    ldmatrix_x4(bf, &sw[buf][mat * BR + wr * WRR + np * 16 + (lane & 7) + ((lane >> 4) << 3)]
                                       [kk * 16 + ((lane >> 3) & 1) * 8]);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816<__half>(acc[mat][mt][2 * np], af[mt], bf[0], bf[1]);
                        mma16816<__half>(acc[mat][mt][2 * np + 1], af[mt], bf[2], bf[3]);
                    }
                }
            }
        }
        if (s + 1 < n_stages) store_stage(buf ^ 1);
        __syncthreads();
    }

    // epilogue: c0, c1 = (token g, rows 2t, 2t+1); c2, c3 = (token g+8, same rows)
    const int g = lane >> 2, tq = lane & 3;
    const bool vec = ((p.d_stride | reinterpret_cast<unsigned long long>(d) / 4) & 1) == 0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const uint32_t tok = t0 + wt * WTT + mt * 16 + g + 8 * half;
            if (tok >= p.n) continue;
            float* col = d + (size_t)tok * p.d_stride;
#pragma unroll
            for (int nr = 0; nr < NR; ++nr) {
                const uint32_t row = r0 + wr * WRR + nr * 8 + 2 * tq;
                if (row >= p.m) continue;
                float v0 = acc[0][mt][nr][2 * half], v1 = acc[0][mt][nr][2 * half + 1];
                if (GLU) {
                    const float u0 = acc[NMAT - 1][mt][nr][2 * half], u1 = acc[NMAT - 1][mt][nr][2 * half + 1];
                    v0 = (p.mode == 3 ? gelu_tanh(v0) : silu(v0)) * u0;
                    v1 = (p.mode == 3 ? gelu_tanh(v1) : silu(v1)) * u1;
                }
                put2(col, row, v0, v1, p, vec);
            }
        }
    }
}
