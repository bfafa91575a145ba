// Tensor-core flash attention for many queries per sequence (FlashAttention-2 style).
//
// Grid: (n_heads, n_seqs, n_q_tiles); block: 4 warps of 16 * MT query rows each (BM = 64 * MT;
// MT = 2 up to head_dim 128, so that every K/V fragment read from shared memory feeds two mma).
// Tiles are taken heaviest first (blockIdx.z = 0 is the last query tile of every head and
// sequence; z varies slowest in the launch order), so the causal diagonal's long tiles start
// before all the short ones. A block loads its Q tile once, then streams K/V tiles of BN keys
// through shared memory with cp.async (two stages: tile t + 1 loads while tile t is used; one
// barrier per tile). Paged keys: the pool rows of a tile's keys are looked up two tiles ahead
// (one per thread, kept in shared memory), so no copy waits for a page-table load; a tile inside
// one page takes its rows from one lookup.
// Per tile and warp: S = Q K^T over KC keys at once (KC = BN = 64 at head_dim 128: each Q fragment read
// from shared memory feeds 8 mma, and the softmax's reductions run once per tile; mma.sync m16n8k16, f32
// accumulators), masks and the online softmax in registers (the row state of row g and
// g + 8 lives in the 4 lanes of a quad), P rounded to T and O += P V on the tensor cores.
//
// Keys come from the paged cache (PAGED: page table of the sequence's slot, kv_len = its
// cached length) or from packed contiguous K/V (varlen: rows cu_seqlens_k[s] ...). Query r
// of a sequence (0 <= r < q_len) sits at position kv_len - q_len + r (causal 2, top left: at r): it sees
// keys j <= that position when causal, and j >= position - window_left when a window is set.
//
// FLOPs: 4 * q_len * (visible keys) * D per head. Bytes: Q, O once; K/V once per query tile.
// Shared addresses are kept as 32-bit integers (ldmatrix / cp.async take base + immediate offsets), and a
// tile of consecutive rows is copied by one walking pointer per thread: either way fewer registers stay
// live across the loop (at head_dim 128 the O accumulators alone are 128 per thread).
// Shared memory rows are padded by 16 bytes, which keeps ldmatrix and cp.async free of
// bank conflicts for every head_dim that is a multiple of 16.
#pragma once

#include "common/kv_cache.cuh"
#include "common/mma.cuh"
#include "common/types.cuh"
#include "attention/common.cuh"
#include "attention/params.cuh"

namespace cukern {
namespace attn {

// Shapes of prefill<T, D, PAGED> (mirrored by _prefill_shape in cukern/attention/plan.py;
// tests/test_attention.py checks the two agree).
template <int D>
struct PrefillShape {
    static constexpr int WARPS = 4;
    static constexpr int MT = D <= 128 ? 2 : 1;        // 16-row m-tiles per warp: K/V fragments serve MT of them
    static constexpr int BM = 16 * MT * WARPS;         // query rows of a block
    static constexpr int BN = D <= 128 ? 64 : 32;      // keys per K/V tile
    static constexpr int KC = D == 96 ? 32 : BN;       // keys of S at once (BN / KC chunks per tile; 96: no spills)
    static constexpr int MIN_BLOCKS = 1;               // __launch_bounds__ minimum of resident blocks per SM
    static constexpr int LD = D + 8;                   // shared row stride in elements (16-byte pad)
    static constexpr int NT = WARPS * 32;
    static constexpr int CPR = D / 8;                  // 16-byte chunks per row
    static constexpr int KV_CHUNKS = BN * CPR / NT;    // chunks of a K (and of a V) tile per thread
    static constexpr int SMEM_BYTES = (BM + 4 * BN) * LD * 2;  // Q + two stages of K and V
    static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
    static_assert(BN * CPR % NT == 0, "a K/V tile must split evenly over the threads");
    static_assert(BN <= NT, "one thread looks up the pool row of each key of a tile");
    static_assert(BN % KC == 0 && KC % 16 == 0, "a K/V tile must be whole compute chunks");
};


// ---- pieces shared with prefill_wg (prefill_wg.cuh): an S tile of 16 * MT rows per warp in mma.sync's C
// layout (wgmma's accumulator layout is the same), the lane's rows g and g + 8 of each m-tile.

// Masks of an S tile: entry (mt, nt, e) is query position pos_g + 16 mt + 8 (e >= 2) (pos_g: the position
// of the lane's row g of m-tile 0) against key j_tq + 8 nt + (e & 1) (j_tq: the tile's first key + 2 tq).
template <int MT, int NK8>
CUKERN_DEVICE void mask_scores(float (&s)[MT][NK8][4], int32_t pos_g, int32_t j_tq, int32_t kv_len, bool causal,
                               bool windowed, int32_t window_left) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NK8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int32_t pos = pos_g + mt * 16 + (e >= 2 ? 8 : 0);
                const int32_t j = j_tq + nt * 8 + (e & 1);
                const bool ok = j < kv_len && (!causal || j <= pos) && (!windowed || j >= pos - window_left);
                s[mt][nt][e] = ok ? s[mt][nt][e] : -INFINITY;
            }
}

// Online softmax of an S tile (rows g (i = 0) and g + 8 (i = 1) of each m-tile; l stays a per-lane partial
// sum): m, l updated, corr = the factor the O rows must be scaled by, P rounded to T in pa (the A fragments
// of O += P V: n-tiles 2 kk and 2 kk + 1 are k-step kk). sl: raw score -> base-2 logit factor. Returns
// whether this lane's corr differs from 1.
template <typename T, int MT, int NK8>
CUKERN_DEVICE bool online_softmax(const float (&s)[MT][NK8][4], uint32_t (&pa)[MT][NK8 / 2][4], float (&m)[MT][2],
                                  float (&l)[MT][2], float (&corr)[MT][2], float sl) {
    bool rescale = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float mu[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mx = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < NK8; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * i], s[mt][nt][2 * i + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            mx = fmaxf(m[mt][i], mx * sl);  // base 2 (sl > 0 commutes with the max)
            mu[i] = safe_max(mx);
            corr[mt][i] = fast_exp2(m[mt][i] - mu[i]);
            rescale |= corr[mt][i] != 1.0f;
            m[mt][i] = mx;
            l[mt][i] *= corr[mt][i];
        }
#pragma unroll
        for (int nt = 0; nt < NK8; ++nt) {
            float pr[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                pr[e] = fast_exp2(fmaf(s[mt][nt][e], sl, -mu[e / 2]));
                l[mt][e / 2] += pr[e];
            }
            pa[mt][nt / 2][(nt % 2) * 2 + 0] = pack2<T>(pr[0], pr[1]);
            pa[mt][nt / 2][(nt % 2) * 2 + 1] = pack2<T>(pr[2], pr[3]);
        }
    }
    return rescale;
}

// O *= corr, row by row.
template <int MT, int DT8>
CUKERN_DEVICE void rescale_rows(float (&o)[MT][DT8][4], const float (&corr)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int dt = 0; dt < DT8; ++dt) {
            o[mt][dt][0] *= corr[mt][0];
            o[mt][dt][1] *= corr[mt][0];
            o[mt][dt][2] *= corr[mt][1];
            o[mt][dt][3] *= corr[mt][1];
        }
}

// Normalise O (the sink joins the denominator here, once) and store the lane's rows wr0 + 16 mt + g + 8 i
// below q_len (wr0: the warp's first row of the sequence), and their natural-log LSE when p.write_lse.
template <typename T, int MT, int D>
CUKERN_DEVICE void store_rows(const float (&oacc)[MT][D / 8][4], const float (&m)[MT][2], const float (&l)[MT][2],
                              T* __restrict__ o, float* __restrict__ lse, const float* __restrict__ sinks,
                              const PrefillParams& p, uint32_t h, int32_t q_start, int32_t q_len, int32_t wr0, int g,
                              int tq) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float L = l[mt][i];
            L += __shfl_xor_sync(0xffffffffu, L, 1);
            L += __shfl_xor_sync(0xffffffffu, L, 2);
            float M = m[mt][i], f = 1.0f;
            const float sk = sink_logit(sinks, p.has_sinks, p.sink_offset + h);
            if (sk > -INFINITY) {
                const float s2 = sk * LOG2E;
                const float m2 = fmaxf(M, s2);
                f = exp2f(M - m2);
                L = L * f + exp2f(s2 - m2);
                M = m2;
            }
            const float inv = L > 0.0f ? f / L : 0.0f;
            const int32_t r = wr0 + mt * 16 + g + 8 * i;
            if (r < q_len) {
                T* orow = o + ((uint64_t)(q_start + r) * p.n_heads + h) * D + 2 * tq;
#pragma unroll
                for (int dt = 0; dt < D / 8; ++dt)
                    *reinterpret_cast<uint32_t*>(orow + dt * 8) =
                        pack2<T>(oacc[mt][dt][2 * i] * inv, oacc[mt][dt][2 * i + 1] * inv);
                if (p.write_lse && tq == 0)
                    lse[(uint64_t)(q_start + r) * p.n_heads + h] = L > 0.0f ? (M + log2f(L)) * LN2 : -INFINITY;
            }
        }
    }
}

}  // namespace attn
}  // namespace cukern

template <typename T, int D, bool PAGED>
__global__ void __launch_bounds__(cukern::attn::PrefillShape<D>::NT, cukern::attn::PrefillShape<D>::MIN_BLOCKS) prefill(
    T* __restrict__ o,                       // [n_q_total, n_heads, D]
    float* __restrict__ lse,                 // [n_q_total, n_heads] natural-log LSE (write_lse only)
    const T* __restrict__ q,                 // [n_q_total, n_heads, D]
    const T* __restrict__ k,                 // PAGED: [n_pages, page_size, n_kv_heads, D]; else [n_k_total, n_kv_heads, D]
    const T* __restrict__ v,                 // same layout as k
    const int32_t* __restrict__ q_indptr,    // [n_seqs + 1] first query row of each sequence
    const int32_t* __restrict__ kv_info,     // PAGED: lengths [n_slots]; else cu_seqlens_k [n_seqs + 1]
    const int32_t* __restrict__ page_table,  // PAGED: [n_slots, max_pages]; else unused
    const int32_t* __restrict__ seq_ids,     // PAGED: [n_seqs] slot of each sequence; else unused
    const float* __restrict__ sinks,         // [sink_offset + n_heads] sink logits, NaN: none (has_sinks only)
    const PrefillParams p) {
    using namespace cukern;
    using namespace cukern::attn;
    using Sh = PrefillShape<D>;
    constexpr int MT = Sh::MT, BM = Sh::BM, BN = Sh::BN, KC = Sh::KC, LD = Sh::LD, NT = Sh::NT, CPR = Sh::CPR;
    constexpr int WROWS = 16 * MT;  // query rows of a warp

    extern __shared__ uint4 smem_raw[];
    T* const Qs = reinterpret_cast<T*>(smem_raw);  // [BM][LD]
    T* const Ks = Qs + BM * LD;                    // [2][BN][LD]
    T* const Vs = Ks + 2 * BN * LD;                // [2][BN][LD]

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, tq = lane % 4;  // fragment row (0..7) and column pair (0..3)

    const uint32_t s = blockIdx.y, h = blockIdx.x;
    const int32_t q_start = q_indptr[s];
    const int32_t q_len = q_indptr[s + 1] - q_start;
    const int32_t r0 = (int32_t)(p.n_q_tiles - 1 - blockIdx.z) * BM;  // first query row of the tile
    if (r0 >= q_len) return;

    int32_t kv_len, k_start = 0;
    const int32_t* pt = nullptr;
    if (PAGED) {
        const int32_t slot = seq_ids[s];
        kv_len = kv_info[slot];
        pt = page_table + (uint64_t)slot * p.max_pages;
    } else {
        k_start = kv_info[s];
        kv_len = kv_info[s + 1] - k_start;
    }
    const uint64_t head_off = (uint64_t)(h / p.group) * D;
    const uint64_t row_elems = (uint64_t)p.n_kv_heads * D;
    const int32_t offset = p.causal == 2 ? 0 : kv_len - q_len;  // position of query row r is offset + r
    const int32_t rows_here = min(BM, q_len - r0);
    const bool windowed = p.window_left >= 0;

    // keys any row of the block sees: [lo, hi)
    const int32_t hi = p.causal ? min(kv_len, offset + r0 + rows_here) : kv_len;
    const int32_t lo = windowed ? max(0, offset + r0 - p.window_left) : 0;
    const int32_t t_begin = lo / BN;
    const int32_t t_end = hi > lo ? (hi + BN - 1) / BN : t_begin;

    // this warp's rows: [wr0, wr0 + WROWS) (rows >= q_len compute values that are never stored)
    const int32_t wr0 = r0 + warp * WROWS;
    const bool warp_active = wr0 < q_len;
    const int32_t w_last = min(wr0 + WROWS - 1, q_len - 1);  // last real row of the warp
    const int32_t w_hi = p.causal ? min(kv_len, offset + w_last + 1) : kv_len;
    const int32_t w_lo = windowed ? offset + wr0 - p.window_left : 0;

    // Q tile (rows past q_len are zeros)
    for (int c = threadIdx.x; c < BM * CPR; c += NT) {
        const int row = c / CPR, ch = c % CPR;
        const int32_t r = r0 + row;
        const bool ok = r < q_len;
        cp_async16(Qs + row * LD + ch * 8, ok ? q + ((uint64_t)(q_start + r) * p.n_heads + h) * D + ch * 8 : q,
                   ok ? 16u : 0u);
    }
    // PAGED: pool row of key (t * BN + thread) of tile t (threads < BN), -1 past kv_len
    __shared__ int32_t sm_rows[2][BN];  // the rows of the tiles in the two stages' order
    auto fetch_row = [&](int32_t t) {
        const int32_t j = t * BN + (int32_t)threadIdx.x;
        return threadIdx.x < BN && j < kv_len ? (int32_t)paged_row(pt, (uint32_t)j, p.page_size, p.page_shift) : -1;
    };
    // K/V tile t into stage st (PAGED: its rows in sm_rows[st])
    // a tile inside one page (page_size a power of two >= BN) has consecutive pool rows: one lookup
    const bool tile_in_page = PAGED && p.page_shift >= 0 && (1u << p.page_shift) >= (uint32_t)BN;
    // Chunk i of this thread is c = tid + i * NT: key c / CPR, column chunk c % CPR. When CPR divides NT
    // (head_dim 32, 64, 128, 256) the column is the same for every i and the keys step by KSTEP.
    constexpr bool REGULAR = NT % CPR == 0;
    constexpr int KSTEP = NT / CPR;
    const int my_key = (int)threadIdx.x / CPR;
    const T* const k_col = k + head_off + (threadIdx.x % CPR) * 8;
    const T* const v_col = v + head_off + (threadIdx.x % CPR) * 8;
    const uint32_t kv_dst = smem_addr(Ks + my_key * LD + (threadIdx.x % CPR) * 8);  // stage 0, chunk 0
    constexpr uint32_t E = sizeof(T);
    constexpr uint32_t V_OFF = 2 * BN * LD * E;  // Ks -> Vs
    auto load_kv = [&](int32_t t, int st) {
        const bool consecutive = !PAGED || tile_in_page;  // the tile's keys are consecutive rows from row0
        const int32_t row0 = !PAGED ? k_start + t * BN : (tile_in_page ? sm_rows[st][0] : 0);
        if (REGULAR && consecutive) {
            // one pointer walks the tile (no per-chunk 64-bit offsets kept live across the loop)
            const uint64_t off = (uint64_t)(row0 + my_key) * row_elems;
            const T* kp = k_col + off;
            const T* vp = v_col + off;
            const int32_t left = kv_len - t * BN - my_key;  // chunk i is a real key when i * KSTEP < left
            const uint32_t dst = kv_dst + st * (BN * LD * E);
#pragma unroll
            for (int i = 0; i < Sh::KV_CHUNKS; ++i) {
                const bool ok = i * KSTEP < left;
                const uint32_t d = dst + i * KSTEP * LD * E;
                cp_async16(d, ok ? kp : k, ok ? 16u : 0u);
                cp_async16(d + V_OFF, ok ? vp : v, ok ? 16u : 0u);
                kp += KSTEP * row_elems;
                vp += KSTEP * row_elems;
            }
        } else {
#pragma unroll
            for (int i = 0; i < Sh::KV_CHUNKS; ++i) {
                const int c = threadIdx.x + i * NT, key = c / CPR, col = c % CPR;
                const int32_t row = consecutive ? (t * BN + key < kv_len ? row0 + key : -1) : sm_rows[st][key];
                const uint64_t off = (uint64_t)max(row, 0) * row_elems + head_off + col * 8;
                const uint32_t d = smem_addr(Ks + (st * BN + key) * LD + col * 8);
                cp_async16(d, k + off, row >= 0 ? 16u : 0u);
                cp_async16(d + V_OFF, v + off, row >= 0 ? 16u : 0u);
            }
        }
    };
    int32_t next_row = -1;  // PAGED: this thread's row of the tile two ahead, stored at the end of an iteration
    if (PAGED) {
        if (threadIdx.x < BN) sm_rows[0][threadIdx.x] = fetch_row(t_begin);
        if (threadIdx.x < BN) sm_rows[1][threadIdx.x] = fetch_row(t_begin + 1);
        __syncthreads();
    }
    if (t_begin < t_end) load_kv(t_begin, 0);
    cp_async_commit();

    float oacc[MT][D / 8][4];
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) oacc[mt][dt][0] = oacc[mt][dt][1] = oacc[mt][dt][2] = oacc[mt][dt][3] = 0.0f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
    }

    const float sl = p.softcap > 0.0f ? 1.0f : p.scale_log2;  // raw score -> base-2 logit factor in the exponent

    // ldmatrix row addresses of this lane: A (Q), B (K), B^T (V)
    const uint32_t q_addr = smem_addr(Qs + (warp * WROWS + (lane % 8) + ((lane / 8) % 2) * 8) * LD + (lane / 16) * 8);
    const uint32_t k_addr = smem_addr(Ks + ((lane % 8) + (lane / 16) * 8) * LD + ((lane / 8) % 2) * 8);
    const uint32_t v_addr = smem_addr(Vs + ((lane % 8) + ((lane / 8) % 2) * 8) * LD + (lane / 16) * 8);

    for (int32_t t = t_begin; t < t_end; ++t) {
        const int st = (t - t_begin) & 1;
        cp_async_wait<0>();  // tile t has landed (this thread's copies) ...
        __syncthreads();     // ... everyone's; and every warp is done with stage st ^ 1 (tile t - 1)
        if (t + 1 < t_end) {  // tile t + 1 loads while tile t is used
            load_kv(t + 1, st ^ 1);
            cp_async_commit();
        }
        if (PAGED && t + 2 < t_end) next_row = fetch_row(t + 2);
        const int32_t j0 = t * BN;
        // skip tiles this warp sees nothing of (past its causal end, or before its window)
        if (warp_active && j0 < w_hi && j0 + BN - 1 >= w_lo) {
            const uint32_t kt = k_addr + st * (BN * LD * E), vt = v_addr + st * (BN * LD * E);
            // the tile in chunks of KC keys: S of one chunk is MT * KC / 2 registers, so S, the O
            // accumulators and the fragments in flight fit in the register file without spilling
#pragma unroll 1
            for (int kc = 0; kc < BN / KC; ++kc) {
                const int32_t jc = j0 + kc * KC;
                if (jc >= w_hi || jc + KC - 1 < w_lo) continue;  // (warp-uniform)
                float sacc[MT][KC / 8][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < KC / 8; ++nt)
                        sacc[mt][nt][0] = sacc[mt][nt][1] = sacc[mt][nt][2] = sacc[mt][nt][3] = 0.0f;
                // S = Q K^T
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    uint32_t a[MT][4];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], q_addr + (mt * 16 * LD + kk * 16) * E);
#pragma unroll
                    for (int n2 = 0; n2 < KC / 16; ++n2) {
                        uint32_t b[4];
                        ldmatrix_x4(b, kt + ((kc * KC + n2 * 16) * LD + kk * 16) * E);
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            mma16816<T>(sacc[mt][2 * n2], a[mt], b[0], b[1]);
                            mma16816<T>(sacc[mt][2 * n2 + 1], a[mt], b[2], b[3]);
                        }
                    }
                }
                // Without a softcap the scores stay raw and the scale joins the exponent's FMA
                // (exp2(s * scale_log2 - m)); with one they become base-2 logits here.
                if (p.softcap > 0.0f) to_logits2<MT * KC / 2>(&sacc[0][0][0], p.scale_log2, p.softcap, p.inv_softcap);
                // masks only on chunks that cross a boundary
                const bool need_mask = jc + KC > kv_len || (p.causal && jc + KC - 1 > offset + wr0) ||
                                       (windowed && jc < offset + w_last - p.window_left);
                if (need_mask)
                    mask_scores(sacc, offset + wr0 + g, jc + 2 * tq, kv_len, p.causal, windowed, p.window_left);
                // online softmax; P is rounded to T right away, as the A fragments of O += P V
                uint32_t pa[MT][KC / 16][4];
                float corr[MT][2];
                const bool rescale = online_softmax<T>(sacc, pa, m, l, corr, sl);
                // O *= corr, skipped when no row of the warp saw a new maximum (the common case
                // once the first keys are in)
                if (__any_sync(0xffffffffu, rescale)) rescale_rows(oacc, corr);
                // O += P V: P of n-tiles 2 kk and 2 kk + 1 is the A fragment of k-step kk
#pragma unroll
                for (int kk = 0; kk < KC / 16; ++kk) {
#pragma unroll
                    for (int d2 = 0; d2 < D / 16; ++d2) {
                        uint32_t b[4];
                        ldmatrix_x4_trans(b, vt + ((kc * KC + kk * 16) * LD + d2 * 16) * E);
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            mma16816<T>(oacc[mt][2 * d2], pa[mt][kk], b[0], b[1]);
                            mma16816<T>(oacc[mt][2 * d2 + 1], pa[mt][kk], b[2], b[3]);
                        }
                    }
                }
            }
        }
        // tile t's rows (slot st) were used by its copies: the slot takes tile t + 2's (read after the
        // next iteration's barrier)
        if (PAGED && t + 2 < t_end && threadIdx.x < BN) sm_rows[st][threadIdx.x] = next_row;
    }
    cp_async_wait<0>();  // no copy outlives the block (the Q tile when no K/V tile is visible)

    store_rows<T, MT, D>(oacc, m, l, o, lse, sinks, p, h, q_start, q_len, wr0, g, tq);
}
