// Parameter structs of the elementwise family, passed by value as the last
// kernel argument. cukern/params.py parses this file: keep to one field per
// line, fixed-width types, a trailing comment with meaning and units.
#pragma once

#include "common/types.cuh"

// Row-wise RMS norms of an [n_rows, n_cols] f32 matrix (norms.cuh):
//   rms_norm, residual_rms_norm, post_norm_residual_rms_norm, rms_norm_accumulate,
//   residual_rms_norm_q8_1
struct RmsNormParams {
    uint32_t n_rows;      // rows (tokens)
    uint32_t n_cols;      // elements per row (hidden size)
    float eps;            // added to mean(x^2) before the reciprocal square root
    float weight_offset;  // y = x * rsqrt(mean(x^2) + eps) * (w + weight_offset); 1 for unit-offset weights
};

// quantize_q8_1: f32 values -> GGUF block_q8_1 blocks (common/q8_1.cuh), rows concatenated
struct QuantizeParams {
    uint64_t n_values;  // values (a multiple of 32: n_rows * n_cols with n_cols % 32 == 0)
};

// group_norm: norm of every contiguous group of group_size elements (per-head Q/K norm,
// DeltaNet's grouped Q/K norm, gated RMS norm)
struct GroupNormParams {
    uint32_t n_groups;    // groups (n_tokens * n_heads)
    uint32_t group_size;  // elements per group (head_dim)
    uint32_t has_weight;  // 1: multiply by (w[i] + weight_offset), w: [group_size]; 0: no weight
    uint32_t l2;          // 0: RMS norm, rsqrt(mean(x^2) + eps); 1: L2 norm, rsqrt(sum(x^2) + eps)
    float eps;            // added under the square root
    float weight_offset;  // see has_weight
};

// binary_rows: out[r, c] = op(a[r * a_stride + c], b[r * b_stride + b_offset + c]) (activations.cuh)
struct BinaryParams {
    uint32_t n_rows;      // rows
    uint32_t n_cols;      // elements per row
    uint64_t a_stride;    // elements between rows of a
    uint64_t b_stride;    // elements between rows of b (0: b broadcast over rows, e.g. a bias)
    uint64_t out_stride;  // elements between rows of out
    uint32_t b_offset;    // first element of b used by row 0
    float alpha;          // axpy: multiplier of b; scale: multiplier of a; swiglu_oai: sigmoid slope
    float limit;          // swiglu_oai: clamp of the gate (above) and of the linear input (both sides)
};

// rope, rms_norm_rope (rope.cuh): one block per token; x, out: [n_tokens, n_heads, head_dim]
struct RopeParams {
    uint32_t n_tokens;     // tokens
    uint32_t n_heads;      // heads per token
    uint32_t head_dim;     // elements per head (even)
    uint32_t rope_dim;     // leading elements of a head that rotate (even, <= head_dim); the rest are copied
    uint32_t neox;         // 1: pairs (i, i + rope_dim/2); 0: interleaved pairs (2i, 2i + 1)
    uint32_t pos_mode;     // 0: pos = positions[0] + t; 1: positions[t]; 2: multi-section; 3: interleaved multi-section (IMRoPE)
    uint32_t sections[4];  // pos_mode 2/3: pairs per section (t, h, w, e); positions is [4, n_tokens]
    uint32_t use_freqs;    // 1: inverse frequencies from freqs[rope_dim / 2]; 0: freq_base^(-2i / rope_dim)
    float freq_base;       // rotary base (theta), used when use_freqs == 0
    float eps;             // rms_norm_rope: norm epsilon
    float weight_offset;   // rms_norm_rope: weight offset
    uint32_t tokens_per_block;  // tokens per step of a block (blocks loop over steps)
    float attn_scale;      // multiplies cos and sin (the rotated elements; YaRN's mscale), 1: plain RoPE
    double inv_ratio;      // freq_base^(-2 / rope_dim), computed in f64 on the host: inv_freq[j] = inv_ratio^j
};

// qk_norm_rope_kv: per token, Q heads normed + rotated into q_out, K heads normed + rotated into the
// K cache, V heads copied (or RMS-normed) into the V cache (rope.cuh). Caches: common/kv_cache.cuh layout.
struct QkvRopeParams {
    uint32_t n_tokens;     // tokens
    uint32_t n_q_heads;    // query heads (0 for the K-only kernel)
    uint32_t n_kv_heads;   // key / value heads
    uint32_t head_dim;     // elements per head (even)
    uint32_t rope_dim;     // rotated leading elements (even, <= head_dim)
    uint32_t neox;         // 1: NeoX pairs; 0: interleaved pairs
    uint32_t pos_mode;     // 0: pos = positions[0] + t, seq = seq_ids[0]; 1: positions[t], seq_ids[t]
    uint32_t use_freqs;    // 1: inverse frequencies from freqs; 0: from freq_base
    float freq_base;       // rotary base
    float eps;             // Q/K norm epsilon
    float weight_offset;   // Q/K norm weight offset
    uint32_t page_size;    // tokens per cache page
    uint32_t max_pages;    // page_table row length (max_pages_per_seq)
    uint32_t norm;         // 1: RMS-norm Q and K heads before the rotation; 0: rotate only
    uint32_t tokens_per_block;  // tokens per step of a block (blocks loop over steps)
    uint32_t v_norm;       // 0: V rows copied; 1: RMS-normed, unit weight; 2: RMS-normed, times (wv + weight_offset)
    float attn_scale;      // multiplies cos and sin (the rotated Q and K elements; YaRN's mscale), 1: plain RoPE
    double inv_ratio;      // freq_base^(-2 / rope_dim) in f64: inv_freq[j] = inv_ratio^j
};

// kv_write: copy [n_tokens, n_kv_heads, head_dim] f32 rows into a K or V cache of f32, f16 or bf16 (kv.cuh)
struct KvWriteParams {
    uint32_t n_tokens;    // tokens
    uint32_t row_elems;   // n_kv_heads * head_dim
    uint32_t page_size;   // tokens per page
    uint32_t max_pages;   // page_table row length
    uint32_t pos_mode;    // 0: pos = positions[0] + t, seq = seq_ids[0]; 1: positions[t], seq_ids[t]
};

// deinterleave: x [n_rows, 2 * head_dim] (per head: [q | gate]) -> q, gate [n_rows, head_dim]
struct DeinterleaveParams {
    uint32_t n_rows;    // n_tokens * n_heads
    uint32_t head_dim;  // elements of q (and of gate) per head
};

// softmax_topk (moe.cuh): one warp per token
struct TopkParams {
    uint32_t n_tokens;   // tokens
    uint32_t n_experts;  // router logits per token
    uint32_t k;          // experts selected per token (<= n_experts)
    uint32_t renorm;     // 1: selected weights rescaled to sum to 1 (= softmax over the top-k logits)
    float scale;         // multiplies the final weights
    uint32_t ids_stride;      // ids entries between consecutive tokens' rows (>= k; 2k for a RouteSlot)
    uint32_t weights_stride;  // weights entries between consecutive tokens' rows (>= k)
};

// moe_weighted_sum: out[t] (+)= sum_j weights[t, j] * expert_out[t, j]
struct MoeSumParams {
    uint32_t n_tokens;    // tokens
    uint32_t n_used;      // experts per token
    uint32_t n_cols;      // hidden size
    uint32_t accumulate;  // 1: out += sum; 0: out = sum
    uint32_t w_stride;    // weights entries between consecutive tokens' rows (>= n_used; 2 n_used for a RouteSlot)
};

// shared_expert_accumulate: hidden[t] += sigmoid(gate_logit[t]) * shared_out[t]
struct SharedGateParams {
    uint32_t n_tokens;  // tokens
    uint32_t n_cols;    // hidden size
};

// router_matvec: logits[t, e] = scale_t * dot(x[t] (* w_norm), W[e]); scale_t = scale (* rsqrt(mean(x^2)+eps))
struct RouterParams {
    uint32_t n_tokens;    // tokens
    uint32_t n_experts;   // rows of W
    uint32_t n_embd;      // columns of W, elements of x per token
    uint32_t norm;        // 1: RMS-norm x with w_norm first (fused router norm); 0: plain matvec
    float eps;            // norm epsilon
    float weight_offset;  // norm weight offset
    float scale;          // multiplies every logit
};

// conv1d_silu, conv1d_silu_in_place (ssm.cuh): depthwise causal conv over time, then SiLU, for n_tokens tokens
struct ConvParams {
    uint32_t n_tokens;     // tokens in this call (1: decode)
    uint32_t n_channels;   // channels
    uint32_t kernel_size;  // taps (2..8); the state holds kernel_size - 1 past inputs per channel
    uint32_t tokens_per_thread;  // tokens of a thread's span (CONV_CHUNK; in place: ceil(n_tokens / spans))
    uint32_t ring;         // 1: the state rows are a ring starting at state_offset; 0: oldest first
    uint32_t state_offset; // ring: row of the oldest entry (< kernel_size - 1)
};

// deltanet: gated delta rule over n_tokens tokens of one sequence
struct DeltaNetParams {
    uint32_t n_tokens;    // tokens
    uint32_t n_v_heads;   // value heads (state matrices)
    uint32_t n_qk_heads;  // query/key heads; divides n_v_heads (v head h uses q/k head h / (n_v_heads / n_qk_heads))
    uint32_t dk;          // key dim (state rows)
    uint32_t dv;          // value dim (state columns)
    float q_scale;        // multiplies q (usually 1 / sqrt(dk))
    uint32_t qk_l2norm;   // 1: q and k of each head L2-normalised first: x * rsqrt(sum(x^2) + norm_eps)
    float norm_eps;       // qk_l2norm's epsilon
};

// deltanet_gates (ssm.cuh): DeltaNet's log decay and write strength per token and value head
struct DeltaNetGateParams {
    uint32_t n_tokens;   // tokens
    uint32_t n_v_heads;  // value heads (gates per token)
    uint32_t group;      // value heads per key head: ba holds [b(group) | alpha(group)] per key head
};
