// Elementwise family: norms, vector arithmetic and (in later files) the
// fused decode-loop kernels. One block per row for row-wise ops; grid-stride
// loops for flat ones. Arithmetic in f32. VEC4 variants use 16-byte loads and
// are chosen by the host when sizes and pointers allow (see
// cukern/elementwise.py).
#include "common/types.cuh"
#include "common/reduce.cuh"
#include "elementwise/params.cuh"

namespace {

using namespace cukern;

template <int BLOCK, bool VEC4>
__device__ __forceinline__ float row_sum_squares(const float* __restrict__ x, uint32_t n, float* scratch) {
    float acc = 0.0f;
    if (VEC4) {
        const float4* x4 = reinterpret_cast<const float4*>(x);
        for (uint32_t i = threadIdx.x; i < n / 4; i += BLOCK) {
            const float4 v = x4[i];
            acc += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (uint32_t i = threadIdx.x; i < n; i += BLOCK) acc += x[i] * x[i];
    }
    return block_sum<BLOCK>(acc, scratch);
}

template <int BLOCK, bool VEC4>
__device__ __forceinline__ void row_scale(float* __restrict__ y, const float* __restrict__ x,
                                          const float* __restrict__ w, float s, float w_off, uint32_t n) {
    if (VEC4) {
        const float4* x4 = reinterpret_cast<const float4*>(x);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        float4* y4 = reinterpret_cast<float4*>(y);
        for (uint32_t i = threadIdx.x; i < n / 4; i += BLOCK) {
            const float4 v = x4[i], g = w4[i];
            y4[i] = make_float4(v.x * s * (g.x + w_off), v.y * s * (g.y + w_off),
                                v.z * s * (g.z + w_off), v.w * s * (g.w + w_off));
        }
    } else {
        for (uint32_t i = threadIdx.x; i < n; i += BLOCK) y[i] = x[i] * s * (w[i] + w_off);
    }
}

}  // namespace

// y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * (w + weight_offset); grid: (n_rows)
template <int BLOCK, bool VEC4>
__global__ void __launch_bounds__(BLOCK) rms_norm(
    float* __restrict__ y,        // [n_rows, n_cols] out (may alias x)
    const float* __restrict__ x,  // [n_rows, n_cols]
    const float* __restrict__ w,  // [n_cols] weight
    const RmsNormParams p) {
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t row = blockIdx.x;
    const float* xr = x + row * p.n_cols;
    const float ss = row_sum_squares<BLOCK, VEC4>(xr, p.n_cols, scratch);
    const float s = rsqrtf(ss / (float)p.n_cols + p.eps);
    row_scale<BLOCK, VEC4>(y + row * p.n_cols, xr, w, s, p.weight_offset, p.n_cols);
}

// residual[r, :] += x[r, :]; y[r, :] = rms_norm(residual[r, :]) * (w + weight_offset); grid: (n_rows)
template <int BLOCK, bool VEC4>
__global__ void __launch_bounds__(BLOCK) residual_rms_norm(
    float* __restrict__ y,         // [n_rows, n_cols] normed out
    float* __restrict__ residual,  // [n_rows, n_cols] in/out: the residual stream
    const float* __restrict__ x,   // [n_rows, n_cols] added to the residual
    const float* __restrict__ w,   // [n_cols] weight
    const RmsNormParams p) {
    __shared__ float scratch[BLOCK / WARP];
    const uint64_t row = blockIdx.x;
    float* rr = residual + row * p.n_cols;
    const float* xr = x + row * p.n_cols;
    // Each thread adds exactly the elements it later reads back, so no barrier is needed between passes.
    float acc = 0.0f;
    if (VEC4) {
        float4* r4 = reinterpret_cast<float4*>(rr);
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        for (uint32_t i = threadIdx.x; i < p.n_cols / 4; i += BLOCK) {
            float4 v = r4[i];
            const float4 d = x4[i];
            v.x += d.x; v.y += d.y; v.z += d.z; v.w += d.w;
            r4[i] = v;
            acc += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (uint32_t i = threadIdx.x; i < p.n_cols; i += BLOCK) {
            const float v = rr[i] + xr[i];
            rr[i] = v;
            acc += v * v;
        }
    }
    const float ss = block_sum<BLOCK>(acc, scratch);
    const float s = rsqrtf(ss / (float)p.n_cols + p.eps);
    row_scale<BLOCK, VEC4>(y + row * p.n_cols, rr, w, s, p.weight_offset, p.n_cols);
}

// y = a + alpha * b; grid-stride over n (or n / 4 float4s)
template <bool VEC4>
__global__ void add_scaled(
    float* y,        // [n] out (may alias a)
    const float* a,  // [n]
    const float* b,  // [n]
    const AxpyParams p) {
    const uint32_t stride = gridDim.x * blockDim.x;
    if (VEC4) {
        float4* y4 = reinterpret_cast<float4*>(y);
        const float4* a4 = reinterpret_cast<const float4*>(a);
        const float4* b4 = reinterpret_cast<const float4*>(b);
        for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n / 4; i += stride) {
            const float4 u = a4[i], v = b4[i];
            y4[i] = make_float4(u.x + p.alpha * v.x, u.y + p.alpha * v.y, u.z + p.alpha * v.z, u.w + p.alpha * v.w);
        }
    } else {
        for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += stride) y[i] = a[i] + p.alpha * b[i];
    }
}

// y = alpha * a; grid-stride over n (or n / 4 float4s)
template <bool VEC4>
__global__ void scale(
    float* y,        // [n] out (may alias a)
    const float* a,  // [n]
    const AxpyParams p) {
    const uint32_t stride = gridDim.x * blockDim.x;
    if (VEC4) {
        float4* y4 = reinterpret_cast<float4*>(y);
        const float4* a4 = reinterpret_cast<const float4*>(a);
        for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n / 4; i += stride) {
            const float4 u = a4[i];
            y4[i] = make_float4(p.alpha * u.x, p.alpha * u.y, p.alpha * u.z, p.alpha * u.w);
        }
    } else {
        for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += stride) y[i] = p.alpha * a[i];
    }
}
