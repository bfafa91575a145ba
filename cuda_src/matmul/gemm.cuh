// gemm_f16: D = W B for N token columns on f16 tensor cores (mma.sync m16n8k16, f32 accumulate).
//
// Roles: the MMA's A operand is the activation tile (tokens x k, row-major = B's natural
// layout), its B operand the weight tile (weight rows x k, "col"), so a thread's accumulator
// pairs are two adjacent weight rows of one token: adjacent floats of a D column.
//
// CTA: 256 threads, BT tokens x 128 weight rows (the fused gate+up GLU: 64 rows of each matrix).
// K runs in super-stages of 256 elements (one K-quant super-block, eight 32-blocks), each split
// into four 64-element stages:
//   * raw W: the super-stage's GGUF bytes of the 128 rows (contiguous per row) are copied into
//     shared memory with coalesced 16-byte cp.async (2-byte copies when rows are not 16-byte
//     aligned), issued one stage before they are needed (single buffer, 2 CTAs per SM);
//   * W tile: after the warps multiply stage t, each thread dequantizes its (row, half segment)
//     of stage t+1 from the raw bytes into the other f16 buffer (dequant_tile.cuh);
//   * B: cp.async brings stage t+1 straight into the other f16 buffer, or into an f32 staging
//     tile that the same thread converts after its copies land;
// one barrier per stage (two when a super-stage starts). Ragged M: rows past m are copied from row
// m-1 and never stored; ragged N: tokens past n are zero-filled and never stored; a K tail
// (k % 256, in 32-element segments) is zero-filled. Split K (blockIdx.z, multiples of 256) adds
// partial sums with atomics into a D the host zeroed (or accumulates).
//
// Traffic per CTA and 256-element super-stage: 128 rows x 256 weights (raw bytes, coalesced),
// BT x 256 activations; W is re-read once per token tile, B once per row tile (mostly from L2).
#pragma once

#include "common/mma.cuh"
#include "matmul/dequant_tile.cuh"
#include "matmul/params.cuh"

namespace cukern {
namespace mm {

constexpr int SEG = 32;        // K elements per segment (one quant block / K-quant sub-block)
constexpr int BK = 2 * SEG;    // K elements per stage
constexpr int LDS = BK + 8;    // halves per shared row: 144 bytes, ldmatrix rows hit distinct banks
constexpr int kThreads = 256;
constexpr int kRows = 128;     // weight rows per CTA (both matrices together for the GLU)
constexpr int SUPER = 256;     // K elements per super-stage (raw copy unit)

// Raw bytes of one row's super-stage (256 elements), and the shared row stride: room for the
// bytes plus the lead (copy_raw starts at the 16-byte boundary below the super-stage; only Q6_K,
// 210 bytes per super-block, has a nonzero lead, at most 14), rounded up to 16.
template <int QT> struct Raw {
    static constexpr int kBytes = SUPER / QTraits<QT>::kElems * QTraits<QT>::kBytes;
    static constexpr int kStride = (kBytes + (kBytes % 16 ? 14 : 0) + 15) / 16 * 16;
};

// Warp grid per token tile: WT warps along tokens x WR along weight rows (WT * WR = 8).
template <int BT> struct Cfg {
    static constexpr int kWT = BT >= 64 ? 2 : 1, kWR = 8 / kWT;
    static constexpr int kMinBlocks = BT >= 32 ? 2 : 3;  // CTAs per SM the registers must allow
};

// Dynamic shared memory of gemm_f16<., BT, ., TB>: W and B double buffers, the f32 staging tile,
// the raw super-stage (raw_stride = Raw<QT>::kStride).
__host__ __device__ constexpr uint32_t gemm_smem_bytes(int bt, int b_bytes, int raw_stride) {
    return 2u * (kRows + bt) * LDS * 2 + (b_bytes == 4 ? (uint32_t)bt * BK * 4 : 0u) + (uint32_t)kRows * raw_stride;
}

// Copy the raw bytes [boff, boff + nbytes) of each of the CTA's weight rows (row r of the tile
// starts at rowptr(r)) into sraw[row][lead ...], lead = boff % 16, so that the copy can start at a
// 16-byte boundary; returns lead. Rows 16-byte aligned with a 16-byte multiple of row bytes
// (aligned16): whole 16-byte cp.async chunks up to the next boundary, which never passes the row's
// end (committed as one group: the caller waits); otherwise synchronous 2-byte copies.
// THREADS threads take part, this one as `thread` (0 .. THREADS-1).
template <int STRIDE, int THREADS = kThreads, typename RowPtr>
CUKERN_DEVICE uint32_t copy_raw(uint8_t* sraw, RowPtr rowptr, uint32_t boff, uint32_t nbytes, bool aligned16,
                                bool commit = true, int thread = threadIdx.x) {
    const uint32_t lead = boff % 16, start = boff - lead, span = lead + nbytes;  // boff, lead even
    if (aligned16) {
        constexpr int CPR = STRIDE / 16, TOTAL = kRows * CPR;
#pragma unroll 1
        for (int c = thread; c < TOTAL; c += THREADS) {
            const int row = c / CPR, off = 16 * (c % CPR);
            const bool live = (uint32_t)off < span;
            cp_async16(sraw + row * STRIDE + off, rowptr(row) + (live ? start + off : 0), live ? 16u : 0u);
        }
        if (commit) cp_async_commit();  // else the caller's next commit closes the group
    } else {
        constexpr int WPR = STRIDE / 2, TOTAL = kRows * WPR;
        for (int c = thread; c < TOTAL; c += THREADS) {
            const int row = c / WPR, off = 2 * (c % WPR);
            const uint16_t v = (uint32_t)off >= lead && (uint32_t)off < span
                                   ? *reinterpret_cast<const uint16_t*>(rowptr(row) + start + off) : 0;
            *reinterpret_cast<uint16_t*>(sraw + row * STRIDE + off) = v;
        }
    }
    return lead;
}

// Two 8x8 b16 matrices (lanes 0-15 give the row addresses; the others must be valid too).
CUKERN_DEVICE void ldmatrix_x2(uint32_t& r0, uint32_t& r1, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r0), "=r"(r1)
                 : "r"(smem_addr(row)));
}

// One BK-deep stage of a warp's tile from shared memory: the warp's weight fragments first (n8 tile j:
// bw[mat][j / 2][2 (j % 2)], [.. + 1]), then one activation fragment at a time (fewer live registers than
// the other order), acc[mat][mt][nr] += B tile (m16 mt) x W tile (n8 nr) of matrix mat.
template <int NMAT, int MT, int NR, int BR, int WRR, int WTT, int ROWS, int BT>
CUKERN_DEVICE void warp_mma_stage(float (&acc)[NMAT][MT][NR][4], const __half (&sw)[ROWS][LDS],
                                  const __half (&sb)[BT][LDS], int wr, int wt, int lane) {
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
        uint32_t bw[NMAT][(NR + 1) / 2][4];
#pragma unroll
        for (int mat = 0; mat < NMAT; ++mat) {
            const int rbase = mat * BR + wr * WRR;
            if (NR == 1) {
                ldmatrix_x2(bw[mat][0][0], bw[mat][0][1], &sw[rbase + (lane & 7)][kk * 16 + ((lane >> 3) & 1) * 8]);
            } else {
#pragma unroll
                for (int np = 0; np < NR / 2; ++np)
                    ldmatrix_x4(bw[mat][np], &sw[rbase + np * 16 + (lane & 7) + ((lane >> 4) << 3)]
                                                [kk * 16 + ((lane >> 3) & 1) * 8]);
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            uint32_t af[4];
            ldmatrix_x4(af, &sb[wt * WTT + mt * 16 + (lane & 15)][kk * 16 + (lane >> 4) * 8]);
#pragma unroll
            for (int mat = 0; mat < NMAT; ++mat)
#pragma unroll
                for (int nr = 0; nr < NR; ++nr)
                    mma16816<__half>(acc[mat][mt][nr], af, bw[mat][nr / 2][2 * (nr % 2)], bw[mat][nr / 2][2 * (nr % 2) + 1]);
        }
    }
}


CUKERN_DEVICE uint32_t dynamic_smem_size() {
    uint32_t r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

CUKERN_DEVICE float silu(float x) { return x / (1.0f + __expf(-x)); }
CUKERN_DEVICE float gelu_tanh(float x) {
    const float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + tanhf(k0 * (x + 0.044715f * x * x * x)));
}

// f32 staging -> f16 tile: 4 floats -> 4 halves (8 bytes)
CUKERN_DEVICE void cvt4(__half* dst, const float* src) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<__half>(v.x, v.y), pack2<__half>(v.z, v.w));
}

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

// Stage t's two K segments of one weight row (this thread's part of it) dequantized into its shared row
// (f16), from the raw super-stage at myraw; segments past n_segs (the K tail) zeroed by the two parts.
template <int QT>
CUKERN_DEVICE void dequant_stage(__half (&row)[LDS], const uint8_t* myraw, int t, uint32_t n_segs, int wpart) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        __half* seg = &row[i * SEG];
        if (2 * t + i < (int)n_segs) {
            typename Deq<QT>::Raw r;
            Deq<QT>::load(r, myraw, (2 * t + i) % (SUPER / SEG), wpart);
            Deq<QT>::store(r, seg, wpart);
        } else {
            st16(seg + 16 * wpart, make_uint4(0, 0, 0, 0));
            st16(seg + 16 * wpart + 8, make_uint4(0, 0, 0, 0));
        }
    }
}

// After cp_async_wait, f32 B staging -> the f16 B tile: this thread's 16-byte chunks of the stage (chunk c:
// tile row c / PER_TOK, element (c % PER_TOK) * VEC).
template <int CH, int PER_TOK, int VEC, int BT>
CUKERN_DEVICE void finish_b_stage(__half (&sb)[BT][LDS], const float* stage32, int tid) {
    constexpr int CPT = (CH + kThreads - 1) / kThreads;
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
        const int c = tid + i * kThreads;
        if (CH % kThreads == 0 || c < CH) {
            const int tk = c / PER_TOK, e = (c % PER_TOK) * VEC;
            cvt4(&sb[tk][e], stage32 + tk * BK + e);
        }
    }
}

// The double-buffered main loop over a tile's n_stages BK-deep stages: while stage t multiplies from
// buffer t % 2, stage t + 1's B chunks (and, every SPS stages, the next raw super-stage) are copied in,
// then dequantized into the other buffer.
template <int SPS, int MT, int BR, int WRR, int WTT, int NMAT, int NR, int ROWS, int BT, class LoadRaw, class IssueB,
          class Dequant, class FinishB>
CUKERN_DEVICE void gemm_mainloop(float (&acc)[NMAT][MT][NR][4], __half (*sw)[ROWS][LDS], __half (*sb)[BT][LDS],
                                 int n_stages, int wr, int wt, int lane, LoadRaw& load_raw, IssueB& issue_b,
                                 Dequant& dequant, FinishB& finish_b) {
    if (n_stages > 0) {
        load_raw(0);
        issue_b(0, 0);
        cp_async_wait<0>();
        __syncthreads();  // raw bytes of other threads' copies
        dequant(0, 0);
        finish_b(0);
    }
    __syncthreads();
    for (int t = 0; t < n_stages; ++t) {
        const int buf = t & 1;
        const bool more = t + 1 < n_stages, new_super = more && (t + 1) % SPS == 0;
        if (more) {
            if (new_super) load_raw((t + 1) / SPS);  // the raw tile's last reader was stage t's dequant
            issue_b(t + 1, buf ^ 1);                 // that buffer was last read in stage t-1
        }
        warp_mma_stage<NMAT, MT, NR, BR, WRR, WTT>(acc, sw[buf], sb[buf], wr, wt, lane);
        if (more) {
            cp_async_wait<0>();
            if (new_super) __syncthreads();  // the new raw tile, copied by every thread
            dequant(t + 1, buf ^ 1);
            finish_b(buf ^ 1);
        }
        __syncthreads();
    }
}

}  // namespace mm
}  // namespace cukern

template <int QT, int BT, bool GLU, typename TB>
__global__ void __launch_bounds__(cukern::mm::kThreads, cukern::mm::Cfg<BT>::kMinBlocks) gemm_f16(
    float* __restrict__ d,             // [n, d_stride] f32 out: d[c * d_stride + r], r < m
    const uint8_t* __restrict__ w,     // raw GGUF bytes: W (glu: gate) = m rows from w + w_offset
    const uint8_t* __restrict__ w2,    // glu: the up matrix, m rows from w2 + w2_offset; else unused
    const TB* __restrict__ b,          // [n, b_stride] f32 or f16 columns, 16-byte aligned rows, k used
    const GemmParams p) {              // dynamic shared memory: gemm_smem_bytes(BT, sizeof(TB), Raw<QT>::kStride)
    using namespace cukern;
    using namespace cukern::mm;
    using C = Cfg<BT>;
    constexpr int NMAT = GLU ? 2 : 1, BR = kRows / NMAT;  // rows of each matrix per CTA
    constexpr int WTT = BT / C::kWT, WRR = BR / C::kWR;   // tokens, rows (per matrix) of one warp
    constexpr int MT = WTT / 16, NR = WRR / 8;            // m16 tiles (tokens), n8 tiles (rows)
    static_assert(MT >= 1 && NR >= 1 && (NR % 2 == 0 || NR == 1), "warp tile");
    static_assert(kRows * 2 == kThreads, "one (row, half segment) per thread");
    constexpr bool F32 = sizeof(TB) == 4;
    constexpr int VEC = 16 / sizeof(TB), PER_TOK = BK / VEC, CH = BT * PER_TOK;  // 16-byte chunks of a B stage
    constexpr int CPT = (CH + kThreads - 1) / kThreads;                          // per thread (BT 16: some idle)
    constexpr int RSTRIDE = Raw<QT>::kStride, SPS = SUPER / BK;                   // stages per super-stage

    extern __shared__ __align__(16) uint8_t smem[];
    auto sw = reinterpret_cast<__half(*)[kRows][LDS]>(smem);                       // [2][kRows][LDS]
    auto sb = reinterpret_cast<__half(*)[BT][LDS]>(smem + 2 * kRows * LDS * 2);    // [2][BT][LDS]
    uint8_t* sraw = smem + 2 * (kRows + BT) * LDS * 2;                             // [kRows][RSTRIDE]
    float* stage32 = reinterpret_cast<float*>(sraw + kRows * RSTRIDE);             // [BT][BK] (f32 B only)
    if (threadIdx.x == 0 && dynamic_smem_size() < gemm_smem_bytes(BT, sizeof(TB), RSTRIDE)) __trap();

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wt = warp / C::kWR, wr = warp % C::kWR;
    const uint32_t t0 = blockIdx.x * BT, r0 = blockIdx.y * BR;
    const uint32_t kbeg = blockIdx.z * p.k_split, kend = min(p.k, kbeg + p.k_split);
    const uint32_t n_segs = (kend - kbeg) / SEG;
    const int n_stages = (int)((n_segs + 1) / 2);

    auto rowptr = [&](int row) {  // row of the tile -> its raw GGUF row (past m: row m-1)
        const uint32_t grow = min(r0 + row % BR, p.m - 1);
        return (row / BR ? w2 + p.w2_offset : w + p.w_offset) + (size_t)grow * p.row_bytes;
    };
    // this thread's weight unit: (row of the tile, part), both segments of every stage
    const int wrow_tile = tid / 2, wpart = tid % 2;
    const uint8_t* myraw = sraw + wrow_tile * RSTRIDE;  // + the lead of the current super-stage
    auto load_raw = [&](int S) {  // super-stage S of this split
        const uint32_t e0 = kbeg + SUPER * S, nel = min((uint32_t)SUPER, kend - e0);
        myraw = sraw + wrow_tile * RSTRIDE + copy_raw<RSTRIDE>(sraw, rowptr, e0 / QTraits<QT>::kElems * QTraits<QT>::kBytes,
                                                               nel / QTraits<QT>::kElems * QTraits<QT>::kBytes, p.raw16 != 0);
    };
    auto dequant = [&](int t, int buf) {  // stage t: segments 2t, 2t+1 of the split
        dequant_stage<QT>(sw[buf][wrow_tile], myraw, t, n_segs, wpart);
    };
    // B chunk c of a stage: token c / PER_TOK, element (c % PER_TOK) * VEC; zero-filled past n / K
    auto issue_b = [&](int t, int buf) {
#pragma unroll
        for (int i = 0; i < CPT; ++i) {
            const int c = tid + i * kThreads;
            if (CH % kThreads == 0 || c < CH) {
                const int tk = c / PER_TOK, e = (c % PER_TOK) * VEC;
                const uint32_t tok = t0 + tk, kel = t * BK + e;  // element within the split
                const bool ok = tok < p.n && kel < n_segs * SEG;
                const TB* src = ok ? b + (size_t)tok * p.b_stride + kbeg + kel : b;
                void* dst = F32 ? (void*)(stage32 + tk * BK + e) : (void*)&sb[buf][tk][e];
                cp_async16(dst, src, ok ? 16u : 0u);
            }
        }
        cp_async_commit();
    };
    auto finish_b = [&](int buf) {  // after cp_async_wait: f32 staging -> f16 (own chunks only)
        if (F32) finish_b_stage<CH, PER_TOK, VEC>(sb[buf], stage32, tid);
    };

    float acc[NMAT][MT][NR][4] = {};
    gemm_mainloop<SPS, MT, BR, WRR, WTT>(acc, sw, sb, n_stages, wr, wt, lane, load_raw, issue_b, dequant, finish_b);

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
