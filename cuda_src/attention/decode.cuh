// Split-KV ("flash-decoding") attention of single query tokens over the paged KV cache.
//
// Grid: (n_splits, n_kv_heads * n_head_blocks, n_queries); block: DECODE_WARPS warps.
// A block reads one chunk of one sequence's K/V for one KV head and serves G query heads
// of its group from that single pass (GQA).
//
// Loads: K/V stream through shared memory in tiles of TK keys with cp.async, NS stages deep
// (about 64 KB of K/V in flight per block, so a few blocks per SM keep enough bytes in flight
// to cover the memory latency without holding them in registers). Every thread issues the
// 16-byte copies of a few rows of each tile (looking the rows up in the page table); rows past
// the chunk are zero-filled and masked.
// Compute: a warp covers a K/V row of D elements with LPK lanes (VPL 16-byte vectors each),
// so it takes KPW keys per step and S steps per tile. Each key group of a warp keeps its own
// online-softmax state (m, l, acc[D/LPK]); the states are merged across the warp with shuffles
// and across warps through shared memory at the end.
//
// n_splits == 1 writes the final O (and LSE, sinks included). n_splits > 1 writes each chunk's
// normalised (O_i, LSE_i) to the partial buffers; the last block of a (query, head block) to
// finish (an atomic counter per grid row, reset by that block, so the launch can be replayed
// in a CUDA graph) merges the n_splits states of its heads and adds the sinks once; or, with
// merge_apart, a merge_states launch after this one merges them (one block per query and head, so
// many SMs share a merge that one block would take long over: many splits, wide heads).
//
// Bytes: every visible K and V row once per (KV head, head block), q once, O once; with splits,
// the partial O / LSE once written and once read back (from L2) by the merging block.
#pragma once

#include "common/kv_cache.cuh"
#include "common/mma.cuh"
#include "common/pdl.cuh"
#include "common/sync.cuh"
#include "common/types.cuh"
#include "attention/common.cuh"  // before reduce.cuh: defines INFINITY, which NVRTC lacks
#include "attention/params.cuh"
#include "common/reduce.cuh"

namespace cukern {
namespace attn {

constexpr int DECODE_WARPS = 4;
constexpr int DECODE_PIPE_BYTES = 64 * 1024;  // K/V bytes of the stages of one block (target)

// How a block covers K/V rows of D elements of T (mirrored by _decode_smem in cukern/attention/plan.py;
// tests/test_attention.py checks the two agree).
template <typename T, int D, int G>
struct DecodeShape {
    static constexpr int NT = DECODE_WARPS * 32;
    static constexpr int VEC = vec_elems<T>();                      // elements per 16-byte load
    static constexpr int NV = D / VEC;                              // 16-byte vectors per row
    static constexpr int LPK = (NV & -NV) < 32 ? (NV & -NV) : 32;   // lanes per key: largest power of 2 dividing NV
    static constexpr int VPL = NV / LPK;                            // vectors per lane per key
    static constexpr int E = VPL * VEC;                             // elements per lane per key
    static constexpr int KPW = 32 / LPK;                            // keys one warp reads per step
    static constexpr int STEP = DECODE_WARPS * KPW;                 // keys the block reads per step
    static constexpr int S = (G >= 8 ? 2 : 4) / VPL > 0 ? (G >= 8 ? 2 : 4) / VPL : 1;  // steps per tile
    static constexpr int TK = S * STEP;                             // keys per tile
    static constexpr int STAGE_BYTES = 2 * TK * NV * 16;            // K and V of one tile
    static constexpr int NS = DECODE_PIPE_BYTES / STAGE_BYTES > 8 ? 8
                              : (DECODE_PIPE_BYTES / STAGE_BYTES < 2 ? 2 : DECODE_PIPE_BYTES / STAGE_BYTES);
    static constexpr int RED_BYTES = DECODE_WARPS * G * D * 4;      // per-warp O of the final merge
    static constexpr int SMEM = NS * STAGE_BYTES > RED_BYTES ? NS * STAGE_BYTES : RED_BYTES;
    static_assert(D % VEC == 0, "head_dim must be a multiple of the 16-byte vector");
};

// Position of query `qi` and its slot; the visible keys are [lo, hi) (empty when the query's position is below 0).
struct QueryRange {
    int32_t slot;
    int32_t lo;
    int32_t hi;
};

CUKERN_DEVICE QueryRange decode_range(const int32_t* __restrict__ lengths, const int32_t* __restrict__ page_table,
                                      const int32_t* __restrict__ seq_ids, const int32_t* __restrict__ q_indptr,
                                      uint32_t qi, const DecodeParams& p) {
    uint32_t s = qi;
    int32_t back = 0;  // queries after this one in its sequence
    if (p.batched) {   // largest s with q_indptr[s] <= qi
        uint32_t a = 0, b = p.n_seqs;  // invariant: q_indptr[a] <= qi < q_indptr[b]
        while (b - a > 1) {
            const uint32_t mid = (a + b) / 2;
            if ((uint32_t)q_indptr[mid] <= qi) a = mid; else b = mid;
        }
        s = a;
        back = q_indptr[s + 1] - 1 - (int32_t)qi;
    }
    QueryRange r;
    r.slot = p.kv_rows ? (int32_t)s : seq_ids[s];
    const int32_t kv_len = p.kv_rows ? lengths[s] - page_table[s] : lengths[r.slot];
    // bottom right: the last query of a sequence is its last cached token; top left (causal 2): query r at r
    const int32_t qpos = (p.batched && p.causal == 2 ? q_indptr[s + 1] - q_indptr[s] : kv_len) - 1 - back;
    r.hi = p.batched && !p.causal ? kv_len : min(qpos + 1, kv_len);  // top left: a row past the keys sees them all
    r.lo = p.window_left >= 0 ? max(0, qpos - p.window_left) : 0;
    return r;
}

// An online merge of states of one (head, float4 column): the running maximum mu of their
// natural-log LSEs, den = sum of exp(LSE_s - mu), a = sum of exp(LSE_s - mu) O_s.
struct MergeAcc {
    float mu = -INFINITY, den = 0.0f;
    float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // this lane's and its neighbour's (lane ^ 1) merges combined, in both lanes
    CUKERN_DEVICE void combine_pair() {
        const float mu1 = __shfl_xor_sync(0xffffffffu, mu, 1), den1 = __shfl_xor_sync(0xffffffffu, den, 1);
        float4 a1;
        a1.x = __shfl_xor_sync(0xffffffffu, a.x, 1);
        a1.y = __shfl_xor_sync(0xffffffffu, a.y, 1);
        a1.z = __shfl_xor_sync(0xffffffffu, a.z, 1);
        a1.w = __shfl_xor_sync(0xffffffffu, a.w, 1);
        const float m = fmaxf(mu, mu1), f0 = __expf(mu - safe_max(m)), f1 = __expf(mu1 - safe_max(m));
        mu = m;
        den = den * f0 + den1 * f1;
        a = make_float4(a.x * f0 + a1.x * f1, a.y * f0 + a1.y * f1, a.z * f0 + a1.z * f1, a.w * f0 + a1.w * f1);
    }
};

// Adds states first, first + step, ... (< ns) of one column to m: their LSEs (ls[s * nh]) and O columns
// (src[s * stride]) loaded MB at a time, all in flight together (an empty state has LSE -inf and O 0).
template <int MB>
CUKERN_DEVICE void merge_column(MergeAcc& m, const float4* src, uint64_t stride, const float* ls, uint32_t nh,
                                uint32_t first, uint32_t step, uint32_t ns) {
    for (uint32_t s0 = first; s0 < ns; s0 += MB * step) {
        float4 x[MB];
        float ll[MB];
#pragma unroll
        for (int u = 0; u < MB; ++u) {
            const uint32_t s = s0 + u * step;
            const bool ok = s < ns;
            ll[u] = ok ? __ldcg(ls + (uint64_t)s * nh) : -INFINITY;
            x[u] = ok ? __ldcg(src + s * stride) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        float mx = m.mu;
#pragma unroll
        for (int u = 0; u < MB; ++u) mx = fmaxf(mx, ll[u]);
        const float f = __expf(m.mu - safe_max(mx));  // rescales what was summed against the old maximum
        m.mu = mx;
        m.den *= f;
        m.a = make_float4(m.a.x * f, m.a.y * f, m.a.z * f, m.a.w * f);
#pragma unroll
        for (int u = 0; u < MB; ++u) {
            const float ws = __expf(ll[u] - safe_max(mx));
            m.den += ws;
            m.a.x = fmaf(ws, x[u].x, m.a.x);
            m.a.y = fmaf(ws, x[u].y, m.a.y);
            m.a.z = fmaf(ws, x[u].z, m.a.z);
            m.a.w = fmaf(ws, x[u].w, m.a.w);
        }
    }
}

// The end of every decode block. On entry (after a barrier) red[w][g][0..D) holds warp w's output of
// head g relative to its maximum sm_m[w][g] (base 2), with the sum of weights sm_l[w][g]. Combines the
// warps, then writes the final O / LSE (n_splits == 1, sinks added here) or the block's normalised
// partial state; in split mode the last block of the (query, head block) to finish (an acq_rel counter)
// merges the n_splits states (sinks added once) and leaves the counter zero for the next launch.
template <int D, int G, int WARPS, typename QO>
CUKERN_DEVICE void decode_finish(
    float* red,                              // shared [WARPS][G][D]
    const float (*sm_m)[G],                  // shared [WARPS][G] warp maxima (base 2)
    const float (*sm_l)[G],                  // shared [WARPS][G] warp sums of weights
    int* sm_last_p,                          // shared flag
    QO* __restrict__ o, float* __restrict__ lse, float* __restrict__ o_part, float* __restrict__ lse_part,
    int32_t* __restrict__ counters, const float* __restrict__ sinks, const DecodeParams& p, uint32_t qi,
    uint32_t split, uint32_t h0, int n_h) {
    constexpr int NT = WARPS * 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int& sm_last = *sm_last_p;
    const bool split_mode = p.n_splits > 1;
    for (int idx = threadIdx.x; idx < n_h * D; idx += NT) {
        const int g = idx / D, d = idx % D;
        float mx = -INFINITY;  // block maximum of head g
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w][g]);
        float L = 0.0f, a = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = exp2f(sm_m[w][g] - safe_max(mx));
            L += sm_l[w][g] * f;
            a += red[(w * G + g) * D + d] * f;
        }
        const float sk = split_mode ? -INFINITY : sink_logit(sinks, p.has_sinks, p.sink_offset + h0 + g);
        if (sk > -INFINITY) {  // the sink joins the denominator once, here or in the merge
            const float s2 = sk * LOG2E;
            const float m2 = fmaxf(mx, s2);
            const float f = exp2f(mx - m2);
            L = L * f + exp2f(s2 - m2);
            a *= f;
            mx = m2;
        }
        const float out = L > 0.0f ? a / L : 0.0f;
        const float lse2 = L > 0.0f ? (mx + log2f(L)) * LN2 : -INFINITY;
        if (split_mode) {
            const uint64_t row = ((uint64_t)qi * p.n_splits + split) * p.n_heads + h0 + g;
            o_part[row * D + d] = out;
            if (d == 0) lse_part[row] = lse2;
        } else {
            const uint64_t row = (uint64_t)qi * p.n_heads + h0 + g;
            o[row * D + d] = from_float<QO>(out);
            if (d == 0 && p.write_lse) lse[row] = lse2;
        }
    }
    if (!split_mode || p.merge_apart) return;  // merge_apart: merge_states, launched next, merges them

    // ---- split mode, merged in this launch by the last block of this (query, head block) to count: thread
    // 0's acq_rel add publishes the block's partials (every thread's stores, ordered before it by the
    // barrier: a release is cumulative) and, in the last block, acquires the other blocks' (the barrier
    // after it orders every thread's loads below): one atomic, no fence in every thread.
    __syncthreads();
    int32_t* const counter = counters + (uint64_t)qi * gridDim.y + blockIdx.y;
    if (threadIdx.x == 0) sm_last = atomic_add_acq_rel_gpu(counter, 1) == (int32_t)p.n_splits - 1;
    __syncthreads();
    if (!sm_last) return;
    // One (head, float4 column) per thread, or per pair of threads where the block has twice as many
    // threads as columns (each pair member merging every other state, the pair combined by a shuffle:
    // half the dependent chain after the loads).
    const uint32_t ns = p.n_splits, nh = p.n_heads;
    constexpr int D4 = D / 4;
    const int items = n_h * D4, parts = 2 * items <= NT ? 2 : 1;
    for (int base = 0; base < items * parts; base += NT) {  // the same trip count in every thread (shuffles)
        const int t = base + (int)threadIdx.x, part = t % parts, idx = t / parts;
        const bool active = idx < items;
        const int g = active ? idx / D4 : 0, c = idx % D4;
        const float4* src = reinterpret_cast<const float4*>(o_part + ((uint64_t)qi * ns * nh + h0 + g) * D) + c;
        const float* ls = lse_part + (uint64_t)qi * ns * nh + h0 + g;  // state s at ls[s * nh]
        MergeAcc m;  // the sink's exp(sink - mu) joins the denominator once
        m.mu = part == 0 && active ? sink_logit(sinks, p.has_sinks, p.sink_offset + h0 + g) : -INFINITY;
        m.den = m.mu > -INFINITY ? 1.0f : 0.0f;
        if (active) {
            if (parts == 2) merge_column<8>(m, src, (uint64_t)nh * D4, ls, nh, part, 2, ns);
            else merge_column<16>(m, src, (uint64_t)nh * D4, ls, nh, 0, 1, ns);
        }
        if (parts == 2) m.combine_pair();
        if (active && part == 0) {
            const float inv = m.den > 0.0f ? 1.0f / m.den : 0.0f;
            const uint64_t row = (uint64_t)qi * nh + h0 + g;
            store4(o + row * D, c, make_float4(m.a.x * inv, m.a.y * inv, m.a.z * inv, m.a.w * inv));
            if (c == 0 && p.write_lse) lse[row] = m.den > 0.0f ? m.mu + logf(m.den) : -INFINITY;
        }
    }
    // every block of this row has counted: ready for the next launch
    if (threadIdx.x == 0) *counter = 0;
}

}  // namespace attn
}  // namespace cukern

// One chunk of the visible keys of one query, for the G query heads [h0, h0 + G) of one KV head.
template <typename T, int D, int G, typename QO = float>
__global__ void __launch_bounds__(cukern::attn::DECODE_WARPS * 32, 2) decode(
    QO* __restrict__ o,                      // [n_queries, n_heads, D] final output
    float* __restrict__ lse,                 // [n_queries, n_heads] final natural-log LSE, sinks included (write_lse)
    float* __restrict__ o_part,              // n_splits > 1: [n_queries, n_splits, n_heads, D] normalised partial O
    float* __restrict__ lse_part,            // n_splits > 1: [n_queries, n_splits, n_heads] their natural-log LSE
    int32_t* __restrict__ counters,          // n_splits > 1: [n_queries * gridDim.y] zeros (left zero on exit)
    const QO* __restrict__ q,                // [n_queries, n_heads, D]
    const T* __restrict__ k_pool,            // [n_pages, page_size, n_kv_heads, D], or head-major [batch, n_kv_heads,
                                             //    capacity, D] (pages of capacity rows, sequence b's page
                                             //    b * n_kv_heads; strides in p); kv_rows: [n_k_total, n_kv_heads, D]
    const T* __restrict__ v_pool,            // the same layout as k_pool
    const int32_t* __restrict__ page_table,  // [n_slots, max_pages]; kv_rows: [n_seqs + 1] first row of each sequence
    const int32_t* __restrict__ lengths,     // [n_slots] cached tokens per slot; kv_rows: [n_seqs] end row of each
    const int32_t* __restrict__ seq_ids,     // [n_seqs] slot of each sequence (unused with kv_rows)
    const int32_t* __restrict__ q_indptr,    // [n_seqs + 1] query rows of each sequence (batched mode only)
    const float* __restrict__ sinks,         // [sink_offset + n_heads] sink logits, NaN: none (has_sinks only)
    const DecodeParams p) {
    using namespace cukern;
    using namespace cukern::attn;
    using Sh = DecodeShape<T, D, G>;
    constexpr int WARPS = DECODE_WARPS, NT = Sh::NT, LPK = Sh::LPK, VPL = Sh::VPL, VEC = Sh::VEC, E = Sh::E;
    constexpr int KPW = Sh::KPW, STEP = Sh::STEP, S = Sh::S, TK = Sh::TK, NS = Sh::NS, NV = Sh::NV;

    extern __shared__ uint4 smem_raw[];  // [NS][2][TK][D] K/V stages, later the merges' scratch
    T* const stages = reinterpret_cast<T*>(smem_raw);
    __shared__ float sm_m[WARPS][G];
    __shared__ float sm_l[WARPS][G];
    __shared__ int sm_last;

    uint32_t dyn_smem;  // the host mirrors SMEM (_decode_smem): a mismatch must fail loudly, not overrun
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
    if (dyn_smem < (uint32_t)Sh::SMEM) __trap();
    pdl_launch_dependents();  // under programmatic dependent launch: nothing is read before the wait
    pdl_wait();

    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int sub = lane / LPK;  // key of the warp's KPW this lane reads: 0 .. KPW-1
    const int gl = lane % LPK;   // lane within that key's group: 0 .. LPK-1

    const uint32_t qi = blockIdx.z;
    const uint32_t split = blockIdx.x;
    const uint32_t kvh = blockIdx.y / p.n_head_blocks;
    const uint32_t hb = blockIdx.y % p.n_head_blocks;
    const uint32_t h0 = kvh * p.group + hb * G;                 // first query head of this block
    const int n_h = min(G, (int)(p.group - hb * G));            // heads of this block that exist

    const QueryRange r = decode_range(lengths, page_table, seq_ids, q_indptr, qi, p);
    const int32_t c0 = r.lo + (int32_t)(split * p.chunk);
    const int32_t c1 = split + 1 == p.n_splits ? r.hi : min(r.hi, c0 + (int32_t)p.chunk);
    const int32_t n_tiles = c1 > c0 ? (c1 - c0 + TK - 1) / TK : 0;

    const int32_t* pt = page_table + (uint64_t)r.slot * p.max_pages;
    const uint64_t row_stride = p.row_stride;
    const int32_t row0 = p.kv_rows ? page_table[r.slot] : 0;  // kv_rows: the sequence's first row

    // Tile t (keys c0 + t TK ...) into a stage, in two parts: lookup() reads the page of each of this
    // thread's CH chunks (one tile ahead, so the page-table loads are in flight while a tile is
    // used), issue() starts the copies; keys past the chunk are zero-filled.
    constexpr int CH = (TK * NV + NT - 1) / NT;  // 16-byte chunks of a K (and of a V) tile per thread
    constexpr bool FULL = TK * NV % NT == 0;
    const uint64_t kv_off = (uint64_t)kvh * p.head_stride;
    auto key_of = [&](int i) { return (int)(threadIdx.x + i * NT) / NV; };
    auto lookup = [&](int32_t t, uint32_t (&page)[CH]) {
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            const uint32_t j = (uint32_t)min(c0 + t * TK + key_of(i), c1 - 1);
            page[i] = (FULL || threadIdx.x + i * NT < TK * NV) && !p.kv_rows
                          ? (uint32_t)pt[p.page_shift >= 0 ? j >> p.page_shift : j / p.page_size] : 0u;
        }
    };
    auto issue = [&](int32_t t, int st, const uint32_t (&page)[CH]) {
        T* ks = stages + (uint64_t)st * 2 * TK * D;
        T* vs = ks + TK * D;
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            const int c = threadIdx.x + i * NT;
            if (FULL || c < TK * NV) {
                const int key = c / NV, ch = c % NV;
                const int32_t j = c0 + t * TK + key;
                const uint32_t jj = (uint32_t)min(j, c1 - 1);
                const uint32_t in_page = p.page_shift >= 0 ? jj & (p.page_size - 1) : jj % p.page_size;
                const uint64_t row =
                    p.kv_rows ? (uint64_t)(row0 + (int32_t)jj) : (uint64_t)page[i] * p.page_size + in_page;
                const uint64_t off = row * row_stride + kv_off + ch * VEC;
                const uint32_t bytes = j < c1 ? 16u : 0u;
                cp_async16(ks + key * D + ch * VEC, k_pool + off, bytes);
                cp_async16(vs + key * D + ch * VEC, v_pool + off, bytes);
            }
        }
    };
    uint32_t page[CH];
#pragma unroll
    for (int st = 0; st < NS - 1; ++st) {  // the first NS - 1 tiles are in flight before q is read
        if (st < n_tiles) {
            lookup(st, page);
            issue(st, st, page);
        }
        cp_async_commit();
    }
    if (NS - 1 < n_tiles) lookup(NS - 1, page);  // the next tile to issue

    // q of the block's heads, the elements this lane multiplies: (gl + i * LPK) * VEC + e
    float qf[G][E];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const QO* qh = q + ((uint64_t)qi * p.n_heads + h0 + min(g, n_h - 1)) * D;
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
#pragma unroll
            for (int e4 = 0; e4 < VEC / 4; ++e4) {
                const float4 v = load4(qh + (gl + i * LPK) * VEC + 4 * e4);
                qf[g][i * VEC + 4 * e4 + 0] = v.x;
                qf[g][i * VEC + 4 * e4 + 1] = v.y;
                qf[g][i * VEC + 4 * e4 + 2] = v.z;
                qf[g][i * VEC + 4 * e4 + 3] = v.w;
            }
        }
    }

    float m[G], l[G], acc[G][E];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = 0.0f;
    }

    for (int32_t t = 0; t < n_tiles; ++t) {
        cp_async_wait<NS - 2>();  // tile t has landed (this thread's copies) ...
        __syncthreads();          // ... everyone's, and every warp is done with the stage refilled next
        if (t + NS - 1 < n_tiles) {
            issue(t + NS - 1, (t + NS - 1) % NS, page);
            if (t + NS < n_tiles) lookup(t + NS, page);
        }
        cp_async_commit();

        const T* ks = stages + (uint64_t)(t % NS) * 2 * TK * D;
        const T* vs = ks + TK * D;
        const int32_t t0 = c0 + t * TK;
        // scores of this warp's S keys of the tile, for every head (each key group reduces over its LPK lanes)
        float sc[S][G];
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const int key = s * STEP + warp * KPW + sub;
            float kf[E];
#pragma unroll
            for (int i = 0; i < VPL; ++i)
                widen(*reinterpret_cast<const uint4*>(ks + key * D + (gl + i * LPK) * VEC), (const T*)nullptr,
                      kf + i * VEC);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < E; ++e) d = fmaf(qf[g][e], kf[e], d);
#pragma unroll
                for (int off = LPK / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
                sc[s][g] = d;
            }
        }
        to_logits2<S * G>(&sc[0][0], p.scale_log2, p.softcap, p.inv_softcap);
#pragma unroll
        for (int s = 0; s < S; ++s) {  // keys past the chunk (zero-filled) weigh nothing
            if (t0 + s * STEP + warp * KPW + sub >= c1) {
#pragma unroll
                for (int g = 0; g < G; ++g) sc[s][g] = -INFINITY;
            }
        }
        // online softmax: one rescale per tile, skipped when no head's maximum moved in the warp
        float mu[G], corr[G];
        bool moved = false;
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = m[g];
#pragma unroll
            for (int s = 0; s < S; ++s) mx = fmaxf(mx, sc[s][g]);
            mu[g] = safe_max(mx);
            corr[g] = fast_exp2(m[g] - mu[g]);
            moved |= corr[g] != 1.0f;
            m[g] = mx;
            l[g] *= corr[g];
        }
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int e = 0; e < E; ++e) acc[g][e] *= corr[g];
        }
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const int key = s * STEP + warp * KPW + sub;
            float vf[E];
#pragma unroll
            for (int i = 0; i < VPL; ++i)
                widen(*reinterpret_cast<const uint4*>(vs + key * D + (gl + i * LPK) * VEC), (const T*)nullptr,
                      vf + i * VEC);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float pu = fast_exp2(sc[s][g] - mu[g]);
                l[g] += pu;
#pragma unroll
                for (int e = 0; e < E; ++e) acc[g][e] = fmaf(pu, vf[e], acc[g][e]);
            }
        }
    }
    cp_async_wait<0>();  // (only empty groups can be left) the stages become the merge scratch
    __syncthreads();

    // merge the KPW key groups of the warp (lanes with equal gl hold the same elements)
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float mw = m[g];
#pragma unroll
        for (int off = LPK; off < 32; off <<= 1) mw = fmaxf(mw, __shfl_xor_sync(0xffffffffu, mw, off));
        const float f = exp2f(m[g] - safe_max(mw));
        l[g] *= f;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] *= f;
#pragma unroll
        for (int off = LPK; off < 32; off <<= 1) {
            l[g] += __shfl_xor_sync(0xffffffffu, l[g], off);
#pragma unroll
            for (int e = 0; e < E; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], off);
        }
        m[g] = mw;
    }
    // merge the warps through shared memory: red[warp][g][d] (relative to the warp's own maximum)
    float* const red = reinterpret_cast<float*>(smem_raw);
    if (sub == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int i = 0; i < VPL; ++i)
#pragma unroll
                for (int e4 = 0; e4 < VEC / 4; ++e4) {
                    const int e = i * VEC + 4 * e4;
                    *reinterpret_cast<float4*>(red + (warp * G + g) * D + (gl + i * LPK) * VEC + 4 * e4) =
                        make_float4(acc[g][e], acc[g][e + 1], acc[g][e + 2], acc[g][e + 3]);
                }
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            sm_m[warp][g] = m[g];
            sm_l[warp][g] = l[g];
        }
    }
    __syncthreads();
    decode_finish<D, G, WARPS>(red, sm_m, sm_l, &sm_last, o, lse, o_part, lse_part, counters, sinks, p,
                               qi, split, h0, n_h);
}
