// Parameter structs of the dmmv family (quantized matrix-vector products), passed by value
// as the last kernel argument. cukern/params.py parses this file: one field per line,
// fixed-width types, a trailing comment with meaning and units.
#pragma once

#include "common/types.cuh"

// dmmv, dmmv_glu: y[c, i] = epilogue(W[i, :] . x[c, :]) for the NCOLS columns c of x
struct DmmvParams {
    uint64_t w_offset;   // bytes: where matrix 1 (or the gate matrix) starts in w
    uint64_t w2_offset;  // bytes: where matrix 2 (pair) or the up matrix (glu) starts in w2
    uint64_t row_bytes;  // bytes per weight row: k / block_elems * block_bytes
    uint32_t m;          // rows of matrix 1 (outputs per column)
    uint32_t m2;         // rows of matrix 2 (pair); 0 otherwise
    uint32_t k;          // elements per row
    uint32_t n_full;     // full 256-element steps per row: k / 256
    uint32_t tail;       // elements of the last, partial step: k % 256
    uint32_t blocks1;    // thread blocks working on matrix 1; later blocks work on matrix 2
    uint32_t x_stride;   // elements between consecutive columns of x (pre-quantized x: bytes)
    uint32_t y_stride;   // elements between consecutive columns of y
    uint32_t y2_stride;  // elements between consecutive columns of y2 (pair)
    uint32_t mode;       // 0: y = alpha*v; 1: y += alpha*v; 2: y += alpha*sigmoid(gate[c])*v
    uint32_t act;        // glu: v = act(gate row . x) * (up row . x); 0 SiLU (SwiGLU), 1 GELU-tanh (GEGLU)
    float alpha;         // output scale
    uint32_t l2_items;   // dmmv_q8 under pdl: items per warp asked of L2 before the wait (q8::block_rows_x)
    uint32_t pad0;
};

// dmmv_nx, dmmv_glu_nx: dmmv (pair) and dmmv_glu on x = rms_norm(r) * (w_norm + weight_offset), r the
// residual plus the sub-layer output (post), computed by every block (DmmvDispatch's NormedX)
struct DmmvNormParams {
    uint64_t w_offset;    // bytes: where matrix 1 (or the gate matrix) starts in w
    uint64_t w2_offset;   // bytes: where matrix 2 (pair) or the up matrix (glu) starts in w2
    uint64_t row_bytes;   // bytes per weight row: k / block_elems * block_bytes
    uint32_t m;           // rows of matrix 1 (outputs per column)
    uint32_t m2;          // rows of matrix 2 (pair); 0 otherwise
    uint32_t k;           // elements per row (and of x): a multiple of 4
    uint32_t n_full;      // full 256-element steps per row: k / 256
    uint32_t tail;        // elements of the last, partial step: k % 256
    uint32_t blocks1;     // thread blocks working on matrix 1; later blocks work on matrix 2
    uint32_t x_stride;    // floats between consecutive columns of residual, proj and residual_out
    uint32_t y_stride;    // elements between consecutive columns of y
    uint32_t y2_stride;   // elements between consecutive columns of y2 (pair)
    uint32_t mode;        // 0: y = alpha*v; 1: y += alpha*v
    uint32_t act;         // glu: 0 SiLU (SwiGLU), 1 GELU-tanh (GEGLU)
    float alpha;          // output scale
    float eps;            // the norms' epsilon: v / sqrt(mean(v^2) + eps)
    float weight_offset;  // the norms multiply by (weight + weight_offset)
    uint32_t post;        // r = residual (0), residual + proj (1), residual + rms_norm(proj) * (w_post + off) (2)
    uint32_t write_out;   // 1: block 0 writes r to residual_out
    uint64_t w3_offset;   // dmmv_nx3: bytes: where matrix 3 starts in w3
    uint64_t row_bytes3;  // dmmv_nx3: bytes per row of matrix 3 (its own type)
    uint32_t m3;          // dmmv_nx3: rows of matrix 3; 0 otherwise
    uint32_t blocks2;     // dmmv_nx3: thread blocks working on matrices 1 and 2; later blocks work on matrix 3
};

// dmmv_mx: dmmv on x merged from split attention states, computed by every block (DmmvDispatch's
// MergedX): x[h * head_dim + j] = sum_s e_s o[s, h, j] / (sum_s e_s + e_sink), e_s = exp(lse[s, h] - M)
struct DmmvMergeParams {
    uint64_t w_offset;    // bytes: where the matrix starts in w
    uint64_t w2_offset;   // unused (0): the matvec body's pair field
    uint64_t row_bytes;   // bytes per weight row: k / block_elems * block_bytes
    uint32_t m;           // rows (outputs)
    uint32_t m2;          // unused (0)
    uint32_t k;           // elements per row: n_heads * head_dim
    uint32_t n_full;      // full 256-element steps per row: k / 256
    uint32_t tail;        // elements of the last, partial step: k % 256
    uint32_t blocks1;     // thread blocks (all on the one matrix)
    uint32_t y_stride;    // unused (one column)
    uint32_t y2_stride;   // unused (0)
    uint32_t mode;        // 0: y = alpha*v; 1: y += alpha*v
    float alpha;          // output scale
    uint32_t n_states;    // states merged per head: 1 ... 65535
    uint32_t n_heads;     // heads of x
    uint32_t head_dim;    // elements per head: a multiple of 4
    uint32_t has_sinks;   // 1: a sink logit per head adds exp(sink - M) to the denominator (NaN: no sink)
    uint32_t sink_offset; // head h's sink at sinks[sink_offset + h] (a buffer of every layer's sinks)
};

// moe_dmmv, moe_dmmv_packed, moe_down: experts picked per slot from a device routing buffer
struct MoeParams {
    uint64_t w_offset;      // bytes: where expert 0 of the (gate) weights starts in w
    uint64_t w2_offset;     // bytes: where expert 0 of the up weights starts in w2 (glu)
    uint64_t row_bytes;     // bytes per weight row
    uint64_t expert_bytes;  // bytes between consecutive experts: m * row_bytes or more
    uint32_t m;             // rows per expert (outputs per slot)
    uint32_t k;             // elements per row
    uint32_t n_full;        // k / 256
    uint32_t tail;          // k % 256
    uint32_t n_experts;     // valid expert ids are 0 ... n_experts-1
    uint32_t top_k;         // slots per token
    uint32_t n_slots;       // tokens * top_k
    uint32_t x_per_slot;    // 1: x is [n_slots, k] (one input per slot); 0: [n_tokens, k]
    uint32_t max_items;     // moe_dmmv_packed: capacity of the work-item list
    uint32_t act;           // glu activation: 0 SiLU, 1 GELU-tanh
    uint32_t mode;          // moe_down: 0 y = sum; 1 y += sum. moe_dmmv_packed: 0 y[slot] = v; 1 y[slot] += v;
                            // 2 y[token] += weights[slot] * v (the down projection summed into y, atomics)
    float alpha;            // output scale
    uint32_t ids_stride;    // ids entries between consecutive tokens' rows (>= top_k)
    uint32_t weights_stride;  // routing weights' entries between consecutive tokens' rows (>= top_k)
};

// moe_route_pack, moe_count_experts: group the slots of a routing buffer by expert
struct RouteParams {
    uint32_t n_slots;    // tokens * top_k entries in the routing buffer
    uint32_t n_experts;  // valid ids are 0 ... n_experts-1 (at most 1023)
    uint32_t cols;       // slots per work item (the packed kernel's NCOLS)
    uint32_t max_items;  // capacity of the work-item list
    uint32_t top_k;      // entries of a token's row of ids
    uint32_t ids_stride;  // ids entries between consecutive tokens' rows (>= top_k)
};

// quantize_x: f32 columns of x into the int8 path's pre-quantized layout (q8::load_x)
struct QuantizeXParams {
    uint32_t k;           // elements per column: a multiple of 32
    uint32_t x_stride;    // floats between consecutive columns of x
    uint32_t out_stride;  // bytes between consecutive columns of out: q8::x_col_bytes(k)
    uint32_t chunk4;      // float4s of a column per thread block: a multiple of 8
};

// dequantize: out[i, j] = W[i, j] in f32 (the per-element path of common/quants.cuh)
struct DequantParams {
    uint64_t w_offset;   // bytes: where the matrix starts in w
    uint64_t row_bytes;  // bytes per weight row
    uint32_t m;          // rows
    uint32_t k;          // elements per row
};
