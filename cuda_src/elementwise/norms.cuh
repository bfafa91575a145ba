// Row-wise RMS norms and their fusions, over [n_rows, n_cols] f32 rows; one block per row.
//
// Two versions of each kernel:
//   *_reg<BLOCK, ITEMS>: the row stays in registers (each thread holds ITEMS float4s, element
//       4 * (threadIdx.x + k * BLOCK) for k < ITEMS), so x is read from memory once and every thread
//       has ITEMS independent 16-byte loads in flight. Needs n_cols % 4 == 0, 16-byte aligned
//       pointers and n_cols <= 4 * BLOCK * ITEMS; the host picks BLOCK by the row width.
//   *_loop<BLOCK>: scalar fallback for any width or alignment (re-reads the row, L1/L2 hits).
// Byte traffic per row (n = n_cols, f32): rms_norm reads n, writes n; residual_rms_norm reads 2n,
// writes 2n; post_norm_residual_rms_norm reads 2n, writes 2n; rms_norm_accumulate reads 2n, writes n;
// residual_rms_norm_q8_1 reads 2n, writes n (residual) + 36n/32 (Q8_1 blocks). Weights hit L2.
#pragma once

#include "common/pdl.cuh"
#include "common/types.cuh"
#include "common/reduce.cuh"
#include "common/q8_1.cuh"
#include "elementwise/params.cuh"

namespace cukern {
namespace ew {

// One row of n4 float4s spread over a block: thread t holds v[k] = row4[t + k * BLOCK].
template <int BLOCK, int ITEMS>
struct RowTile {
    float4 v[ITEMS];
    uint32_t n4;  // float4s in the row

    CUKERN_DEVICE bool has(int k) const { return threadIdx.x + k * BLOCK < n4; }
    CUKERN_DEVICE uint32_t at(int k) const { return threadIdx.x + k * BLOCK; }

    // Streaming load (data read once: evict first).
    CUKERN_DEVICE void load_stream(const float* __restrict__ row) {
        const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) v[k] = has(k) ? __ldcs(r4 + at(k)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    CUKERN_DEVICE void load(const float* row) {
        const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) v[k] = has(k) ? r4[at(k)] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    CUKERN_DEVICE void add_stream(const float* __restrict__ row) {
        const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
            if (has(k)) {
                const float4 d = __ldcs(r4 + at(k));
                v[k].x += d.x; v[k].y += d.y; v[k].z += d.z; v[k].w += d.w;
            }
        }
    }
    CUKERN_DEVICE void add(const RowTile& o) {
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
            v[k].x += o.v[k].x; v[k].y += o.v[k].y; v[k].z += o.v[k].z; v[k].w += o.v[k].w;
        }
    }
    CUKERN_DEVICE float sum_squares() const {
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) acc += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
        return acc;
    }
    // v = v * s * (w + off)
    CUKERN_DEVICE void scale(const float* __restrict__ w, float s, float off) {
        const float4* w4 = reinterpret_cast<const float4*>(w);
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
            if (has(k)) {
                const float4 g = __ldg(w4 + at(k));
                v[k].x *= s * (g.x + off); v[k].y *= s * (g.y + off);
                v[k].z *= s * (g.z + off); v[k].w *= s * (g.w + off);
            }
        }
    }
    CUKERN_DEVICE void store(float* row) const {
        float4* r4 = reinterpret_cast<float4*>(row);
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) if (has(k)) r4[at(k)] = v[k];
    }
    CUKERN_DEVICE void store_stream(float* row) const {
        float4* r4 = reinterpret_cast<float4*>(row);
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) if (has(k)) __stcs(r4 + at(k), v[k]);
    }
};

template <int BLOCK>
CUKERN_DEVICE float rms_scale(float sum_sq, const RmsNormParams& p, float* scratch) {
    return rsqrtf(block_sum<BLOCK>(sum_sq, scratch) / (float)p.n_cols + p.eps);
}

}  // namespace ew
}  // namespace cukern

// ------------------------------------------------------------------ register versions; grid: (n_rows)

// y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * (w + weight_offset)
template <int BLOCK, int ITEMS>
__global__ void __launch_bounds__(BLOCK) rms_norm_reg(
    float* y,                     // [n_rows, n_cols] out (may alias x)
    const float* x,               // [n_rows, n_cols]
    const float* __restrict__ w,  // [n_cols]
    const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    ew::RowTile<BLOCK, ITEMS> t{{}, p.n_cols / 4};
    t.load_stream(x + off);
    t.scale(w, ew::rms_scale<BLOCK>(t.sum_squares(), p, scratch), p.weight_offset);
    t.store_stream(y + off);
}

// residual[r] += x[r]; y[r] = rms_norm(residual[r]) * (w + weight_offset)
template <int BLOCK, int ITEMS>
__global__ void __launch_bounds__(BLOCK) residual_rms_norm_reg(
    float* __restrict__ y,         // [n_rows, n_cols] normed out
    float* __restrict__ residual,  // [n_rows, n_cols] in/out: the residual stream
    const float* __restrict__ x,   // [n_rows, n_cols] added to the residual
    const float* __restrict__ w,   // [n_cols]
    const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    ew::RowTile<BLOCK, ITEMS> t{{}, p.n_cols / 4};
    t.load_stream(residual + off);
    t.add_stream(x + off);
    t.store_stream(residual + off);
    t.scale(w, ew::rms_scale<BLOCK>(t.sum_squares(), p, scratch), p.weight_offset);
    t.store_stream(y + off);
}

// Gemma's post-attention chain: residual[r] += rms_norm(x[r]) * (w_post + off);
// y[r] = rms_norm(residual[r]) * (w + off)
template <int BLOCK, int ITEMS>
__global__ void __launch_bounds__(BLOCK) post_norm_residual_rms_norm_reg(
    float* __restrict__ y,             // [n_rows, n_cols] normed out (input of the next block)
    float* __restrict__ residual,      // [n_rows, n_cols] in/out
    const float* __restrict__ x,       // [n_rows, n_cols] sub-layer output (attention / FFN)
    const float* __restrict__ w_post,  // [n_cols] post-norm weight applied to x
    const float* __restrict__ w,       // [n_cols] weight of the norm of the new residual
    const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    ew::RowTile<BLOCK, ITEMS> t{{}, p.n_cols / 4}, r{{}, p.n_cols / 4};
    t.load_stream(x + off);
    r.load_stream(residual + off);
    t.scale(w_post, ew::rms_scale<BLOCK>(t.sum_squares(), p, scratch), p.weight_offset);
    r.add(t);
    r.store_stream(residual + off);
    r.scale(w, ew::rms_scale<BLOCK>(r.sum_squares(), p, scratch), p.weight_offset);
    r.store_stream(y + off);
}

// hidden[r] += rms_norm(src[r]) * (w + weight_offset)   (post-FFN norm, then the residual add)
template <int BLOCK, int ITEMS>
__global__ void __launch_bounds__(BLOCK) rms_norm_accumulate_reg(
    float* __restrict__ hidden,     // [n_rows, n_cols] in/out
    const float* __restrict__ src,  // [n_rows, n_cols]
    const float* __restrict__ w,    // [n_cols]
    const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    ew::RowTile<BLOCK, ITEMS> t{{}, p.n_cols / 4}, h{{}, p.n_cols / 4};
    t.load_stream(src + off);
    h.load_stream(hidden + off);
    t.scale(w, ew::rms_scale<BLOCK>(t.sum_squares(), p, scratch), p.weight_offset);
    h.add(t);
    h.store_stream(hidden + off);
}

// residual[r] += x[r]; q[r] = Q8_1(rms_norm(residual[r]) * (w + weight_offset)) (common/q8_1.cuh).
// n_cols % 32 == 0: the 8 threads t = 8m..8m+7 hold one 32-value block in their float4 number k.
template <int BLOCK, int ITEMS>
__global__ void __launch_bounds__(BLOCK) residual_rms_norm_q8_1_reg(
    uint8_t* __restrict__ q,       // [n_rows, n_cols / 32] BlockQ8_1 (36 bytes each)
    float* __restrict__ residual,  // [n_rows, n_cols] in/out
    const float* __restrict__ x,   // [n_rows, n_cols] added to the residual
    const float* __restrict__ w,   // [n_cols]
    const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    static_assert(BLOCK % 8 == 0, "a Q8_1 block spans 8 threads");
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    ew::RowTile<BLOCK, ITEMS> t{{}, p.n_cols / 4};
    t.load_stream(residual + off);
    t.add_stream(x + off);
    t.store_stream(residual + off);
    t.scale(w, ew::rms_scale<BLOCK>(t.sum_squares(), p, scratch), p.weight_offset);
    uint8_t* qrow = q + (uint64_t)blockIdx.x * (p.n_cols / Q8_1_BLOCK) * Q8_1_BLOCK_BYTES;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        // t.v[k] is zeros past the row end: whole 8-thread groups, never stored
        const Q8Quarter b = q8_1_quantize_quarter(t.v[k]);
        if (t.has(k)) {
            const uint32_t i4 = t.at(k);  // float4 index in the row; block i4 / 8, quarter i4 % 8
            uint8_t* blk = qrow + (uint64_t)(i4 / 8) * Q8_1_BLOCK_BYTES;
            reinterpret_cast<uint32_t*>(blk + 4)[i4 % 8] = b.packed;
            if (i4 % 8 == 0) *reinterpret_cast<__half2*>(blk) = __floats2half2_rn(b.d, b.d * (float)b.sum);
        }
    }
}

// Quantize f32 values to Q8_1 (the unfused counterpart of residual_rms_norm_q8_1's epilogue): a thread
// takes QUANT_UNROLL float4s u0 + k * (gridDim.x * 256), loaded before any is used; 8 consecutive threads
// share a 32-value block. x 16-byte aligned, q 4-byte aligned.
// grid: (ceil(n_values / 4 / (256 * QUANT_UNROLL))), block: 256. Bytes: read 4, write 36 / 32 per value.
constexpr int QUANT_UNROLL = 4;

__global__ void __launch_bounds__(256) quantize_q8_1(
    uint8_t* __restrict__ q,      // [n_values / 32] BlockQ8_1
    const float* __restrict__ x,  // [n_values]
    const QuantizeParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    float4 vs[QUANT_UNROLL];
#pragma unroll
    for (int k = 0; k < QUANT_UNROLL; ++k) {
        const uint64_t u = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x + k * stride;  // float4 index
        vs[k] = u < p.n_values / 4 ? __ldcs(reinterpret_cast<const float4*>(x) + u) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int k = 0; k < QUANT_UNROLL; ++k) {
        const uint64_t u = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x + k * stride;
        const bool live = u < p.n_values / 4;  // whole 8-thread groups: n_values % 32 == 0, stride % 8 == 0
        const Q8Quarter b = q8_1_quantize_quarter(vs[k]);
        if (!live) continue;
        uint8_t* blk = q + (u / 8) * Q8_1_BLOCK_BYTES;
        reinterpret_cast<uint32_t*>(blk + 4)[u % 8] = b.packed;
        if (u % 8 == 0) *reinterpret_cast<__half2*>(blk) = __floats2half2_rn(b.d, b.d * (float)b.sum);
    }
}

// ------------------------------------------------------------------ scalar fallbacks; grid: (n_rows)
// Each thread re-reads only elements it wrote itself, so no barrier is needed between passes.

template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) rms_norm_loop(
    float* y, const float* x, const float* __restrict__ w,  // as rms_norm_reg (y may alias x)
    const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    float acc = 0.f;
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK) acc += x[off + i] * x[off + i];
    const float s = ew::rms_scale<BLOCK>(acc, p, scratch);
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK) y[off + i] = x[off + i] * s * (w[i] + p.weight_offset);
}

template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) residual_rms_norm_loop(
    float* __restrict__ y, float* __restrict__ residual, const float* __restrict__ x,  // as residual_rms_norm_reg
    const float* __restrict__ w, const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    float acc = 0.f;
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK) {
        const float v = residual[off + i] + x[off + i];
        residual[off + i] = v;
        acc += v * v;
    }
    const float s = ew::rms_scale<BLOCK>(acc, p, scratch);
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK) y[off + i] = residual[off + i] * s * (w[i] + p.weight_offset);
}

template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) post_norm_residual_rms_norm_loop(
    float* __restrict__ y, float* __restrict__ residual, const float* __restrict__ x,  // as the _reg version
    const float* __restrict__ w_post, const float* __restrict__ w, const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    float acc = 0.f;
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK) acc += x[off + i] * x[off + i];
    const float s1 = ew::rms_scale<BLOCK>(acc, p, scratch);
    acc = 0.f;
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK) {
        const float v = residual[off + i] + x[off + i] * s1 * (w_post[i] + p.weight_offset);
        residual[off + i] = v;
        acc += v * v;
    }
    const float s2 = ew::rms_scale<BLOCK>(acc, p, scratch);
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK) y[off + i] = residual[off + i] * s2 * (w[i] + p.weight_offset);
}

template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) rms_norm_accumulate_loop(
    float* __restrict__ hidden, const float* __restrict__ src, const float* __restrict__ w,  // as the _reg version
    const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    float acc = 0.f;
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK) acc += src[off + i] * src[off + i];
    const float s = ew::rms_scale<BLOCK>(acc, p, scratch);
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK) hidden[off + i] += src[off + i] * s * (w[i] + p.weight_offset);
}

// ------------------------------------------------------------------ per-group norms; one warp per group
// out[g] = x[g] * rsqrt(mean or sum of x[g]^2 + eps) (* (w + weight_offset)) (* silu(z[g]) when GATE):
// per-head Q/K RMS norm, DeltaNet's grouped Q/K (L2) norm, and the gated RMS norm z-gate * norm(y).
// grid: (ceil(n_groups / warps per block)), block: 128 threads.
template <bool GATE>
__global__ void __launch_bounds__(128) group_norm(
    float* out,                   // [n_groups, group_size] (may alias x)
    const float* x,               // [n_groups, group_size]
    const float* __restrict__ w,  // [group_size] when has_weight (else any valid pointer, unread)
    const float* __restrict__ z,  // GATE: [n_groups, group_size] gate (else unread)
    const GroupNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    const uint32_t lane = threadIdx.x % WARP;
    const uint64_t g = (uint64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (g >= p.n_groups) return;  // whole warps leave together
    const float* xg = x + g * p.group_size;
    float acc = 0.f;
    for (uint32_t i = lane; i < p.group_size; i += WARP) acc += xg[i] * xg[i];
    acc = warp_sum(acc);
    const float s = rsqrtf((p.l2 ? acc : acc / (float)p.group_size) + p.eps);
    for (uint32_t i = lane; i < p.group_size; i += WARP) {
        float v = xg[i] * s;
        if (p.has_weight) v *= w[i] + p.weight_offset;
        if (GATE) {
            const float gz = z[g * p.group_size + i];
            v *= gz / (1.0f + expf(-gz));
        }
        out[g * p.group_size + i] = v;
    }
}

// Register version of group_norm: the groups of a warp are read once, as float4s (group_size % 4 == 0,
// 16-byte aligned arrays, group_size <= 128 * VPL). Each warp takes GROUPS_PER_WARP groups per step so
// that a lane has several independent 16-byte loads in flight, and warps loop over steps (grid-stride:
// few resident blocks, no per-block overhead for each of the many small groups).
// grid: (<= ceil(n_groups / (4 * GROUPS_PER_WARP))), block: 128.
constexpr int GROUPS_PER_WARP = 2;

template <bool GATE, int VPL>
__global__ void __launch_bounds__(128) group_norm_reg(
    float* out, const float* x, const float* __restrict__ w,  // as group_norm (out may alias x)
    const float* __restrict__ z, const GroupNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    constexpr int G = GROUPS_PER_WARP;
    const uint32_t lane = threadIdx.x % WARP;
    const uint32_t n4 = p.group_size / 4;
    const uint64_t step = (uint64_t)gridDim.x * (blockDim.x / WARP) * G;
    for (uint64_t g0 = ((uint64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP) * G; g0 < p.n_groups;
         g0 += step) {
        float4 v[G][VPL], gz[G][VPL];
        float ss[G];
#pragma unroll
        for (int gi = 0; gi < G; ++gi) {
            ss[gi] = 0.f;
            const bool live = g0 + gi < p.n_groups;
            const float4* x4 = reinterpret_cast<const float4*>(x + (g0 + gi) * p.group_size);
            const float4* z4 = reinterpret_cast<const float4*>(z + (g0 + gi) * p.group_size);
#pragma unroll
            for (int k = 0; k < VPL; ++k) {
                const uint32_t i = lane + WARP * k;
                v[gi][k] = live && i < n4 ? __ldcs(x4 + i) : make_float4(0.f, 0.f, 0.f, 0.f);
                if (GATE) gz[gi][k] = live && i < n4 ? __ldcs(z4 + i) : make_float4(0.f, 0.f, 0.f, 0.f);
                ss[gi] += v[gi][k].x * v[gi][k].x + v[gi][k].y * v[gi][k].y + v[gi][k].z * v[gi][k].z + v[gi][k].w * v[gi][k].w;
            }
        }
#pragma unroll
        for (int gi = 0; gi < G; ++gi) {
            if (g0 + gi >= p.n_groups) break;
            const float s = rsqrtf((p.l2 ? warp_sum(ss[gi]) : warp_sum(ss[gi]) / (float)p.group_size) + p.eps);
            float4* o4 = reinterpret_cast<float4*>(out + (g0 + gi) * p.group_size);
#pragma unroll
            for (int k = 0; k < VPL; ++k) {
                const uint32_t i = lane + WARP * k;
                if (i >= n4) continue;
                float4 r = v[gi][k];
                float4 m = make_float4(s, s, s, s);
                if (p.has_weight) {
                    const float4 wv = __ldg(reinterpret_cast<const float4*>(w) + i);
                    m.x *= wv.x + p.weight_offset; m.y *= wv.y + p.weight_offset;
                    m.z *= wv.z + p.weight_offset; m.w *= wv.w + p.weight_offset;
                }
                if (GATE) {
                    const float4 q = gz[gi][k];
                    m.x *= q.x / (1.0f + expf(-q.x)); m.y *= q.y / (1.0f + expf(-q.y));
                    m.z *= q.z / (1.0f + expf(-q.z)); m.w *= q.w / (1.0f + expf(-q.w));
                }
                r.x *= m.x; r.y *= m.y; r.z *= m.z; r.w *= m.w;
                __stcs(o4 + i, r);
            }
        }
    }
}
