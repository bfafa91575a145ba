// Q4_K repacked for gemm_wgr's A fragments (an experiment: profiling/probe_matmul_packed.py builds
// and times it; no dispatch path uses it yet).
//
// Layout, per row and 256-element super-block (160 bytes): for stage st = 0..3 (elements 64 st ..
// 64 st + 63: sub-blocks 2 st, 2 st + 1) and lane c = 0..3 of a quad, 8 bytes at 32 st + 8 c hold the
// 16 quants that lane converts (the pairs 8 j + 2 c, 8 j + 2 c + 1 of the stage, j = 0..7) as two
// words: pair j of word j / 4 in the nibbles at bits 4 (j % 4) and 16 + 4 (j % 4). Then, at 128 + 8 st,
// the two sub-blocks' (s, -m) as f16 pairs: s = f16(d * sc), m = f16(dmin * mn) (each rounded once),
// the value f16(q s - m) (one fma). So a lane's stage is two 8-byte loads per row and, per pair, a
// shift, a mask-or into 1024 + q, a subtraction and an fma.
// profiling/probe_matmul_packed.py's pack_q4k packs GGUF Q4_K bytes into it and gives the values.
#pragma once

#include "matmul/gemm_wgr.cuh"  // included from its end: RawWgr, FragDeq, h2_from_lanes

namespace cukern {

constexpr int QT_Q4_K_WGR = 112;  // matmul-private type code of the packed layout
template <> struct QTraits<QT_Q4_K_WGR> { using Block = uint8_t; static constexpr int kElems = QK_K, kBytes = 160; };

namespace mm {

// 160 bytes a row: a quad's 32-byte run of each of 8 rows lands on distinct banks (160 = 128 + 32).
template <> struct RawWgr<QT_Q4_K_WGR> { static constexpr int kStride = 160; };

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

}  // namespace mm
}  // namespace cukern
