// bwd_dkdv on Hopper's warpgroup tensor cores (wgmma, sm_90a only; other targets compile a stub that traps,
// and the host never launches it there). Same inputs, outputs, params and semantics as bwd_dkdv
// (varlen_bwd.cuh), whose masks, P / dS arithmetic (p_of) and vector dQ atomics (dq_add4) it shares.
//
// Grid: (K tiles of BN = 128 keys, n_kv_heads, n_seqs). Block: 2 warpgroups; warpgroup w owns keys
// [64 w, 64 w + 64) of the tile (warp q of it: 16 of them). K and V of the tile are copied into shared memory
// once; the block walks the query heads of the KV head's group and, per head, the BM = 64-row query tiles that
// see a key of the tile (as bwd_dkdv), Q, dO, LSE and D of the next step copied by cp.async while a step runs.
// Per step and warpgroup (accumulators f32, the tiles below are of its 64 keys):
//   S^T = K_w Q^T, dP^T = V_w dO^T  64 x 64 each: D / 16 wgmma m64n64k16, A (K / V rows) and B (Q / dO rows)
//                                   K-major in shared memory; two commit groups, so P^T is computed while dP^T runs;
//   P^T, dS^T                       in registers, as bwd_dkdv does them (wgmma's accumulator is mma.sync's C
//                                   layout); P^T and dS^T rounded to T are the register A operands below;
//   dV += P^T dO, dK += dS^T Q      64 x D: 4 k16 steps (64 queries) of m64n{D}k16, A from registers, B (dO / Q:
//                                   K = queries, N = head dims) MN-major in shared memory;
//   dQ (atomic mode)                dS^T (T) goes to shared memory [128 keys][64 queries]; after a block barrier
//                                   each warpgroup takes D / 2 columns of dQ = dS K (64 x D / 2, 8 k16 steps of
//                                   keys): m64n{D/2}k16 with both operands MN-major (A: the stored dS^T read
//                                   transposed, B: the K tile, N = head dims); red.global.add.v4.f32 into dq_accum.
// dK and dV stay in registers across the whole group of heads (64 + 64 accumulators a thread at D 128) and are
// stored once, rounded to T (dK scaled), as bwd_dkdv does. Every warpgroup runs every step (a step none of its
// keys sees is masked whole): wgmma under a branch that depends on the thread makes ptxas serialize all of them;
// the step count and the warp indices are made warp-uniform for the compiler (shuffled from lane 0).
//
// Shared tiles use wgmma's 128-byte swizzled layout as prefill_wg (prefill_wg.cuh): a tile of R rows is D / 64
// blocks of 64 columns, each R rows of 128 bytes, the 16-byte chunk c of row r stored at chunk c ^ (r % 8)
// (1024-byte aligned atoms of 8 rows).
//   K-major operands (K, V as A; Q, dO as B): SBO 1024 (next 8 rows); a k16 step is 32 bytes into the atom,
//   4 per 64-column block (R * 128 bytes apart);
//   MN-major operands (dO, Q as B of dV / dK; dS^T as A and K as B of dQ): 16 rows (the k16 step) are 2048 bytes,
//   SBO 1024 (next 8 rows along K), LBO = R * 128 (next 64 columns along N; dS^T has 64 only). At D 64 warpgroup 1's
//   dQ columns 32..63 start 64 bytes into K's rows (the swizzle is a function of the address, as for the
//   32-byte k16 steps of a K-major operand).
// Shared memory: K, V (BN x D each), 2 stages of Q and dO (BM x D each), dS^T (BN x BM), all T: 144 KB at D 128,
// 80 KB at D 64 (+ 1 KB of alignment slack, + 1 KB of LSE / D stages).
// FLOPs and bytes: bwd_dkdv's (varlen_bwd.cuh).
#pragma once

#include "common/wgmma.cuh"
#include "attention/varlen_bwd.cuh"

namespace cukern {
namespace attn {

// Shapes of bwd_dkdv_wg<T, D> (mirrored by _bwd_wg_shape in cukern/attention/backward.py; tests check the two
// agree).
template <int D>
struct BwdWgShape {
    static constexpr int WGS = 2;                  // warpgroups, 64 keys each
    static constexpr int NT = 128 * WGS;           // threads
    static constexpr int BN = 64 * WGS;            // keys of a block
    static constexpr int BM = 64;                  // query rows per step
    static constexpr int DQN = D / WGS;            // dQ: columns of a warpgroup
    static constexpr int CPR = D / 8;              // 16-byte chunks per row
    static constexpr int KSTEP = NT / CPR;         // rows between a thread's consecutive chunks of a copy
    static constexpr uint32_t KV_BYTES = BN * D * 2;  // the K (or V) tile
    static constexpr uint32_t Q_BYTES = BM * D * 2;   // one stage of Q (or dO)
    static constexpr uint32_t DS_BYTES = BN * BM * 2; // dS^T
    static constexpr uint32_t SMEM_BYTES = 1024 + 2 * KV_BYTES + 4 * Q_BYTES + DS_BYTES;  // slack, K, V, stages, dS^T
    static_assert(D == 64 || D == 128, "bwd_dkdv_wg: head_dim 64 or 128 (dK and dV: D / 2 accumulators each)");
    static_assert(NT % CPR == 0 && KSTEP % 8 == 0 && BM % KSTEP == 0 && BN % KSTEP == 0,
                  "tiles split evenly over the threads, a thread's rows in the same swizzle phase");
    static_assert(BM * 2 == 128, "a dS^T row (BM queries of T) is one 128-byte swizzle row");
};

}  // namespace attn
}  // namespace cukern

template <typename T, int D>
__global__ void __launch_bounds__(cukern::attn::BwdWgShape<D>::NT, 1) bwd_dkdv_wg(
    T* __restrict__ dk,                        // [total_k, n_kv_heads, D]
    T* __restrict__ dv,                        // [total_k, n_kv_heads, D]
    float* __restrict__ dq_accum,              // [total_q, n_heads, D] f32, += dS K / scale (dq_atomic only)
    const T* __restrict__ q,                   // [total_q, n_heads, D]
    const T* __restrict__ k,                   // [total_k, n_kv_heads, D]
    const T* __restrict__ v,                   // [total_k, n_kv_heads, D]
    const T* __restrict__ dout,                // [total_q, n_heads, D]
    const float* __restrict__ lse,             // [total_q, n_heads] natural-log LSE of the forward
    const float* __restrict__ delta,           // [total_q, n_heads] rowsum(dO * O) (bwd_preprocess)
    const int32_t* __restrict__ cu_seqlens_q,  // [n_seqs + 1] first query row of each sequence
    const int32_t* __restrict__ cu_seqlens_k,  // [n_seqs + 1] first key row of each sequence
    const BwdParams p) {                       // dynamic shared memory: BwdWgShape<D>::SMEM_BYTES
    using namespace cukern;
    using namespace cukern::attn;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Sh = BwdWgShape<D>;
    constexpr int BN = Sh::BN, BM = Sh::BM, DQN = Sh::DQN, CPR = Sh::CPR, KSTEP = Sh::KSTEP;
    constexpr uint32_t STEP = KSTEP * 128;  // bytes between a thread's copy rows my_row + i * KSTEP and the next
    // P^T dz/dx held across dP^T as f16 pairs at D 128 (16 registers instead of 32, beside the 128 of dK and dV),
    // as bwd_dkdv's 64-row steps do it; f32 at D 64
    constexpr bool PF16 = D > 64;

    extern __shared__ __align__(128) uint8_t smem[];
    const uint32_t k_s = (smem_addr(smem) + 1023) & ~1023u;  // [BN keys] (1024-byte aligned: swizzle atoms)
    const uint32_t v_s = k_s + Sh::KV_BYTES;                   // [BN keys]
    const uint32_t q_s = v_s + Sh::KV_BYTES;                   // [2 stages][BM rows]
    const uint32_t do_s = q_s + 2 * Sh::Q_BYTES;               // [2 stages][BM rows]
    const uint32_t ds_s = do_s + 2 * Sh::Q_BYTES;              // [BN keys][BM queries] dS^T (dq_atomic)
    uint8_t* const ds_p = smem + (ds_s - smem_addr(smem));     // the same, as a generic pointer
    __shared__ float lse_s[2][BM], del_s[2][BM];               // base-2 LSE and D of the stage's rows

    const int tid = threadIdx.x, lane = tid % 32;
    const int wgi = __shfl_sync(0xffffffffu, tid / 128, 0), wq = __shfl_sync(0xffffffffu, (tid / 32) % 4, 0);
    const int g = lane / 4, tq = lane % 4;
    const uint32_t s = blockIdx.z, hk = blockIdx.y;
    const int32_t k_start = cu_seqlens_k[s], kv_len = cu_seqlens_k[s + 1] - k_start;
    const int32_t q_start = cu_seqlens_q[s], q_len = cu_seqlens_q[s + 1] - q_start;
    const int32_t j0 = (int32_t)blockIdx.x * BN;
    if (j0 >= kv_len) return;
    const int32_t offset = p.causal == 2 ? 0 : kv_len - q_len;  // query row r sits at position offset + r
    const bool windowed = p.window_left >= 0;
    const uint64_t kv_row = (uint64_t)p.n_kv_heads * D, q_row = (uint64_t)p.n_heads * D;

    // query rows that see a key of the tile: [r_lo, r_hi)
    const int32_t j_last = min(j0 + BN, kv_len) - 1;
    const int32_t r_lo = p.causal ? max(0, j0 - offset) : 0;
    const int32_t r_hi = windowed ? min(q_len, j_last + p.window_left - offset + 1) : q_len;
    const int32_t t_begin = r_lo / BM;
    const int32_t n_qt = r_hi > r_lo ? (r_hi + BM - 1) / BM - t_begin : 0;
    const int32_t n_steps = __shfl_sync(0xffffffffu, n_qt * (int32_t)p.group, 0);  // (head, query tile) pairs

    // this warp's keys: [kw0, kw0 + 16)
    const int32_t kw0 = j0 + 64 * wgi + 16 * wq;

    // this thread's copies: column chunk `col` of rows my_row + i * KSTEP
    const int my_row = (tid % 8) + 8 * (tid / (8 * CPR)), col = (tid / 8) % CPR;
    const uint32_t kv_dst0 = wg::swizzled_offset<BN>(my_row, col), q_dst0 = wg::swizzled_offset<BM>(my_row, col);
    {  // K and V of the tile (keys past kv_len are zeros)
        const uint64_t off = (uint64_t)(k_start + j0 + my_row) * kv_row + hk * D + col * 8;
        const T* kp = k + off;
        const T* vp = v + off;
        const int32_t left = kv_len - j0 - my_row;  // chunk i is a real key when i * KSTEP < left
#pragma unroll
        for (int i = 0; i < BN / KSTEP; ++i) {
            const bool ok = i * KSTEP < left;
            cp_async16(k_s + kv_dst0 + i * STEP, ok ? kp : k, ok ? 16u : 0u);
            cp_async16(v_s + kv_dst0 + i * STEP, ok ? vp : v, ok ? 16u : 0u);
            kp += KSTEP * kv_row;
            vp += KSTEP * kv_row;
        }
    }
    // step i: head hk * group + i / n_qt, rows (t_begin + i % n_qt) * BM ...
    auto step_head = [&](int32_t i) { return hk * p.group + (uint32_t)(i / n_qt); };
    auto step_r0 = [&](int32_t i) { return (t_begin + i % n_qt) * BM; };
    auto load_step = [&](int32_t i, int st) {  // Q and dO of step i into stage st (rows past q_len are zeros)
        const uint32_t h = step_head(i);
        const int32_t r0 = step_r0(i);
        const uint64_t off = (uint64_t)(q_start + r0 + my_row) * q_row + h * D + col * 8;
        const T* qp = q + off;
        const T* op = dout + off;
        const int32_t left = q_len - r0 - my_row;
        const uint32_t qd = q_s + st * Sh::Q_BYTES + q_dst0, od = do_s + st * Sh::Q_BYTES + q_dst0;
#pragma unroll
        for (int c = 0; c < BM / KSTEP; ++c) {
            const bool ok = c * KSTEP < left;
            cp_async16(qd + c * STEP, ok ? qp : q, ok ? 16u : 0u);
            cp_async16(od + c * STEP, ok ? op : dout, ok ? 16u : 0u);
            qp += KSTEP * q_row;
            op += KSTEP * q_row;
        }
    };
    // LSE and D of row tid of step i (rows past q_len: P = 0, D = 0)
    auto row_stats = [&](int32_t i) {
        const int32_t r = step_r0(i) + tid;
        if (r >= q_len) return make_float2(INFINITY, 0.0f);
        const uint64_t at = (uint64_t)(q_start + r) * p.n_heads + step_head(i);
        return make_float2(lse2_of(lse[at]), delta[at]);
    };
    if (n_steps > 0) {
        load_step(0, 0);
        if (tid < BM) {
            const float2 st0 = row_stats(0);
            lse_s[0][tid] = st0.x;
            del_s[0][tid] = st0.y;
        }
    }
    cp_async_commit();

    float dka[D / 8][4], dva[D / 8][4];  // dK, dV of key kw0 + g + 8 (e >= 2), column 8 dt + 2 tq + (e & 1)
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dka[dt][e] = dva[dt][e] = 0.0f;

    // descriptors (128-byte swizzle). K-major: k16 step kk of a tile of `rows` rows starting at t.
    auto kmaj = [](uint32_t t, int rows, int kk) {
        return wg::desc(t + kk / 4 * (rows * 128) + kk % 4 * 32, 16, 1024, 1);
    };
    // MN-major, K = the stage's query rows 16 kk ..., N = head dims (B of dV, dK)
    auto qmn = [](uint32_t t, int kk) { return wg::desc(t + kk * 16 * 128, BM * 128, 1024, 1); };
    const uint32_t k_wg = k_s + wgi * 64 * 128, v_wg = v_s + wgi * 64 * 128;  // this warpgroup's 64 keys
    // dQ: keys 16 kk ... of dS^T (A, M = queries) and of K (B, N = this warpgroup's DQN columns)
    const uint32_t k_dq = k_s + (wgi * DQN / 64) * (BN * 128) + (wgi * DQN % 64) * 2;
    auto ds_desc = [&](int kk) { return wg::desc(ds_s + kk * 16 * 128, BN * 128, 1024, 1); };
    auto kdq_desc = [&](int kk) { return wg::desc(k_dq + kk * 16 * 128, BN * 128, 1024, 1); };

    float2 next = make_float2(0.0f, 0.0f);
    for (int32_t i = 0; i < n_steps; ++i) {
        const int st = i & 1;
        cp_async_wait<0>();      // step i's tiles (and K, V) have landed: this thread's copies ...
        wg::fence_async_smem();  // ... are visible to wgmma ...
        __syncthreads();         // ... everyone's; both warpgroups are done with stage st ^ 1 and with dS^T
        if (i + 1 < n_steps) {
            load_step(i + 1, st ^ 1);
            if (tid < BM) next = row_stats(i + 1);
        }
        cp_async_commit();
        const uint32_t h = step_head(i);
        const int32_t r0 = step_r0(i);
        const uint32_t qt = q_s + st * Sh::Q_BYTES, ot = do_s + st * Sh::Q_BYTES;

        // S^T = K_w Q^T and dP^T = V_w dO^T: key kw0 + g + 8 (e >= 2), query r0 + 8 nt + 2 tq + (e & 1)
        float sc[BM / 8][4], dp[BM / 8][4];
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) wg::mma_ss<T>(sc, kmaj(k_wg, BN, kk), kmaj(qt, BM, kk), kk > 0);
        wg::commit();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) wg::mma_ss<T>(dp, kmaj(v_wg, BN, kk), kmaj(ot, BM, kk), kk > 0);
        wg::commit();
        wg::wait<1>();  // S^T (dP^T may still run)
        wg::pin(sc);

        // P^T (rounded to T: the A operand of dV += P^T dO) and P^T dz/dx (in sc, or as f16 pairs in pf)
        const bool need_mask = kw0 + 16 > kv_len || (p.causal && kw0 + 15 > offset + r0) ||
                               (windowed && kw0 < offset + r0 + BM - 1 - p.window_left);
        uint32_t pa[BM / 16][4], pf[BM / 8][2];
#pragma unroll
        for (int nt = 0; nt < BM / 8; ++nt) {
            float pr[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = nt * 8 + 2 * tq + (e & 1);
                const int32_t j = kw0 + g + (e >= 2 ? 8 : 0), pos = offset + r0 + c;
                const bool vis = !need_mask || (j < kv_len && (!p.causal || j <= pos) &&
                                                (!windowed || j >= pos - p.window_left));
                sc[nt][e] = p_of(sc[nt][e], lse_s[st][c], vis, p, pr[e]);
            }
            to_a_frag<T, BM>(pa, nt, pr);
            if constexpr (PF16) {
                pf[nt][0] = pack2<__half>(sc[nt][0], sc[nt][1]);
                pf[nt][1] = pack2<__half>(sc[nt][2], sc[nt][3]);
            }
        }
        // dV += P^T dO (runs while dS^T is computed)
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) wg::mma_rs_mn<T>(dva, pa[kk], qmn(ot, kk));
        wg::commit();
        wg::wait<1>();  // dP^T (dV may still run)
        wg::pin(dp);

        // dS^T = P^T dz/dx (dP^T - D), rounded to T: the A operand of dK += dS^T Q (and dQ's, through shared memory)
        uint32_t da[BM / 16][4];
#pragma unroll
        for (int nt = 0; nt < BM / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float pfe = sc[nt][e];
                if constexpr (PF16) {
                    const uint32_t u = pf[nt][e / 2];
                    const float2 f2 = __half22float2(*reinterpret_cast<const __half2*>(&u));
                    pfe = (e & 1) ? f2.y : f2.x;
                }
                dp[nt][e] = pfe * (dp[nt][e] - del_s[st][nt * 8 + 2 * tq + (e & 1)]);
            }
            to_a_frag<T, BM>(da, nt, dp[nt]);
        }
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) wg::mma_rs_mn<T>(dka, da[kk], qmn(qt, kk));
        wg::commit();

        if (p.dq_atomic) {
            // dS^T of the warp's 16 keys (rows 64 wgi + 16 wq + g + 8 i2: row % 8 = g) x 64 queries (chunk nt) into
            // the swizzled tile; a's registers 2 (nt % 2) + i2 of k-step nt / 2 hold row g + 8 i2, columns 8 nt + 2 tq
#pragma unroll
            for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
                for (int i2 = 0; i2 < 2; ++i2)
                    *reinterpret_cast<uint32_t*>(ds_p + (64 * wgi + 16 * wq + g + 8 * i2) * 128 + ((nt ^ g) * 16) +
                                                 4 * tq) = da[nt / 2][(nt % 2) * 2 + i2];
            wg::fence_async_smem();  // the stores are visible to wgmma ...
            __syncthreads();         // ... both warpgroups'
            // dQ (64 queries x DQN columns from wgi DQN) = dS K: query r0 + 16 wq + g + 8 (e >= 2), column
            // wgi DQN + 8 j + 2 tq + (e & 1)
            float dq[DQN / 8][4];
            wg::fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) wg::mma_ss_tt<T>(dq, ds_desc(kk), kdq_desc(kk), kk > 0);
            wg::commit();
            wg::wait<0>();
            wg::pin(dq);
            const int32_t ra = r0 + 16 * wq;  // the warp's rows [ra, ra + 16)
            float* const qa = dq_accum + ((uint64_t)(q_start + ra + g) * p.n_heads + h) * D + wgi * DQN + 2 * tq;
            const bool odd = tq & 1;
            float* const qa4 = odd ? qa + 8 * q_row - 2 : qa;  // row g + 8 (tq & 1), column 4 (tq / 2)
            const bool ok = g + (odd ? 8 : 0) < q_len - ra;
#pragma unroll
            for (int j = 0; j < DQN / 8; ++j) dq_add4(qa4 + 8 * j, dq[j], odd, ok);
        } else {
            wg::wait<0>();
        }
        // every product of the step has completed: its register operands may be written again
        wg::pin(dka);
        wg::pin(dva);
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                wg::pin(pa[kk][e]);
                wg::pin(da[kk][e]);
            }
        // the stats of step i + 1 into the other stage (its last readers were before this step's first barrier)
        if (i + 1 < n_steps && tid < BM) {
            lse_s[st ^ 1][tid] = next.x;
            del_s[st ^ 1][tid] = next.y;
        }
    }
    cp_async_wait<0>();  // no copy outlives the block (K, V when no step runs)

    // dK = scale sum dS^T Q, dV; keys kw0 + g + 8 i2 below kv_len
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
        const int32_t j = kw0 + g + 8 * i2;
        if (j >= kv_len) continue;
        const uint64_t at = ((uint64_t)(k_start + j) * p.n_kv_heads + hk) * D + 2 * tq;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            *reinterpret_cast<uint32_t*>(dk + at + dt * 8) =
                pack2<T>(dka[dt][2 * i2] * p.scale, dka[dt][2 * i2 + 1] * p.scale);
            *reinterpret_cast<uint32_t*>(dv + at + dt * 8) = pack2<T>(dva[dt][2 * i2], dva[dt][2 * i2 + 1]);
        }
    }
#else
    __trap();  // sm_90a only
#endif
}
