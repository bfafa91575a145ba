// Backward of the varlen forward (FlashAttention-2 style): dQ, dK, dV of packed sequences from the
// forward's O and natural-log LSE ([total_q, n_heads] f32, what prefill / prefill_wg write), with the
// forward's masks (causal: the last query at the last key, or with causal == 2 the first at the first; sliding
// window), softcap and GQA.
//
// Per (query r, key j) of a head, in the forward's terms (x = q.k, z the natural logit):
//   z = scale x, or softcap tanh(scale x / softcap);  P = exp(z - LSE);  D_r = rowsum(dO * O)_r;
//   dV_j = sum_r P dO_r;  dP = dO_r . v_j;  dS = P (dP - D_r) dz/dx / scale;
//   dQ_r = scale sum_j dS k_j;  dK_j = scale sum_r dS q_r      (dz/dx / scale = 1 - tanh^2 with a cap).
// A sink (forward with sinks) is inside the saved LSE, so P and these gradients hold with it too (the
// sink's own gradient is not computed).
//
// Kernels, in launch order:
//   bwd_preprocess  grid (rows / (4 * rows per warp)), 128 threads: D per (token, head), one group of D / 8
//                   lanes a row; zeroes dq_accum's rows in the atomic mode. Reads 2 total_q h D T, writes
//                   4 total_q h bytes (+ 4 total_q h D zeros).
//   bwd_dkdv        grid (K tiles of BN = 16 KW keys, n_kv_heads, n_seqs), KW warps of 16 keys (8, or 4 where
//                   the 8-warp tile's shared memory exceeds a block's, as at D 128 on sm_86/89): the K/V tile in
//                   shared memory once; loops over the query heads of the KV head's group and their query
//                   tiles of BM = QR rows (32 or 64) that see a key of the tile (Q, dO, LSE, D double-buffered
//                   with cp.async), recomputes S^T = K Q^T and P^T, accumulates dV += P^T dO and dK += dS^T Q in
//                   registers (f32; one store per key, so the GQA sum needs no atomics). Atomic mode: dS^T
//                   goes through shared memory and dQ += dS K is added with f32 atomics into dq_accum (the
//                   sum order over K tiles varies from run to run); RED4 on sm_90: one red.global.add.v4.f32
//                   per 4 values instead of 4 scalar atomics (the same sums, fewer atomic instructions).
//   bwd_dq          deterministic mode: grid (n_heads, n_seqs, Q tiles of 64 rows, heaviest first), 4 warps
//                   of 16 rows, the forward's loop over K/V tiles of QN keys recomputing P and dS; dQ in
//                   registers, written once in T. The same result on every run.
//   bwd_dq_convert  atomic mode: dq = T(scale dq_accum), float4 at a time.
// FLOPs per head: 2.5 x the forward's 4 q_len k_len D (S, dP, dV, dK, dQ: 5 GEMMs of 2 q_len k_len D) over
// the visible pairs; the deterministic mode recomputes S and dP once more (+2 GEMMs).
// Bytes: bwd_dkdv reads K, V once and Q, dO (+ LSE, D) once per K tile of a head's sequence, writes dK, dV
// once (+ total_q h D f32 atomics per K tile in the atomic mode); bwd_dq reads Q, dO once and K, V once per
// Q tile.
// Fragments are mma.sync m16n8k16's (common/mma.cuh); S^T and dP^T of bwd_dkdv are C tiles of 16 keys x
// BM queries, turned into A fragments for the next products as the forward turns S into P (n-tiles 2kk,
// 2kk + 1 are k-step kk). Shared rows are padded by 16 bytes (ldmatrix without bank conflicts).
#pragma once

#include "common/mma.cuh"
#include "common/types.cuh"
#include "attention/bwd_params.cuh"
#include "attention/common.cuh"

namespace cukern {
namespace attn {

// Shapes of the backward kernels (mirrored by _bwd_shape in cukern/attention/backward.py).
// KW: the warps of a bwd_dkdv block, 16 keys each (8 where the 128-key tile's shared memory fits a block,
// else 4: Backward._dkdv_warps); bwd_dq runs BwdShape<D>'s 4. QR: bwd_dkdv's query rows per step, 32 or 64
// (64: each K A fragment of S^T serves twice the MMAs, and a step's two block barriers, its LSE / D staging
// and its loop overhead serve twice the rows; S^T takes 32 registers instead of 16, so P^T dz/dx is held as
// f16 pairs and dP^T, dS^T, dK go by 32-row halves; the stages of Q and dO take twice the shared memory:
// Backward._dkdv_tile).
template <int D, int KW = 4, int QR = 32>
struct BwdShape {
    static constexpr int WARPS = KW;
    static constexpr int NT = 32 * WARPS;
    static constexpr int BN = 16 * WARPS;  // bwd_dkdv: keys of a block, 16 per warp
    static constexpr int BM = QR;          // bwd_dkdv: query rows per step
    static constexpr int QM = 16 * WARPS;  // bwd_dq: query rows of a block, 16 per warp
    static constexpr int QN = D <= 64 ? 64 : 32;  // bwd_dq: keys per K/V tile (D = 128: 68 KB, within sm_86's 99)
    static constexpr int LD = D + 8;       // shared row stride of Q, K, V, dO tiles (elements)
    static constexpr int LDS = BM + 8;     // shared row stride of the dS^T tile (elements)
    static constexpr int CPR = D / 8;      // 16-byte chunks of a row
    static constexpr int DKDV_SMEM = ((2 * BN + 4 * BM) * LD + BN * LDS) * 2;  // K, V, 2 x (Q, dO), dS^T
    static constexpr int DQ_SMEM = (2 * QM + 4 * QN) * LD * 2;                 // Q, dO, 2 x (K, V)
    static_assert(D % 32 == 0 && 32 % CPR == 0, "head_dim 32, 64, 128 or 256");
    static_assert(BM == 32 || BM == 64, "bwd_dkdv steps of 32 or 64 query rows");
    static_assert(WARPS % (BM / 16) == 0 && (D / 16) % (WARPS / (BM / 16)) == 0, "dQ tile split over the warps");
};

// Copy `rows` rows of a [*, stride] T matrix (16-byte chunks; row r from src + r * stride) into shared rows of
// LD elements at dst, rows at or past `valid` zero-filled.
template <typename T, int D, int NT>
CUKERN_DEVICE void load_rows(T* dst, const T* __restrict__ src, uint64_t stride, int rows, int valid) {
    constexpr int CPR = D / 8, LD = D + 8;
    for (int c = threadIdx.x; c < rows * CPR; c += NT) {
        const int r = c / CPR, ch = c % CPR;
        const bool ok = r < valid;
        cp_async16(dst + r * LD + ch * 8, ok ? src + (uint64_t)r * stride + ch * 8 : src, ok ? 16u : 0u);
    }
}

// P (or P dz/dx / scale with a softcap) of one score from its raw dot product x: z2 the base-2 logit, lse2 the
// row's base-2 LSE (+inf for a row that saw no key, so that P = 0), `visible` the masks. With a softcap the
// returned value is P (1 - t^2), t = tanh(scale x / softcap) (masked entries give 0, never NaN); p_only = P.
CUKERN_DEVICE float p_of(float x, float lse2, bool visible, const BwdParams& p, float& p_only) {
    float z2, f = 1.0f;
    if (p.softcap > 0.0f) {
        const float t = tanhf(x * (p.scale_log2 * LN2 * p.inv_softcap));
        z2 = t * (p.softcap * LOG2E);
        f = 1.0f - t * t;
    } else {
        z2 = x * p.scale_log2;
    }
    const float pr = visible ? fast_exp2(z2 - lse2) : 0.0f;
    p_only = pr;
    return pr * f;
}

// acc[N / 8][4] (+)= A B^T over D: A the warp's 16 rows of a shared tile (a: this lane's ldmatrix address of its
// A pattern, row stride LD), B N rows of a shared tile (b: this lane's address of its B pattern), both [row][d].
template <typename T, int N, int D, int LD>
CUKERN_DEVICE void mma_rows_bt(float (&acc)[N / 8][4], uint32_t a, uint32_t b) {
    constexpr uint32_t E = sizeof(T);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t af[4];
        ldmatrix_x4(af, a + kk * 16 * E);
#pragma unroll
        for (int n2 = 0; n2 < N / 16; ++n2) {
            uint32_t bf[4];
            ldmatrix_x4(bf, b + (n2 * 16 * LD + kk * 16) * E);
            mma16816<T>(acc[2 * n2], af, bf[0], bf[1]);
            mma16816<T>(acc[2 * n2 + 1], af, bf[2], bf[3]);
        }
    }
}

// acc[D / 8][4] += A B: A in registers (the A fragments of K / 16 k-steps), B K rows x D of a shared [row][d]
// tile read transposed (bt: this lane's address of its B^T pattern, row stride LD).
template <typename T, int K, int D, int LD>
CUKERN_DEVICE void mma_frags_b(float (&acc)[D / 8][4], const uint32_t (&a)[K / 16][4], uint32_t bt) {
    constexpr uint32_t E = sizeof(T);
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
#pragma unroll
        for (int d2 = 0; d2 < D / 16; ++d2) {
            uint32_t bf[4];
            ldmatrix_x4_trans(bf, bt + (kk * 16 * LD + d2 * 16) * E);
            mma16816<T>(acc[2 * d2], a[kk], bf[0], bf[1]);
            mma16816<T>(acc[2 * d2 + 1], a[kk], bf[2], bf[3]);
        }
}

// n-tile nt of a C tile (4 values) rounded to T into the A fragments of the next product (n-tiles 2 kk and
// 2 kk + 1 are k-step kk).
template <typename T, int N>
CUKERN_DEVICE void to_a_frag(uint32_t (&a)[N / 16][4], int nt, const float (&c)[4]) {
    a[nt / 2][(nt % 2) * 2 + 0] = pack2<T>(c[0], c[1]);
    a[nt / 2][(nt % 2) * 2 + 1] = pack2<T>(c[2], c[3]);
}

// dQ += acc, one m16n8 C tile of f32 (the lane's rows g, g + 8, `row_step` floats apart; columns 2 tq, 2 tq + 1)
// at `at` (the lane's row g, column 2 tq), rows at or past `rows` (of the tile's 16) skipped: 4 f32 atomics.
CUKERN_DEVICE void dq_add(float* at, uint64_t row_step, const float (&acc)[4], int rows, int g) {
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
        if (g + 8 * i2 >= rows) continue;
        atomicAdd(at + (uint64_t)(8 * i2) * row_step, acc[2 * i2]);
        atomicAdd(at + (uint64_t)(8 * i2) * row_step + 1, acc[2 * i2 + 1]);
    }
}

// The same sum with one red.global.add.v4.f32 a lane (sm_90): the lane pair (tq, tq ^ 1) trades halves with two
// shuffles so that the even lane holds 4 consecutive columns of row g and the odd lane 4 of row g + 8. at4: the
// lane's 4 columns (row g + 8 (tq & 1), column 4 (tq / 2): 16-byte aligned in a 16-byte aligned row); ok: that
// row is below the tile's rows. Every lane of the warp must call it. The shuffles are volatile asm so that they
// stay in order with the reductions (each tile's 2 registers live, not every tile's at once).
CUKERN_DEVICE void dq_add4(float* at4, const float (&acc)[4], bool odd, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const float s0 = odd ? acc[0] : acc[2], s1 = odd ? acc[1] : acc[3];  // the partner's row
    float r0, r1;
    asm volatile("shfl.sync.bfly.b32 %0, %1, 1, 0x1f, 0xffffffff;" : "=f"(r0) : "f"(s0));
    asm volatile("shfl.sync.bfly.b32 %0, %1, 1, 0x1f, 0xffffffff;" : "=f"(r1) : "f"(s1));
    const float v0 = odd ? r0 : acc[0], v1 = odd ? r1 : acc[1], v2 = odd ? acc[2] : r0, v3 = odd ? acc[3] : r1;
    if (ok)
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(at4), "f"(v0), "f"(v1), "f"(v2), "f"(v3)
                     : "memory");
#endif
}

// A row's base-2 LSE as the backward uses it: -inf (no key seen) becomes +inf, so that exp2(z - lse2) = 0.
CUKERN_DEVICE float lse2_of(float lse) { return lse == -INFINITY ? INFINITY : lse * LOG2E; }

}  // namespace attn
}  // namespace cukern

template <typename T, int D>
__global__ void __launch_bounds__(128) bwd_preprocess(
    float* __restrict__ delta,       // [total_q, n_heads] rowsum(dO * O), f32
    float* __restrict__ dq_accum,    // [total_q, n_heads, D] f32, zeroed when p.zero_dq (else unused)
    const T* __restrict__ dout,      // [total_q, n_heads, D] gradient of the forward's output
    const T* __restrict__ o,         // [total_q, n_heads, D] the forward's output
    const BwdPreParams p) {
    using namespace cukern;
    using namespace cukern::attn;
    constexpr int CPR = D / 8;       // lanes of a row (one 16-byte chunk each)
    constexpr int RPW = 32 / CPR;    // rows of a warp
    const int lane = threadIdx.x % 32, ch = lane % CPR;
    const uint64_t row = ((uint64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * RPW + lane / CPR;
    const bool ok = row < p.n_rows;
    float acc = 0.0f;
    if (ok) {
        float a[8], b[8];
        widen(load16(dout + row * D + ch * 8), dout, a);
        widen(load16(o + row * D + ch * 8), o, b);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc = fmaf(a[i], b[i], acc);
    }
#pragma unroll
    for (int off = CPR / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (ok && ch == 0) delta[row] = acc;
    if (ok && p.zero_dq) {
        float4* z = reinterpret_cast<float4*>(dq_accum + row * D + ch * 8);
        z[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        z[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

template <typename T, int D, int KW, int QR, bool RED4>
__global__ void __launch_bounds__(cukern::attn::BwdShape<D, KW, QR>::NT, 1) bwd_dkdv(
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
    const BwdParams p) {
    using namespace cukern;
    using namespace cukern::attn;
    using Sh = BwdShape<D, KW, QR>;
    constexpr int BN = Sh::BN, BM = Sh::BM, LD = Sh::LD, LDS = Sh::LDS, NT = Sh::NT;
    constexpr uint32_t E = sizeof(T);
    constexpr int MQ = BM / 16;                 // dQ: 16-row m-tiles of a step
    constexpr int DW = D / (Sh::WARPS / MQ);    // dQ: columns of a warp

    extern __shared__ uint4 smem_raw[];
    T* const Ks = reinterpret_cast<T*>(smem_raw);  // [BN][LD]
    T* const Vs = Ks + BN * LD;                    // [BN][LD]
    T* const Qs = Vs + BN * LD;                    // [2][BM][LD]
    T* const dOs = Qs + 2 * BM * LD;               // [2][BM][LD]
    T* const dSs = dOs + 2 * BM * LD;              // [BN][LDS] dS^T (dq_atomic)
    __shared__ float lse_s[2][BM], del_s[2][BM];   // base-2 LSE and D of the stage's rows

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
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
    const int32_t n_steps = n_qt * (int32_t)p.group;  // (head of the group, query tile) pairs

    // this warp's keys: [kw0, kw0 + 16)
    const int32_t kw0 = j0 + warp * 16;

    load_rows<T, D, NT>(Ks, k + (uint64_t)(k_start + j0) * kv_row + hk * D, kv_row, BN, kv_len - j0);
    load_rows<T, D, NT>(Vs, v + (uint64_t)(k_start + j0) * kv_row + hk * D, kv_row, BN, kv_len - j0);
    // step i: head hk * group + i / n_qt, rows (t_begin + i % n_qt) * BM ...
    auto step_head = [&](int32_t i) { return hk * p.group + (uint32_t)(i / n_qt); };
    auto step_r0 = [&](int32_t i) { return (t_begin + i % n_qt) * BM; };
    auto load_step = [&](int32_t i, int st) {
        const uint32_t h = step_head(i);
        const int32_t r0 = step_r0(i);
        const uint64_t off = (uint64_t)(q_start + r0) * q_row + h * D;
        load_rows<T, D, NT>(Qs + st * BM * LD, q + off, q_row, BM, q_len - r0);
        load_rows<T, D, NT>(dOs + st * BM * LD, dout + off, q_row, BM, q_len - r0);
    };
    // LSE and D of row threadIdx.x of step i (rows past q_len: P = 0, D = 0)
    auto row_stats = [&](int32_t i) {
        const int32_t r = step_r0(i) + (int32_t)threadIdx.x;
        if (r >= q_len) return make_float2(INFINITY, 0.0f);
        const uint64_t at = (uint64_t)(q_start + r) * p.n_heads + step_head(i);
        return make_float2(lse2_of(lse[at]), delta[at]);
    };
    if (n_steps > 0) {
        load_step(0, 0);
        if (threadIdx.x < BM) {
            const float2 st0 = row_stats(0);
            lse_s[0][threadIdx.x] = st0.x;
            del_s[0][threadIdx.x] = st0.y;
        }
    }
    cp_async_commit();

    float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dka[dt][e] = dva[dt][e] = 0.0f;

    // ldmatrix row addresses of this lane: A (K, V rows of the warp), B (Q, dO: [query][d]), B^T (Q, dO, K)
    const uint32_t a_off = ((warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * LD + (lane / 16) * 8) * E;
    const uint32_t kA = smem_addr(Ks) + a_off, vA = smem_addr(Vs) + a_off;
    const uint32_t b_off = (((lane % 8) + (lane / 16) * 8) * LD + ((lane / 8) % 2) * 8) * E;
    const uint32_t bt_off = (((lane % 8) + ((lane / 8) % 2) * 8) * LD + (lane / 16) * 8) * E;
    const uint32_t qB = smem_addr(Qs) + b_off, doB = smem_addr(dOs) + b_off;
    const uint32_t qT = smem_addr(Qs) + bt_off, doT = smem_addr(dOs) + bt_off, kT = smem_addr(Ks) + bt_off;
    // dS^T [key][query] read as the A operand of dS K (transposed): the B-pattern rows of dSs
    const uint32_t dsA = smem_addr(dSs) + (((lane % 8) + (lane / 16) * 8) * LDS + ((lane / 8) % 2) * 8) * E;

    float2 next = make_float2(0.0f, 0.0f);
    for (int32_t i = 0; i < n_steps; ++i) {
        const int st = i & 1;
        cp_async_wait<0>();  // step i's tiles (and K, V) have landed: this thread's copies ...
        __syncthreads();     // ... everyone's; every warp is done with stage st ^ 1 and with dS^T
        if (i + 1 < n_steps) {
            load_step(i + 1, st ^ 1);
            cp_async_commit();
            if (threadIdx.x < BM) next = row_stats(i + 1);
        }
        const uint32_t h = step_head(i);
        const int32_t r0 = step_r0(i);
        const uint32_t so = st * BM * LD * E;  // stage offset (bytes)
        // does the warp's key range meet a visible (row, key) pair of this step?
        const bool warp_on = kw0 < kv_len && (!p.causal || r0 + BM - 1 >= kw0 - offset) &&
                             (!windowed || r0 <= kw0 + 15 + p.window_left - offset);
        // dS^T of the warp's 16 keys x 32 queries into shared memory for dQ (columns [c0, c0 + 32), rows of its keys)
        auto store_ds = [&](int c0, const float(&ds)[4][4]) {
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int i2 = 0; i2 < 2; ++i2)
                    *reinterpret_cast<uint32_t*>(dSs + (warp * 16 + g + 8 * i2) * LDS + c0 + nt * 8 + 2 * tq) =
                        pack2<T>(ds[nt][2 * i2], ds[nt][2 * i2 + 1]);
        };
        if (warp_on) {
            // sc: S^T, then P^T dz/dx, of the warp: key kw0 + g + 8 (e >= 2), query r0 + 8 nt + 2 tq + (e & 1)
            float sc[BM / 8][4];
#pragma unroll
            for (int nt = 0; nt < BM / 8; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
            mma_rows_bt<T, BM, D, LD>(sc, kA, qB + so);  // S^T = K_w Q^T (one K A fragment per BM / 8 MMAs)
            // P^T (rounded to T: the A fragments of dV += P^T dO) and P^T dz/dx kept in sc
            const bool need_mask = kw0 + 16 > kv_len || (p.causal && kw0 + 15 > offset + r0) ||
                                   (windowed && kw0 < offset + r0 + BM - 1 - p.window_left);
            uint32_t pa[BM / 16][4];
            // BM 64: P^T dz/dx (in [0, 1]) held across dP^T as f16 pairs, 16 registers instead of 32 (with them
            // in f32 the 64-row step at D 128 spills); f16 keeps 11 significant bits, as many as the f16 rounding
            // of dS^T that follows and more than a bf16 one; values under 2^-14 keep an absolute error of 2^-25
            constexpr bool PF16 = BM > 32;
            uint32_t pf[BM / 8][2];
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
            mma_frags_b<T, BM, D, LD>(dva, pa, doT + so);  // dV += P^T dO
            // dP^T, dS^T and dK by 32-query halves of the step: one half's dP^T (16 registers) live beside sc,
            // not the whole step's (at D 128 and BM 64 that would exceed 255 registers)
#pragma unroll
            for (int hf = 0; hf < BM / 32; ++hf) {
                const uint32_t ho = so + hf * 32 * LD * E;  // the half's first query row (bytes)
                float ds[4][4];  // dP^T, then dS^T, of queries r0 + 32 hf + 8 nt + 2 tq + (e & 1)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) ds[nt][0] = ds[nt][1] = ds[nt][2] = ds[nt][3] = 0.0f;
                mma_rows_bt<T, 32, D, LD>(ds, vA, doB + ho);  // dP^T = V_w dO^T
                // dS^T = P^T dz/dx (dP^T - D)
                uint32_t da[2][4];
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    const int c = hf * 32 + nt * 8 + 2 * tq;
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float pfe = sc[hf * 4 + nt][e];
                        if constexpr (PF16) {
                            const uint32_t u = pf[hf * 4 + nt][e / 2];
                            const float2 f2 = __half22float2(*reinterpret_cast<const __half2*>(&u));
                            pfe = (e & 1) ? f2.y : f2.x;
                        }
                        ds[nt][e] = pfe * (ds[nt][e] - del_s[st][c + (e & 1)]);
                    }
                    to_a_frag<T, 32>(da, nt, ds[nt]);
                }
                mma_frags_b<T, 32, D, LD>(dka, da, qT + ho);  // dK += dS^T Q
                if (p.dq_atomic) store_ds(hf * 32, ds);
            }
        } else if (p.dq_atomic) {
            const float zero[4][4] = {};  // a warp that saw nothing adds nothing to dQ
#pragma unroll
            for (int hf = 0; hf < BM / 32; ++hf) store_ds(hf * 32, zero);
        }
        if (p.dq_atomic) {
            __syncthreads();
            // dQ (BM x D) += dS (BM x BN) K (BN x D): warp -> m-tile mq, columns [dc0, dc0 + DW)
            // (k-steps outer: one A fragment live at a time, the DW columns' accumulators beside it)
            const int mq = warp % MQ, dc0 = (warp / MQ) * DW;
            float acc[DW / 16][2][4] = {};
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                uint32_t aq[4];
                ldmatrix_x4_trans(aq, dsA + (kk * 16 * LDS + mq * 16) * E);
#pragma unroll
                for (int d2 = 0; d2 < DW / 16; ++d2) {
                    uint32_t b[4];
                    ldmatrix_x4_trans(b, kT + (kk * 16 * LD + dc0 + d2 * 16) * E);
                    mma16816<T>(acc[d2][0], aq, b[0], b[1]);
                    mma16816<T>(acc[d2][1], aq, b[2], b[3]);
                }
            }
            const int32_t ra = r0 + mq * 16;  // the m-tile's rows [ra, ra + 16), the lane's ra + g, ra + g + 8
            float* const qa = dq_accum + ((uint64_t)(q_start + ra + g) * p.n_heads + h) * D + dc0 + 2 * tq;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            if constexpr (RED4) {
                const bool odd = tq & 1;
                float* const qa4 = odd ? qa + 8 * q_row - 2 : qa;  // row g + 8 (tq & 1), column 4 (tq / 2)
                const bool ok = g + (odd ? 8 : 0) < q_len - ra;
#pragma unroll
                for (int d2 = 0; d2 < DW / 16; ++d2)
#pragma unroll
                    for (int n = 0; n < 2; ++n) dq_add4(qa4 + d2 * 16 + n * 8, acc[d2][n], odd, ok);
            } else
#endif
            {
#pragma unroll
                for (int d2 = 0; d2 < DW / 16; ++d2)
#pragma unroll
                    for (int n = 0; n < 2; ++n) dq_add(qa + d2 * 16 + n * 8, q_row, acc[d2][n], q_len - ra, g);
            }
        }
        // the stats of step i + 1 into the other stage (its last readers were before this step's barrier)
        if (i + 1 < n_steps && threadIdx.x < BM) {
            lse_s[st ^ 1][threadIdx.x] = next.x;
            del_s[st ^ 1][threadIdx.x] = next.y;
        }
    }
    cp_async_wait<0>();  // no copy outlives the block (K, V when no step runs)

    // dK = scale sum dS^T Q, dV; keys kw0 + g + 8 i below kv_len
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
}

template <typename T, int D>
__global__ void __launch_bounds__(cukern::attn::BwdShape<D>::NT, 1) bwd_dq(
    T* __restrict__ dq,                        // [total_q, n_heads, D]
    const T* __restrict__ q,                   // [total_q, n_heads, D]
    const T* __restrict__ k,                   // [total_k, n_kv_heads, D]
    const T* __restrict__ v,                   // [total_k, n_kv_heads, D]
    const T* __restrict__ dout,                // [total_q, n_heads, D]
    const float* __restrict__ lse,             // [total_q, n_heads] natural-log LSE of the forward
    const float* __restrict__ delta,           // [total_q, n_heads] rowsum(dO * O) (bwd_preprocess)
    const int32_t* __restrict__ cu_seqlens_q,  // [n_seqs + 1]
    const int32_t* __restrict__ cu_seqlens_k,  // [n_seqs + 1]
    const BwdParams p) {
    using namespace cukern;
    using namespace cukern::attn;
    using Sh = BwdShape<D>;
    constexpr int QM = Sh::QM, QN = Sh::QN, LD = Sh::LD, NT = Sh::NT;
    constexpr uint32_t E = sizeof(T);

    extern __shared__ uint4 smem_raw[];
    T* const Qs = reinterpret_cast<T*>(smem_raw);  // [QM][LD]
    T* const dOs = Qs + QM * LD;                   // [QM][LD]
    T* const Ks = dOs + QM * LD;                   // [2][QN][LD]
    T* const Vs = Ks + 2 * QN * LD;                // [2][QN][LD]

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, tq = lane % 4;
    const uint32_t h = blockIdx.x, s = blockIdx.y;
    const int32_t q_start = cu_seqlens_q[s], q_len = cu_seqlens_q[s + 1] - q_start;
    const int32_t r0 = (int32_t)(p.n_tiles - 1 - blockIdx.z) * QM;  // heaviest (last) tiles first
    if (r0 >= q_len) return;
    const int32_t k_start = cu_seqlens_k[s], kv_len = cu_seqlens_k[s + 1] - k_start;
    const int32_t offset = p.causal == 2 ? 0 : kv_len - q_len;  // query row r sits at position offset + r
    const bool windowed = p.window_left >= 0;
    const uint64_t kv_row = (uint64_t)p.n_kv_heads * D, q_row = (uint64_t)p.n_heads * D;
    const uint64_t kv_col = (uint64_t)(h / p.group) * D;
    const int32_t rows_here = min(QM, q_len - r0);

    // keys any row of the block sees: [lo, hi)
    const int32_t hi = p.causal ? min(kv_len, offset + r0 + rows_here) : kv_len;
    const int32_t lo = windowed ? max(0, offset + r0 - p.window_left) : 0;
    const int32_t t_begin = lo / QN, t_end = hi > lo ? (hi + QN - 1) / QN : t_begin;
    // this warp's rows [wr0, wr0 + 16) and the keys they see
    const int32_t wr0 = r0 + warp * 16;
    const bool warp_active = wr0 < q_len;
    const int32_t w_last = min(wr0 + 15, q_len - 1);
    const int32_t w_hi = p.causal ? min(kv_len, offset + w_last + 1) : kv_len;
    const int32_t w_lo = windowed ? offset + wr0 - p.window_left : 0;

    const uint64_t qoff = (uint64_t)(q_start + r0) * q_row + h * D;
    load_rows<T, D, NT>(Qs, q + qoff, q_row, QM, q_len - r0);
    load_rows<T, D, NT>(dOs, dout + qoff, q_row, QM, q_len - r0);
    auto load_kv = [&](int32_t t, int st) {
        const uint64_t off = (uint64_t)(k_start + t * QN) * kv_row + kv_col;
        load_rows<T, D, NT>(Ks + st * QN * LD, k + off, kv_row, QN, kv_len - t * QN);
        load_rows<T, D, NT>(Vs + st * QN * LD, v + off, kv_row, QN, kv_len - t * QN);
    };
    if (t_begin < t_end) load_kv(t_begin, 0);
    cp_async_commit();

    // the lane's rows g, g + 8: base-2 LSE and D
    float lse2[2], dl[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int32_t r = wr0 + g + 8 * i;
        const uint64_t at = (uint64_t)(q_start + r) * p.n_heads + h;
        lse2[i] = r < q_len ? lse2_of(lse[at]) : INFINITY;
        dl[i] = r < q_len ? delta[at] : 0.0f;
    }
    float dqa[D / 8][4];
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) dqa[dt][0] = dqa[dt][1] = dqa[dt][2] = dqa[dt][3] = 0.0f;

    // ldmatrix row addresses: A (Q, dO rows of the warp), B (K, V: [key][d]), B^T (K)
    const uint32_t a_off = ((warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * LD + (lane / 16) * 8) * E;
    const uint32_t qA = smem_addr(Qs) + a_off, doA = smem_addr(dOs) + a_off;
    const uint32_t b_off = (((lane % 8) + (lane / 16) * 8) * LD + ((lane / 8) % 2) * 8) * E;
    const uint32_t kB = smem_addr(Ks) + b_off, vB = smem_addr(Vs) + b_off;
    const uint32_t kT = smem_addr(Ks) + (((lane % 8) + ((lane / 8) % 2) * 8) * LD + (lane / 16) * 8) * E;

    for (int32_t t = t_begin; t < t_end; ++t) {
        const int st = (t - t_begin) & 1;
        cp_async_wait<0>();
        __syncthreads();
        if (t + 1 < t_end) {
            load_kv(t + 1, st ^ 1);
            cp_async_commit();
        }
        const int32_t j0 = t * QN;
        if (!warp_active || j0 >= w_hi || j0 + QN - 1 < w_lo) continue;  // (warp-uniform; no barrier below)
        const uint32_t so = st * QN * LD * E;
        float sc[QN / 8][4], dp[QN / 8][4];
#pragma unroll
        for (int nt = 0; nt < QN / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[nt][e] = dp[nt][e] = 0.0f;
        mma_rows_bt<T, QN, D, LD>(sc, qA, kB + so);   // S = Q K^T
        mma_rows_bt<T, QN, D, LD>(dp, doA, vB + so);  // dP = dO V^T
        // dS = P dz/dx (dP - D), rounded to T as the A fragments of dQ += dS K
        const bool need_mask = j0 + QN > kv_len || (p.causal && j0 + QN - 1 > offset + wr0) ||
                               (windowed && j0 < offset + w_last - p.window_left);
        uint32_t da[QN / 16][4];
#pragma unroll
        for (int nt = 0; nt < QN / 8; ++nt) {
            float d[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int32_t pos = offset + wr0 + g + (e >= 2 ? 8 : 0), j = j0 + nt * 8 + 2 * tq + (e & 1);
                const bool vis = !need_mask || (j < kv_len && (!p.causal || j <= pos) &&
                                                (!windowed || j >= pos - p.window_left));
                float pr;
                d[e] = p_of(sc[nt][e], lse2[e / 2], vis, p, pr) * (dp[nt][e] - dl[e / 2]);
            }
            to_a_frag<T, QN>(da, nt, d);
        }
        mma_frags_b<T, QN, D, LD>(dqa, da, kT + so);  // dQ += dS K
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int32_t r = wr0 + g + 8 * i;
        if (r >= q_len) continue;
        T* const row = dq + ((uint64_t)(q_start + r) * p.n_heads + h) * D + 2 * tq;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt)
            *reinterpret_cast<uint32_t*>(row + dt * 8) =
                pack2<T>(dqa[dt][2 * i] * p.scale, dqa[dt][2 * i + 1] * p.scale);
    }
}

template <typename T>
__global__ void __launch_bounds__(256) bwd_dq_convert(
    T* __restrict__ dq,                // [total_q, n_heads, D]
    const float* __restrict__ dq_accum,  // [total_q, n_heads, D] f32 (bwd_dkdv's atomics)
    const BwdConvertParams p) {
    using namespace cukern::attn;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n4; i += gridDim.x * blockDim.x) {
        const float4 x = reinterpret_cast<const float4*>(dq_accum)[i];
        store4(dq, i, make_float4(x.x * p.scale, x.y * p.scale, x.z * p.scale, x.w * p.scale));
    }
}
