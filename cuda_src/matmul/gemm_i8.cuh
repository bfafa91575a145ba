// gemm_q8: D = W A for N token columns of Q8_1 activations on int8 tensor cores
// (mma.sync m16n8k32 s8 -> s32; m16n8k16 for Q6_K, whose scales cover 16 elements).
//
// Same CTA shape as gemm_f16 (256 threads, BT tokens x 128 weight rows, raw GGUF super-stages of
// 256 elements copied into shared memory, 64-element stages, one barrier per stage, two when a
// super-stage starts), int8 tiles instead of f16, and a deeper pipeline for 128-token tiles (CfgQ8):
//   * W: after the warps multiply stage t, each thread converts its (row, half segment) of stage
//     t+1 from the raw bytes into int8 quants + per-segment f32 scales (i8_tile.cuh);
//   * A: the Q8_1 blocks of stage t+AHEAD arrive by cp.async (4-byte words: blocks are 36 bytes):
//     quants into an int8 tile of a ring of AHEAD + 1, (d, s) into a per-token table.
// Each segment's integer dot products are exact (s32); the f32 accumulator then takes
//   acc += a * (da * dot) (- c * s for Q4_K/Q5_K), per (token, row) pair a thread holds, the s32
// reaching f32 through the kMagic bias and one FMA (no conversion instruction).
// Ragged M/N and split K as gemm_f16 (zero-filled activations contribute nothing: d = s = 0).
//
// EPI 0: d = W a (or d += W a). EPI 1..3, the fused gate+up of a gated MLP (64 rows of each of W
// and W2 per CTA): h = act(W a) * (W2 a) with act SiLU (mode 2) or GELU-tanh (mode 3), stored as
// f32 (EPI 1) or quantized straight to Q8_1 (EPI 2) / Q8_0 (EPI 3) blocks of 32 rows for the next
// int8 GEMM: the CTA's h tile goes through shared memory, 8 lanes quantize each 32-value block.
#pragma once

#include "common/mma.cuh"
#include "common/q8_1.cuh"
#include "matmul/gemm.cuh"
#include "matmul/i8_tile.cuh"
#include "matmul/q8_store.cuh"

namespace cukern {
namespace mm {

constexpr int LDQ = BK + 16;  // bytes per int8 shared row: 80, ldmatrix rows hit distinct banks

// s32 accumulator start of the integer dot products: 0x4B400000 is 1.5 * 2^23 as f32, and any
// kMagic + x with |x| < 2^22 reads as the f32 kMagicF + x exactly (a 32-element int8 dot product
// is at most 32 * 127 * 128 < 2^19).
constexpr int kMagic = 0x4B400000;
constexpr float kMagicF = 12582912.0f;

// Warp grid and occupancy of gemm_q8: Cfg<BT>'s, except that the 128-token tile (64 tokens x 32
// rows per warp) runs one CTA per SM with up to 255 registers instead of spilling at 128.
// The one CTA per SM hides global latency by depth instead: 4 activation stages in a ring (3 in
// flight) and 2 raw super-stage buffers (the next one copied a whole super-stage ahead); smaller
// tiles keep 2 activation stages and 1 raw buffer, and rely on 2-3 CTAs per SM.
template <int BT> struct CfgQ8 : Cfg<BT> {
    static constexpr int kMinBlocks = BT >= 128 ? 1 : Cfg<BT>::kMinBlocks;
    static constexpr int kAStages = BT >= 128 ? 4 : 2, kRawBufs = BT >= 128 ? 2 : 1;
};

// Dynamic shared memory of gemm_q8<., BT>: int8 W and A tiles, W scales (a[4], c[2]), A (d, s),
// the raw super-stage (raw_stride = Raw<QT>::kStride).
template <int BT>
__host__ __device__ constexpr uint32_t gemm_q8_smem_bytes(int raw_stride) {
    return 2u * kRows * LDQ + (uint32_t)CfgQ8<BT>::kAStages * BT * (LDQ + 2 * 4) + 2u * kRows * (4 + 2) * 4 +
           (uint32_t)CfgQ8<BT>::kRawBufs * kRows * raw_stride;
}

// 4-byte global -> shared copy through L1; src_bytes = 0 writes zeros (src not read).
CUKERN_DEVICE void cp_async4(void* smem, const void* gmem, uint32_t src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes));
}

CUKERN_DEVICE void mma_s8_k32(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

CUKERN_DEVICE void mma_s8_k16(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
}

}  // namespace mm
}  // namespace cukern

template <int QT, int BT, int EPI>
__global__ void __launch_bounds__(cukern::mm::kThreads, cukern::mm::CfgQ8<BT>::kMinBlocks) gemm_q8(
    float* __restrict__ d,             // EPI 0, 1: [n, d_stride] f32 out, d[c * d_stride + r], r < m;
                                       // EPI 2, 3: [n, d_stride] bytes out, m / 32 Q8_1 / Q8_0 blocks per row
    const uint8_t* __restrict__ w,     // raw GGUF bytes: m rows from w + w_offset (EPI > 0: the gate)
    const uint8_t* __restrict__ w2,    // EPI > 0: the up matrix, m rows from w2 + w2_offset; else unused
    const uint8_t* __restrict__ a,     // [n, b_stride] bytes: Q8_1 rows (k / 32 blocks of 36), 4-byte aligned
    const GemmParams p) {              // dynamic shared memory: gemm_q8_smem_bytes<BT>(Raw<QT>::kStride); b_stride in bytes
    using namespace cukern;
    using namespace cukern::mm;
    using C = CfgQ8<BT>;
    constexpr int NMAT = EPI ? 2 : 1, BR = kRows / NMAT;   // rows of each matrix per CTA
    constexpr int WTT = BT / C::kWT, WRR = BR / C::kWR;    // tokens, rows (per matrix) of one warp
    constexpr int MT = WTT / 16, NR = WRR / 8;
    static_assert(MT >= 1 && NR >= 1 && (NR % 2 == 0 || NR == 1), "warp tile");
    static_assert(2 * BT <= kThreads, "one thread per (token, segment) of an activation stage");
    constexpr int SUBS = I8<QT>::kSubs;
    constexpr bool MIN = I8<QT>::kMin;
    constexpr int RSTRIDE = Raw<QT>::kStride, SPS = SUPER / BK;

    constexpr int NA = C::kAStages, NRAW = C::kRawBufs, AHEAD = NA - 1;  // activation stages in flight
    static_assert(AHEAD <= SPS, "a raw super-stage is issued no later than the activations of its first stage");
    extern __shared__ __align__(16) uint8_t smem[];
    auto sw = reinterpret_cast<int8_t(*)[kRows][LDQ]>(smem);                          // [2][kRows][LDQ]
    auto sa = reinterpret_cast<int8_t(*)[BT][LDQ]>(smem + 2 * kRows * LDQ);           // [NA][BT][LDQ]
    auto swa = reinterpret_cast<float(*)[4][kRows]>(smem + (2 * kRows + NA * BT) * LDQ);  // [2][seg * SUBS + h][row]
    auto swc = reinterpret_cast<float(*)[2][kRows]>(&swa[2][0][0]);                   // [2][seg][row]
    auto sds = reinterpret_cast<__half2(*)[BT][2]>(&swc[2][0][0]);                    // [NA][token][seg]: (d, s)
    uint8_t* sraw = reinterpret_cast<uint8_t*>(&sds[NA][0][0]);                       // [NRAW][kRows][RSTRIDE]
    if (threadIdx.x == 0 && dynamic_smem_size() < gemm_q8_smem_bytes<BT>(RSTRIDE)) __trap();

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wt = warp / C::kWR, wr = warp % C::kWR;
    const uint32_t t0 = blockIdx.x * BT, r0 = blockIdx.y * BR;
    const uint32_t kbeg = blockIdx.z * p.k_split, kend = min(p.k, kbeg + p.k_split);
    const uint32_t n_segs = (kend - kbeg) / SEG;
    const int n_stages = (int)((n_segs + 1) / 2);
    const uint32_t seg0 = kbeg / SEG;

    auto rowptr = [&](int row) {  // row of the tile -> its raw GGUF row (past m: row m-1)
        const uint32_t grow = min(r0 + row % BR, p.m - 1);
        return (row / BR ? w2 + p.w2_offset : w + p.w_offset) + (size_t)grow * p.row_bytes;
    };
    const int wrow_tile = tid / 2, wpart = tid % 2;
    uint32_t raw_lead[2] = {0, 0};  // copy_raw's lead of the super-stage in each raw buffer
    auto load_raw = [&](int S) {  // super-stage S of this split into raw buffer S % NRAW (commit: the caller's)
        const uint32_t e0 = kbeg + SUPER * S, nel = min((uint32_t)SUPER, kend - e0);
        const uint32_t lead = copy_raw<RSTRIDE>(sraw + (S % NRAW) * kRows * RSTRIDE, rowptr,
                                                e0 / QTraits<QT>::kElems * QTraits<QT>::kBytes,
                                                nel / QTraits<QT>::kElems * QTraits<QT>::kBytes, p.raw16 != 0, false);
        if (S % NRAW) raw_lead[1] = lead;  // constant indices: the pair stays in registers
        else raw_lead[0] = lead;
    };
    auto store_w = [&](int s, int buf) {  // stage s: segments 2s, 2s+1 of the split
        const int rb = (s / SPS) % NRAW;
        const uint8_t* myraw = sraw + (rb * kRows + wrow_tile) * RSTRIDE + (rb ? raw_lead[1] : raw_lead[0]);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            int8_t* seg = &sw[buf][wrow_tile][i * SEG];
            float sa_[2], sc_[1];
            if (2 * s + i < (int)n_segs) {
                typename Deq<QT>::Raw r;
                Deq<QT>::load(r, myraw, (2 * s + i) % (SUPER / SEG), wpart);
                store_i8(r, seg, sa_, sc_, wpart);
            } else {  // K tail: zero quants, zero scales
                st16i(seg + 16 * wpart, 0, 0, 0, 0);
                sa_[0] = sa_[1] = sc_[0] = 0.f;
            }
            if (SUBS == 2) swa[buf][i * 2 + wpart][wrow_tile] = wpart ? sa_[1] : sa_[0];
            else if (wpart == 0) swa[buf][i][wrow_tile] = sa_[0];
            if (MIN && wpart == 0) swc[buf][i][wrow_tile] = sc_[0];
        }
    };
    // A: thread tid < 2 BT copies one Q8_1 block (9 words) of the stage: token tid / 2, segment tid % 2;
    // its source walks 72 bytes (two blocks) per stage.
    const int a_tok = tid / 2, a_sg = tid % 2;
    const bool a_live = tid < 2 * BT && t0 + a_tok < p.n;
    const uint8_t* a_src = a + (a_live ? (size_t)(t0 + a_tok) * p.b_stride + (size_t)(seg0 + a_sg) * Q8_1_BLOCK_BYTES : 0);
    auto issue_a = [&](int s, int buf) {
        if (tid < 2 * BT) {
            const bool ok = a_live && 2 * s + a_sg < (int)n_segs;
            const uint8_t* src = ok ? a_src + (size_t)s * 2 * Q8_1_BLOCK_BYTES : a;
            const uint32_t n = ok ? 4u : 0u;
            cp_async4(&sds[buf][a_tok][a_sg], src, n);
#pragma unroll
            for (int j = 1; j < 9; ++j) cp_async4(&sa[buf][a_tok][a_sg * SEG + 4 * (j - 1)], ok ? src + 4 * j : a, n);
        }
    };
    // Stage s's copies: one cp.async group per loop iteration (empty past the end), so that
    // wait_group<AHEAD - 1> at the end of iteration s means: stage s + 1's activations and every raw
    // super-stage issued up to iteration s + 1 - AHEAD have landed (for this thread).
    auto issue = [&](int s) {  // activation stage s, in iteration s - AHEAD
        const int it = s - AHEAD;
        // raw super-stage S goes in iteration SPS (S - 1) with two buffers (a super-stage ahead), SPS S - 1
        // with one; either way its buffer's last reader, the conversion of an earlier stage, is done
        const int S = NRAW == 2 ? (it % SPS == 0 ? it / SPS + 1 : 0) : ((it + 1) % SPS == 0 ? (it + 1) / SPS : 0);
        if (it >= 0 && S > 0 && S * SUPER < (int)(kend - kbeg)) load_raw(S);
        if (s < n_stages) issue_a(s, s % NA);
        cp_async_commit();
    };

    float acc[NMAT][MT][NR][4] = {};
    if (n_stages > 0) {
        load_raw(0);
        for (int s = 0; s < AHEAD; ++s) issue(s);  // group 0 also holds super-stage 0
        cp_async_wait<AHEAD - 1>();
        __syncthreads();  // raw bytes of other threads' copies
        store_w(0, 0);
    }
    __syncthreads();
    const int g = lane >> 2, tq = lane & 3;
    for (int s = 0; s < n_stages; ++s) {
        const int buf = s & 1, abuf = s % NA;
        const bool more = s + 1 < n_stages, new_super = more && (s + 1) % SPS == 0;
        issue(s + AHEAD);  // into activation slot (s - 1) % NA, last read in stage s - 1
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {  // segment kk of the stage: one k32 step
            uint32_t bw[NMAT][(NR + 1) / 2][4];  // n8 tile j: bw[.][j / 2][2 (j % 2)] (bytes 0-15), [.. + 1] (16-31)
            float2 aw[NMAT][NR][SUBS], ncw[NMAT][NR];  // rows (row, row + 1): scales; minus the mins (MIN)
#pragma unroll
            for (int mat = 0; mat < NMAT; ++mat) {
                const int rbase = mat * BR + wr * WRR;
                if (NR == 1) {
                    ldmatrix_x2(bw[mat][0][0], bw[mat][0][1], &sw[buf][rbase + (lane & 7)][kk * SEG + ((lane >> 3) & 1) * 16]);
                } else {
#pragma unroll
                    for (int np = 0; np < NR / 2; ++np)
                        ldmatrix_x4(bw[mat][np], &sw[buf][rbase + np * 16 + (lane & 7) + ((lane >> 4) << 3)]
                                                    [kk * SEG + ((lane >> 3) & 1) * 16]);
                }
#pragma unroll
                for (int nr = 0; nr < NR; ++nr) {
                    const int row = rbase + nr * 8 + 2 * tq;  // rows row, row + 1 of the tile
#pragma unroll
                    for (int h = 0; h < SUBS; ++h) aw[mat][nr][h] = *reinterpret_cast<const float2*>(&swa[buf][SUBS * kk + h][row]);
                    if (MIN) {
                        const float2 cw = *reinterpret_cast<const float2*>(&swc[buf][kk][row]);
                        ncw[mat][nr] = make_float2(-cw.x, -cw.y);
                    }
                }
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                uint32_t af[4];  // rows 0-7 / 8-15 x bytes 0-15 / 16-31
                const int trow = wt * WTT + mt * 16;
                ldmatrix_x4(af, &sa[abuf][trow + (lane & 15)][kk * SEG + (lane >> 4) * 16]);
                const float2 ds_lo = __half22float2(sds[abuf][trow + g][kk]);      // token g: (d, s)
                const float2 ds_hi = __half22float2(sds[abuf][trow + g + 8][kk]);  // token g + 8
                const float nc_lo = -kMagicF * ds_lo.x, nc_hi = -kMagicF * ds_hi.x;  // exact: d is a half
#pragma unroll
                for (int mat = 0; mat < NMAT; ++mat) {
#pragma unroll
                    for (int nr = 0; nr < NR; ++nr) {
                        const uint32_t b0 = bw[mat][nr / 2][2 * (nr % 2)], b1 = bw[mat][nr / 2][2 * (nr % 2) + 1];
                        float (&o)[4] = acc[mat][mt][nr];
                        // The integer dot products start at kMagic, so that each s32 result, read as f32, is
                        // kMagicF + dot exactly (|dot| < 2^22); fma(that, da, -kMagicF * da) = da * dot,
                        // rounded once. No int -> float conversion instructions (quarter rate) on the way.
                        auto scale = [&](const int (&c)[4], float2 a) {
                            o[0] = fmaf(a.x, fmaf(__int_as_float(c[0]), ds_lo.x, nc_lo), o[0]);
                            o[1] = fmaf(a.y, fmaf(__int_as_float(c[1]), ds_lo.x, nc_lo), o[1]);
                            o[2] = fmaf(a.x, fmaf(__int_as_float(c[2]), ds_hi.x, nc_hi), o[2]);
                            o[3] = fmaf(a.y, fmaf(__int_as_float(c[3]), ds_hi.x, nc_hi), o[3]);
                        };
                        if (SUBS == 1) {
                            int c[4] = {kMagic, kMagic, kMagic, kMagic};
                            mma_s8_k32(c, af, b0, b1);
                            scale(c, aw[mat][nr][0]);
                        } else {
                            int c0[4] = {kMagic, kMagic, kMagic, kMagic}, c1[4] = {kMagic, kMagic, kMagic, kMagic};
                            mma_s8_k16(c0, af[0], af[1], b0);
                            mma_s8_k16(c1, af[2], af[3], b1);
                            scale(c0, aw[mat][nr][0]);
                            scale(c1, aw[mat][nr][SUBS - 1]);
                        }
                        if (MIN) {
                            o[0] = fmaf(ncw[mat][nr].x, ds_lo.y, o[0]);
                            o[1] = fmaf(ncw[mat][nr].y, ds_lo.y, o[1]);
                            o[2] = fmaf(ncw[mat][nr].x, ds_hi.y, o[2]);
                            o[3] = fmaf(ncw[mat][nr].y, ds_hi.y, o[3]);
                        }
                    }
                }
            }
        }
        cp_async_wait<AHEAD - 1>();  // stage s + 1's activations (and its raw super-stage)
        if (more) {
            if (new_super) __syncthreads();  // the new raw tile, copied by every thread
            store_w(s + 1, buf ^ 1);
        }
        __syncthreads();
    }

    const bool vec = ((p.d_stride | reinterpret_cast<unsigned long long>(d) / 4) & 1) == 0;
    auto h = [&](int mt, int nr, int i) {  // the output value of accumulator i (EPI > 0: act(gate) * up)
        const float v = acc[0][mt][nr][i];
        if (EPI == 0) return v;
        return (p.mode == 3 ? gelu_tanh(v) : silu(v)) * acc[NMAT - 1][mt][nr][i];
    };
    if constexpr (EPI <= 1) {
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
                    if (row < p.m) put2(col, row, h(mt, nr, 2 * half), h(mt, nr, 2 * half + 1), p, vec);
                }
            }
        }
    } else {
        // h tile [BT][BR] f32 through shared memory (the main loop's buffers are dead after its
        // last barrier), then 8 lanes per 32-row block quantize it (m % 32 == 0, BR % 32 == 0)
        constexpr int LDH = BR + 4;
        float* sh = reinterpret_cast<float*>(smem);
        static_assert(BT * LDH * 4 <= 2 * (kRows + BT) * LDQ, "h tile fits in the int8 tiles");
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int nr = 0; nr < NR; ++nr) {
                    float* o = sh + (wt * WTT + mt * 16 + g + 8 * half) * LDH + wr * WRR + nr * 8 + 2 * tq;
                    *reinterpret_cast<float2*>(o) = make_float2(h(mt, nr, 2 * half), h(mt, nr, 2 * half + 1));
                }
        __syncthreads();
        constexpr int FMT = EPI == 2 ? 0 : 1, BLOCKS = BT * (BR / 32);  // 32-row blocks of the tile
        uint8_t* q = reinterpret_cast<uint8_t*>(d);
        for (int blk0 = 0; blk0 < BLOCKS; blk0 += kThreads / 8) {  // block-uniform: whole warps shuffle
            const int blk = blk0 + tid / 8, j = tid % 8;
            const int tk = blk / (BR / 32), rb = blk % (BR / 32);
            const bool live = blk < BLOCKS && t0 + tk < p.n && r0 + 32 * rb < p.m;
            const float4 v = blk < BLOCKS ? *reinterpret_cast<const float4*>(sh + tk * LDH + 32 * rb + 4 * j)
                                          : make_float4(0.f, 0.f, 0.f, 0.f);
            uint8_t* out = q + (size_t)(live ? t0 + tk : 0) * p.d_stride + (size_t)((r0 + 32 * rb) / 32) * Q8Fmt<FMT>::kBytes;
            q8_store_block<FMT>(v, live ? out : q, j, live);
        }
    }
}
