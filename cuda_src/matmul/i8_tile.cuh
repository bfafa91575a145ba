// Weight-tile conversion for the int8 tensor-core GEMM: GGUF blocks -> int8 quants + f32 scales
// in shared memory, from the raw registers Deq<QT>::load fetched (dequant_tile.cuh: same units,
// same element positions). Per 32-element segment of a row the GEMM gets
//   q[32] int8 and a[SUBS], c:  w[j] = a[j / (32 / SUBS)] * q[j] - c
//   Q4_0: q = nibble - 8, a = d, c = 0        Q5_0: q = 5-bit - 16, a = d, c = 0
//   Q8_0: q = qs, a = d, c = 0                 Q4_K / Q5_K: q = 4/5-bit, a = d * sc, c = dmin * m
//   Q6_K: q = 6-bit - 32, a[h] = d * scales[16-element half h] (SUBS = 2), c = 0
// so that a segment's dot product with Q8_1 activations (da, s = da * sum(qa)) is
//   sum_h a[h] * da * (q . qa)_h - c * s.
#pragma once

#include "matmul/dequant_tile.cuh"

namespace cukern {
namespace mm {

template <int QT> struct I8 {
    static constexpr int kSubs = QT == QT_Q6_K ? 2 : 1;    // scales per segment
    static constexpr bool kMin = QT == QT_Q4_K || QT == QT_Q5_K;  // has the -c * s term
};

CUKERN_DEVICE void st8(int8_t* dst, uint32_t lo, uint32_t hi) { *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi); }
CUKERN_DEVICE void st16i(int8_t* dst, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(a, b, c, d);
}
CUKERN_DEVICE float half_bits(uint32_t h) { return __half2float(__ushort_as_half((unsigned short)h)); }

// seg: the 32 int8 of the segment; a: its kSubs scales; c: its min (kMin); p: the unit's part
CUKERN_DEVICE void store_i8(const Deq<QT_Q4_0>::Raw& r, int8_t* seg, float* a, float*, int p) {
    st8(seg + 8 * p, __vsub4(r.q0 & 0x0F0F0F0Fu, 0x08080808u), __vsub4(r.q1 & 0x0F0F0F0Fu, 0x08080808u));
    st8(seg + 16 + 8 * p, __vsub4((r.q0 >> 4) & 0x0F0F0F0Fu, 0x08080808u), __vsub4((r.q1 >> 4) & 0x0F0F0F0Fu, 0x08080808u));
    if (p == 0) a[0] = half_bits(r.d);
}

CUKERN_DEVICE void store_i8(const Deq<QT_Q5_0>::Raw& r, int8_t* seg, float* a, float*, int p) {
#pragma unroll
    for (int nib = 0; nib < 2; ++nib) {
        const uint32_t hb = r.qh >> (16 * nib + 8 * p);  // fifth bits of the 8 values
        const uint32_t v0 = ((r.q0 >> (4 * nib)) & 0x0F0F0F0Fu) | (spread_bits4(hb) << 4);
        const uint32_t v1 = ((r.q1 >> (4 * nib)) & 0x0F0F0F0Fu) | (spread_bits4(hb >> 4) << 4);
        st8(seg + 16 * nib + 8 * p, __vsub4(v0, 0x10101010u), __vsub4(v1, 0x10101010u));
    }
    if (p == 0) a[0] = half_bits(r.d);
}

CUKERN_DEVICE void store_i8(const Deq<QT_Q8_0>::Raw& r, int8_t* seg, float* a, float*, int p) {
    st16i(seg + 16 * p, r.q[0], r.q[1], r.q[2], r.q[3]);
    if (p == 0) a[0] = half_bits(r.d);
}

template <bool HIGH>
CUKERN_DEVICE void store_i8_k45(const typename DeqK45<HIGH>::Raw& r, int8_t* seg, float* a, float* c, int p) {
    const int sh = 4 * (r.sub & 1);
    const uint32_t q[4] = {r.q.x, r.q.y, r.q.z, r.q.w}, h[4] = {r.h.x, r.h.y, r.h.z, r.h.w};
    uint32_t v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[i] = (q[i] >> sh) & 0x0F0F0F0Fu;
        if (HIGH) v[i] |= ((h[i] >> r.sub) & 0x01010101u) << 4;
    }
    st16i(seg + 16 * p, v[0], v[1], v[2], v[3]);
    if (p == 0) {
        int sc, m;
        k4_scale_min(r.s0, r.s1, r.s2, r.sub, sc, m);
        a[0] = half_bits(r.dm & 0xFFFF) * sc;
        c[0] = half_bits(r.dm >> 16) * m;
    }
}
CUKERN_DEVICE void store_i8(const DeqK45<false>::Raw& r, int8_t* seg, float* a, float* c, int p) { store_i8_k45<false>(r, seg, a, c, p); }
CUKERN_DEVICE void store_i8(const DeqK45<true>::Raw& r, int8_t* seg, float* a, float* c, int p) { store_i8_k45<true>(r, seg, a, c, p); }

CUKERN_DEVICE void store_i8(const Deq<QT_Q6_K>::Raw& r, int8_t* seg, float* a, float*, int p) {
    const int sl = 4 * ((r.sub & 3) >> 1), sh = 2 * (r.sub & 3);
    uint32_t v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        v[i] = __vsub4(((r.ql[i] >> sl) & 0x0F0F0F0Fu) | (((r.qh[i] >> sh) & 0x03030303u) << 4), 0x20202020u);
    st16i(seg + 16 * p, v[0], v[1], v[2], v[3]);
    a[p] = r.a;  // the unit is one 16-element half
}

}  // namespace mm
}  // namespace cukern
