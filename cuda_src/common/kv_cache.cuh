// Paged KV-cache addressing, shared by the attention family (cache writes,
// attention reads) and the elementwise family (fused norm + RoPE + KV write).
// One implementation of the layout lives here; families never include each other.
//
// Layout (per layer, K and V alike):
//   pool        [n_pages, page_size, n_kv_heads, head_dim]   element type T (half, bf16 or float)
//   page_table  [n_seqs, max_pages_per_seq] int32            page ids of each sequence, in order
//   token at position pos of sequence s lives in page page_table[s][pos / page_size],
//   row pos % page_size of that page.
// A contiguous cache is the special case page_size = capacity, page_table[s] = {s}.
#pragma once

#include "common/types.cuh"

namespace cukern {

// Element offset of the start of token `pos`'s row ([n_kv_heads, head_dim]) in the pool.
CUKERN_DEVICE uint64_t kv_row_offset(const int32_t* __restrict__ page_table_row,  // [max_pages_per_seq]
                                     uint32_t pos,        // token position in its sequence
                                     uint32_t page_size,  // tokens per page
                                     uint32_t row_elems)  // n_kv_heads * head_dim
{
    const uint32_t page = (uint32_t)page_table_row[pos / page_size];
    return ((uint64_t)page * page_size + pos % page_size) * row_elems;
}

// Row index (page * page_size + pos % page_size) of token `pos`: multiply by the row stride
// (n_kv_heads * head_dim elements) to get kv_row_offset.
CUKERN_DEVICE uint64_t kv_row_index(const int32_t* __restrict__ page_table_row,  // [max_pages_per_seq]
                                    uint32_t pos,        // token position in its sequence
                                    uint32_t page_size)  // tokens per page
{
    const uint32_t page = (uint32_t)page_table_row[pos / page_size];
    return (uint64_t)page * page_size + pos % page_size;
}

// Store one f32 value into a cache of element type T.
template <typename T>
CUKERN_DEVICE void kv_store(T* __restrict__ pool, uint64_t index, float v) {
    pool[index] = from_float<T>(v);
}

}  // namespace cukern
