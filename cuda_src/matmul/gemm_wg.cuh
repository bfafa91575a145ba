// gemm_wg: D = W B for N token columns on Hopper's warpgroup tensor cores (wgmma, sm_90a only;
// other targets compile a stub that traps, and the host never launches it there).
//
// Roles: wgmma's A operand (M = 64 weight rows per warpgroup) is the weight tile, its B operand
// (N) a slice of the activation tile, both K-major in shared memory, f32 accumulators in
// registers. CTA: WGS warpgroups (2 or 4) over 128 weight rows x BT tokens (128 or 256); warpgroup
// g multiplies rows 64 (g % 2) .. + 63 by the tokens of slice g / 2 (TW = 2 BT / WGS tokens, in
// pieces of PN = min(TW, 128): one m64nPNk16 per piece and 16 elements of K). A thread's
// accumulator quad j of piece h is (rows R, R+8) x (tokens 2 (lane % 4) + 8 j + PN h + 0, 1 of
// its slice), R = 64 (g % 2) + 16 (warp % 4) + lane / 4. One CTA per SM.
// The fused gate+up GEMM interleaves the two matrices by 8-row groups (tile row r: matrix
// (r / 8) % 2, output row 8 (r / 16) + r % 8), so that a thread's rows R and R+8 are the gate
// and up values of one output: 64 outputs per CTA, no exchange.
//
// K runs in 64-element stages; per stage t:
//   * activations: 16-byte cp.async of the BT x 64 f16 tile into stage buffer t % S (S stages:
//     4 at BT = 128, 3 at BT = 256), issued S-1 stages ahead;
//   * weights: the raw GGUF bytes of each 256-element super-stage (gemm.cuh's copy_raw, two
//     buffers, issued three stages before first use), dequantized to f16 (dequant_tile.cuh) into
//     W buffer t % 3 one stage ahead of its MMA (every thread one or two half segments);
//   * the MMA of stage t runs asynchronously while the threads dequantize stage t+1; a thread
//     waits for the MMA of stage t-1 (and one barrier) before anyone overwrites what stage t-2 read.
// Shared tiles use wgmma's non-swizzled layout: 8x8 "core matrices" of 8 rows x 16 bytes stored
// contiguously, (row, 8-element chunk c) at (row / 8) * 1024 + c * 128 + (row % 8) * 16 bytes:
// conflict-free 16-byte stores when 8 consecutive lanes take 8 consecutive rows of one chunk.
// Raw rows are an odd number of 16-byte units apart (Q6_K padded from 224 to 240 bytes), so the
// dequantizing lanes (consecutive rows) spread over all bank groups.
// Ragged M/N, K tails and split K as in gemm_f16 (gemm.cuh).
#pragma once

#include "matmul/gemm.cuh"

namespace cukern {
namespace mm {

// Profiling only (profiling/probe_matmul_wg.py builds variants): skip parts of the work to see what
// limits the kernel. 1: dequantization, 2: raw weight copies, 4: activation copies, 8: the MMAs.
#ifndef CUKERN_WG_SKIP
#define CUKERN_WG_SKIP 0
#endif

constexpr int kWgWBufs = 3;                      // f16 weight tiles (dequantized one stage ahead)
constexpr uint32_t kTileBytes = BK * 2;          // bytes per row of a 64-element f16 stage tile
constexpr uint32_t kCoreLBO = 128, kCoreSBO = 1024;  // next core matrix along K, along M / N

template <int BT> struct WgCfg {
    static constexpr int kStages = BT >= 256 ? 3 : 4;  // activation stages that fit beside the rest
};

// Shared bytes per raw row: Raw<QT>::kStride made an odd number of 16-byte units.
template <int QT> struct RawWg {
    static constexpr int kStride = Raw<QT>::kStride + ((Raw<QT>::kStride / 16) % 2 ? 0 : 16);
};

// Dynamic shared memory of gemm_wg<., BT, ., .>: activation stages, f16 weight tiles, two raw
// super-stages (raw_stride = RawWg<QT>::kStride).
__host__ __device__ constexpr uint32_t gemm_wg_smem_bytes(int bt, int stages, int raw_stride) {
    return (uint32_t)stages * bt * kTileBytes + kWgWBufs * kRows * kTileBytes + 2u * kRows * raw_stride;
}

// Byte offset of (row, 8-element chunk) in a core-matrix tile.
CUKERN_DEVICE uint32_t core_off(int row, int chunk) { return (row >> 3) * kCoreSBO + chunk * kCoreLBO + (row & 7) * 16; }

// Shared-memory matrix descriptor of a non-swizzled K-major operand starting at saddr.
CUKERN_DEVICE uint64_t wg_desc(uint32_t saddr) {
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | (uint64_t)(kCoreLBO >> 4) << 16 | (uint64_t)(kCoreSBO >> 4) << 32;
}

CUKERN_DEVICE void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
CUKERN_DEVICE void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
CUKERN_DEVICE void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Generic-proxy writes of shared memory (stores, cp.async) made visible to the async proxy (wgmma).
CUKERN_DEVICE void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Orders a register against the asm around it: accumulators are read only after wg_wait.
CUKERN_DEVICE void wg_pin(float& x) { asm volatile("" : "+f"(x)::"memory"); }

// d += A B: A 64x16 (desc_a), B 16xN (desc_b), both K-major f16 in shared memory; d: N / 2 f32.
template <int N> struct Wgmma;
template <> struct Wgmma<64> {
    static CUKERN_DEVICE void run(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "l"(desc_a), "l"(desc_b), "r"(1));
    }
};
template <> struct Wgmma<128> {
    static CUKERN_DEVICE void run(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "l"(desc_a), "l"(desc_b), "r"(1));
    }
};

// One output of the epilogue: plain store, accumulate (mode 1) or atomic add (split K).
CUKERN_DEVICE void put1(float* o, float v, const GemmParams& p) {
    if (p.atomic) atomicAdd(o, v);
    else *o = p.mode == 1 ? *o + v : v;
}

}  // namespace mm
}  // namespace cukern

template <int QT, int BT, bool GLU, int WGS>
__global__ void __launch_bounds__(WGS * 128, 1) gemm_wg(
    float* __restrict__ d,             // [n, d_stride] f32 out: d[c * d_stride + r], r < m
    const uint8_t* __restrict__ w,     // raw GGUF bytes: W (glu: gate) = m rows from w + w_offset
    const uint8_t* __restrict__ w2,    // glu: the up matrix, m rows from w2 + w2_offset; else unused
    const __half* __restrict__ b,      // [n, b_stride] f16 columns, 16-byte aligned rows, k used
    const GemmParams p) {              // dynamic shared memory: gemm_wg_smem_bytes(BT, WgCfg<BT>::kStages, RawWg<QT>::kStride)
    using namespace cukern;
    using namespace cukern::mm;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int NT = WGS * 128;                                    // threads
    constexpr int S = WgCfg<BT>::kStages, RSTRIDE = RawWg<QT>::kStride, SPS = SUPER / BK;
    constexpr int TW = 2 * BT / WGS, PN = TW < 128 ? TW : 128, NP = TW / PN;  // tokens per warpgroup, per wgmma
    constexpr int UPT = 4 * kRows / NT;                              // half segments per thread and stage
    constexpr uint32_t ACT_BYTES = BT * kTileBytes, W_BYTES = kRows * kTileBytes, RAW_BYTES = kRows * RSTRIDE;
    static_assert((WGS == 2 || WGS == 4) && BT % 128 == 0 && (BT * 8) % NT == 0 && UPT >= 1, "tiling");

    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t* sact = smem;                        // [S][BT rows x 64 elements], core-matrix layout
    uint8_t* sw = smem + S * ACT_BYTES;          // [3][128 rows x 64 elements], core-matrix layout
    uint8_t* sraw = sw + kWgWBufs * W_BYTES;     // [2][kRows][RSTRIDE]
    if (threadIdx.x == 0 && dynamic_smem_size() < gemm_wg_smem_bytes(BT, S, RSTRIDE)) __trap();

    const int tid = threadIdx.x, wg = tid / 128;
    const uint32_t t0 = blockIdx.x * BT, r0 = blockIdx.y * (GLU ? kRows / 2 : kRows);
    const uint32_t kbeg = blockIdx.z * p.k_split, kend = min(p.k, kbeg + p.k_split);
    const uint32_t n_segs = (kend - kbeg) / SEG;
    const int n_stages = (int)((n_segs + 1) / 2), n_super = (int)((kend - kbeg + SUPER - 1) / SUPER);

    auto rowptr = [&](int row) {  // row of the tile -> its raw GGUF row (past m: row m-1)
        const int mat = GLU ? (row >> 3) & 1 : 0, out = GLU ? (row >> 4) * 8 + (row & 7) : row;
        const uint32_t grow = min(r0 + out, p.m - 1);
        return (mat ? w2 + p.w2_offset : w + p.w_offset) + (size_t)grow * p.row_bytes;
    };
    uint32_t lead0 = 0, lead1 = 0;  // copy_raw's lead of the super-stage in raw buffer 0 / 1
    auto load_raw = [&](int s) {
        if (s >= n_super || (CUKERN_WG_SKIP & 2)) return;
        const uint32_t e0 = kbeg + SUPER * s, nel = min((uint32_t)SUPER, kend - e0);
        const uint32_t lead = copy_raw<RSTRIDE, NT>(sraw + (s & 1) * RAW_BYTES, rowptr,
                                                    e0 / QTraits<QT>::kElems * QTraits<QT>::kBytes,
                                                    nel / QTraits<QT>::kElems * QTraits<QT>::kBytes, p.raw16 != 0, false);
        (s & 1 ? lead1 : lead0) = lead;
    };
    // this thread's dequantization units: row drow, half segments u = tid / 128 + i * WGS of the
    // stage's four (segment u / 2, part u % 2); a warp's lanes take 32 consecutive rows
    const int drow = tid % 128;
    auto dequant = [&](int t) {  // stage t of the split -> W buffer t % 3
        if (CUKERN_WG_SKIP & 1) return;
        const int s = t / SPS;
        const uint8_t* myraw = sraw + (s & 1) * RAW_BYTES + drow * RSTRIDE + (s & 1 ? lead1 : lead0);
        uint8_t* tile = sw + (t % kWgWBufs) * W_BYTES;
        typename Deq<QT>::Raw r[UPT];
#pragma unroll
        for (int i = 0; i < UPT; ++i) {  // all loads first: independent, in flight together
            const int u = wg + i * WGS;
            if (2 * t + u / 2 < (int)n_segs) Deq<QT>::load(r[i], myraw, (2 * t + u / 2) % (SUPER / SEG), u % 2);
        }
#pragma unroll
        for (int i = 0; i < UPT; ++i) {
            const int u = wg + i * WGS, seg = u / 2, part = u % 2;
            if (2 * t + seg < (int)n_segs) {
                Deq<QT>::emit(r[i], [&](int e, uint4 v) { *reinterpret_cast<uint4*>(tile + core_off(drow, 4 * seg + e / 8)) = v; },
                              part);
            } else {  // K tail: the two parts zero the segment's four chunks
                *reinterpret_cast<uint4*>(tile + core_off(drow, 4 * seg + 2 * part)) = make_uint4(0, 0, 0, 0);
                *reinterpret_cast<uint4*>(tile + core_off(drow, 4 * seg + 2 * part + 1)) = make_uint4(0, 0, 0, 0);
            }
        }
    };
    // activation chunk c of a stage: tokens 8 (c / 64) + c % 8, chunk (c / 8) % 8: eight lanes
    // store one core-matrix row set (128 contiguous bytes) and read 16 bytes of eight tokens
    auto issue_act = [&](int t) {
        if (t >= n_stages || (CUKERN_WG_SKIP & 4)) return;
        uint8_t* dst = sact + (t % S) * ACT_BYTES;
#pragma unroll
        for (int i = 0; i < BT * 8 / NT; ++i) {
            const int c = tid + i * NT, tk = (c & 7) + 8 * (c >> 6), ch = (c >> 3) & 7;
            const uint32_t tok = t0 + tk, kel = t * BK + ch * 8;  // element within the split
            const bool ok = tok < p.n && kel < n_segs * SEG;
            cp_async16(dst + core_off(tk, ch), ok ? b + (size_t)tok * p.b_stride + kbeg + kel : b, ok ? 16u : 0u);
        }
    };

    float acc[NP][PN / 2];
#pragma unroll
    for (int h = 0; h < NP; ++h)
#pragma unroll
        for (int i = 0; i < PN / 2; ++i) acc[h][i] = 0.0f;

    // prologue: raw super-stage 0 and activation stages 0 .. S-2, one group each; W stage 0
    load_raw(0);
    issue_act(0);
    cp_async_commit();
#pragma unroll
    for (int j = 1; j <= S - 2; ++j) {
        issue_act(j);
        cp_async_commit();
    }
    cp_async_wait<S - 2>();
    __syncthreads();  // raw bytes copied by other threads
    if (n_stages > 0) dequant(0);
    fence_async_smem();
    __syncthreads();

    const uint32_t sw_a = smem_addr(sw) + (wg % 2) * (64 / 8) * kCoreSBO;          // this warpgroup's 64 rows
    const uint32_t sact_a = smem_addr(sact) + (wg / 2) * (TW / 8) * kCoreSBO;      // and its token slice
    for (int t = 0; t < n_stages; ++t) {
        wg_fence();
        const uint32_t a0 = sw_a + (t % kWgWBufs) * W_BYTES, b0 = sact_a + (t % S) * ACT_BYTES;
#pragma unroll
        for (int kk = 0; kk < BK / 16 * !(CUKERN_WG_SKIP & 8); ++kk)
#pragma unroll
            for (int h = 0; h < NP; ++h)
                Wgmma<PN>::run(acc[h], wg_desc(a0 + kk * 2 * kCoreLBO), wg_desc(b0 + h * (PN / 8) * kCoreSBO + kk * 2 * kCoreLBO));
        wg_commit();
        wg_wait<1>();  // stage t-1's MMA is done: its activation stage and stage t-2's W tile are free
        if (t + 1 < n_stages) dequant(t + 1);
        cp_async_wait<S - 3>();  // activation stage t+1 (and the raw super-stage of stage t+3)
        fence_async_smem();
        __syncthreads();
        if (t % SPS == 0) load_raw(t / SPS + 1);  // its buffer was last read by stage t-1's dequant
        issue_act(t + S - 1);                      // into the buffer stage t-1 read
        cp_async_commit();
    }
    wg_wait<0>();
#pragma unroll
    for (int h = 0; h < NP; ++h)
#pragma unroll
        for (int i = 0; i < PN / 2; ++i) wg_pin(acc[h][i]);

    // epilogue: quad j of piece h = rows (R, R+8) x tokens (tc, tc+1)
    const int lane = tid % 32, R = 64 * (wg % 2) + 16 * ((tid % 128) / 32) + lane / 4;
#pragma unroll
    for (int h = 0; h < NP; ++h) {
#pragma unroll
        for (int j = 0; j < PN / 8; ++j) {
            const uint32_t tc = t0 + (wg / 2) * TW + PN * h + 8 * j + 2 * (lane % 4);
            const float* q = &acc[h][4 * j];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const uint32_t tok = tc + e;
                if (tok >= p.n) continue;
                float* col = d + (size_t)tok * p.d_stride;
                if (GLU) {
                    const uint32_t row = r0 + (R >> 4) * 8 + (R & 7);
                    if (row < p.m) col[row] = (p.mode == 3 ? gelu_tanh(q[e]) : silu(q[e])) * q[2 + e];
                } else {
                    if (r0 + R < p.m) put1(col + r0 + R, q[e], p);
                    if (r0 + R + 8 < p.m) put1(col + r0 + R + 8, q[2 + e], p);
                }
            }
        }
    }
#else
    __trap();  // sm_90a only
#endif
}
