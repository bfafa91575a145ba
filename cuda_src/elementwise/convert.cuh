// Activation storage types of the elementwise kernels: float, __half and __nv_bfloat16 in memory, f32 in
// registers. Kernels templated on the storage type T load through these helpers, compute in f32 and round
// once on the store; T = float compiles to the plain f32 loads and stores.
//   Vec<T, true>   one 16-byte unit: N = 16 / sizeof(T) elements (4 floats, 8 halves), raw bits in a float4
//                  (norms, group norms, binary ops: the host checks 16-byte alignment and N | row length)
//   Vec<T, false>  one element (the scalar fallbacks)
//   ld4 / st4      4 consecutive elements as a float4 (16 bytes of f32, 8 bytes of f16/bf16; RoPE units)
#pragma once

#include "common/types.cuh"

namespace cukern {
namespace ew {

// Two packed 16-bit values <-> two floats, through the CUDA headers' paired conversions.
CUKERN_DEVICE float2 unpack2(uint32_t w, __half) { return __half22float2(*reinterpret_cast<const __half2*>(&w)); }
CUKERN_DEVICE float2 unpack2(uint32_t w, __nv_bfloat16) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}
CUKERN_DEVICE uint32_t pack2(float a, float b, __half) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
}
CUKERN_DEVICE uint32_t pack2(float a, float b, __nv_bfloat16) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
}

template <typename T, bool VEC> struct Vec;

template <typename T>
struct Vec<T, false> {  // one element
    using raw = T;
    static constexpr int N = 1;
    static CUKERN_DEVICE void unpack(raw r, float (&v)[N]) { v[0] = to_float(r); }
    static CUKERN_DEVICE raw pack(const float (&v)[N]) { return from_float<T>(v[0]); }
};

template <>
struct Vec<float, true> {  // 4 floats
    using raw = float4;
    static constexpr int N = 4;
    static CUKERN_DEVICE void unpack(raw r, float (&v)[N]) { v[0] = r.x; v[1] = r.y; v[2] = r.z; v[3] = r.w; }
    static CUKERN_DEVICE raw pack(const float (&v)[N]) { return make_float4(v[0], v[1], v[2], v[3]); }
};

template <typename T>
struct Vec<T, true> {  // 8 halves or bf16s: 4 packed pairs
    using raw = float4;
    static constexpr int N = 8;
    static CUKERN_DEVICE void unpack(raw r, float (&v)[N]) {
        const uint32_t w[4] = {__float_as_uint(r.x), __float_as_uint(r.y), __float_as_uint(r.z), __float_as_uint(r.w)};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = unpack2(w[i], T());
            v[2 * i] = f.x;
            v[2 * i + 1] = f.y;
        }
    }
    static CUKERN_DEVICE raw pack(const float (&v)[N]) {
        return make_float4(__uint_as_float(pack2(v[0], v[1], T())), __uint_as_float(pack2(v[2], v[3], T())),
                           __uint_as_float(pack2(v[4], v[5], T())), __uint_as_float(pack2(v[6], v[7], T())));
    }
};

// 4 consecutive elements p[i .. i + 3] (p + i aligned to 4 elements) as f32, and back.
CUKERN_DEVICE float4 ld4(const float* p, uint32_t i) { return *reinterpret_cast<const float4*>(p + i); }
template <typename T>
CUKERN_DEVICE float4 ld4(const T* p, uint32_t i) {
    const uint2 u = *reinterpret_cast<const uint2*>(p + i);
    const float2 lo = unpack2(u.x, T()), hi = unpack2(u.y, T());
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}
CUKERN_DEVICE void st4(float* p, uint32_t i, float4 v) { *reinterpret_cast<float4*>(p + i) = v; }
template <typename T>
CUKERN_DEVICE void st4(T* p, uint32_t i, float4 v) {
    *reinterpret_cast<uint2*>(p + i) = make_uint2(pack2(v.x, v.y, T()), pack2(v.z, v.w, T()));
}

}  // namespace ew
}  // namespace cukern
