// Flash attention for many queries per sequence on Hopper's warpgroup tensor cores (wgmma, sm_90a
// only; other targets compile a stub that traps, and the host never launches it there). Same inputs,
// outputs and semantics as prefill (prefill.cuh), whose mask, online softmax and store it shares.
//
// Grid: (n_q_tiles, n_heads, n_seqs), heaviest tile first within each (head, sequence): blockIdx.x = 0 is
// the last query tile. Consecutive blocks share a head, so the blocks resident together read the K/V of a
// few heads, which stay in L2. Block: WGS = 2 warpgroups of 64 query rows each (BM = 128), one block per SM.
// head_dim 128 or 256. Per K/V tile of BN keys (128; 64 at head_dim 256, so that two stages fit beside Q)
// and warpgroup:
//   S = Q K^T: D / 16 wgmma m64nBNk16, Q (A) and K (B) both K-major in shared memory;
//   masks and the online softmax in registers (wgmma's accumulator layout is mma.sync's C layout, so
//   prefill's code serves), P rounded to T in registers;
//   O += P V: BN / 16 k16 steps of D / 128 wgmma m64n128k16 (one per 128 columns of O) with P as the
//   register A operand and V as the MN-major B operand. At head_dim 256 a thread holds 128 O accumulators.
// Every warpgroup runs every tile of the block's key range (a tile none of its rows sees is masked whole):
// wgmma under a branch that depends on the thread makes ptxas serialize all of them. The block's range
// and each warpgroup's rows are made warp-uniform for the compiler (shuffled from lane 0).
// Pingpong: within a tile, warpgroup 1 issues its S only when warpgroup 0's S has completed (a named
// barrier), so warpgroup 0's softmax runs beside warpgroup 1's S, and warpgroup 1's softmax beside
// warpgroup 0's O += P V; the tensor cores idle less than when both do their softmax at once.
// K/V tiles stream through two shared stages with cp.async (tile t + 1 is copied while tile t is used; one
// barrier per tile), as in prefill; paged rows are looked up two tiles ahead into shared memory.
//
// Shared tiles use wgmma's 128-byte swizzled layout: a tile of R rows (queries or keys) is D / 64 blocks of
// 64 columns, each R rows of 128 bytes, with the 16-byte chunk c (of 8) of row r stored at chunk
// c ^ (r % 8) (atoms of 8 rows x 128 bytes, 1024-byte aligned). A thread copies one column chunk of rows
// my_row + i * KSTEP; the 8 lanes that copy the 8 rows of an atom write 8 different bank groups, and so
// do the lanes that take the chunks of one global row (the interleaved layout, where those land 128 bytes
// apart, made the copies 1.6x slower).
//   Q (A), K (B): K-major, SBO 1024 (next 8 rows); a k16 step is 32 bytes into the atom, 4 per block;
//   V (B, K = keys, N = columns): MN-major, LBO = R * 128 (next 64 columns), SBO 1024 (next 8 keys); the
//   product of O's columns 128 c ... starts 2 c blocks in.
#pragma once

#include "common/sync.cuh"
#include "common/wgmma.cuh"
#include "attention/prefill.cuh"

// Pingpong: warpgroup 1 starts S = Q K^T of a tile when warpgroup 0's has completed (a named barrier), so that
// each warpgroup's softmax runs beside the other's products (docs/notes/attention.md has the alternatives).

namespace cukern {
namespace attn {

// Shapes of prefill_wg<T, D, PAGED> (mirrored by _prefill_wg_shape in cukern/attention/plan.py;
// tests/test_attention.py checks the two agree).
template <int D>
struct PrefillWgShape {
    static constexpr int WGS = 2;                        // warpgroups of 64 query rows
    static constexpr int BM = 64 * WGS;                  // query rows of a block
    static constexpr int BN = D > 128 ? 64 : 128;        // keys per K/V tile (S: m64nBN per warpgroup)
    static constexpr int NT = 128 * WGS;                 // threads
    static constexpr int CPR = D / 8;                    // 16-byte chunks per row
    static constexpr int KSTEP = NT / CPR;               // rows between a thread's consecutive chunks
    static constexpr uint32_t Q_BYTES = BM * D * 2;
    static constexpr uint32_t KV_BYTES = BN * D * 2;     // one K (or V) tile
    static constexpr int STAGES = 2;                     // K/V tiles in shared memory
    static constexpr uint32_t SMEM_BYTES = 1024 + Q_BYTES + 2 * STAGES * KV_BYTES;  // alignment slack, Q, K/V stages
    static_assert(D == 128 || D == 256, "prefill_wg: head_dim 128 or 256 (O is D / 128 m64n128 accumulators)");
    static_assert(NT % CPR == 0 && KSTEP % 8 == 0 && BM % KSTEP == 0 && BN % KSTEP == 0,
                  "tiles split evenly over the threads, a thread's rows in the same swizzle phase");
    static_assert(BN <= NT, "one thread looks up the pool row of each key of a tile");
};

}  // namespace attn
}  // namespace cukern

template <typename T, int D, bool PAGED>
__global__ void __launch_bounds__(cukern::attn::PrefillWgShape<D>::NT, 1) prefill_wg(
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
    const PrefillParams p) {                 // dynamic shared memory: PrefillWgShape<D>::SMEM_BYTES
    using namespace cukern;
    using namespace cukern::attn;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Sh = PrefillWgShape<D>;
    constexpr int BM = Sh::BM, BN = Sh::BN, CPR = Sh::CPR, KSTEP = Sh::KSTEP;

    extern __shared__ __align__(128) uint8_t smem[];
    const uint32_t q_s = (smem_addr(smem) + 1023) & ~1023u;  // [BM rows] (1024-byte aligned: swizzle atoms)
    const uint32_t k_s = q_s + Sh::Q_BYTES;       // [STAGES][BN keys]
    const uint32_t v_s = k_s + Sh::STAGES * Sh::KV_BYTES;  // [STAGES][BN keys]

    const int tid = threadIdx.x, lane = tid % 32;
    const int wgi = __shfl_sync(0xffffffffu, tid / 128, 0), warp = __shfl_sync(0xffffffffu, tid / 32, 0);  // uniform
    const int g = lane / 4, tq = lane % 4;

    const uint32_t h = blockIdx.y, s = blockIdx.z;
    const int32_t q_start = q_indptr[s];
    const int32_t q_len = q_indptr[s + 1] - q_start;
    const int32_t r0 = (int32_t)(p.n_q_tiles - 1 - blockIdx.x) * BM;  // first query row of the tile
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
    const uint64_t row_elems = (uint64_t)p.n_kv_heads * D;
    const int32_t offset = p.causal == 2 ? 0 : kv_len - q_len;  // position of query row r is offset + r
    const int32_t rows_here = min(BM, q_len - r0);
    const bool windowed = p.window_left >= 0;

    // keys any row of the block sees: [lo, hi)
    const int32_t hi = p.causal ? min(kv_len, offset + r0 + rows_here) : kv_len;
    const int32_t lo = windowed ? max(0, offset + r0 - p.window_left) : 0;
    const int32_t t_begin = __shfl_sync(0xffffffffu, lo / BN, 0);
    const int32_t t_end = __shfl_sync(0xffffffffu, hi > lo ? (hi + BN - 1) / BN : lo / BN, 0);

    // this warp's rows [wr0, wr0 + 16) (rows >= q_len compute values that are never stored)
    const int32_t wr0 = r0 + warp * 16;
    const int32_t w_last = min(wr0 + 15, q_len - 1);

    // this thread's copies: column chunk `col` of rows my_row + i * KSTEP
    const int my_row = (tid % 8) + 8 * (tid / (8 * CPR)), col = (tid / 8) % CPR;
    const uint32_t q_dst0 = wg::swizzled_offset<BM>(my_row, col), kv_dst0 = wg::swizzled_offset<BN>(my_row, col);
    constexpr uint32_t STEP = KSTEP * 128;  // bytes between rows my_row + i * KSTEP and the next

    // Q tile (rows past q_len are zeros)
    {
        const T* qp = q + ((uint64_t)(q_start + r0 + my_row) * p.n_heads + h) * D + col * 8;
#pragma unroll
        for (int i = 0; i < BM / KSTEP; ++i) {
            const bool ok = r0 + my_row + i * KSTEP < q_len;
            cp_async16(q_s + q_dst0 + i * STEP, ok ? qp : q, ok ? 16u : 0u);
            qp += (uint64_t)KSTEP * p.n_heads * D;
        }
    }
    // PAGED: pool row of key (t * BN + thread) of tile t (threads < BN), -1 past kv_len
    __shared__ int32_t sm_rows[2][BN];  // rows of tile t in slot (t - t_begin) % 2
    auto fetch_row = [&](int32_t t) {
        const int32_t j = t * BN + tid;
        return tid < BN && j < kv_len ? (int32_t)paged_row(pt, (uint32_t)j, p.page_size, p.page_shift) : -1;
    };
    const T* const k_col = k + (uint64_t)(h / p.group) * D + col * 8;
    const T* const v_col = v + (uint64_t)(h / p.group) * D + col * 8;
    auto load_kv = [&](int32_t t, int st) {  // K/V tile t into stage st (PAGED: its rows in sm_rows)
        const uint32_t kd = k_s + st * Sh::KV_BYTES + kv_dst0, vd = v_s + st * Sh::KV_BYTES + kv_dst0;
        if (PAGED) {
#pragma unroll
            for (int i = 0; i < BN / KSTEP; ++i) {
                const int32_t row = sm_rows[(t - t_begin) & 1][my_row + i * KSTEP];
                const uint64_t off = (uint64_t)max(row, 0) * row_elems;
                cp_async16(kd + i * STEP, k_col + off, row >= 0 ? 16u : 0u);
                cp_async16(vd + i * STEP, v_col + off, row >= 0 ? 16u : 0u);
            }
        } else {
            const uint64_t off = (uint64_t)(k_start + t * BN + my_row) * row_elems;
            const T* kp = k_col + off;
            const T* vp = v_col + off;
            const int32_t left = kv_len - t * BN - my_row;  // chunk i is a real key when i * KSTEP < left
#pragma unroll
            for (int i = 0; i < BN / KSTEP; ++i) {
                const bool ok = i * KSTEP < left;
                cp_async16(kd + i * STEP, ok ? kp : k, ok ? 16u : 0u);
                cp_async16(vd + i * STEP, ok ? vp : v, ok ? 16u : 0u);
                kp += KSTEP * row_elems;
                vp += KSTEP * row_elems;
            }
        }
    };
    int32_t next_row = -1;  // PAGED: this thread's row of the tile two ahead, stored at the end of an iteration
    if (PAGED) {
        if (tid < BN) sm_rows[0][tid] = fetch_row(t_begin);
        if (tid < BN) sm_rows[1][tid] = fetch_row(t_begin + 1);
        __syncthreads();
    }
    if (t_begin < t_end) load_kv(t_begin, 0);
    cp_async_commit();

    float oacc[1][D / 8][4];
    float m[1][2] = {{-INFINITY, -INFINITY}}, l[1][2] = {{0.0f, 0.0f}};
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) oacc[0][dt][0] = oacc[0][dt][1] = oacc[0][dt][2] = oacc[0][dt][3] = 0.0f;

    const float sl = p.softcap > 0.0f ? 1.0f : p.scale_log2;  // raw score -> base-2 logit factor in the exponent
    const uint32_t q_wg = q_s + wg::swizzled_offset<BM>(wgi * 64, 0);  // this warpgroup's 64 rows
    // descriptors of k16 step kk (128-byte swizzle): Q (A) and K (B) K-major, V (B) MN-major
    auto q_desc = [&](int kk) { return wg::desc(q_wg + kk / 4 * (BM * 128) + kk % 4 * 32, 16, 1024, 1); };
    auto k_desc = [&](uint32_t kt, int kk) { return wg::desc(kt + kk / 4 * (BN * 128) + kk % 4 * 32, 16, 1024, 1); };
    auto v_desc = [&](uint32_t vt, int kk, int c) {  // keys 16 kk ..., O's columns 128 c ...
        return wg::desc(vt + c * 2 * (BN * 128) + kk * 16 * 128, BN * 128, 1024, 1);
    };

    for (int32_t t = t_begin; t < t_end; ++t) {
        const int st = (t - t_begin) % Sh::STAGES;
        cp_async_wait<0>();      // tile t has landed (this thread's copies) ...
        wg::fence_async_smem();  // ... is visible to wgmma ...
        __syncthreads();         // ... everyone's; and both warpgroups are done with the stage tile t + 1 takes
        const int32_t j0 = t * BN;
        const uint32_t kt = k_s + st * Sh::KV_BYTES, vt = v_s + st * Sh::KV_BYTES;
        // this thread's copies of tile t + 1 (which run while tile t is used), and the pool rows of tile t + 2
        auto copy_ahead = [&]() {
            if (t + 1 < t_end) load_kv(t + 1, (st + 1) % Sh::STAGES);
            cp_async_commit();
            if (PAGED && t + 2 < t_end) next_row = fetch_row(t + 2);
        };
        // S = Q K^T. Warpgroup 0 issues it first and then its copies; warpgroup 1 copies first and, with
        // pingpong, waits for warpgroup 0's S to complete (barrier 1: warpgroup 0 arrives, 1 waits).
        const bool copy_first = wgi == 1;
        if (copy_first) {
            copy_ahead();
            named_bar_sync(1, Sh::NT);
        }
        float sacc[1][BN / 8][4];
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) wg::mma_ss<T>(sacc[0], q_desc(kk), k_desc(kt, kk), kk > 0);
        wg::commit();
        if (!copy_first) copy_ahead();
        wg::wait<0>();
        wg::pin(sacc[0]);
        if (wgi == 0) named_bar_arrive(1, Sh::NT);
        // Without a softcap the scores stay raw and the scale joins the exponent's FMA; with one they become
        // base-2 logits here. Masks only on tiles that cross a boundary of this warp's rows (a tile none of
        // them sees is one).
        if (p.softcap > 0.0f) to_logits2<BN / 2>(&sacc[0][0][0], p.scale_log2, p.softcap, p.inv_softcap);
        const bool need_mask = j0 + BN > kv_len || (p.causal && j0 + BN - 1 > offset + wr0) ||
                               (windowed && j0 < offset + w_last - p.window_left);
        if (__any_sync(0xffffffffu, need_mask))
            mask_scores(sacc, offset + wr0 + g, j0 + 2 * tq, kv_len, p.causal, windowed, p.window_left);
        uint32_t pa[1][BN / 16][4];
        float corr[1][2];
        online_softmax<T>(sacc, pa, m, l, corr, sl);
        rescale_rows(oacc, corr);  // always: a branch around the accumulators serializes the wgmma
        // O += P V
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
            for (int c = 0; c < D / 128; ++c)
                wg::mma_rs_mn<T>(*reinterpret_cast<float(*)[16][4]>(&oacc[0][16 * c][0]), pa[0][kk],
                                     v_desc(vt, kk, c));
        wg::commit();
        wg::wait<0>();
        wg::pin(oacc[0]);
        // tile t's rows (its slot) were used by its copies: the slot takes tile t + 2's (read after the
        // next iteration's barrier)
        if (PAGED && t + 2 < t_end && tid < BN) sm_rows[(t - t_begin) & 1][tid] = next_row;
    }
    cp_async_wait<0>();  // no copy outlives the block (the Q tile when no K/V tile is visible)

    store_rows<T, 1, D>(oacc, m, l, o, lse, sinks, p, h, q_start, q_len, wr0, g, tq);
#else
    __trap();  // sm_90a only
#endif
}
