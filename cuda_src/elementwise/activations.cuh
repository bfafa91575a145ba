// Row-wise binary operations and gated activations: out[r, c] = op(a[r, c], b[r, c]).
//
// One kernel template, binary_rows<OP, VEC4>, covers every two-input elementwise op of the decode
// and prefill loops (see EwOp). Rows may be strided (a view of a fused [gate | up] matmul output),
// b may be broadcast over rows (b_stride 0: a bias), and out may alias a.
// grid: (column blocks, min(n_rows, 65535)) with grid-stride loops over both; VEC4 = 16-byte
// loads, when n_cols, strides, offsets and pointers are multiples of 4 floats / 16 bytes.
// Byte traffic per element: read a and b (b once per row unless broadcast), write out.
#pragma once

#include "common/pdl.cuh"
#include "common/types.cuh"
#include "elementwise/params.cuh"

namespace cukern {
namespace ew {

enum EwOp : int {
    OP_AXPY = 0,         // a + alpha * b       (add: alpha = 1; bias add: b broadcast; a += s * b: out = a)
    OP_SCALE = 1,        // alpha * a           (b unread)
    OP_SIGMOID_MUL = 2,  // a * sigmoid(b)
    OP_SWIGLU = 3,       // silu(a) * b         (a: gate, b: up)
    OP_SWIGLU_OAI = 4,   // gpt-oss: g = min(a, limit); u = clamp(b, -limit, limit); g * sigmoid(alpha g) * (u + 1)
    OP_GEGLU = 5,        // gelu_tanh(a) * b    (Gemma)
};

CUKERN_DEVICE float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

CUKERN_DEVICE float gelu_tanh(float x) {
    const float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + tanhf(k0 * (x + 0.044715f * x * x * x)));
}

template <int OP>
CUKERN_DEVICE float apply(float a, float b, const BinaryParams& p) {
    if (OP == OP_AXPY) return a + p.alpha * b;
    if (OP == OP_SCALE) return p.alpha * a;
    if (OP == OP_SIGMOID_MUL) return a * sigmoid(b);
    if (OP == OP_SWIGLU) return a * sigmoid(a) * b;
    if (OP == OP_SWIGLU_OAI) {
        const float g = fminf(a, p.limit);
        const float u = fminf(fmaxf(b, -p.limit), p.limit);
        return g * sigmoid(p.alpha * g) * (u + 1.0f);
    }
    return gelu_tanh(a) * b;  // OP_GEGLU
}

// The unit a thread loads: float4 on the vectorised path, float otherwise.
template <bool VEC4> struct Unit { using type = float; };
template <> struct Unit<true> { using type = float4; };

template <int OP>
CUKERN_DEVICE float apply4(float a, float b, const BinaryParams& p) { return apply<OP>(a, b, p); }
template <int OP>
CUKERN_DEVICE float4 apply4(float4 a, float4 b, const BinaryParams& p) {
    return make_float4(apply<OP>(a.x, b.x, p), apply<OP>(a.y, b.y, p), apply<OP>(a.z, b.z, p), apply<OP>(a.w, b.w, p));
}

}  // namespace ew
}  // namespace cukern

// Each thread takes UNROLL units (float4s or floats) per step, all loads issued before any store:
// out may alias a, so without this the compiler could not overlap one step's loads with the last
// step's stores, and a thread would have a single 16-byte load in flight.
constexpr int BINARY_UNROLL = 4;

template <int OP, bool VEC4>
__global__ void binary_rows(
    float* out,          // [n_rows, out_stride] first n_cols of each row written (may alias a)
    const float* a,      // [n_rows, a_stride]
    const float* b,      // [n_rows, b_stride] from b_offset, or [b_offset + n_cols] when b_stride == 0
    const BinaryParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    using V = typename ew::Unit<VEC4>::type;
    constexpr int U = BINARY_UNROLL;
    const uint32_t n = VEC4 ? p.n_cols / 4 : p.n_cols;  // units per row
    const uint32_t stride = gridDim.x * blockDim.x;
    for (uint32_t r = blockIdx.y; r < p.n_rows; r += gridDim.y) {
        const V* ar = reinterpret_cast<const V*>(a + r * p.a_stride);
        const V* br = reinterpret_cast<const V*>(b + r * p.b_stride + p.b_offset);
        V* outr = reinterpret_cast<V*>(out + r * p.out_stride);
        for (uint32_t i0 = blockIdx.x * blockDim.x + threadIdx.x; i0 < n; i0 += U * stride) {
            V u[U], v[U];
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const uint32_t i = i0 + k * stride;
                if (i < n) {
                    u[k] = ar[i];
                    if (OP != ew::OP_SCALE) v[k] = br[i];
                }
            }
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const uint32_t i = i0 + k * stride;
                if (i < n) outr[i] = ew::apply4<OP>(u[k], OP == ew::OP_SCALE ? u[k] : v[k], p);
            }
        }
    }
}
