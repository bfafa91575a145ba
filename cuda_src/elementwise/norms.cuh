// Row-wise RMS norms and their fusions, over [n_rows, n_cols] rows; one block per row.
// Activations are stored as T (float, __half or __nv_bfloat16: the trailing template argument, float by
// default), weights as f32; all arithmetic is f32, and each stored value is rounded to T once.
//
// Two versions of each kernel:
//   *_reg<BLOCK, ITEMS, T>: the row stays in registers (each thread holds ITEMS 16-byte units of
//       N = 16 / sizeof(T) elements, unit threadIdx.x + k * BLOCK for k < ITEMS), so x is read from memory
//       once and every thread has ITEMS independent 16-byte loads in flight. Needs n_cols % N == 0,
//       16-byte aligned pointers and n_cols <= N * BLOCK * ITEMS; the host picks BLOCK by the row width.
//   *_loop<BLOCK, T>: scalar fallback for any width or alignment (re-reads the row, L1/L2 hits).
// Byte traffic per row (n = n_cols elements of sizeof(T) bytes): rms_norm reads n, writes n;
// residual_rms_norm reads 2n, writes 2n; post_norm_residual_rms_norm reads 2n, writes 2n;
// rms_norm_accumulate reads 2n, writes n; residual_rms_norm_q8_1 (f32 only) reads 2n, writes n (residual)
// + 36n/32 bytes (Q8_1 blocks). Weights (4n bytes) hit L2.
#pragma once

#include "common/pdl.cuh"
#include "common/types.cuh"
#include "common/reduce.cuh"
#include "common/q8_1.cuh"
#include "elementwise/params.cuh"
#include "elementwise/convert.cuh"

namespace cukern {
namespace ew {

// One row of n_units 16-byte units of T spread over a block: thread t holds v[k] = unit t + k * BLOCK,
// as N = 16 / sizeof(T) f32 values (4 floats, or 8 halves / bf16s). Weights are f32: N / 4 float4s a unit.
template <typename T, int BLOCK, int ITEMS>
struct RowTile {
    using U = Vec<T, true>;
    static constexpr int N = U::N;
    float v[ITEMS][N];
    uint32_t n_units;  // units in the row

    CUKERN_DEVICE bool has(int k) const { return threadIdx.x + k * BLOCK < n_units; }
    CUKERN_DEVICE uint32_t at(int k) const { return threadIdx.x + k * BLOCK; }

    // Streaming load (data read once: evict first).
    CUKERN_DEVICE void load_stream(const T* __restrict__ row) {
        const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) U::unpack(has(k) ? __ldcs(r4 + at(k)) : make_float4(0.f, 0.f, 0.f, 0.f), v[k]);
    }
    CUKERN_DEVICE void add_stream(const T* __restrict__ row) {
        const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
            if (has(k)) {
                float d[N];
                U::unpack(__ldcs(r4 + at(k)), d);
#pragma unroll
                for (int e = 0; e < N; ++e) v[k][e] += d[e];
            }
        }
    }
    CUKERN_DEVICE void add(const RowTile& o) {
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
#pragma unroll
            for (int e = 0; e < N; ++e) v[k][e] += o.v[k][e];
        }
    }
    CUKERN_DEVICE float sum_squares() const {
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
            float s = v[k][0] * v[k][0];
#pragma unroll
            for (int e = 1; e < N; ++e) s += v[k][e] * v[k][e];
            acc += s;
        }
        return acc;
    }
    // v = v * s * (w + off)
    CUKERN_DEVICE void scale(const float* __restrict__ w, float s, float off) {
        const float4* w4 = reinterpret_cast<const float4*>(w);
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
            if (has(k)) {
#pragma unroll
                for (int q = 0; q < N / 4; ++q) {
                    const float4 g = __ldg(w4 + at(k) * (N / 4) + q);
                    v[k][4 * q] *= s * (g.x + off); v[k][4 * q + 1] *= s * (g.y + off);
                    v[k][4 * q + 2] *= s * (g.z + off); v[k][4 * q + 3] *= s * (g.w + off);
                }
            }
        }
    }
    // v[k] as a float4 (T = float: the Q8_1 epilogue's quarters)
    CUKERN_DEVICE float4 f4(int k) const { return make_float4(v[k][0], v[k][1], v[k][2], v[k][3]); }
    CUKERN_DEVICE void store_stream(T* row) const {
        float4* r4 = reinterpret_cast<float4*>(row);
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) if (has(k)) __stcs(r4 + at(k), U::pack(v[k]));
    }
};

template <int BLOCK>
CUKERN_DEVICE float rms_scale(float sum_sq, const RmsNormParams& p, float* scratch) {
    return rsqrtf(block_sum<BLOCK>(sum_sq, scratch) / (float)p.n_cols + p.eps);
}

}  // namespace ew
}  // namespace cukern

// ------------------------------------------------------------------ register versions; grid: (n_rows)
// T: the activations' storage type (float, __half, __nv_bfloat16; weights f32). n_cols % N == 0, N = 16 / sizeof(T).

// y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * (w + weight_offset)
template <int BLOCK, int ITEMS, typename T = float>
__global__ void __launch_bounds__(BLOCK) rms_norm_reg(
    T* y,                         // [n_rows, n_cols] out (may alias x)
    const T* x,                   // [n_rows, n_cols]
    const float* __restrict__ w,  // [n_cols]
    const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    ew::RowTile<T, BLOCK, ITEMS> t{{}, p.n_cols / ew::Vec<T, true>::N};
    t.load_stream(x + off);
    t.scale(w, ew::rms_scale<BLOCK>(t.sum_squares(), p, scratch), p.weight_offset);
    t.store_stream(y + off);
}

// residual[r] += x[r]; y[r] = rms_norm(residual[r]) * (w + weight_offset). The norm reads the f32 sum;
// the residual is stored rounded to T.
template <int BLOCK, int ITEMS, typename T = float>
__global__ void __launch_bounds__(BLOCK) residual_rms_norm_reg(
    T* __restrict__ y,             // [n_rows, n_cols] normed out
    T* __restrict__ residual,      // [n_rows, n_cols] in/out: the residual stream
    const T* __restrict__ x,       // [n_rows, n_cols] added to the residual
    const float* __restrict__ w,   // [n_cols]
    const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    ew::RowTile<T, BLOCK, ITEMS> t{{}, p.n_cols / ew::Vec<T, true>::N};
    t.load_stream(residual + off);
    t.add_stream(x + off);
    t.store_stream(residual + off);
    t.scale(w, ew::rms_scale<BLOCK>(t.sum_squares(), p, scratch), p.weight_offset);
    t.store_stream(y + off);
}

// Gemma's post-attention chain: residual[r] += rms_norm(x[r]) * (w_post + off);
// y[r] = rms_norm(residual[r]) * (w + off)
template <int BLOCK, int ITEMS, typename T = float>
__global__ void __launch_bounds__(BLOCK) post_norm_residual_rms_norm_reg(
    T* __restrict__ y,                 // [n_rows, n_cols] normed out (input of the next block)
    T* __restrict__ residual,          // [n_rows, n_cols] in/out
    const T* __restrict__ x,           // [n_rows, n_cols] sub-layer output (attention / FFN)
    const float* __restrict__ w_post,  // [n_cols] post-norm weight applied to x
    const float* __restrict__ w,       // [n_cols] weight of the norm of the new residual
    const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    constexpr int N = ew::Vec<T, true>::N;
    ew::RowTile<T, BLOCK, ITEMS> t{{}, p.n_cols / N}, r{{}, p.n_cols / N};
    t.load_stream(x + off);
    r.load_stream(residual + off);
    t.scale(w_post, ew::rms_scale<BLOCK>(t.sum_squares(), p, scratch), p.weight_offset);
    r.add(t);
    r.store_stream(residual + off);
    r.scale(w, ew::rms_scale<BLOCK>(r.sum_squares(), p, scratch), p.weight_offset);
    r.store_stream(y + off);
}

// hidden[r] += rms_norm(src[r]) * (w + weight_offset)   (post-FFN norm, then the residual add)
template <int BLOCK, int ITEMS, typename T = float>
__global__ void __launch_bounds__(BLOCK) rms_norm_accumulate_reg(
    T* __restrict__ hidden,         // [n_rows, n_cols] in/out
    const T* __restrict__ src,      // [n_rows, n_cols]
    const float* __restrict__ w,    // [n_cols]
    const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    constexpr int N = ew::Vec<T, true>::N;
    ew::RowTile<T, BLOCK, ITEMS> t{{}, p.n_cols / N}, h{{}, p.n_cols / N};
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
    ew::RowTile<float, BLOCK, ITEMS> t{{}, p.n_cols / 4};
    t.load_stream(residual + off);
    t.add_stream(x + off);
    t.store_stream(residual + off);
    t.scale(w, ew::rms_scale<BLOCK>(t.sum_squares(), p, scratch), p.weight_offset);
    uint8_t* qrow = q + (uint64_t)blockIdx.x * (p.n_cols / Q8_1_BLOCK) * Q8_1_BLOCK_BYTES;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        // t.v[k] is zeros past the row end: whole 8-thread groups, never stored
        const Q8Quarter b = q8_1_quantize_quarter(t.f4(k));
        if (t.has(k)) {
            const uint32_t i4 = t.at(k);  // float4 index in the row; block i4 / 8, quarter i4 % 8
            uint8_t* blk = qrow + (uint64_t)(i4 / 8) * Q8_1_BLOCK_BYTES;
            reinterpret_cast<uint32_t*>(blk + 4)[i4 % 8] = b.packed;
            if (i4 % 8 == 0) *reinterpret_cast<__half2*>(blk) = __floats2half2_rn(b.d, b.d * (float)b.sum);
        }
    }
}

// ------------------------------------------------------------------ scalar fallbacks; grid: (n_rows)
// Each thread re-reads only elements it wrote itself, so no barrier is needed between passes (a re-read
// residual is the rounded T value). T as the register versions.

template <int BLOCK, typename T = float>
__global__ void __launch_bounds__(BLOCK) rms_norm_loop(
    T* y, const T* x, const float* __restrict__ w,  // as rms_norm_reg (y may alias x)
    const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    float acc = 0.f;
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK) acc += to_float(x[off + i]) * to_float(x[off + i]);
    const float s = ew::rms_scale<BLOCK>(acc, p, scratch);
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK)
        y[off + i] = from_float<T>(to_float(x[off + i]) * s * (w[i] + p.weight_offset));
}

template <int BLOCK, typename T = float>
__global__ void __launch_bounds__(BLOCK) residual_rms_norm_loop(
    T* __restrict__ y, T* __restrict__ residual, const T* __restrict__ x,  // as residual_rms_norm_reg
    const float* __restrict__ w, const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    float acc = 0.f;
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK) {
        const float v = to_float(residual[off + i]) + to_float(x[off + i]);
        residual[off + i] = from_float<T>(v);
        acc += v * v;
    }
    const float s = ew::rms_scale<BLOCK>(acc, p, scratch);
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK)
        y[off + i] = from_float<T>(to_float(residual[off + i]) * s * (w[i] + p.weight_offset));
}

template <int BLOCK, typename T = float>
__global__ void __launch_bounds__(BLOCK) post_norm_residual_rms_norm_loop(
    T* __restrict__ y, T* __restrict__ residual, const T* __restrict__ x,  // as the _reg version
    const float* __restrict__ w_post, const float* __restrict__ w, const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    float acc = 0.f;
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK) acc += to_float(x[off + i]) * to_float(x[off + i]);
    const float s1 = ew::rms_scale<BLOCK>(acc, p, scratch);
    acc = 0.f;
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK) {
        const float v = to_float(residual[off + i]) + to_float(x[off + i]) * s1 * (w_post[i] + p.weight_offset);
        residual[off + i] = from_float<T>(v);
        acc += v * v;
    }
    const float s2 = ew::rms_scale<BLOCK>(acc, p, scratch);
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK)
        y[off + i] = from_float<T>(to_float(residual[off + i]) * s2 * (w[i] + p.weight_offset));
}

template <int BLOCK, typename T = float>
__global__ void __launch_bounds__(BLOCK) rms_norm_accumulate_loop(
    T* __restrict__ hidden, const T* __restrict__ src, const float* __restrict__ w,  // as the _reg version
    const RmsNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t off = (uint64_t)blockIdx.x * p.n_cols;
    float acc = 0.f;
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK) acc += to_float(src[off + i]) * to_float(src[off + i]);
    const float s = ew::rms_scale<BLOCK>(acc, p, scratch);
    for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK)
        hidden[off + i] = from_float<T>(to_float(hidden[off + i]) + to_float(src[off + i]) * s * (w[i] + p.weight_offset));
}

// ------------------------------------------------------------------ per-group norms; one warp per group
// out[g] = x[g] * rsqrt(mean or sum of x[g]^2 + eps) (* (w + weight_offset)) (* silu(z[g]) when GATE):
// per-head Q/K RMS norm, DeltaNet's grouped Q/K (L2) norm, and the gated RMS norm z-gate * norm(y).
// T: storage type of x, z and out (float, __half, __nv_bfloat16); w is f32.
// grid: (ceil(n_groups / warps per block)), block: 128 threads.
template <bool GATE, typename T = float>
__global__ void __launch_bounds__(128) group_norm(
    T* out,                       // [n_groups, group_size] (may alias x)
    const T* x,                   // [n_groups, group_size]
    const float* __restrict__ w,  // [group_size] when has_weight (else any valid pointer, unread)
    const T* __restrict__ z,      // GATE: [n_groups, group_size] gate (else unread)
    const GroupNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    const uint32_t lane = threadIdx.x % WARP;
    const uint64_t g = (uint64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (g >= p.n_groups) return;  // whole warps leave together
    const T* xg = x + g * p.group_size;
    float acc = 0.f;
    for (uint32_t i = lane; i < p.group_size; i += WARP) acc += to_float(xg[i]) * to_float(xg[i]);
    acc = warp_sum(acc);
    const float s = rsqrtf((p.l2 ? acc : acc / (float)p.group_size) + p.eps);
    for (uint32_t i = lane; i < p.group_size; i += WARP) {
        float v = to_float(xg[i]) * s;
        if (p.has_weight) v *= w[i] + p.weight_offset;
        if (GATE) {
            const float gz = to_float(z[g * p.group_size + i]);
            v *= gz / (1.0f + expf(-gz));
        }
        out[g * p.group_size + i] = from_float<T>(v);
    }
}

// Register version of group_norm: the groups of a warp are read once, as 16-byte units of N = 16 / sizeof(T)
// elements (group_size % N == 0, 16-byte aligned arrays, group_size <= 32 * N * VPL). Each warp takes
// GROUPS_PER_WARP groups per step so that a lane has several independent 16-byte loads in flight, and warps
// loop over steps (grid-stride: few resident blocks, no per-block overhead for each of the many small groups).
// grid: (<= ceil(n_groups / (4 * GROUPS_PER_WARP))), block: 128.
constexpr int GROUPS_PER_WARP = 2;

template <bool GATE, int VPL, typename T = float>
__global__ void __launch_bounds__(128) group_norm_reg(
    T* out, const T* x, const float* __restrict__ w,  // as group_norm (out may alias x)
    const T* __restrict__ z, const GroupNormParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    using U = ew::Vec<T, true>;
    constexpr int G = GROUPS_PER_WARP, N = U::N;
    const uint32_t lane = threadIdx.x % WARP;
    const uint32_t n_units = p.group_size / N;
    const uint64_t step = (uint64_t)gridDim.x * (blockDim.x / WARP) * G;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    for (uint64_t g0 = ((uint64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP) * G; g0 < p.n_groups;
         g0 += step) {
        float v[G][VPL][N], gz[G][VPL][N];
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
                U::unpack(live && i < n_units ? __ldcs(x4 + i) : zero, v[gi][k]);
                if (GATE) U::unpack(live && i < n_units ? __ldcs(z4 + i) : zero, gz[gi][k]);
                float sq = v[gi][k][0] * v[gi][k][0];
#pragma unroll
                for (int e = 1; e < N; ++e) sq += v[gi][k][e] * v[gi][k][e];
                ss[gi] += sq;
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
                if (i >= n_units) continue;
                float m[N];
#pragma unroll
                for (int e = 0; e < N; ++e) m[e] = s;
                if (p.has_weight) {
#pragma unroll
                    for (int q = 0; q < N / 4; ++q) {
                        const float4 wv = __ldg(reinterpret_cast<const float4*>(w) + i * (N / 4) + q);
                        m[4 * q] *= wv.x + p.weight_offset; m[4 * q + 1] *= wv.y + p.weight_offset;
                        m[4 * q + 2] *= wv.z + p.weight_offset; m[4 * q + 3] *= wv.w + p.weight_offset;
                    }
                }
                float r[N];
#pragma unroll
                for (int e = 0; e < N; ++e) {
                    if (GATE) m[e] *= gz[gi][k][e] / (1.0f + expf(-gz[gi][k][e]));
                    r[e] = v[gi][k][e] * m[e];
                }
                __stcs(o4 + i, U::pack(r));
            }
        }
    }
}
