// Q8_1 activations: the int8 input of the quantized matmul path.
//
// Layout (GGUF's block_q8_1, 36 bytes, 4-byte aligned): a row of n elements
// (n % 32 == 0) is n / 32 consecutive blocks
//     struct { __half d; __half s; int8_t qs[32]; }
//   d  = max(|x_i|) / 127 over the block's 32 values (0 for an all-zero block)
//   qs = round(x_i / d), rounded half away from zero, in [-127, 127]
//   s  = d * sum(qs)   (the block's quantized sum, used by the Q4_0/Q4_1/Q5_* dot products
//                       to fold the weight offset in without touching every element)
// Row r starts at byte r * (n / 32) * 36. The quantized-matmul kernels read this layout.
#pragma once

#include "common/types.cuh"

namespace cukern {

constexpr int Q8_1_BLOCK = 32;        // values per block
constexpr int Q8_1_BLOCK_BYTES = 36;  // sizeof(BlockQ8_1)

struct BlockQ8_1 {
    __half2 ds;      // (d, s): scale and d * sum(qs)
    int8_t qs[32];   // quantized values
};
static_assert(sizeof(BlockQ8_1) == Q8_1_BLOCK_BYTES, "BlockQ8_1 must match GGUF's block_q8_1");

// Quantize one value with the block's reciprocal scale (0 when d == 0): round(x / d) half away
// from zero, as sign(x) * floor(|x * inv_d| + 0.5). a = |x * inv_d| + 0.5 is at least 0.5, so
// truncating copysign(a, x) gives the same integer with one conversion instead of a floor and a
// conversion (both in the SM's slow conversion pipe).
CUKERN_DEVICE int q8_1_quantize(float x, float inv_d) {
    return __float2int_rz(copysignf(fabsf(x * inv_d) + 0.5f, x));
}

// The low bytes of a, b, c, d as one word, a's in the low byte (four int8 from their 32-bit forms).
CUKERN_DEVICE uint32_t pack_low_bytes4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// The four values of v quantized (q8_1_quantize) and packed as int8 bytes, v.x in the low byte.
CUKERN_DEVICE uint32_t q8_1_quantize4(float4 v, float inv_d) {
    return pack_low_bytes4(q8_1_quantize(v.x, inv_d), q8_1_quantize(v.y, inv_d), q8_1_quantize(v.z, inv_d),
                           q8_1_quantize(v.w, inv_d));
}

// A quarter of a block: 8 consecutive lanes hold one block, lane j = lane % 8 its values 4j..4j+3.
struct Q8Quarter {
    float d;          // the block's scale
    uint32_t packed;  // this lane's four qs, the first in the low byte
    int sum;          // sum(qs) over the whole block
};

// Quantize the block that v belongs to (d = max|x| / 127 by an f32 division, its reciprocal by
// another). Every lane of the warp must call it (shuffles in groups of 8); lanes holding no data
// pass zeros and store nothing.
CUKERN_DEVICE Q8Quarter q8_1_quantize_quarter(float4 v) {
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.0f;
    const float inv_d = d > 0.f ? 1.0f / d : 0.0f;
    const uint32_t packed = q8_1_quantize4(v, inv_d);
    int sum = __dp4a((int)packed, 0x01010101, 0);
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    return {d, packed, sum};
}

}  // namespace cukern
