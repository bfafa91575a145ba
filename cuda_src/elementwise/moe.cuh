// Mixture-of-experts routing: router matvec (optionally fused with the RMS norm), softmax + top-k,
// the weighted sum of the selected experts' outputs, and the sigmoid-gated shared expert.
#pragma once

#include "common/pdl.cuh"
#include "common/types.cuh"
#include "common/reduce.cuh"
#include "common/mma.cuh"  // cp_async16 (router_gemm)
#include "elementwise/params.cuh"

namespace cukern {
namespace ew {
constexpr int TOPK_WARPS = 4;  // tokens per block of softmax_topk
constexpr int TOPK_MAX_K = 32;  // lane j keeps the j-th selected expert
CUKERN_DEVICE float neg_inf() { return __int_as_float(0xff800000); }
CUKERN_DEVICE float quiet_nan() { return __int_as_float(0x7fffffff); }
}  // namespace ew
}  // namespace cukern

// Per token: p = softmax(logits[t]); the k largest logits (ties: lower expert id first) give
// ids[t, :k] in descending order and weights[t, j] = scale * p[id_j] (renorm = 0) or
// scale * p[id_j] / sum_j p[id_j] (renorm = 1, which equals a softmax over the k selected logits).
// One warp per token; dynamic shared memory: TOPK_WARPS * n_experts floats.
// grid: (ceil(n_tokens / TOPK_WARPS)), block: 32 * TOPK_WARPS.
__global__ void __launch_bounds__(32 * cukern::ew::TOPK_WARPS) softmax_topk(
    int32_t* __restrict__ ids,          // [n_tokens, ids_stride] selected expert ids (k written per row)
    float* __restrict__ weights,        // [n_tokens, weights_stride] (k written per row)
    const float* __restrict__ logits,   // [n_tokens, n_experts]
    const TopkParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    extern __shared__ float rows[];  // [TOPK_WARPS, n_experts]
    const uint32_t lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const uint32_t t = blockIdx.x * ew::TOPK_WARPS + warp;
    if (t >= p.n_tokens) return;  // whole warps; no block barrier below
    float* row = rows + warp * p.n_experts;
    const float* lt = logits + (uint64_t)t * p.n_experts;
    float mx = ew::neg_inf();
    for (uint32_t e = lane; e < p.n_experts; e += WARP) {
        row[e] = lt[e];
        mx = fmaxf(mx, row[e]);
    }
    mx = warp_max(mx);
    float denom = 0.f;
    for (uint32_t e = lane; e < p.n_experts; e += WARP) denom += expf(row[e] - mx);
    denom = warp_sum(denom);
    __syncwarp();
    float my_logit = ew::neg_inf();  // lane j < k: the j-th selected logit
    int32_t my_id = 0;
    for (uint32_t j = 0; j < p.k; ++j) {
        float bv = ew::neg_inf();
        uint32_t bi = 0xffffffffu;
        for (uint32_t e = lane; e < p.n_experts; e += WARP) {
            const float v = row[e];  // NaN marks an expert already taken
            if (v == v && (v > bv || (v == bv && e < bi))) { bv = v; bi = e; }
        }
#pragma unroll
        for (int o = WARP / 2; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const uint32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == j) { my_logit = bv; my_id = (int32_t)bi; }
        if (lane == 0) row[bi] = ew::quiet_nan();
        __syncwarp();
    }
    const float e = lane < p.k ? expf(my_logit - mx) : 0.f;
    const float sel = warp_sum(e);
    if (lane < p.k) {
        ids[(uint64_t)t * p.ids_stride + lane] = my_id;
        weights[(uint64_t)t * p.weights_stride + lane] = p.scale * e / (p.renorm ? sel : denom);
    }
}

// Register version of softmax_topk for n_experts <= 32 * EPL: lane l holds experts l + 32 i, i < EPL,
// as order-preserving 32-bit keys (0: absent or taken), so a selection round is a local scan and two
// warp reductions (redux.sync: the largest key, then the lowest id holding it). Same results and tie
// rule as softmax_topk. grid/block as softmax_topk, no shared memory.
namespace cukern {
namespace ew {
// Order-preserving map of a finite or infinite float to uint32 (> 0); -0 and +0 map alike.
CUKERN_DEVICE uint32_t float_key(float v) {
    uint32_t b = __float_as_uint(v);
    if (b == 0x80000000u) b = 0;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
CUKERN_DEVICE float key_float(uint32_t k) { return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }
}  // namespace ew
}  // namespace cukern

template <int EPL>
__global__ void __launch_bounds__(32 * cukern::ew::TOPK_WARPS) softmax_topk_reg(
    int32_t* __restrict__ ids, float* __restrict__ weights, const float* __restrict__ logits,  // as softmax_topk
    const TopkParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    const uint32_t lane = threadIdx.x % WARP;
    const uint32_t t = blockIdx.x * ew::TOPK_WARPS + threadIdx.x / WARP;
    if (t >= p.n_tokens) return;
    const float* lt = logits + (uint64_t)t * p.n_experts;
    uint32_t key[EPL];
    float mx = ew::neg_inf();
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        const uint32_t e = lane + WARP * i;
        const float v = e < p.n_experts ? lt[e] : ew::neg_inf();
        key[i] = e < p.n_experts ? ew::float_key(v) : 0u;
        mx = fmaxf(mx, v);
    }
    mx = warp_max(mx);
    float denom = 0.f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) denom += key[i] ? expf(ew::key_float(key[i]) - mx) : 0.f;
    denom = warp_sum(denom);
    uint32_t my_key = 0, my_id = 0;  // lane j < k: the j-th selection
    for (uint32_t j = 0; j < p.k; ++j) {
        uint32_t bk = 0, bi = 0xffffffffu;
#pragma unroll
        for (int i = 0; i < EPL; ++i)  // ascending ids: strict > keeps the lower id on ties
            if (key[i] > bk) { bk = key[i]; bi = lane + WARP * i; }
        const uint32_t top = __reduce_max_sync(0xffffffffu, bk);
        const uint32_t id = __reduce_min_sync(0xffffffffu, bk == top ? bi : 0xffffffffu);
        if (lane == j) { my_key = top; my_id = id; }
#pragma unroll
        for (int i = 0; i < EPL; ++i)
            if (lane + WARP * i == id) key[i] = 0;
    }
    const float e = lane < p.k ? expf(ew::key_float(my_key) - mx) : 0.f;
    const float sel = warp_sum(e);
    if (lane < p.k) {
        ids[(uint64_t)t * p.ids_stride + lane] = (int32_t)my_id;
        weights[(uint64_t)t * p.weights_stride + lane] = p.scale * e / (p.renorm ? sel : denom);
    }
}

// Lane-group version of softmax_topk for token batches: L = TOPK_L_LANES lanes per token hold its row in
// registers (n_experts <= 32 V, n_experts % 4 == 0, 16-byte aligned logits; lane l loads float4s l + L i,
// i < V, so a warp's loads cover whole rows), k <= TOPK_L_KMAX. Same results and tie rule as softmax_topk.
//   1. each lane keeps the M largest of its logits (with repeats; M = 1, 2, 4 for k <= 4, 8, 16); the
//      group sorts its L M kept values (bitonic network over the lanes) and takes the k-th largest, T:
//      k logits are >= T, so only logits >= T can be selected (about k + 1 of 128 on random logits);
//   2. the candidates (logit >= T, at most R L: R = 2 for k <= 8, 4 for k <= 16) go to the token's list in
//      shared memory (a scan over the group gives each lane its place); a lane ranks R of them: a
//      candidate's rank is the number of larger candidates, and rank < k is its
//      output position. Equal candidates would share a rank: each selected candidate reads its slot back,
//      and a warp where one finds another's id starts over with step 2';
//   2'. (a warp with equal candidates, with more than R L candidates or with T = -inf) k rounds of
//      argmax over the registers: the largest logit, of equal ones the lowest id;
//   3. weights from exp(l - max) over the selected sum (renorm) or the row's denominator.
// Control flow is warp-uniform (tokens past the end run masked), so the group shuffles take the full mask.
// Bytes: read n_experts floats per token, write k ids and k weights.
// grid: (ceil(n_tokens / TOPK_L_TOKENS)), block: TOPK_L_BLOCK.
namespace cukern {
namespace ew {
constexpr int TOPK_L_LANES = 8;    // lanes per token
constexpr int TOPK_L_BLOCK = 256;  // threads per block
constexpr int TOPK_L_TOKENS = TOPK_L_BLOCK / TOPK_L_LANES;
constexpr int TOPK_L_KMAX = 16;

// 0xffffffff when a >= b (a > b), else 0: one FSET, where the C++ comparison would take a predicate and a select
// (ftz, as CuPy compiles every unit).
CUKERN_DEVICE uint32_t ge_mask(float a, float b) {
    uint32_t m;
    asm("set.ge.ftz.u32.f32 %0, %1, %2;" : "=r"(m) : "f"(a), "f"(b));
    return m;
}
CUKERN_DEVICE uint32_t gt_mask(float a, float b) {
    uint32_t m;
    asm("set.gt.ftz.u32.f32 %0, %1, %2;" : "=r"(m) : "f"(a), "f"(b));
    return m;
}

// Sort the L * M values of each group of L lanes descending (value j of lane l is element l * M + j; L, M
// powers of two) with a bitonic network: exchanges between lanes through shuffles, within a lane in
// registers. The whole warp calls it.
template <int L, int M>
CUKERN_DEVICE void group_sort_desc(float (&v)[M], uint32_t gl) {
#pragma unroll
    for (int size = 2; size <= L * M; size *= 2) {
#pragma unroll
        for (int stride = size / 2; stride > 0; stride /= 2) {
            if (stride >= M) {  // partner: lane gl ^ (stride / M), same j
                const uint32_t lx = stride / M;
                const bool keep_max = ((gl & lx) == 0) == (((gl * M) & size) == 0);
#pragma unroll
                for (int j = 0; j < M; ++j) {
                    const float o = __shfl_xor_sync(0xffffffffu, v[j], lx, L);
                    v[j] = keep_max ? fmaxf(v[j], o) : fminf(v[j], o);
                }
            } else {  // partner: j ^ stride in this lane
#pragma unroll
                for (int j = 0; j < M; ++j) {
                    if (j & stride) continue;
                    const bool desc = ((gl * M + j) & size) == 0;
                    const float hi = fmaxf(v[j], v[j ^ stride]), lo = fminf(v[j], v[j ^ stride]);
                    v[j] = desc ? hi : lo;
                    v[j ^ stride] = desc ? lo : hi;
                }
            }
        }
    }
}
}  // namespace ew
}  // namespace cukern

template <int V, int M>
__global__ void __launch_bounds__(cukern::ew::TOPK_L_BLOCK) softmax_topk_lanes(
    int32_t* __restrict__ ids, float* __restrict__ weights, const float* __restrict__ logits,  // as softmax_topk
    const TopkParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    constexpr int L = ew::TOPK_L_LANES, S = 4 * V;
    constexpr int R = M > 2 ? M : 2, CMAX = R * L;  // candidates ranked per lane, candidate slots per token
    constexpr uint32_t ALL = 0xffffffffu, NONE = 0xffffffffu;
    // per token: its candidate list (value bits, id), one spare entry shifting the next list by two banks,
    // then its k selections (id, exp(l - max))
    __shared__ uint2 cand[ew::TOPK_L_TOKENS][CMAX + 1];
    __shared__ uint2 sel[ew::TOPK_L_TOKENS][ew::TOPK_L_KMAX];
    const uint32_t gl = threadIdx.x % L, tb = threadIdx.x / L;
    const uint32_t t = blockIdx.x * ew::TOPK_L_TOKENS + tb;
    if (t - threadIdx.x % WARP / L >= p.n_tokens) return;  // whole warps; no block barrier below
    const bool live = t < p.n_tokens;
    const uint32_t n4 = live ? p.n_experts / 4 : 0;  // a token past the end: an empty row
    const float4* row = reinterpret_cast<const float4*>(logits + (uint64_t)t * p.n_experts);
    float x[S];  // x[4 i + c]: expert 4 (gl + L i) + c; -inf past the row
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const float4 v = gl + L * i < n4 ? __ldcs(row + gl + L * i)
                                         : make_float4(ew::neg_inf(), ew::neg_inf(), ew::neg_inf(), ew::neg_inf());
        x[4 * i] = v.x; x[4 * i + 1] = v.y; x[4 * i + 2] = v.z; x[4 * i + 3] = v.w;
    }
    auto expert = [&](int s) { return 4 * (gl + L * (s / 4)) + s % 4; };
    // 1. the M largest per lane, the row maximum, the threshold
    float top[M];
#pragma unroll
    for (int j = 0; j < M; ++j) top[j] = ew::neg_inf();
#pragma unroll
    for (int s = 0; s < S; ++s) {
        float c = x[s];
#pragma unroll
        for (int j = 0; j < M; ++j) {  // insertion into the descending list
            const float hi = fmaxf(top[j], c);
            c = fminf(top[j], c);
            top[j] = hi;
        }
    }
    float mx = top[0];
#pragma unroll
    for (int o = 1; o < L; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(ALL, mx, o, L));
    ew::group_sort_desc<L, M>(top, gl);
    float thr = top[0];  // element k - 1 of the sorted values: lane (k - 1) / M, slot (k - 1) % M
#pragma unroll
    for (int j = 1; j < M; ++j) thr = j == (int)((p.k - 1) % M) ? top[j] : thr;
    thr = __shfl_sync(ALL, thr, (p.k - 1) / M, L);
    float denom = 0.f;  // with renorm = 0: sum of exp(l - max) over the row (exp(-inf) = 0 past the row)
    if (!p.renorm) {
#pragma unroll
        for (int s = 0; s < S; ++s) denom += expf(x[s] - mx);
#pragma unroll
        for (int o = 1; o < L; o <<= 1) denom += __shfl_xor_sync(ALL, denom, o, L);
    }
    // 2. candidates (with T > -inf, no -inf filler is one): count, place by an inclusive scan over the group
    uint32_t n_mine = 0;
#pragma unroll
    for (int s = 0; s < S; ++s) n_mine -= ew::ge_mask(x[s], thr);
    uint32_t incl = n_mine;
#pragma unroll
    for (int o = 1; o < L; o <<= 1) {
        const uint32_t v = __shfl_up_sync(ALL, incl, o, L);
        if (gl >= (uint32_t)o) incl += v;
    }
    const uint32_t n_cand = __shfl_sync(ALL, incl, L - 1, L);
    uint2* list = cand[tb];
    uint2* out = sel[tb];
    bool by_rounds = __any_sync(ALL, live && (thr == ew::neg_inf() || n_cand < p.k || n_cand > CMAX));
    if (!by_rounds) {
        uint2* at = list + (incl - n_mine);
#pragma unroll
        for (int s = 0; s < S; ++s) {
            if (x[s] >= thr) *at++ = make_uint2(__float_as_uint(x[s]), expert(s));
        }
        __syncwarp();
        // lane gl ranks candidates gl + L r: rank = the number of larger candidates
        float cv[R];
        uint32_t ci[R], rank[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const uint2 c = list[min(gl + L * r, n_cand - 1)];
            cv[r] = __uint_as_float(c.x);
            ci[r] = c.y;
            rank[r] = 0;
        }
        for (uint32_t y = 0; y < n_cand; ++y) {
            const float yv = __uint_as_float(list[y].x);
#pragma unroll
            for (int r = 0; r < R; ++r) rank[r] -= ew::gt_mask(yv, cv[r]);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) rank[r] = gl + L * r < n_cand ? rank[r] : NONE;  // NONE: no candidate
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (rank[r] < p.k) out[rank[r]] = make_uint2(ci[r], __float_as_uint(expf(cv[r] - mx)));
        __syncwarp();
        bool clash = false;  // equal candidates wrote the same slot
#pragma unroll
        for (int r = 0; r < R; ++r) clash |= rank[r] < p.k && out[rank[r]].x != ci[r];
        by_rounds = __any_sync(ALL, clash);
        __syncwarp();
    }
    if (by_rounds) {  // 2'. taken bit s: x[s] selected
        uint32_t taken = 0;
        for (uint32_t j = 0; j < p.k; ++j) {
            float bv = ew::neg_inf();
            uint32_t bi = NONE;
#pragma unroll
            for (int s = 0; s < S; ++s) {  // ascending ids: strict > keeps the lower id
                const bool in_row = gl + L * (s / 4) < n4;
                if (in_row && !((taken >> s) & 1u) && (bi == NONE || x[s] > bv)) { bv = x[s]; bi = expert(s); }
            }
#pragma unroll
            for (int o = 1; o < L; o <<= 1) {
                const float ov = __shfl_xor_sync(ALL, bv, o, L);
                const uint32_t oi = __shfl_xor_sync(ALL, bi, o, L);
                if (oi != NONE && (bi == NONE || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
            }
#pragma unroll
            for (int s = 0; s < S; ++s) taken |= (uint32_t)(expert(s) == bi) << s;
            if (gl == 0 && live) out[j] = make_uint2(bi, __float_as_uint(expf(bv - mx)));
        }
        __syncwarp();
    }
    // 3. weights: lane gl writes selections gl + L r
    float sum = 0.f;
    for (uint32_t j = gl; live && j < p.k; j += L) sum += __uint_as_float(out[j].y);
#pragma unroll
    for (int o = 1; o < L; o <<= 1) sum += __shfl_xor_sync(ALL, sum, o, L);
    const float f = p.scale / (p.renorm ? sum : denom);
    for (uint32_t j = gl; live && j < p.k; j += L) {
        const uint2 o = out[j];
        ids[(uint64_t)t * p.ids_stride + j] = (int32_t)o.x;
        weights[(uint64_t)t * p.weights_stride + j] = __uint_as_float(o.y) * f;
    }
}

// out[t] = (out[t] +) sum_j weights[t, j] * expert_out[t, j]. grid: (column blocks, tokens <= 65535 per
// pass, grid-stride), VEC4: 16-byte loads. Bytes: read (n_used + accumulate) * n_cols floats, write n_cols.
template <bool VEC4>
__global__ void moe_weighted_sum(
    float* __restrict__ out,               // [n_tokens, n_cols]
    const float* __restrict__ expert_out,  // [n_tokens, n_used, n_cols]
    const float* __restrict__ weights,     // [n_tokens, w_stride] (n_used used)
    const MoeSumParams p) {
    cukern::pdl_enter();
    const uint32_t n = VEC4 ? p.n_cols / 4 : p.n_cols;
    for (uint32_t t = blockIdx.y; t < p.n_tokens; t += gridDim.y) {
        const float* wt = weights + (uint64_t)t * p.w_stride;
        for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
            if (VEC4) {
                float4 acc = p.accumulate ? reinterpret_cast<const float4*>(out + (uint64_t)t * p.n_cols)[i]
                                          : make_float4(0.f, 0.f, 0.f, 0.f);
                for (uint32_t j = 0; j < p.n_used; ++j) {
                    const float wj = wt[j];
                    const float4 e = reinterpret_cast<const float4*>(expert_out + ((uint64_t)t * p.n_used + j) * p.n_cols)[i];
                    acc.x += wj * e.x; acc.y += wj * e.y; acc.z += wj * e.z; acc.w += wj * e.w;
                }
                reinterpret_cast<float4*>(out + (uint64_t)t * p.n_cols)[i] = acc;
            } else {
                float acc = p.accumulate ? out[(uint64_t)t * p.n_cols + i] : 0.f;
                for (uint32_t j = 0; j < p.n_used; ++j)
                    acc += wt[j] * expert_out[((uint64_t)t * p.n_used + j) * p.n_cols + i];
                out[(uint64_t)t * p.n_cols + i] = acc;
            }
        }
    }
}

// hidden[t] += sigmoid(gate_logit[t]) * shared_out[t] (Qwen-MoE's gated shared expert).
// grid: (column blocks, tokens, grid-stride). Bytes: read 2 n_cols floats, write n_cols.
template <bool VEC4>
__global__ void shared_expert_accumulate(
    float* __restrict__ hidden,            // [n_tokens, n_cols] in/out
    const float* __restrict__ shared_out,  // [n_tokens, n_cols] shared expert output
    const float* __restrict__ gate_logit,  // [n_tokens] logit of the shared-expert gate
    const SharedGateParams p) {
    cukern::pdl_enter();
    const uint32_t n = VEC4 ? p.n_cols / 4 : p.n_cols;
    for (uint32_t t = blockIdx.y; t < p.n_tokens; t += gridDim.y) {
        const float g = 1.0f / (1.0f + expf(-gate_logit[t]));
        for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
            if (VEC4) {
                float4* h4 = reinterpret_cast<float4*>(hidden + (uint64_t)t * p.n_cols);
                const float4 s = reinterpret_cast<const float4*>(shared_out + (uint64_t)t * p.n_cols)[i];
                float4 h = h4[i];
                h.x += g * s.x; h.y += g * s.y; h.z += g * s.z; h.w += g * s.w;
                h4[i] = h;
            } else {
                hidden[(uint64_t)t * p.n_cols + i] += g * shared_out[(uint64_t)t * p.n_cols + i];
            }
        }
    }
}

// logits[t, e] = scale * dot(x[t], W[e]), or with norm = 1 the fused router norm:
// scale * rsqrt(mean(x[t]^2) + eps) * dot(x[t] * (w_norm + weight_offset), W[e]) (the norm's
// per-token factor is applied to the dot product, so x is read once and never written).
// One block computes E_TILE experts x T_TILE tokens; its BLOCK threads split n_embd (float4 steps),
// so n_embd % 4 == 0 and 16-byte alignment are required. grid: (ceil(n_experts / E_TILE),
// ceil(n_tokens / T_TILE)). Bytes: W once per token tile, x once per expert tile (L2).
template <int E_TILE, int T_TILE, int BLOCK>
__global__ void __launch_bounds__(BLOCK) router_matvec(
    float* __restrict__ logits,        // [n_tokens, n_experts]
    const float* __restrict__ x,       // [n_tokens, n_embd]
    const float* __restrict__ W,       // [n_experts, n_embd] f32 router weight
    const float* __restrict__ w_norm,  // norm: [n_embd] (else unread)
    const RouterParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float part[BLOCK / WARP][E_TILE * T_TILE + T_TILE];
    const uint32_t e0 = blockIdx.x * E_TILE, t0 = blockIdx.y * T_TILE;
    float acc[E_TILE][T_TILE] = {};
    float ss[T_TILE] = {};
    const uint32_t n4 = p.n_embd / 4;
    for (uint32_t i = threadIdx.x; i < n4; i += BLOCK) {
        float4 xv[T_TILE];
        float4 g = make_float4(1.f, 1.f, 1.f, 1.f);
        if (p.norm) {
            g = __ldg(reinterpret_cast<const float4*>(w_norm) + i);
            g.x += p.weight_offset; g.y += p.weight_offset; g.z += p.weight_offset; g.w += p.weight_offset;
        }
#pragma unroll
        for (int tt = 0; tt < T_TILE; ++tt) {
            xv[tt] = t0 + tt < p.n_tokens ? reinterpret_cast<const float4*>(x + (uint64_t)(t0 + tt) * p.n_embd)[i]
                                          : make_float4(0.f, 0.f, 0.f, 0.f);
            ss[tt] += xv[tt].x * xv[tt].x + xv[tt].y * xv[tt].y + xv[tt].z * xv[tt].z + xv[tt].w * xv[tt].w;
            xv[tt].x *= g.x; xv[tt].y *= g.y; xv[tt].z *= g.z; xv[tt].w *= g.w;
        }
#pragma unroll
        for (int ee = 0; ee < E_TILE; ++ee) {
            if (e0 + ee >= p.n_experts) break;
            const float4 wv = __ldg(reinterpret_cast<const float4*>(W + (uint64_t)(e0 + ee) * p.n_embd) + i);
#pragma unroll
            for (int tt = 0; tt < T_TILE; ++tt)
                acc[ee][tt] += xv[tt].x * wv.x + xv[tt].y * wv.y + xv[tt].z * wv.z + xv[tt].w * wv.w;
        }
    }
    const uint32_t lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
#pragma unroll
    for (int ee = 0; ee < E_TILE; ++ee)
#pragma unroll
        for (int tt = 0; tt < T_TILE; ++tt) {
            const float s = warp_sum(acc[ee][tt]);
            if (lane == 0) part[warp][ee * T_TILE + tt] = s;
        }
#pragma unroll
    for (int tt = 0; tt < T_TILE; ++tt) {
        const float s = warp_sum(ss[tt]);
        if (lane == 0) part[warp][E_TILE * T_TILE + tt] = s;
    }
    __syncthreads();
    for (uint32_t o = threadIdx.x; o < E_TILE * T_TILE; o += BLOCK) {
        const uint32_t ee = o / T_TILE, tt = o % T_TILE;
        if (e0 + ee >= p.n_experts || t0 + tt >= p.n_tokens) continue;
        float dot = 0.f, sq = 0.f;
        for (int w = 0; w < BLOCK / WARP; ++w) {
            dot += part[w][o];
            sq += part[w][E_TILE * T_TILE + tt];
        }
        const float f = p.norm ? p.scale * rsqrtf(sq / (float)p.n_embd + p.eps) : p.scale;
        logits[(uint64_t)(t0 + tt) * p.n_experts + e0 + ee] = f * dot;
    }
}

// router_matvec for token batches, a small f32 GEMM (logits = x W^T, both operands n_embd-contiguous): a block
// computes RG_TOKENS tokens x RG_EXPERTS experts, streaming BK columns of x and W per stage through a
// STAGES-deep cp.async ring in dynamic shared memory (rg_smem_bytes; rows padded to BK + 4 floats: the
// 16-byte reads of 8 consecutive rows hit distinct banks); thread (tg, eg) accumulates tokens 4 tg + i (i < 4)
// x experts eg + 16 j (j < 8) in registers: per 4 columns, 4 + 8 16-byte shared reads feed 128 FMAs. NORM:
// the fused router norm (x scaled by w_norm + weight_offset on its way to the FMAs, sum of squares per token
// on the side). Same results as router_matvec up to the f32 summation order. n_embd % 4 == 0, 16-byte
// aligned x, W, w_norm. grid: (ceil(n_tokens / RG_TOKENS), ceil(n_experts / RG_EXPERTS)), block: RG_THREADS.
// Bytes: x once per expert tile, W once per token tile (L2); FLOPs: 2 n_tokens n_experts n_embd.
namespace cukern {
namespace ew {
constexpr int RG_TOKENS = 32, RG_EXPERTS = 128, RG_THREADS = 128;
constexpr int RG_TT = 4, RG_TE = 8;  // tokens x experts per thread
}  // namespace ew
}  // namespace cukern

template <bool NORM, int BK, int STAGES>
__global__ void __launch_bounds__(cukern::ew::RG_THREADS) router_gemm(
    float* __restrict__ logits, const float* __restrict__ x, const float* __restrict__ W,
    const float* __restrict__ w_norm,  // as router_matvec
    const RouterParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    using namespace cukern::ew;
    constexpr int XR = RG_TOKENS, WR = RG_EXPERTS, ROW = BK + 4;  // ROW: floats per staged row
    constexpr int CPR = BK / 4, RP = RG_THREADS / CPR;  // float4s per row, rows per pass of the block
    static_assert(BK % 4 == 0 && RG_THREADS % CPR == 0 && XR % RP == 0 && WR % RP == 0, "whole passes");
    // [STAGES][XR][ROW] x, [STAGES][WR][ROW] W, [STAGES][BK] w_norm
    extern __shared__ float4 rg_smem[];
    float* xs = reinterpret_cast<float*>(rg_smem);
    float* ws = xs + STAGES * XR * ROW;
    float* gs = ws + STAGES * WR * ROW;
    const uint32_t tid = threadIdx.x, tg = tid / 16, eg = tid % 16;
    const uint32_t t0 = blockIdx.x * XR, e0 = blockIdx.y * WR;
    const uint32_t n_steps = (p.n_embd + BK - 1) / BK;
    // thread tid copies float4 tid % CPR of rows tid / CPR + RP h of the x and W tiles per step; zero-filled
    // past n_embd and past the last token / expert (from the array's start: a valid address)
    const uint32_t c4 = 4 * (tid % CPR), lr = tid / CPR;
    const float* xsrc = x + (uint64_t)(t0 + lr) * p.n_embd + c4;
    const float* wsrc = W + (uint64_t)(e0 + lr) * p.n_embd + c4;
    auto load = [&](uint32_t step, int s) {
        const uint32_t k0 = step * BK;
        const bool k_in = k0 + c4 < p.n_embd;
#pragma unroll
        for (int h = 0; h < XR / RP; ++h) {
            const bool in = k_in && t0 + lr + RP * h < p.n_tokens;
            cp_async16(xs + (s * XR + lr + RP * h) * ROW + c4, in ? xsrc + (uint64_t)RP * h * p.n_embd + k0 : x,
                       in ? 16 : 0);
        }
#pragma unroll
        for (int h = 0; h < WR / RP; ++h) {
            const bool in = k_in && e0 + lr + RP * h < p.n_experts;
            cp_async16(ws + (s * WR + lr + RP * h) * ROW + c4, in ? wsrc + (uint64_t)RP * h * p.n_embd + k0 : W,
                       in ? 16 : 0);
        }
        if (NORM && tid < CPR) {
            const uint32_t k = k0 + 4 * tid;
            cp_async16(gs + s * BK + 4 * tid, w_norm + (k < p.n_embd ? k : 0), k < p.n_embd ? 16 : 0);
        }
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if ((uint32_t)s < n_steps) load(s, s);
        cp_async_commit();
    }
    float acc[RG_TT][RG_TE] = {};
    float ss[RG_TT] = {};
    for (uint32_t step = 0; step < n_steps; ++step) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // stage step % STAGES is in; every thread is done with the stage reloaded below
        if (step + STAGES - 1 < n_steps) load(step + STAGES - 1, (step + STAGES - 1) % STAGES);
        cp_async_commit();
        const int s = step % STAGES;
        const float* xt = xs + (s * XR + RG_TT * tg) * ROW;
        const float* wt = ws + (s * WR + eg) * ROW;
#pragma unroll
        for (int c = 0; c < BK / 4; ++c) {
            float4 xv[RG_TT];
#pragma unroll
            for (int i = 0; i < RG_TT; ++i) xv[i] = *reinterpret_cast<const float4*>(xt + i * ROW + 4 * c);
            if (NORM) {
                const float4 g = *reinterpret_cast<const float4*>(gs + s * BK + 4 * c);
                const float o = p.weight_offset;
#pragma unroll
                for (int i = 0; i < RG_TT; ++i) {
                    ss[i] += xv[i].x * xv[i].x + xv[i].y * xv[i].y + xv[i].z * xv[i].z + xv[i].w * xv[i].w;
                    xv[i].x *= g.x + o; xv[i].y *= g.y + o; xv[i].z *= g.z + o; xv[i].w *= g.w + o;
                }
            }
#pragma unroll
            for (int j = 0; j < RG_TE; ++j) {
                const float4 wv = *reinterpret_cast<const float4*>(wt + 16 * j * ROW + 4 * c);
#pragma unroll
                for (int i = 0; i < RG_TT; ++i) {  // one FMA per product, in column order
                    acc[i][j] = fmaf(xv[i].x, wv.x, acc[i][j]);
                    acc[i][j] = fmaf(xv[i].y, wv.y, acc[i][j]);
                    acc[i][j] = fmaf(xv[i].z, wv.z, acc[i][j]);
                    acc[i][j] = fmaf(xv[i].w, wv.w, acc[i][j]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < RG_TT; ++i) {
        const uint32_t t = t0 + RG_TT * tg + i;
        if (t >= p.n_tokens) continue;
        const float f = NORM ? p.scale * rsqrtf(ss[i] / (float)p.n_embd + p.eps) : p.scale;
#pragma unroll
        for (int j = 0; j < RG_TE; ++j) {
            const uint32_t e = e0 + eg + 16 * j;
            if (e < p.n_experts) logits[(uint64_t)t * p.n_experts + e] = f * acc[i][j];
        }
    }
}
