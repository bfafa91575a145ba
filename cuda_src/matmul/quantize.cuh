// One-pass activation quantizers (f32 rows -> Q8_1 / Q8_0 blocks of 32) and the dequantizer
// of whole weight matrices to f16 (what a dequantize + cuBLAS pipeline runs, and a debugging aid).
//
// quantize_q8<FMT>: 8 threads per 32-value block, a float4 each; the block's absmax and quant sum
// are reduced over the 8 lanes by shuffles. Q8_1 as common/q8_1.cuh (36 bytes: half2 (d, d*sum),
// 32 int8); Q8_0 as GGUF's block_q8_0 (34 bytes: half d, 32 int8, only 2-byte aligned).
// Traffic: reads 4 bytes, writes 36/32 or 34/32 bytes per value.
#pragma once

#include "matmul/dequant_tile.cuh"
#include "matmul/params.cuh"
#include "matmul/q8_store.cuh"

namespace cukern {
namespace mm {
constexpr int kQuantThreads = 256;
constexpr int kDequantThreads = 256;
}  // namespace mm
}  // namespace cukern

// FMT 0: Q8_1, FMT 1: Q8_0. Grid-strided over n_rows * n_cols / 4 float4s.
template <int FMT>
__global__ void __launch_bounds__(cukern::mm::kQuantThreads) quantize_q8(
    uint8_t* __restrict__ q,        // [n_rows, q_stride] bytes: n_cols / 32 blocks of 36 (Q8_1) or 34 (Q8_0)
    const float* __restrict__ x,    // [n_rows, x_stride] f32, 16-byte aligned rows, n_cols used
    const QuantizeParams p) {
    using namespace cukern;
    const uint32_t per_row = p.n_cols / 4;
    const uint64_t total = (uint64_t)p.n_rows * per_row;
    // whole warps iterate together (the shuffles need all 32 lanes); 8 | 32 keeps blocks in one warp
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t base = (uint64_t)blockIdx.x * blockDim.x; base < total; base += stride) {
        const uint64_t i = base + threadIdx.x;
        const bool live = i < total;
        const uint32_t row = live ? (uint32_t)(i / per_row) : 0, c4 = live ? (uint32_t)(i % per_row) : 0;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (live) v = *reinterpret_cast<const float4*>(x + (size_t)row * p.x_stride + 4 * c4);
        mm::q8_store_block<FMT>(v, q + (size_t)row * p.q_stride + (size_t)(c4 / 8) * mm::Q8Fmt<FMT>::kBytes, c4 % 8, live);
    }
}

// out = dequantize(W) as f16 [m, k]; one thread per half segment (row, 32-element segment, part).
template <int QT>
__global__ void __launch_bounds__(cukern::mm::kDequantThreads) dequantize_f16(
    __half* __restrict__ out,       // [m, k] f16 out, 16-byte aligned
    const uint8_t* __restrict__ w,  // raw GGUF bytes: m rows from w + w_offset
    const DequantParams p) {
    using namespace cukern::mm;
    const uint32_t segs = p.k / 32;
    const uint64_t total = (uint64_t)p.m * segs * 2;
    for (uint64_t u = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total; u += (uint64_t)gridDim.x * blockDim.x) {
        const uint32_t part = (uint32_t)(u & 1), seg = (uint32_t)((u >> 1) % segs), row = (uint32_t)((u >> 1) / segs);
        typename Deq<QT>::Raw raw;
        Deq<QT>::load(raw, w + p.w_offset + (size_t)row * p.row_bytes, seg, part);
        Deq<QT>::store(raw, out + (size_t)row * p.k + (size_t)seg * 32, part);
    }
}
