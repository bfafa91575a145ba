// Parameter structs of the attention family, passed by value as the last
// kernel argument. cukern/params.py parses this file: keep to one field per
// line, fixed-width types, a trailing comment with meaning and units.
//
// Conventions shared by every kernel of the family:
//   * positions and lengths are tokens; a query at position i sees key j when
//     max(0, i - window_left) <= j <= i (window_left < 0: no window);
//   * logits are scale * q.k, then softcap * tanh(logit / softcap) when softcap > 0;
//   * a sink is one extra logit per query head that joins the softmax denominator only; head h reads
//     sinks[sink_offset + h] (one buffer for every layer), and a NaN there means no sink for that head;
//   * causal 1 aligns the last query with the last key (FlashAttention, torch CausalVariant.LOWER_RIGHT:
//     query r of q_len against kv_len keys sits at position kv_len - q_len + r), causal 2 the first query
//     with the first key (torch is_causal, CausalVariant.UPPER_LEFT: position r); a query whose position
//     is below 0 sees no key (O = 0, LSE -inf, or the sink's LSE);
//   * log-sum-exp values (LSE) are natural logarithms.
#pragma once

#include "common/types.cuh"

// kv_write: place n_tokens rows of K and V ([n_kv_heads, head_dim] each) into the paged pools
struct KvWriteParams {
    uint32_t n_tokens;       // rows to write
    uint32_t row_elems;      // n_kv_heads * head_dim
    uint32_t page_size;      // tokens per page
    uint32_t max_pages;      // page-table row length (pages per sequence)
    uint32_t per_token;      // 1: slot and position of row i from slot_ids[i], positions[i]; 0: slot, pos0 + i
    uint32_t slot;           // sequence slot (per_token = 0)
    uint32_t pos0;           // position of the first row (per_token = 0)
    uint32_t pad0;           // keeps the struct a multiple of 8 bytes
};

// decode: single-query (per sequence) split-KV attention over the paged cache, and its
// "batched" mode, in which each of several queries of a sequence sees a causal prefix
struct DecodeParams {
    uint32_t n_queries;      // query tokens (decode: one per sequence)
    uint32_t n_seqs;         // sequences (decode: = n_queries)
    uint32_t batched;        // 0: query b is the last token of sequence b; 1: queries of sequence s are
                             //    rows q_indptr[s] .. q_indptr[s+1]-1, the last one at position len - 1
    uint32_t n_heads;        // query heads
    uint32_t n_kv_heads;     // KV heads; n_heads % n_kv_heads == 0
    uint32_t group;          // n_heads / n_kv_heads
    uint32_t n_head_blocks;  // blocks per KV head along grid.y: ceil(group / heads per block)
    uint32_t page_size;      // tokens per page
    uint32_t max_pages;      // page-table row length
    uint32_t n_splits;       // KV chunks (grid.x); 1 writes the final output directly, > 1 partial states
                             //    that the last block of each (query, head block) merges
    uint32_t chunk;          // tokens per chunk (the last split runs to the query's last visible key)
    int32_t window_left;     // sliding window (tokens before the query), < 0: none
    float scale_log2;        // scale * log2(e)
    float softcap;           // logit cap, 0: off
    float inv_softcap;       // 1 / softcap (0 when off)
    uint32_t has_sinks;      // 1: sinks[sink_offset + h] join the denominator (once: in the final write or the merge)
    uint32_t causal;         // batched mode: 1 causal bottom-right, 2 causal top-left, 0 every query sees all keys
    uint32_t write_lse;      // 1: write the final lse (the partial LSEs of n_splits > 1 are always written)
    int32_t page_shift;      // log2(page_size) when it is a power of two, else -1
    uint32_t l2_prefetch;    // decode_tc: warp tiles after the prologue's that each warp asks L2 to prefetch
                             //    before pdl_wait (0: none; meant for programmatic dependent launch)
    uint32_t evict_first;    // decode_tc: 1 streams K/V with an L2 evict-first policy (read once per launch)
    uint32_t merge_apart;    // n_splits > 1: 1 writes the partial states only, merged by a merge_states launch
                             //    after this one (no counters touched); 0: the last block merges them
    uint32_t l2_ahead;       // decode_tc: each warp keeps L2 asked for its tiles up to this many after the one it
                             //    copies next (0: none), more of its stream in flight than its ring of stages holds
    uint32_t row_stride;     // elements between the K/V rows of consecutive keys of one KV head (pages: n_kv_heads * D;
                             //    head-major [.., n_kv_heads, capacity, D]: D)
    uint32_t head_stride;    // elements between the rows of consecutive KV heads (pages: D; head-major: capacity * D)
    uint32_t kv_rows;        // SIMT decode: 1 reads packed rows (varlen): sequence s's key j at row page_table[s] + j,
                             //    lengths[s] - page_table[s] keys (page_table = cu_seqlens_k, lengths = its tail);
                             //    slot s itself (seq_ids unused); 0: pages
    uint32_t sink_offset;    // head h's sink is sinks[sink_offset + h]
    uint32_t pad0;           // keeps the struct a multiple of 8 bytes
};

// merge_states: combine n_states partial results (O, LSE) per (token, head)
struct MergeParams {
    uint32_t n_tokens;       // rows
    uint32_t n_states;       // partial states per row
    uint32_t n_heads;        // heads
    uint32_t head_dim;       // elements per head
    uint32_t has_sinks;      // 1: sinks[sink_offset + h] (natural-log logits; NaN: none) join the denominator once
    uint32_t write_lse;      // 1: write the merged LSE
    uint32_t cols4;          // float4 columns per block (grid.z = ceil(head_dim / 4 / cols4))
    uint32_t sink_offset;    // head h's sink is sinks[sink_offset + h]
};

// prefill: tensor-core flash attention of many queries per sequence, over the paged cache
// (paged = 1) or over packed contiguous K/V addressed by cu_seqlens_k (varlen, paged = 0)
struct PrefillParams {
    uint32_t n_seqs;         // sequences (grid.z)
    uint32_t n_heads;        // query heads
    uint32_t n_kv_heads;     // KV heads
    uint32_t group;          // n_heads / n_kv_heads
    uint32_t n_q_tiles;      // query tiles per sequence in the grid (from the caller's max q length)
    uint32_t page_size;      // paged: tokens per page
    uint32_t max_pages;      // paged: page-table row length
    uint32_t causal;         // 0: none; 1: query r sees keys j <= kv_len - q_len + r (bottom right); 2: j <= r
                             //    (top left)
    int32_t window_left;     // sliding window, < 0: none
    float scale_log2;        // scale * log2(e)
    float softcap;           // logit cap, 0: off
    float inv_softcap;       // 1 / softcap (0 when off)
    uint32_t has_sinks;      // 1: sinks[sink_offset + h] joins the denominator
    uint32_t write_lse;      // 1: write lse[n_q_total, n_heads]
    int32_t page_shift;      // paged: log2(page_size) when it is a power of two, else -1
    uint32_t sink_offset;    // head h's sink is sinks[sink_offset + h]
};
