// Merging partial attention states: n_states results (O_i normalised over its own keys,
// LSE_i the natural-log sum of its exponentiated logits) of the same query become
//   O = sum_i exp(LSE_i - M) O_i / (sum_i exp(LSE_i - M) + exp(sink - M)),
//   LSE = M + log(sum_i exp(LSE_i - M) + exp(sink - M)),   M = max(max_i LSE_i, sink),
// where the sink term is present only with has_sinks and a sink that is not NaN. States with LSE = -inf (no keys)
// weigh nothing; a row whose states are all empty (and has no sink) gets O = 0, LSE = -inf.
//
// Grid: (n_heads, n_tokens, ceil(head_dim / 4 / cols4)); block: MERGE_THREADS threads, for cols4
// float4 columns of one (token, head). The block first turns the LSEs into weights (in shared
// memory, MERGE_CHUNK states at a time; every column block of a row does this), then
// MERGE_THREADS / cols4 groups of threads each sum a share of the states with float4 loads (many
// loads in flight per thread), and the groups' sums are added through shared memory. Narrow column
// blocks spread a merge of few rows (one query, few heads) over many SMs.
// Bytes: n_states * (head_dim + 1) floats read, head_dim values of O (+ 1 float) written per (token, head).
// Programmatic dependent launch (decode's merge_apart, after the decode launch): every input is
// read and the outputs written after pdl_wait.
#pragma once

#include "common/pdl.cuh"
#include "common/reduce.cuh"
#include "common/types.cuh"
#include "attention/common.cuh"
#include "attention/params.cuh"

namespace cukern {
namespace attn {
constexpr int MERGE_THREADS = 128;
constexpr int MERGE_CHUNK = 512;  // state weights held in shared memory at a time
}  // namespace attn
}  // namespace cukern

// O: the merged output's type (float; or the 16-bit q/out type of a decode whose states merge apart).
template <typename O = float>
__global__ void __launch_bounds__(cukern::attn::MERGE_THREADS) merge_states(
    O* __restrict__ o,                // [n_tokens, n_heads, head_dim] merged output
    float* __restrict__ lse,          // [n_tokens, n_heads] merged natural-log LSE (write_lse only)
    const float* __restrict__ o_in,   // [n_tokens, n_states, n_heads, head_dim] normalised partial outputs
    const float* __restrict__ lse_in, // [n_tokens, n_states, n_heads] their natural-log LSE
    const float* __restrict__ sinks,  // [sink_offset + n_heads] natural-log sink logits, NaN: none (has_sinks only)
    const MergeParams p) {
    using namespace cukern;
    using namespace cukern::attn;
    constexpr int NT = MERGE_THREADS;
    __shared__ float w[MERGE_CHUNK];
    __shared__ float scratch[NT / WARP];
    __shared__ float4 part[NT];  // per-thread partial sums, reduced over the groups
    pdl_launch_dependents();
    pdl_wait();

    const uint32_t h = blockIdx.x;
    const uint64_t t = blockIdx.y;
    const uint32_t ns = p.n_states, nh = p.n_heads;
    const float* li = lse_in + t * ns * nh + h;  // state s at li[s * nh]

    const float sk = sink_logit(sinks, p.has_sinks, p.sink_offset + h);  // -inf: none
    float mx = sk;
    for (uint32_t s = threadIdx.x; s < ns; s += NT) mx = fmaxf(mx, li[(uint64_t)s * nh]);
    mx = block_max<NT>(mx, scratch);
    const float mu = safe_max(mx);

    const int d4 = (int)p.head_dim / 4;             // float4 columns of a head: 8 ... 128
    const int col0 = (int)(blockIdx.z * p.cols4);   // this block's columns [col0, col0 + dv)
    const int dv = min((int)p.cols4, d4 - col0);
    const int groups = NT / dv > 0 ? NT / dv : 1;   // thread groups splitting the states
    const int grp = threadIdx.x / dv, col = threadIdx.x % dv;
    const bool has_col = threadIdx.x < groups * dv;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float den = 0.0f;  // per-thread share of the denominator
    for (uint32_t c0 = 0; c0 < ns; c0 += MERGE_CHUNK) {
        const uint32_t cn = min((uint32_t)MERGE_CHUNK, ns - c0);
        __syncthreads();  // the previous chunk's weights are no longer read
        for (uint32_t s = threadIdx.x; s < cn; s += NT) {
            const float x = __expf(li[(uint64_t)(c0 + s) * nh] - mu);
            w[s] = x;
            den += x;
        }
        __syncthreads();
        if (has_col) {
            const float4* src =
                reinterpret_cast<const float4*>(o_in + ((t * ns + c0) * nh + h) * p.head_dim) + col0 + col;
            const uint64_t stride = (uint64_t)nh * d4;  // float4s between consecutive states
#pragma unroll 8
            for (uint32_t s = grp; s < cn; s += groups) {
                const float ws = w[s];
                if (ws > 0.0f) {  // an empty state's O is never read into the sum
                    const float4 x = src[s * stride];
                    acc.x = fmaf(ws, x.x, acc.x);
                    acc.y = fmaf(ws, x.y, acc.y);
                    acc.z = fmaf(ws, x.z, acc.z);
                    acc.w = fmaf(ws, x.w, acc.w);
                }
            }
        }
    }
    den = block_sum<NT>(den, scratch);
    if (sk > -INFINITY) den += __expf(sk - mu);
    part[threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.x < dv) {
        float4 sum = part[threadIdx.x];
        for (int gi = 1; gi < groups; ++gi) {
            const float4 x = part[gi * dv + threadIdx.x];
            sum.x += x.x;
            sum.y += x.y;
            sum.z += x.z;
            sum.w += x.w;
        }
        const float inv = den > 0.0f ? 1.0f / den : 0.0f;
        store4(o + (t * nh + h) * p.head_dim, col0 + threadIdx.x,
               make_float4(sum.x * inv, sum.y * inv, sum.z * inv, sum.w * inv));
    }
    if (p.write_lse && blockIdx.z == 0 && threadIdx.x == 0) lse[t * nh + h] = den > 0.0f ? mu + logf(den) : -INFINITY;
}
