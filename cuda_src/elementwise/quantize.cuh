// f32 values -> GGUF Q8_1 blocks (common/q8_1.cuh). Apart from norms.cuh because it is not a template:
// only the f32 unit (elementwise.cu) holds it, not the 16-bit units (act16.cu) that include norms.cuh.
#pragma once

#include "common/pdl.cuh"
#include "common/types.cuh"
#include "common/q8_1.cuh"
#include "elementwise/params.cuh"

// Quantize f32 values to Q8_1 (the unfused counterpart of residual_rms_norm_q8_1's epilogue): a thread
// takes QUANT_UNROLL float4s u0 + k * (gridDim.x * 256), loaded before any is used; 8 consecutive threads
// share a 32-value block. x 16-byte aligned, q 4-byte aligned.
// grid: (ceil(n_values / 4 / (256 * QUANT_UNROLL))), block: 256. Bytes: read 4, write 36 / 32 per value.
constexpr int QUANT_UNROLL = 4;

__global__ void __launch_bounds__(256) quantize_q8_1(
    uint8_t* __restrict__ q,      // [n_values / 32] BlockQ8_1
    const float* __restrict__ x,  // [n_values]
    const QuantizeParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    float4 vs[QUANT_UNROLL];
#pragma unroll
    for (int k = 0; k < QUANT_UNROLL; ++k) {
        const uint64_t u = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x + k * stride;  // float4 index
        vs[k] = u < p.n_values / 4 ? __ldcs(reinterpret_cast<const float4*>(x) + u) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int k = 0; k < QUANT_UNROLL; ++k) {
        const uint64_t u = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x + k * stride;
        const bool live = u < p.n_values / 4;  // whole 8-thread groups: n_values % 32 == 0, stride % 8 == 0
        const Q8Quarter b = q8_1_quantize_quarter(vs[k]);
        if (!live) continue;
        uint8_t* blk = q + (u / 8) * Q8_1_BLOCK_BYTES;
        reinterpret_cast<uint32_t*>(blk + 4)[u % 8] = b.packed;
        if (u % 8 == 0) *reinterpret_cast<__half2*>(blk) = __floats2half2_rn(b.d, b.d * (float)b.sum);
    }
}
