// MXFP4 weight tiles for the f16 tensor-core GEMMs (dequant_tile.cuh's Deq<QT> interface).
//
// Block (17 bytes, 1-byte aligned): u8 e (E8M0 scale 2^(e-127)), u8 qs[16]; element i < 16 is the
// low nibble of qs[i], element 16 + i the high nibble, each an FP4 E2M1 code. Part p of a segment
// holds qs[8p..8p+7]: elements 8p..8p+7 (low nibbles) and 16+8p..16+8p+7 (high), as Q4_0.
// Each value is exact in f16 for e in [104, 140] (2 * E2M1 * 2^(e-128) on f16 subnormal steps and
// below 65504); smaller scales round away low bits or to zero, larger ones overflow to inf.
#pragma once

#include "common/quants.cuh"
#include "matmul/dequant_tile.cuh"

namespace cukern {
namespace mm {

template <> struct Deq<QT_MXFP4> {
    struct Raw { uint32_t q0, q1, e; };
    static CUKERN_DEVICE uint32_t ld_u32_a1(const uint8_t* p) {
        return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    }
    static CUKERN_DEVICE void load(Raw& r, const uint8_t* row, uint32_t kb, int p) {
        const uint8_t* blk = row + (size_t)kb * 17;
        r.e = blk[0];
        r.q0 = ld_u32_a1(blk + 1 + 8 * p);
        r.q1 = ld_u32_a1(blk + 5 + 8 * p);
    }
    // four nibbles (one per byte of v, bits 0-3) -> mxfp4_lookup4_biased's 16-bit selector
    static CUKERN_DEVICE uint32_t sel4(uint32_t v) {
        return (v & 0xFu) | ((v >> 4) & 0xF0u) | ((v >> 8) & 0xF00u) | ((v >> 12) & 0xF000u);
    }
    // 8 values of nibble half NIB: bytes 128 + 2 * E2M1, then a * (byte - 128), a = 2^(e-128)
    template <int NIB>
    static CUKERN_DEVICE uint4 eight(const Raw& r, float a) {
        const uint2 lo = affine4(mxfp4_lookup4_biased(sel4((r.q0 >> (4 * NIB)) & 0x0F0F0F0Fu)), a, 128.0f * a);
        const uint2 hi = affine4(mxfp4_lookup4_biased(sel4((r.q1 >> (4 * NIB)) & 0x0F0F0F0Fu)), a, 128.0f * a);
        return make_uint4(lo.x, lo.y, hi.x, hi.y);
    }
    static CUKERN_DEVICE void store(const Raw& r, __half* seg, int p) {
        emit(r, [seg](int e, uint4 v) { st16(seg + e, v); }, p);
    }
    template <class Put>
    static CUKERN_DEVICE void emit(const Raw& r, Put put, int p) {
        const float a = e8m0_to_float_half(r.e);
        put(8 * p, eight<0>(r, a));
        put(16 + 8 * p, eight<1>(r, a));
    }
};

}  // namespace mm
}  // namespace cukern
