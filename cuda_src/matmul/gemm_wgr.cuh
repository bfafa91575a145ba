// gemm_wgr: D = W B for N token columns on Hopper's warpgroup tensor cores (wgmma, sm_90a only;
// other targets compile a stub that traps, and the host never launches it there), with the weight
// operand dequantized straight into registers.
//
// Roles: wgmma's A operand (64 weight rows per instruction) comes from registers, its B operand (BN
// tokens, 128 or 256) from shared memory, f32 accumulators in registers. CTA: three warpgroups,
// 128 weight rows x BN tokens, one CTA per SM:
//   * warpgroup 0, the producer (40 registers per thread after setmaxnreg): its thread 0 loads each
//     64-element stage of the activation tile with the tensor copy engine (a TMA box of 64 x BN f16,
//     128-byte swizzle, out-of-range elements zero-filled) into a ring of 4 (BN 256) to 6 (BN 128) slots
//     (gemm_wgr_stages); warps 1-3 copy the raw GGUF bytes of each 256-element super-stage of the
//     128 rows (gemm.cuh's copy_raw: 16-byte cp.async, or 2-byte copies for rows that are not
//     16-byte aligned) into a ring of two raw slots (a third measured no faster); on packed weights
//     (packed_wgr.cuh, type codes >= 100, stored tile-major) warp 1's lane 0 alone moves each
//     super-stage with one bulk copy;
//   * warpgroups 1 and 2, the consumers (232 registers): consumer c multiplies rows 64c .. 64c+63 by
//     the BN tokens. Per stage t it issues four m64nBNk16 (A: register set t % 3, B: the swizzled
//     slot) and, once wgmma.wait has retired stage t-2's MMAs, converts stage t+1's raw registers
//     into that set and loads stage t+2's raw bytes (FragDeq::load, ::convert): two stages of MMAs
//     in flight per consumer while it dequantizes.
// Full/empty mbarriers hand each slot over: full_act by the copy engine's byte count, full_raw by
// the raw copiers' arrivals (count 96; cp.async arrivals when the rows are 16-byte aligned),
// empty_act by one arrival per consumer warp once wgmma.wait has retired the stage's MMAs (count 8),
// empty_raw by every consumer thread after its last shared-memory read of the super-stage (count
// 256: each thread's own release orders its reads before the slot is refilled).
//
// A fragments (wgmma m64k16, f16, per warp w of the consumer, g = lane / 4, c = lane % 4): rows
// R = 16w + g and R + 8; registers (R, 2c..2c+1), (R+8, 2c..), (R, 2c+8..), (R+8, 2c+8..). Over a
// 64-element stage a lane therefore holds the element pairs 8j + 2c, j = 0..7, of its two rows:
// FragDeq<QT> produces exactly those 8 f16 pairs per row from the raw bytes in f16 arithmetic on
// exact integer quants: _0 types (q - offset) times d, rounded once (the values dequantize_f16
// writes); K-quants with one rounding more (the note above spread64).
// Raw rows are an odd number of 16-byte units apart (RawWgr), so the 8 rows x 4 lanes of a warp's
// 2-byte raw loads hit distinct banks.
// Epilogue: where the host passes a tensor map of d (p.d_tma: d's base and row stride 16-byte aligned),
// the consumers write the f32 tile into the activation ring (free once every MMA has retired) in the
// map's 128-byte swizzle and one thread per consumer issues tensor stores of 32-row boxes (reduce-add
// for accumulate and split K); the block exits once the copy engine has read them, so its writes drain
// while the next block on the SM fills its pipeline. Otherwise each lane stores its values (put1).
// Ragged M (rows past m read row m-1, never stored), ragged N (zero-filled tokens, never stored) and
// split K (blockIdx.z slices of whole super-stages, atomics) as in gemm_f16. A K tail (k % 64 = 32:
// the last stage's second segment lies past k) needs no masking: the copy engine zero-fills the
// activations there and the raw bytes past the row's end are zeros (copy_raw), so A is 0 x 0. The
// fused GLU interleaves gate and up rows by 8-row groups (tile row r: matrix (r / 8) % 2, output row
// 8 (r / 16) + r % 8), so rows R and R+8 of a lane are the gate and up of one output.
// Measurements (what limits it, each change's effect) and the designs not kept: docs/notes/matmul.md.
#pragma once

#include "common/mbarrier.cuh"
#include "common/sync.cuh"
#include "common/wgmma.cuh"
#include "matmul/gemm.cuh"

namespace cukern {
namespace mm {

constexpr uint32_t kTileBytes = BK * 2;  // bytes per token row of a 64-element f16 activation stage
constexpr uint32_t kWgrSmemLimit = 227 * 1024;  // dynamic shared memory one block may opt in to (sm_90)
constexpr int kWgrMaxStages = 6;
constexpr uint32_t kWgrMaxRingBytes = 128 * 1024;  // activation ring: 4 slots at 256 tokens, 6 at 128
constexpr int kWgrThreads = 384;     // producer + two consumer warpgroups
constexpr int kWgrRawThreads = 96;   // producer warps 1-3 copy the raw super-stages
constexpr int kWgrProducerRegs = 40, kWgrConsumerRegs = 232;

// Dynamic shared memory of gemm_wgr with `stages` activation slots: 1 KB of alignment slack
// (swizzled slots sit on 1 KB boundaries), the activation ring, two raw super-stages (raw_stride =
// RawWgr<QT>::kStride), the barriers.
__host__ __device__ constexpr uint32_t gemm_wgr_smem_bytes(int bn, int raw_stride, int stages) {
    return 1024u + (uint32_t)stages * bn * kTileBytes + 2u * kRows * raw_stride + 2u * (stages + 2) * 8u;
}
// Activation slots: as many as fit beside the raw ring, at most 6 and 128 KB. Example: 256 tokens take
// 32 KB a slot, so 4 (a fifth, which fits beside most raw rings, measured slower or equal:
// docs/notes/matmul.md); 128 tokens take 16 KB, so 6.
__host__ __device__ constexpr int gemm_wgr_stages(int bn, int raw_stride) {
    int s = kWgrMaxStages;
    while (s > 2 && (gemm_wgr_smem_bytes(bn, raw_stride, s) > kWgrSmemLimit ||
                     (uint32_t)s * bn * kTileBytes > kWgrMaxRingBytes))
        --s;
    return s;
}

// Shared bytes per raw row: Raw<QT>::kStride made an odd number of 16-byte units, so that the 8
// rows x 4 lanes of a warp's 2-byte fragment loads hit distinct banks (Q6_K: 224 -> 240).
template <int QT> struct RawWgr {
    static constexpr int kStride = Raw<QT>::kStride + ((Raw<QT>::kStride / 16) % 2 ? 0 : 16);
};

// wgmma B descriptor of an activation slot: K-major, 128-byte swizzle, 8-row groups 1 KB apart.
CUKERN_DEVICE uint64_t act_desc(uint32_t saddr) { return wg::desc(saddr, 16, 1024, 1); }

// One output of the epilogue: plain store, accumulate (mode 1) or atomic add (split K).
CUKERN_DEVICE void put1(float* o, float v, const GemmParams& p) {
    if (p.atomic) atomicAdd(o, v);
    else *o = p.mode == 1 ? *o + v : v;
}

// ---------------------------------------------------------------------------- A fragments
// FragDeq<QT>: the 8 f16 pairs of one weight row that a lane (quad position c) holds in stage st
// (0..3: elements 64 st .. 64 st + 63) of a 256-element super-stage, o[j] = elements (8j + 2c,
// 8j + 2c + 1) of the stage, in two steps so that the shared-memory loads of the next stage can be
// in flight while this one converts: load(r, row, st, c) reads the raw bytes (row: the
// super-stage's first byte in shared memory; 2-byte reads, the K4/K5 headers 16-byte reads) into
// registers, convert(o, r, st) turns them into halves.
// The half in the low 16 bits of `bits`, in both lanes (a register-operand select, no instruction).
CUKERN_DEVICE __half2 h2_low(uint32_t bits) { return __low2half2(as_h2(bits)); }
// ((lanes | 0x6400) - off) * d: lanes < 1024 hold quants, off = 1024 + the format's zero point.
CUKERN_DEVICE uint32_t q_scaled(uint32_t lanes, uint32_t off, __half2 d2) {
    return as_u32(__hmul2(__hsub2(h2_from_lanes(lanes), as_h2(off)), d2));
}
// The same from halves already 1024 + quant.
CUKERN_DEVICE uint32_t h_scaled(uint32_t h, uint32_t off, __half2 d2) {
    return as_u32(__hmul2(__hsub2(as_h2(h), as_h2(off)), d2));
}

template <int QT> struct FragDeq;

// The 32-element blocks: the stage is blocks 2 st and 2 st + 1 (h = 0, 1).
template <> struct FragDeq<QT_Q8_0> {
    struct Raw { uint32_t d[2], q[2][4]; };
    static CUKERN_DEVICE void load(Raw& r, const uint8_t* row, int st, int c) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint8_t* blk = row + (2 * st + h) * 34;
            r.d[h] = ld_u16(blk);
#pragma unroll
            for (int j = 0; j < 4; ++j) r.q[h][j] = ld_u16(blk + 2 + 8 * j + 2 * c);
        }
    }
    static CUKERN_DEVICE void convert(uint32_t (&o)[8], const Raw& r, int) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < 4; ++j)  // signed byte b -> lanes 0x64 | (b ^ 0x80) = half 1152 + b
                o[4 * h + j] = h_scaled(lanes2<0>(r.q[h][j]) ^ 0x64806480u, 0x64806480u, h2_low(r.d[h]));
    }
};

// Q4_0 / Q5_0: element e < 16 is the low nibble of qs[e], e >= 16 the high nibble of qs[e - 16];
// Q5_0 (HIGH) adds bit e of qh as the fifth bit. Value d * (q - 8) or d * (q - 16).
template <bool HIGH> struct FragDeqQ0 {
    static constexpr int kBlock = HIGH ? 22 : 18, kQs = HIGH ? 6 : 2;
    static constexpr uint32_t kOff = HIGH ? 0x64106410u : 0x64086408u;  // 1024 + the zero point
    struct Raw { uint32_t d[2], qh[2], q[2][2]; };  // qh shifted by 2c: bit e is element 2c + e's
    static CUKERN_DEVICE void load(Raw& r, const uint8_t* row, int st, int c) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint8_t* blk = row + (2 * st + h) * kBlock;
            r.d[h] = ld_u16(blk);
            if (HIGH) r.qh[h] = ld_u32_a2(blk + 2) >> (2 * c);
            r.q[h][0] = ld_u16(blk + kQs + 2 * c);
            r.q[h][1] = ld_u16(blk + kQs + 8 + 2 * c);
        }
    }
    static CUKERN_DEVICE void convert(uint32_t (&o)[8], const Raw& r, int) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const __half2 d2 = h2_low(r.d[h]);
            const uint32_t l0 = lanes2<0>(r.q[h][0]), l1 = lanes2<0>(r.q[h][1]);
            // the bits each pair of halves has beside its nibbles: 0x6400 (1024) and, Q5_0, bit 8k of qh
            // at bit 4 of lane 0 and bit 8k + 1 at bit 4 of lane 1 (pair k: elements 8k + 2c, + 1), taken
            // as byte k of qh << 4 and of qh << 3 side by side by one permute (its other bytes masked)
            const uint32_t qh4 = r.qh[h] << 4, qh3 = r.qh[h] << 3;
            uint32_t hi[4];
#pragma unroll
            for (int k = 0; k < 4; ++k)
                hi[k] = HIGH ? (__byte_perm(qh4, qh3, 0x4400u + 0x1111u * k) & 0x00100010u) | 0x64006400u : 0x64006400u;
            o[4 * h + 0] = h_scaled((l0 & 0x000F000Fu) | hi[0], kOff, d2);
            o[4 * h + 1] = h_scaled((l1 & 0x000F000Fu) | hi[1], kOff, d2);
            o[4 * h + 2] = h_scaled(((l0 >> 4) & 0x000F000Fu) | hi[2], kOff, d2);
            o[4 * h + 3] = h_scaled(((l1 >> 4) & 0x000F000Fu) | hi[3], kOff, d2);
        }
    }
};
template <> struct FragDeq<QT_Q4_0> : FragDeqQ0<false> {};
template <> struct FragDeq<QT_Q5_0> : FragDeqQ0<true> {};

// K-quants in f16 arithmetic on exact integers. Q4_K / Q5_K: x = sc * q exactly (fma(1024 + q, sc,
// -1024 sc), at most 63 * 31 < 2048; high nibbles in place as 1024 + 16 q against sc / 16), then
// fma(x, d, hi(-c)) + lo(-c) with c = d_min * m split into two halves (hi its f16 rounding, lo the
// f16 rounding of the rest): two roundings where dequantize_f16 has one. Q6_K: (q - 32) exactly,
// then fma(q - 32, hi(a), (q - 32) lo(a)) with a = d * sc split the same way.
// cukern.reference.matmul.wgr_values is this arithmetic in float64.

// a * b as two halves, hi = f16(a b) and lo = f16(a b - hi) (the FMA's exact residual rounded
// once): for a b exact in f32, the values of its f32 split, without conversions.
CUKERN_DEVICE __half2 split_product(__half2 a, __half2 b, __half2& lo) {
    const __half2 hi = __hmul2(a, b);
    lo = __hfma2(a, b, __hneg2(hi));
    return hi;
}

// 0x64646464, the bytes spread64 puts above each quant, as a value the compiler cannot fold (threadIdx.y
// is 0: blocks are 1-D): as a constant, with spread64's selector a second one, SASS moved one of them into
// a register before every permute (Q6_K: 16 moves per warp and stage).
CUKERN_DEVICE uint32_t bytes64() { return 0x64646464u | threadIdx.y; }

// [0x64, b1, 0x64, b0]: bytes 0 and 1 of x (HI: bytes 2 and 3) as the f16 pair 1024 + b; k64: bytes64().
template <int HI = 0> CUKERN_DEVICE uint32_t spread64(uint32_t x, uint32_t k64) {
    return __byte_perm(x, k64, HI ? 0x5342 : 0x5140);
}

// Q4_K / Q5_K: stage st holds sub-blocks 2 st (low nibbles of qs[32 st + l]) and 2 st + 1 (high
// nibbles); Q5_K's fifth bits are bits 2 st and 2 st + 1 of qh[l]; l = 8j + 2c, 8j + 2c + 1.
template <bool HIGH> struct FragDeqK45 {
    static constexpr int kQs = HIGH ? 48 : 16;
    struct Raw { uint4 head; uint32_t q[4], h[4]; };
    static CUKERN_DEVICE void load(Raw& r, const uint8_t* row, int st, int c) {
        r.head = *reinterpret_cast<const uint4*>(row);  // d, dmin, scales[12]
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            r.q[j] = ld_u16(row + kQs + 32 * st + 8 * j + 2 * c);
            if (HIGH) r.h[j] = ld_u16(row + 16 + 8 * j + 2 * c);
        }
    }
    static CUKERN_DEVICE void convert(uint32_t (&o)[8], const Raw& r, int st) {
        // the 6-bit scales and mins of sub-blocks 2 st, 2 st + 1 from the header (d, dmin, 12 scale
        // bytes) as byte pairs (k4_scale_min's rule for both at once, no branch)
        const uint32_t k64 = bytes64();
        const int sh = 16 * (st & 1);
        const uint32_t w0 = (r.head.y >> sh) & 0xFFFFu, w1 = (r.head.z >> sh) & 0xFFFFu, w2 = (r.head.w >> sh) & 0xFFFFu;
        const uint32_t scp = st >= 2 ? (w2 & 0x0F0Fu) | ((w0 >> 2) & 0x3030u) : w0 & 0x3F3Fu;
        const uint32_t mp = st >= 2 ? ((w2 >> 4) & 0x0F0Fu) | ((w1 >> 2) & 0x3030u) : w1 & 0x3F3Fu;
        // (sc_2st, sc_2st+1 / 16) and -1024 times them, exact; -c split into two halves
        const __half2 sc = __hmul2(__hsub2(as_h2(spread64(scp, k64)), as_h2(0x64006400u)), __floats2half2_rn(1.0f, 0.0625f));
        // c = dmin * m split into halves (split_product)
        const __half2 m2 = __hsub2(as_h2(spread64(mp, k64)), as_h2(0x64006400u)), dmin2 = __high2half2(as_h2(r.head.x));
        __half2 c_lo;
        const __half2 c_hi = split_product(dmin2, m2, c_lo);
        const __half2 nc_hi = __hneg2(c_hi), nc_lo = __hneg2(c_lo);
        const __half2 sc_off = __hmul2(sc, __float2half2_rn(-1024.0f)), d2 = h2_low(r.head.x);
        // sub-block s (0: low nibbles, 1: high nibbles) of halves h = 1024 + q (1024 + 16 q)
        auto value = [&](uint32_t h, int s) {
            const __half2 x = __hfma2(as_h2(h), s ? __high2half2(sc) : __low2half2(sc),
                                      s ? __high2half2(sc_off) : __low2half2(sc_off));
            const __half2 v = __hfma2(x, d2, s ? __high2half2(nc_hi) : __low2half2(nc_hi));
            return as_u32(__hadd2(v, s ? __high2half2(nc_lo) : __low2half2(nc_lo)));
        };
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t t = spread64(r.q[j], k64);
            uint32_t lo = t & 0xFF0FFF0Fu, hi = t & 0xFFF0FFF0u;
            if (HIGH) {  // the fifth bits: 16 (low), 16 * 16 (high)
                const uint32_t th = lanes2<0>(r.h[j] >> (2 * st));
                lo |= (th & 0x00010001u) << 4;
                hi |= (th & 0x00020002u) << 7;
            }
            o[j] = value(lo, 0);
            o[4 + j] = value(hi, 1);
        }
    }
};
template <> struct FragDeq<QT_Q4_K> : FragDeqK45<false> {};
template <> struct FragDeq<QT_Q5_K> : FragDeqK45<true> {};

// Q6_K: half h = st / 2 of the super-block; stage elements e < 32 are quants ql[64h + e] and
// e >= 32 are ql[64h + e] (same byte index, second 32), low nibbles in even stages and high nibbles
// in odd ones, two bits of qh[32h + e % 32] each (shift 0/2 in even stages, 4/6 in odd ones), and
// four int8 scales (scales[8h + 4 (st % 2) + 2 (e >= 32) + (e % 32) / 16]) times d; a (q - 32).
template <> struct FragDeq<QT_Q6_K> {
    struct Raw { uint32_t d, sc, qh[4], q0[4], q1[4]; };
    static CUKERN_DEVICE void load(Raw& r, const uint8_t* row, int st, int c) {
        const int h = st >> 1;
        r.d = ld_u16(row + 208);
        r.sc = ld_u32_a2(row + 192 + 4 * st);  // scales 8 h + 4 (st % 2) .. + 3
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int l = 8 * j + 2 * c;
            r.qh[j] = ld_u16(row + 128 + 32 * h + l);
            r.q0[j] = ld_u16(row + 64 * h + l);
            r.q1[j] = ld_u16(row + 64 * h + 32 + l);
        }
    }
    static CUKERN_DEVICE void convert(uint32_t (&o)[8], const Raw& r, int st) {
        const uint32_t k64 = bytes64();
        const int sh = 4 * (st & 1);
        // the four scales a = d * sc split into halves two at a time (split_product), the int8 sc
        // exact as halves (byte b -> 0x64 | (b ^ 0x80) = 1152 + b)
        const __half2 d2 = h2_low(r.d);
        __half2 hi[2], lo[2];
        hi[0] = split_product(d2, __hsub2(as_h2(lanes2<0>(r.sc) ^ 0x64806480u), as_h2(0x64806480u)), lo[0]);
        hi[1] = split_product(d2, __hsub2(as_h2(lanes2<1>(r.sc) ^ 0x64806480u), as_h2(0x64806480u)), lo[1]);
        // halves 1024 + q: (q - 32) exactly, then fma(q - 32, hi(a), (q - 32) lo(a)) with scale i
        auto value = [&](uint32_t h, int i) {
            const __half2 q = __hsub2(as_h2(h), as_h2(0x64206420u));
            const __half2 ah = i & 1 ? __high2half2(hi[i / 2]) : __low2half2(hi[i / 2]);
            const __half2 al = i & 1 ? __high2half2(lo[i / 2]) : __low2half2(lo[i / 2]);
            return as_u32(__hfma2(q, ah, __hmul2(q, al)));
        };
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // both quant words at once: bytes 0, 1 from ql (q0), 2, 3 from ql + 32 (q1)
            const uint32_t q = __byte_perm(r.q0[j], r.q1[j], 0x5410);
            const uint32_t h = __byte_perm(r.qh[j], r.qh[j] >> 2, 0x5410);  // their two high bits at sh, sh + 1
            const uint32_t v = ((q >> sh) & 0x0F0F0F0Fu) | ((h >> sh) & 0x03030303u) << 4;
            o[j] = value(spread64<0>(v, k64), j / 2);
            o[4 + j] = value(spread64<1>(v, k64), 2 + j / 2);
        }
    }
};

}  // namespace mm
}  // namespace cukern

#include "matmul/packed_wgr.cuh"  // the packed layouts' RawWgr / FragDeq (type codes >= 100), pack_wgr

template <int QT, int BN, bool GLU>
__global__ void __launch_bounds__(cukern::mm::kWgrThreads, 1) gemm_wgr(
    float* __restrict__ d,             // [n, d_stride] f32 out: d[c * d_stride + r], r < m
    const uint8_t* __restrict__ w,     // raw GGUF bytes: W (glu: gate) = m rows from w + w_offset; packed (QT >=
                                       // 100): pack_wgr's image (glu: of both matrices), from w + w_offset
    const uint8_t* __restrict__ w2,    // glu on GGUF bytes: the up matrix, m rows from w2 + w2_offset; else unused
    const __grid_constant__ cukern::TensorMap tb,  // B: f16 [n, b_stride] as a 2-D map (k, n), box 64 x BN, 128-byte swizzle
    const __grid_constant__ cukern::TensorMap td,  // p.d_tma: D f32 [n, d_stride] as a 2-D map (m, n), box 32 x BN, 128-byte swizzle
    const GemmParams p) {              // dynamic shared memory: gemm_wgr_smem_bytes(BN, RawWgr<QT>::kStride, stages)
    using namespace cukern;
    using namespace cukern::mm;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int RSTRIDE = RawWgr<QT>::kStride, S = gemm_wgr_stages(BN, RSTRIDE), SPS = SUPER / BK;
    constexpr uint32_t ACT_BYTES = BN * kTileBytes, RAW_BYTES = kRows * RSTRIDE;
    // packed layouts, tile-major: the 128 rows x 256 elements of a super-stage are one RAW_BYTES chunk (row
    // stride RSTRIDE, rows past m zero), chunk (row tile, super-block) at (row tile * k / 256 + super-block)
    // * RAW_BYTES: one bulk copy each
    constexpr bool TILED = QT >= 100;
    static_assert(BN == 128 || BN == 256, "token tile");

    extern __shared__ __align__(16) uint8_t smem_raw[];
    uint8_t* smem = smem_raw + ((1024u - smem_addr(smem_raw) % 1024u) % 1024u);  // swizzle atoms: 1 KB aligned
    uint8_t* sact = smem;                          // [S][BN rows x 128 bytes], 128-byte swizzle
    uint8_t* sraw = sact + S * ACT_BYTES;          // [2][kRows][RSTRIDE]
    uint64_t* bars = reinterpret_cast<uint64_t*>(sraw + 2 * RAW_BYTES);
    uint64_t *full_act = bars, *empty_act = bars + S, *full_raw = bars + 2 * S, *empty_raw = bars + 2 * S + 2;
    if (threadIdx.x == 0 && dynamic_smem_size() < gemm_wgr_smem_bytes(BN, RSTRIDE, S)) __trap();

    const int tid = threadIdx.x, wg = tid / 128;
    const uint32_t t0 = blockIdx.x * BN, r0 = blockIdx.y * (GLU ? kRows / 2 : kRows);
    const uint32_t kbeg = blockIdx.z * p.k_split, kend = min(p.k, kbeg + p.k_split);
    const uint32_t n_segs = (kend - kbeg) / SEG;
    const int n_stages = (int)((n_segs + 1) / 2), n_super = (n_stages + SPS - 1) / SPS;
    // byte offset of super-stage s in a raw row (copy_raw's lead there: its value % 16)
    auto raw_off = [&](int s) { return (kbeg + SUPER * s) / QTraits<QT>::kElems * QTraits<QT>::kBytes; };

    if (tid == 0) {
        for (int i = 0; i < S; ++i) mbar_init(full_act + i, 1), mbar_init(empty_act + i, 8);
        for (int i = 0; i < 2; ++i) mbar_init(full_raw + i, TILED ? 1 : kWgrRawThreads), mbar_init(empty_raw + i, 256);
        mbar_init_fence();
        tma_prefetch_map(&tb);
    }
    __syncthreads();

    if (wg == 0) {  // ------------------------------------------------------------ producer
        wg::setmaxnreg_dec<kWgrProducerRegs>();
        auto rowptr = [&](int row) {  // row of the tile -> its raw GGUF row (past m: row m-1)
            const int mat = GLU ? (row >> 3) & 1 : 0, out = GLU ? (row >> 4) * 8 + (row & 7) : row;
            const uint32_t grow = min(r0 + out, p.m - 1);
            return (mat ? w2 + p.w2_offset : w + p.w_offset) + (size_t)grow * p.row_bytes;
        };
        if (tid < 32) {  // warp 0: the activation stages (lane 0 issues them)
            if (tid == 0) {
                for (int t = 0; t < n_stages; ++t) {
                    const int slot = t % S;
                    if (t >= S) mbar_wait(empty_act + slot, ((t / S) - 1) & 1);
                    mbar_arrive_expect(full_act + slot, ACT_BYTES);
                    tma_load_2d(sact + slot * ACT_BYTES, &tb, (int32_t)(kbeg + BK * t), (int32_t)t0, full_act + slot);
                }
            }
            return;
        }
        if (TILED) {  // warp 1's lane 0: one bulk copy per super-stage
            if (tid == 32) {
                const uint8_t* chunk = w + p.w_offset + ((size_t)blockIdx.y * (p.k / SUPER) + kbeg / SUPER) * RAW_BYTES;
                for (int s = 0; s < n_super; ++s) {
                    const int slot = s & 1;
                    if (s >= 2) mbar_wait(empty_raw + slot, ((s >> 1) - 1) & 1);
                    mbar_arrive_expect(full_raw + slot, RAW_BYTES);
                    bulk_copy(sraw + slot * RAW_BYTES, chunk + (size_t)s * RAW_BYTES, RAW_BYTES, full_raw + slot);
                }
            }
            return;
        }
        for (int s = 0; s < n_super; ++s) {  // warps 1-3: the raw super-stages
            const int slot = s & 1;
            if (s >= 2) mbar_wait(empty_raw + slot, ((s >> 1) - 1) & 1);
            const uint32_t e0 = kbeg + SUPER * s, nel = min((uint32_t)SUPER, kend - e0);
            copy_raw<RSTRIDE, kWgrRawThreads>(sraw + slot * RAW_BYTES, rowptr, raw_off(s),
                                              nel / QTraits<QT>::kElems * QTraits<QT>::kBytes, p.raw16 != 0, false,
                                              tid - 32);
            if (p.raw16) mbar_arrive_cp_async(full_raw + slot);
            else mbar_arrive(full_raw + slot);
        }
        cp_async_commit();
        cp_async_wait<0>();  // nothing of this thread's still in flight when it exits
        return;
    }

    // ------------------------------------------------------------------------------ consumers
    wg::setmaxnreg_inc<kWgrConsumerRegs>();
    const int cw = wg - 1, lane = tid % 32, warp = (tid % 128) / 32, c = lane % 4;
    const int R = 64 * cw + 16 * warp + lane / 4;  // this lane's rows R, R + 8 of the tile
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;

    // Raw bytes of stage t (both rows) into registers; the raw slot is released after the last
    // stage of its super-stage has been loaded
    using Frag = FragDeq<QT>;
    auto load = [&](int t, typename Frag::Raw (&r)[2]) {
        const int s = t / SPS, st = t % SPS;
        if (st == 0) mbar_wait(full_raw + (s & 1), (s >> 1) & 1);
        const uint8_t* base = sraw + (s & 1) * RAW_BYTES + raw_off(s) % 16;
        Frag::load(r[0], base + R * RSTRIDE, st, c);
        Frag::load(r[1], base + (R + 8) * RSTRIDE, st, c);
        if (st == SPS - 1 || t == n_stages - 1) mbar_arrive(empty_raw + (s & 1));  // this thread's last read of the slot
    };
    // A fragments of stage t from its raw registers: a[4 kk + i] = register i of k step kk
    auto convert = [&](int t, const typename Frag::Raw (&r)[2], uint32_t (&a)[16]) {
        uint32_t x0[8], x1[8];
        Frag::convert(x0, r[0], t % SPS);
        Frag::convert(x1, r[1], t % SPS);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            a[4 * (j / 2) + 2 * (j % 2)] = x0[j];
            a[4 * (j / 2) + 2 * (j % 2) + 1] = x1[j];
        }
    };
    // stage t's MMAs from register set a (stage t % 3's); then, with stage t-2's MMAs done, release
    // its activation slot, convert stage t+1 (raw registers loaded one step ago) into its register
    // set b, and load stage t+2's raw bytes
    typename Frag::Raw raw[2];
    auto step = [&](int t, uint32_t (&a)[16], uint32_t (&b)[16]) {
        const int slot = t % S;
        mbar_wait(full_act + slot, (t / S) & 1);
        wg::fence();
        const uint64_t desc = act_desc(smem_addr(sact + slot * ACT_BYTES));
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)  // k step kk: 32 bytes on, 2 in the address field
            wg::MmaRsK<BN>::run(acc, a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3], desc + 2 * kk);
        wg::commit();
        wg::wait<2>();  // stage t-2's MMAs are done: its slot and register set (b) are free
#pragma unroll
        for (int i = 0; i < 16; ++i) wg::pin(b[i]);
        if (t >= 2) {
            __syncwarp();
            if (lane == 0) mbar_arrive(empty_act + (t - 2) % S);
        }
        if (t + 1 < n_stages) convert(t + 1, raw, b);
        if (t + 2 < n_stages) load(t + 2, raw);
    };

    uint32_t f0[16], f1[16], f2[16];
    load(0, raw);
    convert(0, raw, f0);
    if (n_stages > 1) load(1, raw);
    int t = 0;
    for (; t + 2 < n_stages; t += 3) {
        step(t, f0, f1);
        step(t + 1, f1, f2);
        step(t + 2, f2, f0);
    }
    if (t < n_stages) step(t, f0, f1);
    if (t + 1 < n_stages) step(t + 1, f1, f2);
    wg::wait<0>();
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) wg::pin(acc[i]);
#pragma unroll
    for (int i = 0; i < 16; ++i) wg::pin(f0[i]), wg::pin(f1[i]), wg::pin(f2[i]);

    // epilogue: quad j = rows (R, R+8) x tokens (tc, tc+1)
    if (p.d_tma) {
        // through shared memory and the copy engine: the tile's outputs into the activation ring (free
        // once both consumers' MMAs have retired) as boxes of 32 rows x BN tokens in the map's 128-byte
        // swizzle (conflict-free: a warp's 32 values fall in 8 distinct 16-byte chunks x 4 words), then
        // one tensor store (reduce-add for accumulate and split K) per box. The block may exit once the
        // copy engine has read the boxes, while its writes drain: the next block's fill overlaps them.
        constexpr int OUT_ROWS = GLU ? kRows / 2 : kRows;
        static_assert(OUT_ROWS * BN * 4 <= S * ACT_BYTES, "the output tile fits the activation ring");
        named_bar_sync(1, 256);
        auto put_s = [&](int r, int tok, float v) {  // tile row r, token tok of the tile
            uint8_t* box = sact + (r / 32) * (BN * 128);
            const int rr = r % 32;
            *reinterpret_cast<float*>(box + tok * 128 + ((((rr >> 2) ^ (tok & 7)) << 4) | ((rr & 3) << 2))) = v;
        };
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const float* q = &acc[4 * j];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int tok = 8 * j + 2 * c + e;
                if (GLU) {
                    put_s((R >> 4) * 8 + (R & 7), tok, (p.mode == 3 ? gelu_tanh(q[e]) : silu(q[e])) * q[2 + e]);
                } else {
                    put_s(R, tok, q[e]);
                    put_s(R + 8, tok, q[2 + e]);
                }
            }
        }
        wg::fence_async_smem();
        named_bar_sync(2 + cw, 128);  // this consumer's boxes: GLU box cw, else boxes 2 cw, 2 cw + 1
        if (tid % 128 == 0) {
            const bool add = p.mode == 1 || p.atomic;
#pragma unroll
            for (int b = GLU ? cw : 2 * cw; b < (GLU ? cw + 1 : 2 * cw + 2); ++b) {
                const void* box = sact + b * (BN * 128);
                const int32_t row = (int32_t)r0 + 32 * b;
                if (add) tma_store_2d<true>(&td, box, row, (int32_t)t0);
                else tma_store_2d<false>(&td, box, row, (int32_t)t0);
            }
            bulk_commit();
            bulk_wait_read();
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const uint32_t tc = t0 + 8 * j + 2 * c;
        const float* q = &acc[4 * j];
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
#else
    __trap();  // sm_90a only
#endif
}
