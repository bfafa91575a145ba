// Writing K and V rows into the paged cache.
//
// Row i of k_src / v_src ([n_kv_heads * head_dim] elements) goes to its sequence's slot at a
// token position: per_token = 1 reads both from slot_ids[i] / positions[i] (a decode step:
// one new token for each of a batch of sequences); per_token = 0 writes n_tokens consecutive
// positions pos0, pos0 + 1, ... of one slot (a prefill chunk). Positions past the slot's
// page-table row or in pages not allocated (-1) are skipped; the host checks run writes
// against its allocator, per-token slot ids and positions are trusted device values.
//
// Grid: (n_tokens); block: KV_WRITE_THREADS threads over the row. Bytes: 2 rows read, 2 written.
#pragma once

#include "common/pdl.cuh"
#include "common/kv_cache.cuh"
#include "common/types.cuh"
#include "attention/params.cuh"

namespace cukern {
namespace attn {
constexpr int KV_WRITE_THREADS = 128;
}
}  // namespace cukern

template <typename T, typename Src>
__global__ void __launch_bounds__(cukern::attn::KV_WRITE_THREADS) kv_write(
    T* __restrict__ k_pool,                  // [n_pages, page_size, n_kv_heads, head_dim]
    T* __restrict__ v_pool,                  // [n_pages, page_size, n_kv_heads, head_dim]
    const Src* __restrict__ k_src,           // [n_tokens, n_kv_heads, head_dim]
    const Src* __restrict__ v_src,           // [n_tokens, n_kv_heads, head_dim]
    const int32_t* __restrict__ page_table,  // [n_slots, max_pages]
    const int32_t* __restrict__ slot_ids,    // [n_tokens] (per_token only)
    const int32_t* __restrict__ positions,   // [n_tokens] (per_token only)
    const KvWriteParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    const uint32_t i = blockIdx.x;
    const uint32_t slot = p.per_token ? (uint32_t)slot_ids[i] : p.slot;
    const int32_t pos = p.per_token ? positions[i] : (int32_t)(p.pos0 + i);
    if (pos < 0 || (uint32_t)pos >= p.max_pages * p.page_size) return;
    const int32_t* pt = page_table + (uint64_t)slot * p.max_pages;
    if (pt[pos / p.page_size] < 0) return;  // page not allocated (the host marks free entries -1)
    const uint64_t dst = kv_row_offset(pt, (uint32_t)pos, p.page_size, p.row_elems);
    const uint64_t src = (uint64_t)i * p.row_elems;
    for (uint32_t e = threadIdx.x; e < p.row_elems; e += attn::KV_WRITE_THREADS) {
        kv_store(k_pool, dst + e, to_float(k_src[src + e]));
        kv_store(v_pool, dst + e, to_float(v_src[src + e]));
    }
}
