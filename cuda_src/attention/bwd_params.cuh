// Parameter structs of the attention family's varlen backward (varlen_bwd.cu), passed by value as the
// last kernel argument. cukern/params.py parses this file: one field per line, fixed-width types, a
// trailing comment with meaning and units. Conventions are params.cuh's (positions, masks, logits,
// natural-log LSE).
#pragma once

#include "common/types.cuh"

// bwd_preprocess: delta = rowsum(dO * O) per (token, head); zeroes the f32 dQ accumulator when asked
struct BwdPreParams {
    uint32_t n_rows;         // total_q * n_heads rows of head_dim values
    uint32_t zero_dq;        // 1: write zeros to the rows of dq_accum (the atomic dQ mode)
};

// bwd_dkdv (grid: K tiles, KV heads, sequences) and bwd_dq (grid: heads, sequences, Q tiles)
struct BwdParams {
    uint32_t n_seqs;         // sequences
    uint32_t n_heads;        // query heads
    uint32_t n_kv_heads;     // KV heads; n_heads % n_kv_heads == 0
    uint32_t group;          // n_heads / n_kv_heads (bwd_dkdv sums dK, dV over a group's heads)
    uint32_t n_tiles;        // tiles per sequence in the grid: K tiles (bwd_dkdv), Q tiles (bwd_dq)
    uint32_t causal;         // 1: query r of a sequence sees keys j <= kv_len - q_len + r; 2: keys j <= r
    int32_t window_left;     // sliding window (keys before the query's position), < 0: none
    float scale_log2;        // scale * log2(e)
    float softcap;           // logit cap, 0: off
    float inv_softcap;       // 1 / softcap (0 when off)
    float scale;             // softmax scale (natural): the factor of dQ and dK
    uint32_t dq_atomic;      // bwd_dkdv: 1 adds dS K into dq_accum with f32 atomics; 0 leaves dQ to bwd_dq
};

// bwd_dq_convert: dq = T(scale * dq_accum)
struct BwdConvertParams {
    uint32_t n4;             // groups of 4 values: total_q * n_heads * head_dim / 4
    float scale;             // softmax scale (natural)
};
