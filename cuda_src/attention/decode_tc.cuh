// Split-KV decode on tensor cores, for f16 / bf16 caches with head_dim up to 256.
//
// Grid: (n_splits, n_kv_heads * n_head_blocks, n_queries) as in decode.cuh; block: NW warps (4: two
// blocks per SM; 8: one block per SM, for launches of about one block per SM). A block serves up to
// G = 8 query heads of one KV head over one chunk of keys.
//
// The mma tile: the m16n8k16 A operand holds the block's query heads as rows, each head twice, in
// two halves of an f32-accurate split (rows 0-7: hi = T(x), rows 8-15: lo = T(x - hi); split2 in
// common.cuh). So one mma yields, in the accumulator of each lane (row g = lane / 4), both halves
// of the product for head g, and their sum is the f32 product to ~2^-22:
//   S = Q K^T   A = [q_hi; q_lo] (registers, loaded once), B = K from shared memory (ldmatrix);
//   O += P V    A = [p_hi; p_lo] built in the lane that holds S (no shuffles), B = V (ldmatrix.trans).
// Q is scaled by scale * log2(e) (and a power of two that keeps it in f16 range) before the split,
// so S is already a base-2 logit. The online softmax runs on the S fragments: a lane holds 4 scores
// of its head, the quad of lanes of one head shares its running maximum.
//
// Loads: every warp streams its own tiles of KW = 16 keys (the warp's i-th tile is tile
// i * NW + warp of the chunk) through its own ring of NS shared-memory stages with cp.async; lanes
// 0-15 look up the pool rows of the tile's keys one tile ahead and hand them out by shuffles. No
// block barrier until the end: a warp waits for its own copies only.
//
// Splits: each block writes its chunk's normalised state, and one block of the (query, head block) merges
// them in the same launch (decode_finish): the last to finish, by an acq_rel counter.
//
// Bytes: every visible K and V row once per (KV head, head block of 8 heads), q once, O once; with
// splits the partial O / LSE once written and once read back (from L2) by the merging block.
//
// Programmatic dependent launch (AttentionDispatch(pdl=True), common/pdl.cuh): a block lets the next
// kernel launch at once and, before pdl_wait(), reads only seq_ids, lengths, the page table and the K/V
// rows of keys below each query's own position (len - 1); q, sinks, the outputs, the partial buffers and
// the counters are touched after it.
#pragma once

#include "common/kv_cache.cuh"
#include "common/mma.cuh"
#include "common/pdl.cuh"
#include "common/types.cuh"
#include "attention/common.cuh"
#include "attention/decode.cuh"
#include "attention/params.cuh"

namespace cukern {
namespace attn {

constexpr int DECODE_TC_WARP_BYTES = 26 * 1024;  // target bytes of one warp's ring of stages

// Shapes of decode_tc<T, D, NW> (mirrored by _decode_tc_smem in cukern/attention/plan.py;
// tests/test_attention.py checks the two agree).
template <int D, int NW>
struct DecodeTcShape {
    static constexpr int WARPS = NW;
    static constexpr int NT = WARPS * 32;
    static constexpr int G = 8;                       // query heads per block (rows 0-7 / 8-15 of the tile)
    static constexpr int KW = 16;                     // keys of a warp tile
    static constexpr int LD = D + 8;                  // shared row stride in elements (16-byte pad)
    static constexpr int CPR = D / 8;                 // 16-byte chunks per row
    static constexpr int CPL = KW * CPR / 32;         // chunks of a K (and of a V) warp tile per lane
    static constexpr int STAGE = 2 * KW * LD;         // elements of K and V of a warp tile
    static constexpr int NS_FIT = DECODE_TC_WARP_BYTES / (2 * STAGE);
    static constexpr int NS = NS_FIT < 2 ? 2 : (NS_FIT > 8 ? 8 : NS_FIT);  // stages of a warp's ring
    static constexpr int RING_BYTES = WARPS * NS * STAGE * 2;
    static constexpr int RED_BYTES = WARPS * G * D * 4;
    static constexpr int SMEM = RING_BYTES > RED_BYTES ? RING_BYTES : RED_BYTES;
    static_assert(D % 32 == 0 && D <= 256, "head_dim must be a multiple of 32 up to 256");
    static_assert(NW == 4 || (NW == 8 && D <= 128), "8 warps only up to head_dim 128 (shared memory)");
    static_assert(KW * CPR % 32 == 0, "a warp tile must split evenly over the lanes");
};

}  // namespace attn
}  // namespace cukern

template <typename T, int D, int NW, typename QO = float>
__global__ void __launch_bounds__(NW * 32, NW == 4 && D <= 128 ? 2 : 1) decode_tc(
    QO* __restrict__ o,                      // [n_queries, n_heads, D] final output
    float* __restrict__ lse,                 // [n_queries, n_heads] final natural-log LSE, sinks included (write_lse)
    float* __restrict__ o_part,              // n_splits > 1: [n_queries, n_splits, n_heads, D] normalised partial O
    float* __restrict__ lse_part,            // n_splits > 1: [n_queries, n_splits, n_heads] their natural-log LSE
    int32_t* __restrict__ counters,          // n_splits > 1: [n_queries * gridDim.y] zeros (left zero on exit)
    const QO* __restrict__ q,                // [n_queries, n_heads, D]
    const T* __restrict__ k_pool,            // [n_pages, page_size, n_kv_heads, D], or head-major [batch, n_kv_heads,
                                             //    capacity, D] (pages of capacity rows, sequence b's page
                                             //    b * n_kv_heads; row_stride, head_stride in p)
    const T* __restrict__ v_pool,            // the same layout as k_pool
    const int32_t* __restrict__ page_table,  // [n_slots, max_pages]
    const int32_t* __restrict__ lengths,     // [n_slots] cached tokens per slot
    const int32_t* __restrict__ seq_ids,     // [n_seqs] slot of each sequence
    const int32_t* __restrict__ q_indptr,    // [n_seqs + 1] query rows of each sequence (batched mode only)
    const float* __restrict__ sinks,         // [sink_offset + n_heads] sink logits, NaN: none (has_sinks only)
    const DecodeParams p) {
    using namespace cukern;
    using namespace cukern::attn;
    using Sh = DecodeTcShape<D, NW>;
    constexpr int WARPS = Sh::WARPS, G = Sh::G, KW = Sh::KW, LD = Sh::LD, CPR = Sh::CPR, CPL = Sh::CPL;
    constexpr int NS = Sh::NS, STAGE = Sh::STAGE;

    extern __shared__ uint4 smem_raw[];  // [WARPS][NS] stages of [2][KW][LD] T, later the merges' scratch
    __shared__ float sm_m[WARPS][G];
    __shared__ float sm_l[WARPS][G];
    __shared__ int sm_last;

    uint32_t dyn_smem;  // the host mirrors SMEM (_decode_tc_smem): a mismatch must fail loudly, not overrun
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
    if (dyn_smem < (uint32_t)Sh::SMEM) __trap();
    pdl_launch_dependents();

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, tq = lane % 4;  // fragment row (the head) 0..7 and column pair 0..3

    const uint32_t qi = blockIdx.z;
    const uint32_t split = blockIdx.x;
    const uint32_t kvh = blockIdx.y / p.n_head_blocks;
    const uint32_t hb = blockIdx.y % p.n_head_blocks;
    const uint32_t h0 = kvh * p.group + hb * G;       // first query head of this block
    const int n_h = min(G, (int)(p.group - hb * G));  // heads of this block that exist

    const QueryRange r = decode_range(lengths, page_table, seq_ids, q_indptr, qi, p);
    const int32_t c0 = r.lo + (int32_t)(split * p.chunk);
    const int32_t c1 = split + 1 == p.n_splits ? r.hi : min(r.hi, c0 + (int32_t)p.chunk);
    const int32_t n_wt = c1 > c0 ? (c1 - c0 + KW - 1) / KW : 0;              // warp tiles of the chunk
    const int32_t my_tiles = n_wt > warp ? (n_wt - 1 - warp) / WARPS + 1 : 0;  // ... of this warp

    const int32_t* pt = page_table + (uint64_t)r.slot * p.max_pages;
    const uint64_t row_stride = p.row_stride;
    const uint64_t kv_off = (uint64_t)kvh * p.head_stride;
    T* const ring = reinterpret_cast<T*>(smem_raw) + warp * NS * STAGE;

    // first key of the warp's tile i
    auto key0 = [&](int32_t i) { return c0 + (i * WARPS + warp) * KW; };
    // The pool row of key (lane % KW) of the warp's tile i (clamped into the chunk, and to key 0 when the chunk is
    // empty: then nothing is copied), in two steps: lookup(i) issues the page-table load (paged_entry) and
    // row_of() forms the row where it is used. So the load stays in flight until then (an iteration of the tile
    // loop) instead of stalling the warp where it is issued.
    auto lookup = [&](int32_t i) {
        return paged_entry(pt, (uint32_t)max(min(key0(i) + lane % KW, c1 - 1), 0), p.page_size, p.page_shift);
    };
    auto row_of = [&](uint2 e) { return (uint32_t)entry_row(e, p.page_size, p.page_shift); };
    const uint64_t policy = l2_evict_first_policy();
    // copies of the warp's tile i into stage st; `row` is row_of(lookup(i)); keys past the chunk are zero-filled
    auto issue = [&](int32_t i, int st, uint32_t row) {
        T* ks = ring + st * STAGE;
        T* vs = ks + KW * LD;
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
            const int chunk = lane + 32 * c;
            const int key = chunk / CPR, ch = chunk % CPR;
            const uint32_t rk = __shfl_sync(0xffffffffu, row, key);
            const uint64_t off = (uint64_t)rk * row_stride + kv_off + ch * 8;
            const uint32_t bytes = key0(i) + key < c1 ? 16u : 0u;
            if (p.evict_first) {
                cp_async16_policy(ks + key * LD + ch * 8, k_pool + off, bytes, policy);
                cp_async16_policy(vs + key * LD + ch * 8, v_pool + off, bytes, policy);
            } else {
                cp_async16(ks + key * LD + ch * 8, k_pool + off, bytes);
                cp_async16(vs + key * LD + ch * 8, v_pool + off, bytes);
            }
        }
    };
    // the first NS - 1 tiles are in flight before q is read; their page-table loads, and those of the PRE - NS + 1
    // tiles after them (the next to copy, the L2 prefetch's), are issued together (the lookup clamps into the
    // chunk, so any key is safe to look up).
    // Under programmatic dependent launch only the tiles whose keys all precede the query's own token
    // (r.hi - 1, the one the decode step's KV write may still be writing) are issued before pdl_wait();
    // `safe` holds for a prefix of the tiles, so the copy groups stay in tile order.
    constexpr int PRE = NS + 2;  // tiles looked up in the prologue
    uint2 rows0[PRE];
#pragma unroll
    for (int st = 0; st < PRE; ++st) rows0[st] = lookup(st);
    int early = 0;  // prologue tiles issued before the wait
#pragma unroll
    for (int st = 0; st < NS - 1; ++st) {
        if (st < my_tiles && key0(st) + KW < r.hi) {
            issue(st, st, row_of(rows0[st]));
            cp_async_commit();
            early = st + 1;
        }
    }
    // L2 prefetch of the keys below `end` of the warp's tile i (pool row `row`): lane k of the first KW lanes
    // asks for key k's K row slice, lane KW + k for its V slice
    auto ask_l2 = [&](int32_t i, uint32_t row, int32_t end) {
        if (key0(i) + lane % KW < end)
            prefetch_l2_lines<D * sizeof(T)>((lane < KW ? k_pool : v_pool) + (uint64_t)row * row_stride + kv_off);
    };
    // the next p.l2_prefetch tiles of the warp (the same safe keys) into L2 while the previous kernel ends
    const int32_t pf_end = min(my_tiles, (int32_t)(NS - 1 + p.l2_prefetch));
#pragma unroll
    for (int st = NS - 1; st < PRE; ++st)
        if (st < pf_end) ask_l2(st, row_of(rows0[st]), min(c1, r.hi - 1));
    for (int32_t i = PRE; i < pf_end; ++i) ask_l2(i, row_of(lookup(i)), min(c1, r.hi - 1));
    pdl_wait();  // the previous kernel in the stream is done: q, sinks, outputs, partials and counters
#pragma unroll
    for (int st = 0; st < NS - 1; ++st) {
        if (st >= early) {
            if (st < my_tiles) issue(st, st, row_of(rows0[st]));
            cp_async_commit();
        }
    }
    uint2 next = rows0[NS - 1];  // lookup() of the next tile to issue
    // p.l2_ahead: L2 is asked for the warp's tiles up to l2_ahead after the one it copies next (those the
    // prologue did not ask for now, then one per tile in the loop, its pool row looked up a tile early)
    const int32_t ahead = (int32_t)p.l2_ahead;
    uint2 ahead_e = make_uint2(0, 0);
    if (ahead > 0) {
        for (int32_t i = pf_end; i < min(my_tiles, (int32_t)NS - 1 + ahead); ++i) ask_l2(i, row_of(lookup(i)), c1);
        ahead_e = lookup(NS - 1 + ahead);
    }

    // Q fragments: lane (g, tq) holds elements 16 kk + 2 tq + {0, 1, 8, 9} of head g, as A rows g (hi) and
    // g + 8 (lo). Q is scaled to base-2 logits and by 2^-e, e chosen per head so that |q| < 2^14 (f16 range).
    uint32_t qa[D / 16][4];
    float unscale;  // 2^e: S * unscale is the base-2 logit
    {
        float qv[D / 16][4];
        float amax = 0.0f;
        const bool real = g < n_h;
        const QO* qh = q + ((uint64_t)qi * p.n_heads + h0 + (real ? g : 0)) * D + 2 * tq;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const float2 a = real ? load2(qh + kk * 16) : make_float2(0.0f, 0.0f);
            const float2 b = real ? load2(qh + kk * 16 + 8) : make_float2(0.0f, 0.0f);
            qv[kk][0] = a.x * p.scale_log2;
            qv[kk][1] = a.y * p.scale_log2;
            qv[kk][2] = b.x * p.scale_log2;
            qv[kk][3] = b.y * p.scale_log2;
#pragma unroll
            for (int e = 0; e < 4; ++e) amax = fmaxf(amax, fabsf(qv[kk][e]));
        }
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const int ex = min(max((int)((__float_as_uint(amax) >> 23) & 0xff) - 127 - 13, 0), 100);
        const float down = __uint_as_float((uint32_t)(127 - ex) << 23);
        unscale = __uint_as_float((uint32_t)(127 + ex) << 23);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            split2<T>(qv[kk][0] * down, qv[kk][1] * down, qa[kk][0], qa[kk][1]);
            split2<T>(qv[kk][2] * down, qv[kk][3] * down, qa[kk][2], qa[kk][3]);
        }
    }
    const bool capped = p.softcap > 0.0f;
    const float cap_a = LN2 * p.inv_softcap, cap_b = p.softcap * LOG2E;  // base-2 logit x -> b tanh(a x)

    float oacc[D / 8][4];  // O of head g at d = 8 n + 2 tq + {0, 1}: [0, 1] from p_hi, [2, 3] from p_lo
#pragma unroll
    for (int n = 0; n < D / 8; ++n) oacc[n][0] = oacc[n][1] = oacc[n][2] = oacc[n][3] = 0.0f;
    float m = -INFINITY, l = 0.0f;  // running maximum (base 2) and this lane's share of the sum of weights

    // ldmatrix row addresses of this lane within a stage: B (K) and B^T (V)
    const int k_row = (lane % 8) + (lane / 16) * 8, k_col = ((lane / 8) % 2) * 8;
    const int v_row = (lane % 8) + ((lane / 8) % 2) * 8, v_col = (lane / 16) * 8;

    for (int32_t i = 0; i < my_tiles; ++i) {
        cp_async_wait<NS - 2>();  // tile i has landed (this lane's copies) ...
        __syncwarp();             // ... every lane's, and the stage refilled next is no longer read
        if (i + NS - 1 < my_tiles) {
            issue(i + NS - 1, (i + NS - 1) % NS, row_of(next));
            if (i + NS < my_tiles) next = lookup(i + NS);
        }
        cp_async_commit();
        if (ahead > 0 && i + NS - 1 + ahead < my_tiles) {
            ask_l2(i + NS - 1 + ahead, row_of(ahead_e), c1);
            ahead_e = lookup(i + NS + ahead);
        }

        const T* ks = ring + (i % NS) * STAGE;
        const T* vs = ks + KW * LD;
        // S = Q K^T over 16 keys (two n-tiles), even and odd k-steps in separate accumulators
        float sa[2][2][4];
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int n = 0; n < 2; ++n) sa[a][n][0] = sa[a][n][1] = sa[a][n][2] = sa[a][n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t b[4];
            ldmatrix_x4(b, ks + k_row * LD + kk * 16 + k_col);
            mma16816<T>(sa[kk & 1][0], qa[kk], b[0], b[1]);
            mma16816<T>(sa[kk & 1][1], qa[kk], b[2], b[3]);
        }
        // s[n][e]: head g, key key0 + 8 n + 2 tq + e (hi and lo halves summed)
        float s[2][2];
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                s[n][e] = ((sa[0][n][e] + sa[0][n][e + 2]) + (sa[1][n][e] + sa[1][n][e + 2])) * unscale;
                if (capped) s[n][e] = cap_b * tanhf(s[n][e] * cap_a);
            }
        const int32_t kb = key0(i);
        if (kb + KW > c1) {  // keys past the chunk (zero-filled) weigh nothing
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) s[n][e] = kb + 8 * n + 2 * tq + e < c1 ? s[n][e] : -INFINITY;
        }
        // online softmax: the quad's maximum; O rescaled only when some head's maximum moved
        float mx = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = fmaxf(m, mx);
        const float mu = safe_max(mx);
        const float corr = fast_exp2(m - mu);
        m = mx;
        l *= corr;
        if (__any_sync(0xffffffffu, corr != 1.0f)) {
#pragma unroll
            for (int n = 0; n < D / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) oacc[n][e] *= corr;
        }
        float pr[2][2];
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                pr[n][e] = fast_exp2(s[n][e] - mu);
                l += pr[n][e];
            }
        // A of O += P V: rows g = p_hi, g + 8 = p_lo; keys 2 tq.. (a0, a1) and 8 + 2 tq.. (a2, a3)
        uint32_t pa[4];
        split2<T>(pr[0][0], pr[0][1], pa[0], pa[1]);
        split2<T>(pr[1][0], pr[1][1], pa[2], pa[3]);
#pragma unroll
        for (int d2 = 0; d2 < D / 16; ++d2) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, vs + v_row * LD + d2 * 16 + v_col);
            mma16816<T>(oacc[2 * d2], pa, b[0], b[1]);
            mma16816<T>(oacc[2 * d2 + 1], pa, b[2], b[3]);
        }
    }
    cp_async_wait_all();  // (only empty groups can be left) the stages become the merge scratch
    __syncthreads();

    // the warp's state: red[warp][g][d] relative to its maximum m, its sum of weights over the quad
    float* const red = reinterpret_cast<float*>(smem_raw);
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (g < n_h) {
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<float2*>(red + (warp * G + g) * D + 8 * n + 2 * tq) =
                make_float2(oacc[n][0] + oacc[n][2], oacc[n][1] + oacc[n][3]);
        if (tq == 0) {
            sm_m[warp][g] = m;
            sm_l[warp][g] = l;
        }
    }
    __syncthreads();
    decode_finish<D, G, WARPS>(red, sm_m, sm_l, &sm_last, o, lse, o_part, lse_part, counters, sinks, p,
                               qi, split, h0, n_h);
}
