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
    const Q8Quarter b = q8_1_quantize_quarter(v);
    if (!live) return;
    uint16_t* qs = reinterpret_cast<uint16_t*>(blk + Q8Fmt<FMT>::kQs + 4 * j);  // Q8_0 blocks: 2-byte aligned
    qs[0] = (uint16_t)(b.packed & 0xFFFF);
    qs[1] = (uint16_t)(b.packed >> 16);
    if (j == 0) {
        if (FMT == 0) *reinterpret_cast<__half2*>(blk) = __floats2half2_rn(b.d, b.d * (float)b.sum);
        else *reinterpret_cast<__half*>(blk) = __float2half_rn(b.d);
    }
}

}  // namespace mm
}  // namespace cukern
