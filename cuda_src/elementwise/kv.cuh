// Data movement of the attention block: KV-cache writes and the Q/gate deinterleave.
//
// kv_write copies f32 rows [n_tokens, n_kv_heads * head_dim] into a K or V cache of element type
// KV (half, bf16 or float) in common/kv_cache.cuh's paged layout (a contiguous cache is the case
// page_size = capacity with one page per sequence). grid: (n_tokens), 128 threads per row.
// Byte traffic: read 4 bytes, write sizeof(KV) per element.
#pragma once

#include "common/types.cuh"
#include "common/kv_cache.cuh"
#include "elementwise/params.cuh"

template <typename KV>
__global__ void __launch_bounds__(128) kv_write(
    KV* __restrict__ cache,                 // [n_pages, page_size, n_kv_heads, head_dim]
    const float* __restrict__ src,          // [n_tokens, n_kv_heads, head_dim]
    const int32_t* __restrict__ positions,  // pos_mode 0: [1] first token's position; 1: [n_tokens]
    const int32_t* __restrict__ seq_ids,    // pos_mode 0: [1]; 1: [n_tokens]: page_table row of each token
    const int32_t* __restrict__ page_table, // [n_seqs, max_pages]
    const KvWriteParams p) {
    using namespace cukern;
    const uint32_t t = blockIdx.x;
    const int32_t pos = p.pos_mode == 0 ? positions[0] + (int32_t)t : positions[t];
    const int32_t seq = p.pos_mode == 0 ? seq_ids[0] : seq_ids[t];
    KV* dst = cache + kv_row_offset(page_table + (uint64_t)seq * p.max_pages, (uint32_t)pos, p.page_size, p.row_elems);
    const float* s = src + (uint64_t)t * p.row_elems;
    for (uint32_t i = threadIdx.x; i < p.row_elems; i += blockDim.x) kv_store<KV>(dst, i, s[i]);
}

// q[r] = x[r, :head_dim], gate[r] = x[r, head_dim:] for every head row r (gated attention's
// per-head interleaved [Q | gate] projection). V = float4 when head_dim % 4 == 0 and the pointers are
// 16-byte aligned, else float; the kernel counts in units of V. grid-stride over n_rows * head_dim.
// Byte traffic: read 8 bytes, write 8 bytes per head element.
template <typename V>
__global__ void deinterleave(
    V* __restrict__ q,        // [n_rows, head_dim]
    V* __restrict__ gate,     // [n_rows, head_dim]
    const V* __restrict__ x,  // [n_rows, 2 * head_dim]
    const DeinterleaveParams p) {
    constexpr uint32_t U = sizeof(V) / sizeof(float);
    const uint32_t hd = p.head_dim / U;  // units of V per head
    const uint64_t n = (uint64_t)p.n_rows * hd;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t r = i / hd, c = i % hd;
        q[i] = x[2 * r * hd + c];
        gate[i] = x[(2 * r + 1) * hd + c];
    }
}
