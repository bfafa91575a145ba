// Small helpers shared by the attention kernels: constants of the base-2
// softmax, 16-byte loads of K/V rows converted to f32, and the logit transform
// (scale, optional softcap) every kernel applies in the same way.
//
// Every kernel works in base 2 internally (scores are multiplied by log2(e)
// so that exp2 is one instruction) and converts LSE values to natural
// logarithms at the boundary.
#pragma once

#include "common/kv_cache.cuh"
#include "common/mma.cuh"
#include "common/types.cuh"

namespace cukern {
namespace attn {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// Elements of T in one 16-byte vector.
template <typename T>
__host__ __device__ constexpr int vec_elems() { return 16 / (int)sizeof(T); }

// A 16-byte vector of T, widened to f32.
CUKERN_DEVICE void widen(const uint4& r, const __half*, float* f /* [8] */) {
    const __half2* h = reinterpret_cast<const __half2*>(&r);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 v = __half22float2(h[i]);
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
    }
}

CUKERN_DEVICE void widen(const uint4& r, const __nv_bfloat16*, float* f /* [8] */) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&r);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 v = __bfloat1622float2(h[i]);
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
    }
}

CUKERN_DEVICE void widen(const uint4& r, const float*, float* f /* [4] */) {
    f[0] = __uint_as_float(r.x);
    f[1] = __uint_as_float(r.y);
    f[2] = __uint_as_float(r.z);
    f[3] = __uint_as_float(r.w);
}

// 16-byte read-only load (ld.global.nc).
template <typename T>
CUKERN_DEVICE uint4 load16(const T* p) {
    return __ldg(reinterpret_cast<const uint4*>(p));
}

// Token `j` of a paged sequence in two parts: {its page's entry in the page table (the load), its row in
// that page}; page_shift >= 0 when page_size is a power of two, which turns the division into a shift.
// entry_row() makes the pair the pool row (kv_row_index); a caller that keeps the pair and forms the row
// only where it uses it leaves the page-table load in flight until then.
CUKERN_DEVICE uint2 paged_entry(const int32_t* __restrict__ pt, uint32_t j, uint32_t page_size, int32_t page_shift) {
    if (page_shift >= 0) return make_uint2((uint32_t)pt[j >> page_shift], j & (page_size - 1));
    const uint32_t pg = j / page_size;
    return make_uint2((uint32_t)pt[pg], j - pg * page_size);
}
CUKERN_DEVICE uint64_t entry_row(uint2 e, uint32_t page_size, int32_t page_shift) {
    return (page_shift >= 0 ? (uint64_t)e.x << page_shift : (uint64_t)e.x * page_size) + e.y;
}

// Token `j` of a paged sequence -> its row in the pool.
CUKERN_DEVICE uint64_t paged_row(const int32_t* __restrict__ pt, uint32_t j, uint32_t page_size, int32_t page_shift) {
    return entry_row(paged_entry(pt, j, page_size, page_shift), page_size, page_shift);
}

// 2^x with one MUFU.EX2 (ex2.approx.ftz: relative error ~2^-22; 2^-inf = 0).
CUKERN_DEVICE float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Raw dot products -> base-2 logits, N at a time. The softcap test sits outside the loop, so the
// common path is one multiply per logit and tanh is never evaluated (nor predicated) without a cap.
//   scale_log2 = scale * log2(e); softcap > 0: softcap * tanh(scale * x / softcap) * log2(e).
// Masks are applied after this (a capped -inf would become finite).
template <int N>
CUKERN_DEVICE void to_logits2(float* x, float scale_log2, float softcap, float inv_softcap) {
    if (softcap > 0.0f) {
        const float a = scale_log2 * LN2 * inv_softcap, b = softcap * LOG2E;
#pragma unroll
        for (int i = 0; i < N; ++i) x[i] = b * tanhf(x[i] * a);
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) x[i] *= scale_log2;
    }
}

// The sink logit (natural log) of sinks[idx], -inf where there is none: has_sinks off, or a NaN entry (a head
// without a sink in a buffer shared by every head of every layer). A -inf sink weighs nothing anywhere.
CUKERN_DEVICE float sink_logit(const float* __restrict__ sinks, uint32_t has_sinks, uint32_t idx) {
    if (!has_sinks) return -INFINITY;
    const float s = sinks[idx];
    return (__float_as_uint(s) & 0x7fffffffu) > 0x7f800000u ? -INFINITY : s;  // NaN test on the bits (fast math)
}

// exp2 of x - m where m may be -inf (no key seen yet): then every weight is 0, never NaN.
CUKERN_DEVICE float safe_max(float m) { return m == -INFINITY ? 0.0f : m; }

// Two f32 values as a (hi, lo) pair of registers of two T each: hi = T(x), lo = T(x - hi). hi + lo carries
// x to about 2^-22 (f16) / 2^-16 (bf16) relative, so one m16n8k16 with hi in rows 0-7 of the A tile and lo in
// rows 8-15 computes both halves of an f32-accurate product at once (the decode's tensor-core path).
CUKERN_DEVICE float2 unpack2(uint32_t r, const __half*) {
    return __half22float2(*reinterpret_cast<const __half2*>(&r));
}
CUKERN_DEVICE float2 unpack2(uint32_t r, const __nv_bfloat16*) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r));
}
template <typename T>
CUKERN_DEVICE void split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
    hi = pack2<T>(x0, x1);
    const float2 h = unpack2(hi, (const T*)nullptr);
    lo = pack2<T>(x0 - h.x, x1 - h.y);
}

// q and the final output of the decode kernels: f32, or the cache's 16-bit type Q (widened on the load,
// rounded once on the store). Groups aligned to their size: 8 / 16 bytes for 4 values, 4 / 8 for 2.
CUKERN_DEVICE float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
template <typename Q>
CUKERN_DEVICE float4 load4(const Q* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 lo = unpack2(u.x, p), hi = unpack2(u.y, p);
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}
CUKERN_DEVICE float2 load2(const float* p) { return *reinterpret_cast<const float2*>(p); }
template <typename Q>
CUKERN_DEVICE float2 load2(const Q* p) { return unpack2(*reinterpret_cast<const uint32_t*>(p), p); }
// store4: the i-th group of 4 values from p (p + 4 i).
CUKERN_DEVICE void store4(float* p, uint64_t i, float4 v) { reinterpret_cast<float4*>(p)[i] = v; }
template <typename Q>
CUKERN_DEVICE void store4(Q* p, uint64_t i, float4 v) {
    reinterpret_cast<uint2*>(p)[i] = make_uint2(pack2<Q>(v.x, v.y), pack2<Q>(v.z, v.w));
}

}  // namespace attn
}  // namespace cukern
