// Mixture-of-experts routing: router matvec (optionally fused with the RMS norm), softmax + top-k,
// the weighted sum of the selected experts' outputs, and the sigmoid-gated shared expert.
#pragma once

#include "common/types.cuh"
#include "common/reduce.cuh"
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
    int32_t* __restrict__ ids,          // [n_tokens, k] selected expert ids
    float* __restrict__ weights,        // [n_tokens, k]
    const float* __restrict__ logits,   // [n_tokens, n_experts]
    const TopkParams p) {
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
        ids[(uint64_t)t * p.k + lane] = my_id;
        weights[(uint64_t)t * p.k + lane] = p.scale * e / (p.renorm ? sel : denom);
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
        ids[(uint64_t)t * p.k + lane] = (int32_t)my_id;
        weights[(uint64_t)t * p.k + lane] = p.scale * e / (p.renorm ? sel : denom);
    }
}

// out[t] = (out[t] +) sum_j weights[t, j] * expert_out[t, j]. grid: (column blocks, tokens <= 65535 per
// pass, grid-stride), VEC4: 16-byte loads. Bytes: read (n_used + accumulate) * n_cols floats, write n_cols.
template <bool VEC4>
__global__ void moe_weighted_sum(
    float* __restrict__ out,               // [n_tokens, n_cols]
    const float* __restrict__ expert_out,  // [n_tokens, n_used, n_cols]
    const float* __restrict__ weights,     // [n_tokens, n_used]
    const MoeSumParams p) {
    const uint32_t n = VEC4 ? p.n_cols / 4 : p.n_cols;
    for (uint32_t t = blockIdx.y; t < p.n_tokens; t += gridDim.y) {
        const float* wt = weights + (uint64_t)t * p.n_used;
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
