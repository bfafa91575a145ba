// Warp- and block-wide reductions over f32, and a block-wide prefix sum.
//
// Block reductions take a caller-provided shared scratch of at least
// BLOCK/32 floats and return the result to every thread of the block.
#pragma once

#include "common/types.cuh"

namespace cukern {

constexpr int WARP = 32;

CUKERN_DEVICE float warp_sum(float x) {
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

CUKERN_DEVICE float warp_max(float x) {
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

template <int BLOCK>
CUKERN_DEVICE float block_sum(float x, float* scratch /* [BLOCK / 32] */) {
    static_assert(BLOCK % WARP == 0 && BLOCK <= 1024, "BLOCK must be a multiple of 32, at most 1024");
    const int lane = threadIdx.x % WARP;
    const int warp = threadIdx.x / WARP;
    x = warp_sum(x);
    if (BLOCK == WARP) return x;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    x = lane < BLOCK / WARP ? scratch[lane] : 0.0f;
    return warp_sum(x);
}

template <int BLOCK>
CUKERN_DEVICE float block_max(float x, float* scratch /* [BLOCK / 32] */) {
    static_assert(BLOCK % WARP == 0 && BLOCK <= 1024, "BLOCK must be a multiple of 32, at most 1024");
    const int lane = threadIdx.x % WARP;
    const int warp = threadIdx.x / WARP;
    x = warp_max(x);
    if (BLOCK == WARP) return x;
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    x = lane < BLOCK / WARP ? scratch[lane] : -INFINITY;
    return warp_max(x);
}

// Exclusive prefix sum over the block in thread order, one value per thread; *total gets the block's
// sum. scratch: [32] in shared memory. Every thread calls it (blockDim.x a multiple of 32).
template <typename T>
CUKERN_DEVICE T block_exclusive_scan(T v, T* scratch /* [32] */, T* total) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    T incl = v;
#pragma unroll
    for (int o = 1; o < WARP; o <<= 1) {
        const T n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == WARP - 1) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        T s = lane < (int)(blockDim.x / WARP) ? scratch[lane] : T(0);
#pragma unroll
        for (int o = 1; o < WARP; o <<= 1) {
            const T n = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += n;
        }
        scratch[lane] = s;  // inclusive sums of the warps
    }
    __syncthreads();
    const T base = warp > 0 ? scratch[warp - 1] : T(0);
    *total = scratch[blockDim.x / WARP - 1];
    return base + incl - v;
}

}  // namespace cukern
