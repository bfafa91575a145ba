// GGUF weights repacked once, at load, for gemm_wgr's A fragments (MatmulDispatch.pack launches pack_wgr
// below; gemm on the PackedWeight runs gemm_wgr<QT + 100, ...>). Per 128-row tile and 256-element
// super-block, one contiguous chunk of 128 rows x RawWgr::kStride bytes (rows past m and the bytes past a
// row's data zero), chunk (tile, super-block) at (tile * k / 256 + super-block) * 128 * stride: gemm_wgr
// moves a super-stage with one bulk copy. Within a row every lane's share of a stage is contiguous:
//
// Q4_K (QT_Q4_K_WGR, 160 bytes): for stage st = 0..3 (elements 64 st .. 64 st + 63: sub-blocks 2 st,
// 2 st + 1) and lane c = 0..3 of a quad, 8 bytes at 32 st + 8 c hold the 16 quants that lane converts
// (the pairs 8 j + 2 c, 8 j + 2 c + 1 of the stage, j = 0..7) as two words: pair j of word j / 4 in the
// nibbles at bits 4 (j % 4) and 16 + 4 (j % 4). Then, at 128 + 8 st, the two sub-blocks' (s, -m) as f16
// pairs: s = f16(d * sc), m = f16(dmin * mn) (each rounded once), the value f16(q s - m) (one fma). So a
// lane's stage is two 8-byte loads per row and, per pair, a shift, a mask-or into 1024 + q, a
// subtraction and an fma.
// Q4_0, Q5_0, Q8_0 (QT_Q4_0_WGR ..., 272 bytes), Q6_K and Q5_K (QT_Q6_K_WGR, QT_Q5_K_WGR, 288 bytes), one
// byte a quant: at 64 st + 16 c the 16 quants of lane c in stage st (word h: pairs 2 h and 2 h + 1, low
// bytes first); Q4_0, Q5_0 and Q5_K store their 4- or 5-bit q, Q8_0 b ^ 0x80 (b the int8 quant), Q6_K its
// 6-bit q. Then the stage's scales as f16, from 256 + 4 st (the _0 types: d of its two 32-blocks) or 256 +
// 8 st (Q6_K: f16(d * sc) of its four 16-groups; Q5_K: the (s, -m) pairs of its two sub-blocks, as Q4_K's).
// Value (1024 + byte - off) * s in f16 (off 1032, 1040, 1152 or 1056: the exact quant, then one rounding);
// Q5_K f16(q s - m) (one fma).
// cukern.reference.matmul.pack_wgr builds the same bytes (bit for bit) and the values.
#pragma once

#include "matmul/gemm_wgr.cuh"  // included from its end: RawWgr, FragDeq, h2_from_lanes

namespace cukern {

// matmul-private type codes of the packed layouts (QT_ + 100)
constexpr int QT_Q4_0_WGR = 102, QT_Q5_0_WGR = 106, QT_Q8_0_WGR = 108, QT_Q4_K_WGR = 112, QT_Q5_K_WGR = 113,
              QT_Q6_K_WGR = 114;
template <> struct QTraits<QT_Q4_K_WGR> { using Block = uint8_t; static constexpr int kElems = QK_K, kBytes = 160; };
template <> struct QTraits<QT_Q4_0_WGR> { using Block = uint8_t; static constexpr int kElems = QK_K, kBytes = 272; };
template <> struct QTraits<QT_Q5_0_WGR> { using Block = uint8_t; static constexpr int kElems = QK_K, kBytes = 272; };
template <> struct QTraits<QT_Q8_0_WGR> { using Block = uint8_t; static constexpr int kElems = QK_K, kBytes = 272; };
template <> struct QTraits<QT_Q5_K_WGR> { using Block = uint8_t; static constexpr int kElems = QK_K, kBytes = 288; };
template <> struct QTraits<QT_Q6_K_WGR> { using Block = uint8_t; static constexpr int kElems = QK_K, kBytes = 288; };

namespace mm {

// 160 bytes a row: a quad's 32-byte run of each of 8 rows lands on distinct banks (160 = 128 + 32).
template <> struct RawWgr<QT_Q4_K_WGR> { static constexpr int kStride = 160; };
// 320 bytes a row (64 mod 128): the 64-byte runs of two rows a quarter-warp reads fill the 32 banks.
template <> struct RawWgr<QT_Q4_0_WGR> { static constexpr int kStride = 320; };
template <> struct RawWgr<QT_Q5_0_WGR> { static constexpr int kStride = 320; };
template <> struct RawWgr<QT_Q8_0_WGR> { static constexpr int kStride = 320; };
template <> struct RawWgr<QT_Q5_K_WGR> { static constexpr int kStride = 320; };
template <> struct RawWgr<QT_Q6_K_WGR> { static constexpr int kStride = 320; };

template <> struct FragDeq<QT_Q4_K_WGR> {
    struct Raw { uint2 q, s; };
    static CUKERN_DEVICE void load(Raw& r, const uint8_t* row, int st, int c) {
        r.q = *reinterpret_cast<const uint2*>(row + 32 * st + 8 * c);
        r.s = *reinterpret_cast<const uint2*>(row + 128 + 8 * st);
    }
    static CUKERN_DEVICE void convert(uint32_t (&o)[8], const Raw& r, int) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t w = h ? r.q.y : r.q.x, sm = h ? r.s.y : r.s.x;
            const __half2 s2 = __low2half2(as_h2(sm)), nm2 = __high2half2(as_h2(sm));
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const __half2 q = __hsub2(h2_from_lanes((w >> (4 * j)) & 0x000F000Fu), as_h2(0x64006400u));
                o[4 * h + j] = as_u32(__hfma2(q, s2, nm2));
            }
        }
    }
};

// The byte layouts: GROUPS scales per stage (Q8_0 2, Q6_K 4), OFF = 1024 + the byte of quant 0; MIN (Q5_K):
// per sub-block (two a stage) an (s, -m) pair, the value fma(q, s, -m).
template <int GROUPS, uint32_t OFF, bool MIN = false> struct FragDeqPacked8 {
    struct Raw { uint4 q; uint2 s; };
    static CUKERN_DEVICE void load(Raw& r, const uint8_t* row, int st, int c) {
        r.q = *reinterpret_cast<const uint4*>(row + 64 * st + 16 * c);
        if (GROUPS == 2 && !MIN) r.s.x = *reinterpret_cast<const uint32_t*>(row + 256 + 4 * st);
        else r.s = *reinterpret_cast<const uint2*>(row + 256 + 8 * st);
    }
    static CUKERN_DEVICE void convert(uint32_t (&o)[8], const Raw& r, int) {
        const uint32_t k64 = bytes64();
        const uint32_t w[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int h = 0; h < 4; ++h) {  // pairs 2 h, 2 h + 1; scale group (2 h) * GROUPS / 8, MIN: sub-block h / 2
            const int gi = 2 * h * GROUPS / 8;
            const uint32_t sw = (MIN ? h < 2 : gi < 2) ? r.s.x : r.s.y;
            const __half2 s2 = !MIN && gi % 2 ? __high2half2(as_h2(sw)) : __low2half2(as_h2(sw));
            const __half2 nm2 = __high2half2(as_h2(sw));  // MIN only
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const __half2 q = __hsub2(as_h2(e ? spread64<1>(w[h], k64) : spread64<0>(w[h], k64)), as_h2(OFF * 0x10001u));
                o[2 * h + e] = as_u32(MIN ? __hfma2(q, s2, nm2) : __hmul2(q, s2));
            }
        }
    }
};
template <> struct FragDeq<QT_Q4_0_WGR> : FragDeqPacked8<2, 0x6408u> {};
template <> struct FragDeq<QT_Q5_0_WGR> : FragDeqPacked8<2, 0x6410u> {};
template <> struct FragDeq<QT_Q8_0_WGR> : FragDeqPacked8<2, 0x6480u> {};
template <> struct FragDeq<QT_Q6_K_WGR> : FragDeqPacked8<4, 0x6420u> {};
template <> struct FragDeq<QT_Q5_K_WGR> : FragDeqPacked8<2, 0x6400u, true> {};

// ---------------------------------------------------------------------------------------------- packing
// The stored quant (byte or nibble) of element e (0...255) of the GGUF super-block at sb (256 elements:
// eight 32-blocks of the _0 types, one K-quant block), as the packed layout keeps it (Q8_0: the int8's
// byte ^ 0x80).
template <int QT> CUKERN_DEVICE uint32_t packed_quant(const uint8_t* sb, int e) {
    constexpr int E = QTraits<QT>::kElems;
    const auto* b = reinterpret_cast<const typename QTraits<QT>::Block*>(sb + (e / E) * QTraits<QT>::kBytes);
    const uint32_t q = (uint32_t)quant(b, e % E) & 0xFFu;
    return QT == QT_Q8_0 ? q ^ 0x80u : q;
}

// Bytes g (0...) of the scale field: the _0 types' d of block g / 2; Q6_K f16(d sc) of group g / 2; Q4_K and
// Q5_K the (f16(d sc), f16(-dmin m)) pair of sub-block g / 4. Built per 16-bit half h.
template <int QT> CUKERN_DEVICE uint32_t packed_scale_half(const uint8_t* sb, int h) {
    if constexpr (QT == QT_Q4_0 || QT == QT_Q5_0 || QT == QT_Q8_0) {
        const uint8_t* blk = sb + h * QTraits<QT>::kBytes;
        return blk[0] | (uint32_t)blk[1] << 8;
    } else if constexpr (QT == QT_Q4_K || QT == QT_Q5_K) {
        const auto* b = reinterpret_cast<const typename QTraits<QT>::Block*>(sb);
        int sc, mn;
        k4_scale_min(b->scales, h / 2, sc, mn);
        const float d = __half2float(h % 2 ? b->dmin : b->d);
        return __half_as_ushort(__float2half_rn(h % 2 ? -(d * (float)mn) : d * (float)sc));
    } else {  // Q6_K
        const BlockQ6_K* b = reinterpret_cast<const BlockQ6_K*>(sb);
        return __half_as_ushort(__float2half_rn(__half2float(b->d) * (float)b->scales[h]));
    }
}

}  // namespace mm
}  // namespace cukern

// GGUF rows -> the packed layout of QT, tile-major (gemm_wgr's TILED image: per (128-row tile, super-block)
// RawWgr::kStride bytes a row, rows past m and the bytes past a row's data zero). Glu: each tile holds 64
// rows of the gate matrix and the same 64 of the up matrix, interleaved by 8-row groups (tile row r: matrix
// (r / 8) % 2, row 64 tile + 8 (r / 16) + r % 8), the rows gemm_wgr's GLU reads from the GGUF bytes.
// Grid (row tiles, k / 256), 128 threads: one tile row each. One-time work at load; byte loads, word stores.
template <int QT>
__global__ void __launch_bounds__(128) pack_wgr(
    uint8_t* __restrict__ out,       // (row tiles) * (k / 256) * 128 * stride bytes, 16-byte aligned
    const uint8_t* __restrict__ w,   // raw GGUF bytes: m rows (glu: of the gate matrix) from w + w_offset
    const uint8_t* __restrict__ w2,  // glu: the up matrix, m rows from w2 + w2_offset; else unused
    const PackParams p) {
    using namespace cukern;
    using namespace cukern::mm;
    constexpr int PQ = QT + 100, STRIDE = RawWgr<PQ>::kStride, BYTES = QTraits<PQ>::kBytes;
    const uint32_t r = threadIdx.x, sbi = blockIdx.y;
    const bool up = p.glu && ((r >> 3) & 1);
    const uint32_t row = p.glu ? blockIdx.x * 64 + (r >> 4) * 8 + (r & 7) : blockIdx.x * 128 + r;
    uint32_t* dst = reinterpret_cast<uint32_t*>(out + (((size_t)blockIdx.x * gridDim.y + sbi) * 128 + r) * STRIDE);
    if (row >= p.m) {
        for (int i = 0; i < STRIDE / 4; ++i) dst[i] = 0;
        return;
    }
    const uint8_t* sb = (up ? w2 + p.w2_offset : w + p.w_offset) + (size_t)row * p.row_bytes +
                        (size_t)sbi * (QK_K / QTraits<QT>::kElems) * QTraits<QT>::kBytes;
    int o = 0;  // words written
    if constexpr (QT == QT_Q4_K) {
        for (int st = 0; st < 4; ++st)
            for (int c = 0; c < 4; ++c)
                for (int h = 0; h < 2; ++h) {
                    uint32_t word = 0;
                    for (int jj = 0; jj < 4; ++jj) {
                        const int e0 = 64 * st + 8 * (4 * h + jj) + 2 * c;
                        word |= packed_quant<QT>(sb, e0) << (4 * jj) | packed_quant<QT>(sb, e0 + 1) << (16 + 4 * jj);
                    }
                    dst[o++] = word;
                }
    } else {
        for (int st = 0; st < 4; ++st)
            for (int c = 0; c < 4; ++c)
                for (int j = 0; j < 8; j += 2) {
                    const int e0 = 64 * st + 8 * j + 2 * c, e1 = e0 + 8;
                    dst[o++] = packed_quant<QT>(sb, e0) | packed_quant<QT>(sb, e0 + 1) << 8 |
                               packed_quant<QT>(sb, e1) << 16 | packed_quant<QT>(sb, e1 + 1) << 24;
                }
    }
    // the scale field: 16 halves (the K-quants' eight (s, -m) pairs, Q6_K's sixteen scales), the _0 types' 8 d
    constexpr int HALVES = QT == QT_Q4_K || QT == QT_Q5_K || QT == QT_Q6_K ? 16 : 8;
    for (int h = 0; h < HALVES; h += 2) dst[o++] = packed_scale_half<QT>(sb, h) | packed_scale_half<QT>(sb, h + 1) << 16;
    for (; o < STRIDE / 4; ++o) dst[o] = 0;
    static_assert(BYTES <= STRIDE, "row image");
}
