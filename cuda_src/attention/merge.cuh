// Merging partial attention states: n_states results (O_i normalised over its own keys,
// LSE_i the natural-log sum of its exponentiated logits) of the same query become
//   O = sum_i exp(LSE_i - M) O_i / (sum_i exp(LSE_i - M) + exp(sink - M)),
//   LSE = M + log(sum_i exp(LSE_i - M) + exp(sink - M)),   M = max(max_i LSE_i, sink),
// where the sink term is present only with has_sinks. States with LSE = -inf (no keys)
// weigh nothing; a row whose states are all empty (and has no sink) gets O = 0, LSE = -inf.
//
// Grid: (n_heads, n_tokens); block: MERGE_THREADS threads over head_dim.
// Bytes: n_states * (head_dim + 1) floats read, head_dim (+ 1) written per (token, head).
#pragma once

#include "common/types.cuh"
#include "attention/common.cuh"
#include "attention/params.cuh"

namespace cukern {
namespace attn {
constexpr int MERGE_THREADS = 128;
}
}  // namespace cukern

extern "C" __global__ void __launch_bounds__(cukern::attn::MERGE_THREADS) merge_states(
    float* __restrict__ o,            // [n_tokens, n_heads, head_dim] merged output
    float* __restrict__ lse,          // [n_tokens, n_heads] merged natural-log LSE (write_lse only)
    const float* __restrict__ o_in,   // [n_tokens, n_states, n_heads, head_dim] normalised partial outputs
    const float* __restrict__ lse_in, // [n_tokens, n_states, n_heads] their natural-log LSE
    const float* __restrict__ sinks,  // [n_heads] natural-log sink logits (has_sinks only)
    const MergeParams p) {
    using namespace cukern::attn;
    const uint32_t h = blockIdx.x;
    const uint64_t t = blockIdx.y;
    const float* li = lse_in + t * p.n_states * p.n_heads + h;  // stride n_heads between states
    float mx = p.has_sinks ? sinks[h] : -INFINITY;
    for (uint32_t s = 0; s < p.n_states; ++s) mx = fmaxf(mx, li[(uint64_t)s * p.n_heads]);
    const float mu = safe_max(mx);
    float den = p.has_sinks ? __expf(sinks[h] - mu) : 0.0f;
    for (uint32_t s = 0; s < p.n_states; ++s) den += __expf(li[(uint64_t)s * p.n_heads] - mu);
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
    for (uint32_t d = threadIdx.x; d < p.head_dim; d += MERGE_THREADS) {
        float a = 0.0f;
        for (uint32_t s = 0; s < p.n_states; ++s) {
            const float w = __expf(li[(uint64_t)s * p.n_heads] - mu);
            const float v = o_in[((t * p.n_states + s) * p.n_heads + h) * p.head_dim + d];
            a = w > 0.0f ? fmaf(w, v, a) : a;  // an empty state's O is never read into the sum
        }
        o[(t * p.n_heads + h) * p.head_dim + d] = a * inv;
    }
    if (p.write_lse && threadIdx.x == 0) lse[t * p.n_heads + h] = den > 0.0f ? mu + logf(den) : -INFINITY;
}
