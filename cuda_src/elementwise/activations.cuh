// Row-wise binary operations and gated activations: out[r, c] = op(a[r, c], b[r, c]).
//
// One kernel template, binary_rows<OP, VEC4>, covers every two-input elementwise op of the decode
// and prefill loops (see EwOp). Rows may be strided (a view of a fused [gate | up] matmul output),
// b may be broadcast over rows (b_stride 0: a bias), and out may alias a.
// grid: (column blocks, min(n_rows, 65535)) with grid-stride loops over both; VEC4 = 16-byte
// loads, when n_cols, strides, offsets and pointers are multiples of 4 floats / 16 bytes.
// Byte traffic per element: read a and b (b once per row unless broadcast), write out.
#pragma once

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

}  // namespace ew
}  // namespace cukern

template <int OP, bool VEC4>
__global__ void binary_rows(
    float* out,          // [n_rows, out_stride] first n_cols of each row written (may alias a)
    const float* a,      // [n_rows, a_stride]
    const float* b,      // [n_rows, b_stride] from b_offset, or [b_offset + n_cols] when b_stride == 0
    const BinaryParams p) {
    using namespace cukern;
    const uint32_t stride = gridDim.x * blockDim.x;
    for (uint32_t r = blockIdx.y; r < p.n_rows; r += gridDim.y) {
        const float* ar = a + r * p.a_stride;
        const float* br = b + r * p.b_stride + p.b_offset;
        float* outr = out + r * p.out_stride;
        if (VEC4) {
            const float4* a4 = reinterpret_cast<const float4*>(ar);
            const float4* b4 = reinterpret_cast<const float4*>(br);
            float4* o4 = reinterpret_cast<float4*>(outr);
            for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n_cols / 4; i += stride) {
                const float4 u = a4[i];
                const float4 v = OP == ew::OP_SCALE ? u : b4[i];
                o4[i] = make_float4(ew::apply<OP>(u.x, v.x, p), ew::apply<OP>(u.y, v.y, p),
                                    ew::apply<OP>(u.z, v.z, p), ew::apply<OP>(u.w, v.w, p));
            }
        } else {
            for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n_cols; i += stride)
                outr[i] = ew::apply<OP>(ar[i], OP == ew::OP_SCALE ? 0.f : br[i], p);
        }
    }
}
