// gemm_wgs (experiment, profiling/probe_matmul_wgs.py only): D = W B on Hopper wgmma with the weight
// dequantized by warpgroups of its own into shared memory, both operands read by wgmma from there
// (SS), so that the conversion runs beside the MMAs instead of in the warps that issue them
// (gemm_wgr's consumers are latency-bound on it). Q8_0 only, k % 64 == 0, no K split, no GLU.
//
// CTA: three warpgroups (168 registers each: ptxas compiles a kernel to its launch bounds whatever
// setmaxnreg says later, and 128 accumulators need more than a 512-thread CTA's 128), 128 weight rows
// x BN tokens.
//   * warpgroup 0 (dequantizer): copies each stage's raw rows (68 bytes of Q8_0 each) into a ring of
//     three raw slots by 4-byte cp.async two stages ahead (thread i: words i, i + 128, ... of the
//     stage, so a warp's copies are contiguous runs of rows; rows 17 words apart: no bank conflicts
//     when thread r then reads row r), converts row r's 64 elements and stores them as eight 16-byte
//     chunks in the 128-byte swizzled K-major layout (chunk c of row r at c ^ (r % 8), the layout the
//     copy engine writes for the activations); thread 0 also issues the activation stages (TMA);
//   * warpgroups 1, 2 (consumers): rows 64c .. 64c+63; per 64-element stage four m64nBNk16 from the
//     A slot (their 64 rows) and the activation slot.
// Barriers: full_act (copy engine bytes), empty_act (8 consumer warps), full_a (128 dequantizer
// threads, each after a proxy fence: wgmma reads through the async proxy), empty_a (8 consumer warps).
#pragma once

#include "common/mbarrier.cuh"
#include "common/wgmma.cuh"
#include "matmul/gemm.cuh"
#include "matmul/gemm_wgr.cuh"
#include "common/sync.cuh"

#ifndef CUKERN_WGS_SKIP
#define CUKERN_WGS_SKIP 0  // 1: no conversion (constants stored); 2: the dequantizers only hand slots over
                           // (no copies, loads, stores); 4: the consumers do not wait for the A slots
#endif

namespace cukern {
namespace mm {

constexpr int kWgsThreads = 384, kWgsSA = 4, kWgsSB = 4;
constexpr uint32_t kWgsABytes = kRows * 128;  // one A stage: 128 rows x 64 halves
constexpr int kWgsRawWords = 17, kWgsRawStride = 17, kWgsRawSlots = 3;  // Q8_0 stage row: 17 words (odd)
constexpr uint32_t kWgsRawBytes = kRows * kWgsRawStride * 4;

__host__ __device__ constexpr uint32_t gemm_wgs_smem_bytes(int bn) {
    return 1024u + kWgsSB * (uint32_t)bn * 128u + kWgsSA * kWgsABytes + kWgsRawSlots * kWgsRawBytes +
           2u * (kWgsSA + kWgsSB) * 8u;
}

CUKERN_DEVICE void cp_async4(uint32_t smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem), "l"(gmem));
}

// Q8_0: a row's stage t is blocks 2t, 2t+1, 68 bytes: 17 words when the row is 4-byte aligned, block
// 0's d in bytes 0-1 and quants in 2-33, block 1's d in 34-35 and quants in 36-67.
struct WgsQ8_0 {
    struct Raw { uint32_t w[17]; };
    static CUKERN_DEVICE void load(Raw& r, const uint32_t* row) {  // row: the stage's words in shared memory
#pragma unroll
        for (int i = 0; i < 17; ++i) r.w[i] = row[i];
    }
    // chunk c (elements 8c .. 8c+7 of the stage) as four f16 pairs
    static CUKERN_DEVICE void convert(uint4 (&o)[8], const Raw& r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const __half2 d2 = h2_low(h ? r.w[8] >> 16 : r.w[0]);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                uint32_t f[4];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int i = 2 * c + e;  // quant word i of block h
                    const uint32_t q = h ? r.w[9 + i] : __funnelshift_r(r.w[i], r.w[i + 1], 16);
                    f[2 * e] = h_scaled(lanes2<0>(q) ^ 0x64806480u, 0x64806480u, d2);
                    f[2 * e + 1] = h_scaled(lanes2<1>(q) ^ 0x64806480u, 0x64806480u, d2);
                }
                o[4 * h + c] = make_uint4(f[0], f[1], f[2], f[3]);
            }
        }
    }
};

}  // namespace mm
}  // namespace cukern

template <int QT, int BN>
__global__ void __launch_bounds__(cukern::mm::kWgsThreads, 1) gemm_wgs(
    float* __restrict__ d,             // [n, d_stride] f32 out
    const uint8_t* __restrict__ w,     // raw Q8_0 rows (4-byte aligned) from w + w_offset
    const __grid_constant__ cukern::TensorMap tb,  // B: f16 [n, b_stride], box 64 x BN, 128-byte swizzle
    const GemmParams p) {              // dynamic shared memory: gemm_wgs_smem_bytes(BN)
    using namespace cukern;
    using namespace cukern::mm;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(QT == QT_Q8_0, "experiment: Q8_0 only");
    using Deq = WgsQ8_0;
    constexpr int SA = kWgsSA, SB = kWgsSB;
    constexpr uint32_t ACT_BYTES = BN * kTileBytes;
    extern __shared__ __align__(16) uint8_t smem_raw[];
    uint8_t* smem = smem_raw + ((1024u - smem_addr(smem_raw) % 1024u) % 1024u);
    uint8_t* sact = smem;                 // [SB][BN x 128 bytes]
    uint8_t* sa = sact + SB * ACT_BYTES;  // [SA][128 x 128 bytes]
    uint8_t* sraw = sa + SA * kWgsABytes;  // [kWgsRawSlots][128 rows x kWgsRawStride words]
    uint64_t* bars = reinterpret_cast<uint64_t*>(sraw + kWgsRawSlots * kWgsRawBytes);
    uint64_t *full_act = bars, *empty_act = bars + SB, *full_a = bars + 2 * SB, *empty_a = bars + 2 * SB + SA;
    if (threadIdx.x == 0 && dynamic_smem_size() < gemm_wgs_smem_bytes(BN)) __trap();

    const int tid = threadIdx.x, wg = tid / 128;
    const uint32_t t0 = blockIdx.x * BN, r0 = blockIdx.y * kRows;
    const int n_stages = (int)(p.k / BK);
    if (tid == 0) {
        for (int i = 0; i < SB; ++i) mbar_init(full_act + i, 1), mbar_init(empty_act + i, 8);
        for (int i = 0; i < SA; ++i) mbar_init(full_a + i, 128), mbar_init(empty_a + i, 8);
        mbar_init_fence();
        tma_prefetch_map(&tb);
    }
    __syncthreads();

    if (wg == 0) {  // ------------------------------------------------------------ dequantizer
        const int j = tid, row = tid;
        uint8_t* dst_row = sa + row * 128;
        // this thread's words of a stage: word g = i * 128 + j of the 128 x 17, row g / 17, word g % 17
        const uint8_t* wbase = w + p.w_offset;
        uint32_t goff[kWgsRawWords], soff[kWgsRawWords];
#pragma unroll
        for (int i = 0; i < kWgsRawWords; ++i) {
            const uint32_t g = i * 128 + j, r = g / kWgsRawWords, x = g % kWgsRawWords;
            goff[i] = min(r0 + r, p.m - 1) * (uint32_t)p.row_bytes + 4 * x;  // (rows of a CTA: < 4 GB)
            soff[i] = smem_addr(sraw) + 4 * (r * kWgsRawStride + x);
        }
        const uint8_t* cta_w = wbase + (size_t)0;
        auto copy = [&](int t) {  // stage t's raw rows into slot t % 3
            if (t < n_stages) {
                const uint32_t so = (t % kWgsRawSlots) * kWgsRawBytes;
#pragma unroll
                for (int i = 0; i < kWgsRawWords; ++i) cp_async4(soff[i] + so, cta_w + goff[i] + 68u * t);
            }
            cp_async_commit();
        };
        if (!(CUKERN_WGS_SKIP & 2)) copy(0), copy(1);
        for (int t = 0; t < n_stages; ++t) {
            if (j == 0) {  // the activation stage t
                const int slot = t % SB;
                if (t >= SB) mbar_wait(empty_act + slot, ((t / SB) - 1) & 1);
                mbar_arrive_expect(full_act + slot, ACT_BYTES);
                tma_load_2d(sact + slot * ACT_BYTES, &tb, (int32_t)(BK * t), (int32_t)t0, full_act + slot);
            }
            const int slot = t % SA;
            if (CUKERN_WGS_SKIP & 2) {
                if (t >= SA) mbar_wait(empty_a + slot, ((t / SA) - 1) & 1);
                mbar_arrive(full_a + slot);
                continue;
            }
            cp_async_wait<1>();      // this thread's copies of stage t are done
            named_bar_sync(1, 128);  // everyone's are visible, and everyone is done with stage t - 1's slot
            copy(t + 2);
            typename Deq::Raw raw;
            Deq::load(raw, reinterpret_cast<const uint32_t*>(sraw + (t % kWgsRawSlots) * kWgsRawBytes) + row * kWgsRawStride);
            if (t >= SA) mbar_wait(empty_a + slot, ((t / SA) - 1) & 1);
            uint4 o[8];
            if (CUKERN_WGS_SKIP & 1) {
#pragma unroll
                for (int c = 0; c < 8; ++c) o[c] = make_uint4(raw.w[2 * c] & 0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u);
            } else {
                Deq::convert(o, raw);
            }
            uint8_t* dst = dst_row + slot * kWgsABytes;
#pragma unroll
            for (int c = 0; c < 8; ++c) *reinterpret_cast<uint4*>(dst + ((c ^ (row & 7)) << 4)) = o[c];
            wg::fence_async_smem();
            mbar_arrive(full_a + slot);
        }
        cp_async_wait<0>();
        return;
    }

    // ------------------------------------------------------------------------------ consumers
    const int cw = wg - 1, lane = tid % 32, warp = (tid % 128) / 32, c = lane % 4;
    const int R = 64 * cw + 16 * warp + lane / 4;
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
    for (int t = 0; t < n_stages; ++t) {
        const int sb = t % SB, sl = t % SA;
        mbar_wait(full_act + sb, (t / SB) & 1);
        if (!(CUKERN_WGS_SKIP & 4)) mbar_wait(full_a + sl, (t / SA) & 1);
        wg::fence();
        const uint64_t db = act_desc(smem_addr(sact + sb * ACT_BYTES));
        const uint64_t da = act_desc(smem_addr(sa + sl * kWgsABytes + cw * 64 * 128));
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) wg::MmaSsK<BN>::run(acc, da + 2 * kk, db + 2 * kk);
        wg::commit();
        wg::wait<1>();  // stage t-1's MMAs are done: its slots are free
        if (t >= 1) {
            __syncwarp();
            if (lane == 0) mbar_arrive(empty_act + (t - 1) % SB), mbar_arrive(empty_a + (t - 1) % SA);
        }
    }
    wg::wait<0>();
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) wg::pin(acc[i]);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const uint32_t tc = t0 + 8 * j + 2 * c;
        const float* q = &acc[4 * j];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const uint32_t tok = tc + e;
            if (tok >= p.n) continue;
            float* col = d + (size_t)tok * p.d_stride;
            if (r0 + R < p.m) col[r0 + R] = q[e];
            if (r0 + R + 8 < p.m) col[r0 + R + 8] = q[2 + e];
        }
    }
#else
    __trap();  // sm_90a only
#endif
}
