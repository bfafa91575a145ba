// GGUF weights repacked for gemm_wgr's A fragments (an experiment: profiling/probe_matmul_packed.py packs,
// checks and times them; no dispatch path uses them yet). Three layouts, each per row and 256-element
// super-block, every lane's share of a stage contiguous:
//
// Q4_K (QT_Q4_K_WGR), per row and 256-element super-block (160 bytes): for stage st = 0..3 (elements 64 st ..
// 64 st + 63: sub-blocks 2 st, 2 st + 1) and lane c = 0..3 of a quad, 8 bytes at 32 st + 8 c hold the
// 16 quants that lane converts (the pairs 8 j + 2 c, 8 j + 2 c + 1 of the stage, j = 0..7) as two
// words: pair j of word j / 4 in the nibbles at bits 4 (j % 4) and 16 + 4 (j % 4). Then, at 128 + 8 st,
// the two sub-blocks' (s, -m) as f16 pairs: s = f16(d * sc), m = f16(dmin * mn) (each rounded once),
// the value f16(q s - m) (one fma). So a lane's stage is two 8-byte loads per row and, per pair, a
// shift, a mask-or into 1024 + q, a subtraction and an fma.
// profiling/probe_matmul_packed.py's pack_q4k packs GGUF Q4_K bytes into it and gives the values.
// Q5_0, Q8_0 (QT_Q5_0_WGR, QT_Q8_0_WGR, 272 bytes) and Q6_K (QT_Q6_K_WGR, 288 bytes), one byte a quant: at
// 64 st + 16 c the 16 quants of lane c in stage st (word h: pairs 2 h and 2 h + 1, low bytes first); Q5_0
// stores its 5-bit q, Q8_0 b ^ 0x80 (b the int8 quant), Q6_K its 6-bit q. Then the stage's scales as f16,
// from 256 + 4 st (Q5_0, Q8_0: d of its two 32-blocks) or 256 + 8 st (Q6_K: f16(d * sc) of its four
// 16-groups). Value (1024 + byte - off) * s in f16 (off 1040, 1152 or 1056: the exact quant, then one
// rounding).
#pragma once

#include "matmul/gemm_wgr.cuh"  // included from its end: RawWgr, FragDeq, h2_from_lanes

namespace cukern {

// matmul-private type codes of the packed layouts (QT_ + 100)
constexpr int QT_Q5_0_WGR = 106, QT_Q8_0_WGR = 108, QT_Q4_K_WGR = 112, QT_Q6_K_WGR = 114;
template <> struct QTraits<QT_Q4_K_WGR> { using Block = uint8_t; static constexpr int kElems = QK_K, kBytes = 160; };
template <> struct QTraits<QT_Q5_0_WGR> { using Block = uint8_t; static constexpr int kElems = QK_K, kBytes = 272; };
template <> struct QTraits<QT_Q8_0_WGR> { using Block = uint8_t; static constexpr int kElems = QK_K, kBytes = 272; };
template <> struct QTraits<QT_Q6_K_WGR> { using Block = uint8_t; static constexpr int kElems = QK_K, kBytes = 288; };

namespace mm {

// 160 bytes a row: a quad's 32-byte run of each of 8 rows lands on distinct banks (160 = 128 + 32).
template <> struct RawWgr<QT_Q4_K_WGR> { static constexpr int kStride = 160; };
// 320 bytes a row (64 mod 128): the 64-byte runs of two rows a quarter-warp reads fill the 32 banks.
template <> struct RawWgr<QT_Q5_0_WGR> { static constexpr int kStride = 320; };
template <> struct RawWgr<QT_Q8_0_WGR> { static constexpr int kStride = 320; };
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

// The byte layouts: GROUPS scales per stage (Q8_0 2, Q6_K 4), OFF = 1024 + the byte of quant 0.
template <int GROUPS, uint32_t OFF> struct FragDeqPacked8 {
    struct Raw { uint4 q; uint2 s; };
    static CUKERN_DEVICE void load(Raw& r, const uint8_t* row, int st, int c) {
        r.q = *reinterpret_cast<const uint4*>(row + 64 * st + 16 * c);
        if (GROUPS == 2) r.s.x = *reinterpret_cast<const uint32_t*>(row + 256 + 4 * st);
        else r.s = *reinterpret_cast<const uint2*>(row + 256 + 8 * st);
    }
    static CUKERN_DEVICE void convert(uint32_t (&o)[8], const Raw& r, int) {
        const uint32_t k64 = bytes64();
        const uint32_t w[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int h = 0; h < 4; ++h) {  // pairs 2 h, 2 h + 1; scale group (2 h) * GROUPS / 8
            const int gi = 2 * h * GROUPS / 8;
            const uint32_t sw = gi < 2 ? r.s.x : r.s.y;
            const __half2 s2 = gi % 2 ? __high2half2(as_h2(sw)) : __low2half2(as_h2(sw));
            o[2 * h] = as_u32(__hmul2(__hsub2(as_h2(spread64<0>(w[h], k64)), as_h2(OFF * 0x10001u)), s2));
            o[2 * h + 1] = as_u32(__hmul2(__hsub2(as_h2(spread64<1>(w[h], k64)), as_h2(OFF * 0x10001u)), s2));
        }
    }
};
template <> struct FragDeq<QT_Q5_0_WGR> : FragDeqPacked8<2, 0x6410u> {};
template <> struct FragDeq<QT_Q8_0_WGR> : FragDeqPacked8<2, 0x6480u> {};
template <> struct FragDeq<QT_Q6_K_WGR> : FragDeqPacked8<4, 0x6420u> {};

}  // namespace mm
}  // namespace cukern
