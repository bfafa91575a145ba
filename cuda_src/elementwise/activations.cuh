// Row-wise binary operations and gated activations: out[r, c] = op(a[r, c], b[r, c]).
//
// One kernel template, binary_rows<OP, VEC, T>, covers every two-input elementwise op of the decode
// and prefill loops (see EwOp). Rows may be strided (a view of a fused [gate | up] matmul output),
// b may be broadcast over rows (b_stride 0: a bias), and out may alias a.
// Arrays are stored as float, __half or __nv_bfloat16 (T), computed in f32.
// grid: (column blocks, min(n_rows, 65535)) with grid-stride loops over both; VEC = 16-byte loads, when
// n_cols, strides, offsets are multiples of 16 / sizeof(T) elements and pointers of 16 bytes.
// Byte traffic per element: read a and b (b once per row unless broadcast), write out; sizeof(T) each.
#pragma once

#include "common/pdl.cuh"
#include "common/types.cuh"
#include "elementwise/params.cuh"
#include "elementwise/convert.cuh"

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

// op applied to each element of a load unit U (ew::Vec: one element, or 16 bytes of them), in f32.
template <int OP, typename U>
CUKERN_DEVICE typename U::raw apply_unit(typename U::raw a, typename U::raw b, const BinaryParams& p) {
    float x[U::N], y[U::N];
    U::unpack(a, x);
    U::unpack(b, y);
#pragma unroll
    for (int e = 0; e < U::N; ++e) x[e] = apply<OP>(x[e], y[e], p);
    return U::pack(x);
}

}  // namespace ew
}  // namespace cukern

// Each thread takes UNROLL units (16-byte vectors or single elements) per step, all loads issued before any
// store: out may alias a, so without this the compiler could not overlap one step's loads with the last
// step's stores, and a thread would have a single 16-byte load in flight.
// T: storage type of a, b and out (float, __half, __nv_bfloat16); VEC: 16-byte units of N = 16 / sizeof(T)
// elements (the host checks n_cols, strides and offset are multiples of N and the pointers 16-byte aligned).
constexpr int BINARY_UNROLL = 4;

template <int OP, bool VEC, typename T = float>
__global__ void binary_rows(
    T* out,              // [n_rows, out_stride] first n_cols of each row written (may alias a)
    const T* a,          // [n_rows, a_stride]
    const T* b,          // [n_rows, b_stride] from b_offset, or [b_offset + n_cols] when b_stride == 0
    const BinaryParams p) {
    cukern::pdl_enter();
    using namespace cukern;
    using U = ew::Vec<T, VEC>;
    using V = typename U::raw;
    constexpr int UN = BINARY_UNROLL;
    const uint32_t n = p.n_cols / U::N;  // units per row
    const uint32_t stride = gridDim.x * blockDim.x;
    for (uint32_t r = blockIdx.y; r < p.n_rows; r += gridDim.y) {
        const V* ar = reinterpret_cast<const V*>(a + r * p.a_stride);
        const V* br = reinterpret_cast<const V*>(b + r * p.b_stride + p.b_offset);
        V* outr = reinterpret_cast<V*>(out + r * p.out_stride);
        for (uint32_t i0 = blockIdx.x * blockDim.x + threadIdx.x; i0 < n; i0 += UN * stride) {
            V u[UN], v[UN];
#pragma unroll
            for (int k = 0; k < UN; ++k) {
                const uint32_t i = i0 + k * stride;
                if (i < n) {
                    u[k] = ar[i];
                    if (OP != ew::OP_SCALE) v[k] = br[i];
                }
            }
#pragma unroll
            for (int k = 0; k < UN; ++k) {
                const uint32_t i = i0 + k * stride;
                if (i < n) outr[i] = ew::apply_unit<OP, U>(u[k], OP == ew::OP_SCALE ? u[k] : v[k], p);
            }
        }
    }
}
