// Quantize one 32-value block held by 8 consecutive lanes (4 values each) and store it as a
// Q8_1 (FMT 0: common/q8_1.cuh, 36 bytes) or Q8_0 (FMT 1: half d, int8 qs[32], 34 bytes, 2-byte
// aligned) block. All 32 lanes of the warp must call it (shuffles); `live` lanes store.
#pragma once

#include "common/q8_1.cuh"

namespace cukern {
namespace mm {

template <int FMT> struct Q8Fmt {
    static constexpr int kBytes = FMT == 0 ? Q8_1_BLOCK_BYTES : 34, kQs = FMT == 0 ? 4 : 2;  // block size, qs offset
};

// v: values 4j..4j+3 of the block (j = lane % 8); blk: the block's first byte
template <int FMT>
CUKERN_DEVICE void q8_store_block(float4 v, uint8_t* blk, int j, bool live) {
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float dd = amax / 127.0f;
    const float inv_d = dd > 0.f ? 1.0f / dd : 0.0f;
    const int q0 = q8_1_quantize(v.x, inv_d), q1 = q8_1_quantize(v.y, inv_d);
    const int q2 = q8_1_quantize(v.z, inv_d), q3 = q8_1_quantize(v.w, inv_d);
    int sum = q0 + q1 + q2 + q3;
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (!live) return;
    const uint32_t packed = (uint32_t)(q0 & 0xff) | ((uint32_t)(q1 & 0xff) << 8) |
                            ((uint32_t)(q2 & 0xff) << 16) | ((uint32_t)(q3 & 0xff) << 24);
    uint16_t* qs = reinterpret_cast<uint16_t*>(blk + Q8Fmt<FMT>::kQs + 4 * j);
    qs[0] = (uint16_t)(packed & 0xFFFF);
    qs[1] = (uint16_t)(packed >> 16);
    if (j == 0) {
        if (FMT == 0) *reinterpret_cast<__half2*>(blk) = __floats2half2_rn(dd, dd * (float)sum);
        else *reinterpret_cast<__half*>(blk) = __float2half_rn(dd);
    }
}

}  // namespace mm
}  // namespace cukern
