// Parameter structs of the tokens family, passed by value as the last kernel
// argument. cukern/params.py parses this file: one field per line, fixed-width
// types, a trailing comment with meaning and units.
#pragma once

#include "common/types.cuh"

// embed_rows: out[t] = scale * dequant(table row ids[t])
struct EmbedParams {
    uint64_t row_bytes;       // bytes of one table row (n_cols / block_elems * block_bytes)
    uint32_t n_tokens;        // rows of out
    uint32_t n_cols;          // elements per row
    uint32_t n_table_rows;    // rows of the table (vocabulary size); ids outside give zero rows
    float scale;              // multiplier of every element
};

// topk_chunk + sample_rows: next token of every row of a [n_rows, n_cols] f32 logit matrix
struct SampleParams {
    uint32_t n_rows;          // rows (sequences of the batch)
    uint32_t n_cols;          // logits per row (vocabulary size)
    uint32_t chunk;           // logits per stage-1 block (sampling: 64 ... MAX_CHUNK, see SamplePlan)
    uint32_t n_chunks;        // ceil(n_cols / chunk)
    uint32_t top_k;           // candidates kept: 1 (greedy) ... SAMPLE_MAX_K
    uint32_t history_len;     // columns of the history matrix (0: no history)
    float inv_temperature;    // 1 / T; 0 means greedy (argmax, lowest id on ties)
    float top_p;              // nucleus: keep the fewest best candidates whose probability sums to >= top_p
    uint64_t seed;            // random stream; draw n of row r uses hash(seed, r, n)
};

// advance_positions: after a decode step, every row moves one position on
struct AdvanceParams {
    uint32_t n_rows;          // rows (sequences of the batch)
    uint32_t pad0;            // keeps the struct 8 bytes
};
