// Sampling: the next token of every row of a logit matrix, chosen on the device.
//   topk_chunk<1>    stage 1 of greedy, grid (n_chunks, n_rows), block THREADS, 256 B shared: the argmax of
//                    a chunk of one row by a block reduction, written as (value, id) [n_rows, 1, n_chunks]
//   topk_chunk<64>   stage 1 of sampling, grid (n_chunks, n_rows), block THREADS (4 blocks per SM: at most
//                    64 registers), 2.2 KiB shared: the best 64 of a chunk of 64 ... MAX_CHUNK logits by
//                    block_top64, written best first to [n_rows, SAMPLE_MAX_K, n_chunks] (slot-major)
//   sample_rows<K>   stage 2, grid (n_rows), block THREADS, 2.2 KiB shared (K == 1: 256 B): merges a row's
//                    candidates (K == 1: a block argmax; K == 64: block_top64 over its 64 * n_chunks);
//                    greedy takes the best, otherwise softmax(value / T) over the top_k best, nucleus cut
//                    at top_p, and one uniform draw from a counter-based hash (seed, row, draw number)
//   advance_positions  positions[r] += 1; lengths[seq_ids[r]] = positions[r] + 1
// Order: larger value first, lower id first on ties (so greedy is argmax with the lowest id); NaN logits
// count as -inf; +0 and -0 are equal (and, under CuPy's -ftz, so are denormals and zero).
// Bytes per row: stage 1 reads the logits once (4 * n_cols) and writes 8 * 64 * n_chunks (K == 1: 8 *
// n_chunks); stage 2 reads the candidate values once (4 * 64 * n_chunks) and the ids of the 64 it keeps
// (of more only at a tie at the 64th value).
//
// block_top64 (a selection; nothing is sorted but the 64 chosen): every thread holds its items' order
// keys in registers (item j of thread t is element j * THREADS + t of the block's input; key 0: absent)
//   1. bound: every warp sorts its 32 lane maxima and takes the (64 / WARPS)-th; the smallest of those
//      8 values is reached by 64 distinct items, so the best 64 all have key >= bound. That leaves about
//      100 candidates of a 2048-logit chunk of random logits; in stage 2 (slot-major input: at 128 chunks
//      thread t holds every other slot of chunk t % 128) the lane maxima are chunk maxima, as selective;
//   2. radix select over the candidates: 8-bit digit histograms in shared memory, most significant digit
//      first, until the bin that holds the 64th best holds exactly as many as are still needed (or all 4
//      digits are known: then they are the 64th key T);
//   3. a tie at T (more items with key T than still needed): the same radix select over ~id among them
//      keeps the lowest ids; items equal in key and id (stage 1's pads only) are taken first come;
//   4. the 64 chosen go to shared memory (a warp-aggregated counter gives the slots), and each one's
//      output position is its rank: the number of chosen items that order before it.
// Stage 1 pads a chunk past the end of the row with (-inf, NO_ID) items (they order after every logit,
// -inf included), so every chunk emits 64 candidates and stage 2 always finds 64.
// tests/test_tokens.py emulates block_top64 step by step on the CPU (test_selection_emulation_*).
#pragma once

#include "common/pdl.cuh"
#include "common/reduce.cuh"
#include "common/types.cuh"
#include "tokens/params.cuh"

namespace cukern {
namespace tokens {

constexpr int SAMPLE_MAX_K = 64;                                  // top_k limit of the sampling path
constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr int CHUNK_ITEMS = 16;                                   // stage-1 logits per thread, at most
constexpr int MERGE_ITEMS = 32;                                   // stage-2 candidates per thread, at most
constexpr int MAX_CHUNK = THREADS * CHUNK_ITEMS;                  // 4096 logits per stage-1 block
constexpr int MAX_CHUNKS = THREADS * MERGE_ITEMS / SAMPLE_MAX_K;  // 128 chunks per row
constexpr int32_t NO_ID = 0x7fffffff;                             // id of a pad (no logit)
static_assert(THREADS == 4 * SAMPLE_MAX_K, "block_top64 ranks each chosen item with 4 threads");
static_assert(SAMPLE_MAX_K % WARPS == 0 && SAMPLE_MAX_K / WARPS <= 32, "bound: 64 / WARPS lanes per warp");
static_assert(THREADS == 256, "radix select: one 8-bit digit bin per thread");
static_assert(MERGE_ITEMS <= 32 && CHUNK_ITEMS <= MERGE_ITEMS, "items per thread");

CUKERN_DEVICE float neg_inf() { return __int_as_float(0xff800000); }

// true when candidate a (value va, id ia) ranks before b
CUKERN_DEVICE bool before(float va, int32_t ia, float vb, int32_t ib) {
    return va > vb || (va == vb && ia < ib);
}

CUKERN_DEVICE float clean(float x) { return x != x ? neg_inf() : x; }

// Order key of a logit: key(a) > key(b) exactly when clean(a) > clean(b), equal keys for equal values
// (both zeros, and denormals under -ftz, map to +0's key). Every key is > 0: 0 marks an absent item.
CUKERN_DEVICE uint32_t order_key(float x) {
    x = clean(x);
    uint32_t b = __float_as_uint(x);
    if (x == 0.0f) b = 0u;                   // a float comparison: follows the unit's ftz like before()
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The value of an order key (zeros come back as +0).
CUKERN_DEVICE float key_value(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

constexpr uint32_t PAD_KEY = 0x007fffffu;    // order_key(-inf)

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

// The warp's 32 values sorted largest first: lane i gets the i-th largest (bitonic network). The whole
// warp calls it.
CUKERN_DEVICE uint32_t warp_sort_desc(uint32_t v) {
    const uint32_t lane = threadIdx.x % 32;
#pragma unroll
    for (int size = 2; size <= 32; size <<= 1) {
#pragma unroll
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            const uint32_t o = __shfl_xor_sync(0xffffffffu, v, stride);
            const bool desc = (lane & size) == 0;            // this run sorts largest first (size 32: all)
            const bool low = (lane & stride) == 0;           // the lower lane of the pair
            v = desc == low ? max(v, o) : min(v, o);
        }
    }
    return v;
}

// hist[d] += 1 for every lane of the warp with `in`: one atomic when all those lanes share the digit
// (runs of equal keys), else one per lane. The whole warp calls it.
CUKERN_DEVICE void warp_count(uint32_t* hist, uint32_t d, bool in) {
    const uint32_t act = __ballot_sync(0xffffffffu, in);
    if (act == 0) return;
    const int leader = __ffs(act) - 1;
    const uint32_t d0 = __shfl_sync(0xffffffffu, d, leader);
    if (__all_sync(0xffffffffu, !in || d == d0)) {
        if ((int)(threadIdx.x % 32) == leader) atomicAdd(hist + d0, (uint32_t)__popc(act));
    } else if (in) {
        atomicAdd(hist + d, 1u);
    }
}

// Shared memory of block_top64.
struct SelectShared {
    uint32_t hist[THREADS];                  // digit counts of one radix pass (bin d: digit d); 0 between passes
    uint32_t scan[32];                       // block_exclusive_scan scratch
    uint32_t bound[WARPS];                   // each warp's bound (step 1)
    uint32_t digit, need, tied;              // result of a radix pass, broadcast
    uint32_t n_sel;                          // chosen items written to sel_*
    uint32_t n_dup;                          // items equal in key and id met at the last tie
    uint32_t sel_key[SAMPLE_MAX_K];          // chosen items, in no particular order
    int32_t sel_id[SAMPLE_MAX_K];
    float top_val[SAMPLE_MAX_K];             // the result: the best 64, best first
    int32_t top_id[SAMPLE_MAX_K];
};

// Radix select over the block: the need-th largest (need >= 1) of kof(j) over this thread's items j <
// per for which part(j) holds (at least need such items in the block). On return, in every thread:
// mask covers the known digits from the top, the items with (kof & mask) > prefix number (need on entry
// - need on return) and are all among the best; the `tied` >= need items with (kof & mask) == prefix
// hold the rest; tied == need, or mask == ~0u (prefix is the need-th key). s.hist is zero on entry and
// on return.
template <int ITEMS, class Part, class KeyOf>
CUKERN_DEVICE void radix_select(int per, Part part, KeyOf kof, uint32_t& prefix, uint32_t& mask, uint32_t& need,
                                uint32_t& tied, SelectShared& s) {
    prefix = 0u;
    mask = 0u;
    for (int shift = 24; shift >= 0; shift -= 8) {
#pragma unroll
        for (int j = 0; j < ITEMS; ++j) {
            if (j < per) {
                const bool in = part(j);
                const uint32_t k = in ? kof(j) : 0u;          // kof may load (an id): only for counted items
                warp_count(s.hist, (k >> shift) & 0xffu, in && (k & mask) == prefix);
            }
        }
        __syncthreads();
        const uint32_t d = THREADS - 1 - threadIdx.x;      // thread 0 holds the largest digit
        const uint32_t h = s.hist[d];
        uint32_t total;
        const uint32_t above = cukern::block_exclusive_scan(h, s.scan, &total);   // items with a larger digit
        s.hist[d] = 0u;                                   // only this thread reads bin d
        if (above < need && need <= above + h) { s.digit = d; s.need = need - above; s.tied = h; }
        __syncthreads();
        prefix |= s.digit << shift;
        mask |= 0xffu << shift;
        need = s.need;
        tied = s.tied;
        if (tied == need) break;                          // the whole bin is in
    }
}

// The best SAMPLE_MAX_K items of the block, best first, into s.top_val / s.top_id (see the file
// header). key[j]: order key of element j * THREADS + threadIdx.x (0: absent), set for j < per <= ITEMS;
// at least SAMPLE_MAX_K items present in the block. id_of(j): that element's id. Every thread calls it;
// the result is visible to every thread on return.
template <int ITEMS, class IdOf>
CUKERN_DEVICE void block_top64(const uint32_t (&key)[ITEMS], int per, IdOf id_of, SelectShared& s) {
    constexpr int K = SAMPLE_MAX_K;
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    // 1. bound
    uint32_t m = 0u;
#pragma unroll
    for (int j = 0; j < ITEMS; ++j)
        if (j < per) m = max(m, key[j]);
    m = warp_sort_desc(m);
    if (lane == K / WARPS - 1) s.bound[warp] = m;
    s.hist[threadIdx.x] = 0u;
    if (threadIdx.x == 0) { s.n_sel = 0u; s.n_dup = 0u; }
    __syncthreads();
    uint32_t bound = s.bound[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) bound = min(bound, s.bound[w]);
    auto cand = [&](int j) { return key[j] != 0u && key[j] >= bound; };
    // 2. radix select over the keys
    uint32_t prefix, mask, need = K, tied;
    radix_select<ITEMS>(per, cand, [&](int j) { return key[j]; }, prefix, mask, need, tied, s);
    // 3. a tie at the 64th key (then mask == ~0u): lowest ids first, by a radix select over ~id
    const bool by_id = tied != need;
    uint32_t prefix2 = 0u, mask2 = 0u, need2 = need, tied2 = need;
    if (by_id)
        radix_select<ITEMS>(per, [&](int j) { return cand(j) && key[j] == prefix; },
                            [&](int j) { return ~(uint32_t)id_of(j); }, prefix2, mask2, need2, tied2, s);
    // 4. the chosen items into sel_*, then each to its rank
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        if (j < per) {
            bool take = false;
            if (cand(j)) {
                const uint32_t k = key[j] & mask;
                if (k > prefix) {
                    take = true;
                } else if (k == prefix) {
                    if (!by_id) {
                        take = true;
                    } else {
                        const uint32_t k2 = ~(uint32_t)id_of(j) & mask2;
                        take = k2 > prefix2 ||
                               (k2 == prefix2 && (tied2 == need2 || atomicAdd(&s.n_dup, 1u) < need2));
                    }
                }
            }
            const uint32_t bal = __ballot_sync(0xffffffffu, take);
            if (bal != 0u) {
                uint32_t base = 0u;
                if (lane == 0) base = atomicAdd(&s.n_sel, (uint32_t)__popc(bal));
                base = __shfl_sync(0xffffffffu, base, 0);
                const uint32_t slot = base + __popc(bal & ((1u << lane) - 1u));
                if (take && slot < K) { s.sel_key[slot] = key[j]; s.sel_id[slot] = id_of(j); }
            }
        }
    }
    __syncthreads();
    {
        const int i = threadIdx.x / 4, part = threadIdx.x % 4;    // 4 threads rank chosen item i
        const uint32_t ki = s.sel_key[i];
        const int32_t ii = s.sel_id[i];
        uint32_t r = 0u;
#pragma unroll
        for (int c = part * (K / 4); c < (part + 1) * (K / 4); ++c) {
            const uint32_t kc = s.sel_key[c];
            const int32_t ic = s.sel_id[c];
            r += kc > ki || (kc == ki && (ic < ii || (ic == ii && c < i)));
        }
        r += __shfl_xor_sync(0xffffffffu, r, 1);
        r += __shfl_xor_sync(0xffffffffu, r, 2);
        if (part == 0) { s.top_val[r] = key_value(ki); s.top_id[r] = ii; }
    }
    __syncthreads();
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
__global__ void __launch_bounds__(THREADS, 4) topk_chunk(
    float* __restrict__ cand_val,          // [n_rows, n_chunks] (K == 1) or [n_rows, K, n_chunks]: best values, best first
    int32_t* __restrict__ cand_idx,        // same shape: their token ids (NO_ID: a pad)
    const float* __restrict__ logits,      // [n_rows, n_cols]
    const SampleParams p) {
    cukern::pdl_enter();
    const uint32_t row = blockIdx.y, c = blockIdx.x;
    const float* x = logits + (uint64_t)row * p.n_cols;
    const uint32_t begin = c * p.chunk;
    if constexpr (K == 1) {
        __shared__ float s_val[32];
        __shared__ int32_t s_idx[32];
        const uint32_t end = min(begin + p.chunk, p.n_cols);
        float v = neg_inf();
        int32_t id = 0x7fffffff;
        for (uint32_t i = begin + threadIdx.x; i < end; i += THREADS) {
            const float xi = clean(__ldg(x + i));
            if (before(xi, (int32_t)i, v, id)) { v = xi; id = (int32_t)i; }
        }
        block_argmax(v, id, s_val, s_idx);
        if (threadIdx.x == 0) {
            cand_val[(uint64_t)row * p.n_chunks + c] = v;
            cand_idx[(uint64_t)row * p.n_chunks + c] = id;
        }
    } else {
        static_assert(K == SAMPLE_MAX_K, "sampling keeps SAMPLE_MAX_K candidates per chunk");
        __shared__ SelectShared s;
        if (p.chunk < K || p.chunk > MAX_CHUNK) __trap();   // host-checked (SamplePlan)
        const int per = (int)((p.chunk + THREADS - 1) / THREADS);
        // item j of this thread: chunk position q = j * THREADS + threadIdx.x; past the row: a pad
        uint32_t key[CHUNK_ITEMS];
#pragma unroll
        for (int j = 0; j < CHUNK_ITEMS; ++j) {
            const uint32_t q = j * THREADS + threadIdx.x;
            key[j] = 0u;
            if (j < per && q < p.chunk) key[j] = begin + q < p.n_cols ? order_key(__ldg(x + begin + q)) : PAD_KEY;
        }
        block_top64<CHUNK_ITEMS>(key, per, [&](int j) {
            const uint32_t i = begin + j * THREADS + threadIdx.x;
            return i < p.n_cols ? (int32_t)i : NO_ID;
        }, s);
        if (threadIdx.x < K) {                // slot-major: slot r of chunk c at [row, r, c]
            const uint64_t o = ((uint64_t)row * K + threadIdx.x) * p.n_chunks + c;
            cand_val[o] = s.top_val[threadIdx.x];
            cand_idx[o] = s.top_id[threadIdx.x];
        }
    }
}

template <int K>
__global__ void __launch_bounds__(THREADS, 1) sample_rows(
    int32_t* __restrict__ next_ids,        // [n_rows] chosen token (the next step's input)
    int32_t* __restrict__ history,         // [n_rows, history_len] chosen tokens by draw number (if history_len)
    int32_t* __restrict__ draws,           // [n_rows] draws made so far: RNG counter and history column, +1 here
    const float* __restrict__ cand_val,    // from topk_chunk<K>: [n_rows, n_chunks] or [n_rows, K, n_chunks]
    const int32_t* __restrict__ cand_idx,  // same shape
    const SampleParams p) {
    cukern::pdl_enter();
    const uint32_t row = blockIdx.x;
    const uint32_t n = p.n_chunks * K;
    const float* cv = cand_val + (uint64_t)row * n;
    const int32_t* ci = cand_idx + (uint64_t)row * n;
    int32_t chosen;
    if constexpr (K == 1) {
        __shared__ float s_val[32];
        __shared__ int32_t s_idx[32];
        float v = neg_inf();
        int32_t id = 0x7fffffff;
        for (uint32_t i = threadIdx.x; i < n; i += THREADS)
            if (before(cv[i], ci[i], v, id)) { v = cv[i]; id = ci[i]; }
        block_argmax(v, id, s_val, s_idx);
        chosen = id == 0x7fffffff ? 0 : id;    // every logit NaN/-inf: token 0
    } else {
        __shared__ SelectShared s;
        if (n > THREADS * MERGE_ITEMS) __trap();   // host-checked (SamplePlan): n_chunks <= MAX_CHUNKS
        const int per = (int)((n + THREADS - 1) / THREADS);
        uint32_t key[MERGE_ITEMS];               // item j: candidate j * THREADS + threadIdx.x
#pragma unroll
        for (int j = 0; j < MERGE_ITEMS; ++j) {
            const uint32_t e = j * THREADS + threadIdx.x;
            key[j] = j < per && e < n ? order_key(cv[e]) : 0u;
        }
        block_top64<MERGE_ITEMS>(key, per, [&](int j) { return ci[j * THREADS + threadIdx.x]; }, s);
        const float* s_val = s.top_val;
        const int32_t* s_idx = s.top_id;
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
