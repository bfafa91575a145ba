// Sampling: the next token of every row of a logit matrix, chosen on the device.
//   topk_chunk<K>    stage 1, grid (n_chunks, n_rows): the best K logits of a chunk of one row
//                    (K == 1: argmax by a block reduction; K == SAMPLE_MAX_K: bitonic sort in
//                    shared memory), written as (value, id) candidates [n_rows, n_chunks, K]
//   sample_rows<K>   stage 2, grid (n_rows): merges a row's candidates; greedy takes the best,
//                    otherwise softmax(value / T) over the top_k best, nucleus cut at top_p, and
//                    one uniform draw from a counter-based hash (seed, row, draw number)
//   advance_positions  positions[r] += 1; lengths[seq_ids[r]] = positions[r] + 1
// Order: larger value first, lower id first on ties (so greedy is argmax with the lowest id);
// NaN logits count as -inf. Bytes: stage 1 reads the logits once (4 * n_cols per row).
#pragma once

#include "common/pdl.cuh"
#include "common/types.cuh"
#include "tokens/params.cuh"

namespace cukern {
namespace tokens {

constexpr int SAMPLE_MAX_K = 64;      // top_k limit of the sampling path
constexpr int SORT_ELEMS = 4096;      // shared-memory sort size of both stages (32 KiB of (value, id))
constexpr int THREADS = 256;

CUKERN_DEVICE float neg_inf() { return __int_as_float(0xff800000); }

// true when candidate a (value va, id ia) ranks before b
CUKERN_DEVICE bool before(float va, int32_t ia, float vb, int32_t ib) {
    return va > vb || (va == vb && ia < ib);
}

CUKERN_DEVICE float clean(float x) { return x != x ? neg_inf() : x; }

// Sort n (a power of two <= SORT_ELEMS) pairs in shared memory, best first.
CUKERN_DEVICE void bitonic_sort(float* val, int32_t* idx, int n) {
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int t = threadIdx.x; t < n / 2; t += blockDim.x) {
                const int i = 2 * t - (t & (stride - 1));    // first of the pair (i, i + stride)
                const int j = i + stride;
                const bool up = (i & size) == 0;             // this run is sorted best-first
                const bool swap = up ? before(val[j], idx[j], val[i], idx[i])
                                     : before(val[i], idx[i], val[j], idx[j]);
                if (swap) {
                    const float v = val[i]; val[i] = val[j]; val[j] = v;
                    const int32_t k = idx[i]; idx[i] = idx[j]; idx[j] = k;
                }
            }
        }
    }
    __syncthreads();
}

// Best (value, id) over the block; every thread gets the result.
CUKERN_DEVICE void block_argmax(float& v, int32_t& id, float* s_val, int32_t* s_idx) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, off);
        const int32_t oi = __shfl_xor_sync(0xffffffffu, id, off);
        if (before(ov, oi, v, id)) { v = ov; id = oi; }
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) { s_val[warp] = v; s_idx[warp] = id; }
    __syncthreads();
    v = lane < blockDim.x / 32 ? s_val[lane] : neg_inf();
    id = lane < blockDim.x / 32 ? s_idx[lane] : 0x7fffffff;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, off);
        const int32_t oi = __shfl_xor_sync(0xffffffffu, id, off);
        if (before(ov, oi, v, id)) { v = ov; id = oi; }
    }
}

CUKERN_DEVICE uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

}  // namespace tokens
}  // namespace cukern

using namespace cukern::tokens;

template <int K>
__global__ void __launch_bounds__(THREADS) topk_chunk(
    float* __restrict__ cand_val,          // [n_rows, n_chunks, K] best values of each chunk
    int32_t* __restrict__ cand_idx,        // [n_rows, n_chunks, K] their token ids (0x7fffffff: none)
    const float* __restrict__ logits,      // [n_rows, n_cols]
    const SampleParams p) {
    cukern::pdl_enter();
    __shared__ float s_val[K == 1 ? 32 : SORT_ELEMS];
    __shared__ int32_t s_idx[K == 1 ? 32 : SORT_ELEMS];
    const uint32_t row = blockIdx.y, c = blockIdx.x;
    const float* x = logits + (uint64_t)row * p.n_cols;
    const uint32_t begin = c * p.chunk;
    const uint32_t end = min(begin + p.chunk, p.n_cols);
    float* out_v = cand_val + ((uint64_t)row * p.n_chunks + c) * K;
    int32_t* out_i = cand_idx + ((uint64_t)row * p.n_chunks + c) * K;
    if constexpr (K == 1) {
        float v = neg_inf();
        int32_t id = 0x7fffffff;
        for (uint32_t i = begin + threadIdx.x; i < end; i += THREADS) {
            const float xi = clean(__ldg(x + i));
            if (before(xi, (int32_t)i, v, id)) { v = xi; id = (int32_t)i; }
        }
        block_argmax(v, id, s_val, s_idx);
        if (threadIdx.x == 0) { out_v[0] = v; out_i[0] = id; }
    } else {
        // p.chunk <= SORT_ELEMS, a power of two (host-checked)
        for (uint32_t t = threadIdx.x; t < p.chunk; t += THREADS) {
            const uint32_t i = begin + t;
            s_val[t] = i < end ? clean(__ldg(x + i)) : neg_inf();
            s_idx[t] = i < end ? (int32_t)i : 0x7fffffff;
        }
        bitonic_sort(s_val, s_idx, p.chunk);
        for (int t = threadIdx.x; t < K; t += THREADS) {
            out_v[t] = t < (int)p.chunk ? s_val[t] : neg_inf();
            out_i[t] = t < (int)p.chunk ? s_idx[t] : 0x7fffffff;
        }
    }
}

template <int K>
__global__ void __launch_bounds__(THREADS) sample_rows(
    int32_t* __restrict__ next_ids,        // [n_rows] chosen token (the next step's input)
    int32_t* __restrict__ history,         // [n_rows, history_len] chosen tokens by draw number (if history_len)
    int32_t* __restrict__ draws,           // [n_rows] draws made so far: RNG counter and history column, +1 here
    const float* __restrict__ cand_val,    // [n_rows, n_chunks, K] from topk_chunk<K>
    const int32_t* __restrict__ cand_idx,  // [n_rows, n_chunks, K]
    const SampleParams p) {
    cukern::pdl_enter();
    __shared__ float s_val[K == 1 ? 32 : SORT_ELEMS];
    __shared__ int32_t s_idx[K == 1 ? 32 : SORT_ELEMS];
    const uint32_t row = blockIdx.x;
    const uint32_t n = p.n_chunks * K;
    const float* cv = cand_val + (uint64_t)row * n;
    const int32_t* ci = cand_idx + (uint64_t)row * n;
    int32_t chosen;
    if constexpr (K == 1) {
        float v = neg_inf();
        int32_t id = 0x7fffffff;
        for (uint32_t i = threadIdx.x; i < n; i += THREADS)
            if (before(cv[i], ci[i], v, id)) { v = cv[i]; id = ci[i]; }
        block_argmax(v, id, s_val, s_idx);
        chosen = id == 0x7fffffff ? 0 : id;    // every logit NaN/-inf: token 0
    } else {
        uint32_t m = 1;
        while (m < n) m <<= 1;                 // n <= SORT_ELEMS (host-checked)
        for (uint32_t t = threadIdx.x; t < m; t += THREADS) {
            s_val[t] = t < n ? cv[t] : neg_inf();
            s_idx[t] = t < n ? ci[t] : 0x7fffffff;
        }
        bitonic_sort(s_val, s_idx, (int)m);
        chosen = s_idx[0] == 0x7fffffff ? 0 : s_idx[0];
        if (p.inv_temperature > 0.0f && s_val[0] > neg_inf()) {
            // one thread: at most SAMPLE_MAX_K candidates, sorted best first
            __shared__ int32_t s_chosen;
            if (threadIdx.x == 0) {
                const int k = (int)min(p.top_k, (uint32_t)K);
                float prob[K];
                float total = 0.0f;
                for (int i = 0; i < k; ++i) {
                    prob[i] = s_idx[i] == 0x7fffffff ? 0.0f : __expf((s_val[i] - s_val[0]) * p.inv_temperature);
                    total += prob[i];
                }
                int keep = k;                  // nucleus: the fewest best candidates reaching top_p
                float run = 0.0f;
                for (int i = 0; i < k; ++i) {
                    run += prob[i];
                    if (run >= p.top_p * total) { keep = i + 1; total = run; break; }
                }
                const int32_t draw = draws[row];
                const uint64_t h = splitmix64(p.seed ^ splitmix64(((uint64_t)row << 32) | (uint32_t)draw));
                const float u = (float)(h >> 40) * (1.0f / 16777216.0f) * total;   // [0, total)
                int pick = keep - 1;
                run = 0.0f;
                for (int i = 0; i < keep; ++i) {
                    run += prob[i];
                    if (u < run) { pick = i; break; }
                }
                s_chosen = s_idx[pick];
            }
            __syncthreads();
            chosen = s_chosen;
        }
    }
    if (threadIdx.x == 0) {
        next_ids[row] = chosen;
        const int32_t draw = draws[row];
        if (p.history_len && draw >= 0 && (uint32_t)draw < p.history_len)
            history[(uint64_t)row * p.history_len + draw] = chosen;
        draws[row] = draw + 1;
    }
}

extern "C" __global__ void advance_positions(
    int32_t* __restrict__ positions,       // [n_rows] position of each row's next input token, += 1
    int32_t* __restrict__ lengths,         // [max_seqs] cached tokens per sequence slot (PagedKVCache.lengths)
    const int32_t* __restrict__ seq_ids,   // [n_rows] slot of each row
    const AdvanceParams p) {
    cukern::pdl_enter();
    const uint32_t r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= p.n_rows) return;
    const int32_t next = positions[r] + 1;
    positions[r] = next;
    lengths[seq_ids[r]] = next + 1;
}
