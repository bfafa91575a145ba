// Token embedding: rows of a GGUF weight (raw blocks, any type of common/quants.cuh) gathered
// by token ids that live on the device, dequantized to f32 and scaled (Gemma: sqrt(d_model)).
//   embed_rows<QT>   grid (ceil(n_cols / (4 * EMBED_THREADS)), n_tokens)
// Bytes: reads n_tokens rows of the table (row_bytes each), writes 4 * n_tokens * n_cols.
#pragma once

#include "common/pdl.cuh"
#include "common/quants.cuh"
#include "common/types.cuh"
#include "tokens/params.cuh"

namespace cukern {
namespace tokens {
constexpr int EMBED_THREADS = 128;
}  // namespace tokens
}  // namespace cukern

template <int QT>
__global__ void __launch_bounds__(cukern::tokens::EMBED_THREADS) embed_rows(
    float* __restrict__ out,             // [n_tokens, n_cols] f32
    const uint8_t* __restrict__ table,   // [n_rows_table, row_bytes] raw GGUF blocks
    const int32_t* __restrict__ ids,     // [n_tokens] row of each token; outside [0, n_rows_table): zeros
    const EmbedParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    using T = QTraits<QT>;
    const uint32_t t = blockIdx.y;
    const int32_t id = ids[t];
    const bool valid = id >= 0 && (uint32_t)id < p.n_table_rows;
    const uint8_t* row = table + (uint64_t)(valid ? id : 0) * p.row_bytes;
    float* dst = out + (uint64_t)t * p.n_cols;
    for (uint32_t c = blockIdx.x * blockDim.x + threadIdx.x; c < p.n_cols; c += gridDim.x * blockDim.x) {
        const auto* blk = reinterpret_cast<const typename T::Block*>(row + (uint64_t)(c / T::kElems) * T::kBytes);
        dst[c] = valid ? dequant(blk, c % T::kElems) * p.scale : 0.0f;
    }
}
