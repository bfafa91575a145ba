// Data movement of the attention block: KV-cache writes and the Q/gate deinterleave.
//
// kv_write copies f32 rows [n_tokens, n_kv_heads * head_dim] into a K or V cache of element type
// KV (float, __half or __nv_bfloat16) in common/kv_cache.cuh's paged layout (a contiguous cache is the case
// page_size = capacity with one page per sequence). Byte traffic: read 4 bytes, write sizeof(KV)
// per element.
#pragma once

#include "common/pdl.cuh"
#include "common/types.cuh"
#include "common/kv_cache.cuh"
#include "elementwise/params.cuh"
#include "elementwise/convert.cuh"

namespace cukern {
namespace ew {
template <bool VEC4> struct KvUnit { using type = float; };
template <> struct KvUnit<true> { using type = float4; };
}  // namespace ew
}  // namespace cukern

// Units of 4 elements (VEC4: row_elems % 4 == 0, 16-byte aligned src and cache) or of one element; a
// thread takes KV_UNROLL units u0 + k * (gridDim.x * 256), all loaded before any is stored.
// grid: (ceil(n_tokens * units per row / (256 * KV_UNROLL))), block: 256.
constexpr int KV_UNROLL = 4;

template <typename KV, bool VEC4>
__global__ void __launch_bounds__(256) kv_write(
    KV* __restrict__ cache,                 // [n_pages, page_size, n_kv_heads, head_dim]
    const float* __restrict__ src,          // [n_tokens, n_kv_heads, head_dim]
    const int32_t* __restrict__ positions,  // pos_mode 0: [1] first token's position; 1: [n_tokens]
    const int32_t* __restrict__ seq_ids,    // pos_mode 0: [1]; 1: [n_tokens]: page_table row of each token
    const int32_t* __restrict__ page_table, // [n_seqs, max_pages]
    const KvWriteParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    using V = typename ew::KvUnit<VEC4>::type;
    constexpr uint32_t U = VEC4 ? 4 : 1;
    const uint32_t row_units = p.row_elems / U;
    const uint32_t n_units = p.n_tokens * row_units;  // < 2^32, and so is u0 + KV_UNROLL * stride (host-checked)
    const uint32_t stride = gridDim.x * blockDim.x;
    const uint32_t u0 = blockIdx.x * blockDim.x + threadIdx.x;
    V vals[KV_UNROLL];
#pragma unroll
    for (int k = 0; k < KV_UNROLL; ++k) {
        const uint32_t u = u0 + k * stride;
        if (u < n_units) vals[k] = __ldcs(reinterpret_cast<const V*>(src) + u);  // rows are contiguous in src
    }
#pragma unroll
    for (int k = 0; k < KV_UNROLL; ++k) {
        const uint32_t u = u0 + k * stride;
        if (u >= n_units) break;
        const uint32_t t = u / row_units, c = (u % row_units) * U;
        const int32_t pos = p.pos_mode == 0 ? positions[0] + (int32_t)t : positions[t];
        const int32_t seq = p.pos_mode == 0 ? seq_ids[0] : seq_ids[t];
        KV* dst = cache + kv_row_offset(page_table + (uint64_t)seq * p.max_pages, (uint32_t)pos, p.page_size,
                                        p.row_elems) + c;
        if constexpr (VEC4) ew::st4(dst, 0, vals[k]);
        else kv_store<KV>(dst, 0, vals[k]);
    }
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
    cukern::pdl_enter();
    constexpr uint32_t U = sizeof(V) / sizeof(float);
    const uint32_t hd = p.head_dim / U;  // units of V per head
    const uint64_t n = (uint64_t)p.n_rows * hd;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t r = i / hd, c = i % hd;
        q[i] = x[2 * r * hd + c];
        gate[i] = x[(2 * r + 1) * hd + c];
    }
}
