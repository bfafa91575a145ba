// Weight-tile dequantization: GGUF blocks -> f16 (the f16 tensor-core GEMM's shared tiles, and
// dequantize_f16's output); i8_tile.cuh converts the same registers to int8 for the int8 GEMM.
//
// The K axis is cut into 32-element segments (kb = k / 32): one Q4_0/Q5_0/Q8_0 block, or one
// sub-block of a K-quant super-block (s = kb % 8). A thread dequantizes a "unit", half a segment
// of one row (part p = 0, 1), in two steps: Deq<QT>::load pulls the raw bytes into registers
// (from global memory, or from a GEMM's shared copy of the raw super-stage), Deq<QT>::store
// converts them and writes 16 halves of the segment (through Deq<QT>::emit, which hands each 8-half chunk,
// at its element offset in the segment, to a functor).
//   Q4_0 / Q5_0: part p holds qs[8p..8p+7]: elements 8p..8p+7 (low nibbles) and 16+8p..16+8p+7
//   Q8_0, Q4_K, Q5_K, Q6_K: part p holds elements 16p..16p+15
// Every value is the exact product rounded once to f16: the _0 types in half2 arithmetic (the
// quant minus its offset is exact, one rounding in the multiply), the K-quants in f32 (the
// scaled quant is exact in f32, one rounding in the f16 conversion).
//
// Alignment: blocks of Q4_0/Q5_0/Q8_0/Q6_K are 2-byte aligned only (read as u16); Q4_K/Q5_K
// blocks are whole 16-byte multiples, so with a 16-byte aligned row start (the host checks the
// matrix start; the GEMMs' shared raw rows are 16-byte aligned) their quants are read as uint4.
#pragma once

#include "common/quants.cuh"

namespace cukern {
namespace mm {

CUKERN_DEVICE uint32_t ld_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
CUKERN_DEVICE uint32_t ld_u32_a2(const uint8_t* p) { return ld_u16(p) | (ld_u16(p + 2) << 16); }
CUKERN_DEVICE uint32_t as_u32(__half2 h) { return *reinterpret_cast<const uint32_t*>(&h); }
CUKERN_DEVICE __half2 as_h2(uint32_t u) { return *reinterpret_cast<const __half2*>(&u); }

// Bytes 0,1 (HI = 0) or 2,3 (HI = 1) of v in the low byte of the two 16-bit lanes.
template <int HI>
CUKERN_DEVICE uint32_t lanes2(uint32_t v) { return __byte_perm(v, 0, HI ? 0x4342 : 0x4140); }

// (1024 + a, 1024 + b) as half2 from lane values a, b < 1024: the f16 exponent trick.
CUKERN_DEVICE __half2 h2_from_lanes(uint32_t lanes) { return as_h2(lanes | 0x64006400u); }

// Four values (bytes of v, 0...255) -> four halves a*q - c, computed in f32, rounded once.
CUKERN_DEVICE uint2 affine4(uint32_t v, float a, float c) {
    float f[4];
    bytes_to_float4(v, f);
    return make_uint2(as_u32(__floats2half2_rn(fmaf(a, f[0], -c), fmaf(a, f[1], -c))),
                      as_u32(__floats2half2_rn(fmaf(a, f[2], -c), fmaf(a, f[3], -c))));
}

CUKERN_DEVICE void st16(__half* dst, uint4 v) { *reinterpret_cast<uint4*>(dst) = v; }

template <int QT> struct Deq;

template <> struct Deq<QT_Q4_0> {
    struct Raw { uint32_t q0, q1, d; };
    static CUKERN_DEVICE void load(Raw& r, const uint8_t* row, uint32_t kb, int p) {
        const uint8_t* blk = row + (size_t)kb * 18;
        r.d = ld_u16(blk);
        r.q0 = ld_u32_a2(blk + 2 + 8 * p);
        r.q1 = ld_u32_a2(blk + 6 + 8 * p);
    }
    // 8 values of nibble half NIB of bytes q0, q1, as d * (q - 8)
    template <int NIB>
    static CUKERN_DEVICE uint4 eight(const Raw& r) {
        const __half2 d2 = as_h2(r.d | (r.d << 16)), off = __half2half2(__ushort_as_half(0x6408));  // 1032
        auto cv = [&](uint32_t l) { return as_u32(__hmul2(__hsub2(h2_from_lanes((l >> (4 * NIB)) & 0x000F000Fu), off), d2)); };
        return make_uint4(cv(lanes2<0>(r.q0)), cv(lanes2<1>(r.q0)), cv(lanes2<0>(r.q1)), cv(lanes2<1>(r.q1)));
    }
    static CUKERN_DEVICE void store(const Raw& r, __half* seg, int p) {
        emit(r, [seg](int e, uint4 v) { st16(seg + e, v); }, p);
    }
    template <class Put>
    static CUKERN_DEVICE void emit(const Raw& r, Put put, int p) {
        put(8 * p, eight<0>(r));
        put(16 + 8 * p, eight<1>(r));
    }
};

template <> struct Deq<QT_Q5_0> {
    struct Raw { uint32_t q0, q1, qh, d; };
    static CUKERN_DEVICE void load(Raw& r, const uint8_t* row, uint32_t kb, int p) {
        const uint8_t* blk = row + (size_t)kb * 22;
        r.d = ld_u16(blk);
        r.qh = ld_u32_a2(blk + 2);
        r.q0 = ld_u32_a2(blk + 6 + 8 * p);
        r.q1 = ld_u32_a2(blk + 10 + 8 * p);
    }
    // 8 values of nibble half NIB; the fifth bit of element j is bit j of qh; d * (q - 16)
    template <int NIB>
    static CUKERN_DEVICE uint4 eight(const Raw& r, int p) {
        const __half2 d2 = as_h2(r.d | (r.d << 16)), off = __half2half2(__ushort_as_half(0x6410));  // 1040
        const uint32_t hb = r.qh >> (16 * NIB + 8 * p);  // bit i: fifth bit of the i-th of the 8 values
        auto cv = [&](uint32_t l, int i) {
            const uint32_t h = ((hb >> i) & 1u) << 4 | ((hb >> (i + 1)) & 1u) << 20;
            return as_u32(__hmul2(__hsub2(h2_from_lanes(((l >> (4 * NIB)) & 0x000F000Fu) | h), off), d2));
        };
        return make_uint4(cv(lanes2<0>(r.q0), 0), cv(lanes2<1>(r.q0), 2), cv(lanes2<0>(r.q1), 4), cv(lanes2<1>(r.q1), 6));
    }
    static CUKERN_DEVICE void store(const Raw& r, __half* seg, int p) {
        emit(r, [seg](int e, uint4 v) { st16(seg + e, v); }, p);
    }
    template <class Put>
    static CUKERN_DEVICE void emit(const Raw& r, Put put, int p) {
        put(8 * p, eight<0>(r, p));
        put(16 + 8 * p, eight<1>(r, p));
    }
};

template <> struct Deq<QT_Q8_0> {
    struct Raw { uint32_t q[4], d; };
    static CUKERN_DEVICE void load(Raw& r, const uint8_t* row, uint32_t kb, int p) {
        const uint8_t* blk = row + (size_t)kb * 34;
        r.d = ld_u16(blk);
#pragma unroll
        for (int i = 0; i < 4; ++i) r.q[i] = ld_u32_a2(blk + 2 + 16 * p + 4 * i);
    }
    static CUKERN_DEVICE void store(const Raw& r, __half* seg, int p) {
        emit(r, [seg](int e, uint4 v) { st16(seg + e, v); }, p);
    }
    template <class Put>
    static CUKERN_DEVICE void emit(const Raw& r, Put put, int p) {
        // signed byte b -> lane (b ^ 0x80) = b + 128 -> half 1152 + b -> minus 1152 (exact), times d
        const __half2 d2 = as_h2(r.d | (r.d << 16)), off = __half2half2(__ushort_as_half(0x6480));  // 1152
        auto cv = [&](uint32_t l) { return as_u32(__hmul2(__hsub2(h2_from_lanes(l ^ 0x00800080u), off), d2)); };
        put(16 * p, make_uint4(cv(lanes2<0>(r.q[0])), cv(lanes2<1>(r.q[0])), cv(lanes2<0>(r.q[1])), cv(lanes2<1>(r.q[1]))));
        put(16 * p + 8, make_uint4(cv(lanes2<0>(r.q[2])), cv(lanes2<1>(r.q[2])), cv(lanes2<0>(r.q[3])), cv(lanes2<1>(r.q[3]))));
    }
};

// Q4_K and Q5_K share the scale/min header; HIGH adds the fifth bits (qh) of Q5_K.
template <bool HIGH> struct DeqK45 {
    static constexpr int kBytes = HIGH ? 176 : 144, kQs = HIGH ? 48 : 16;
    struct Raw { uint32_t dm, s0, s1, s2; uint4 q, h; int sub; };
    static CUKERN_DEVICE void load(Raw& r, const uint8_t* row, uint32_t kb, int p) {
        const uint8_t* blk = row + (size_t)(kb / 8) * kBytes;
        r.sub = kb % 8;
        const uint4 head = *reinterpret_cast<const uint4*>(blk);  // d, dmin, scales[12]
        r.dm = head.x, r.s0 = head.y, r.s1 = head.z, r.s2 = head.w;
        r.q = *reinterpret_cast<const uint4*>(blk + kQs + 32 * (r.sub / 2) + 16 * p);
        if (HIGH) r.h = *reinterpret_cast<const uint4*>(blk + 16 + 16 * p);
    }
    static CUKERN_DEVICE void store(const Raw& r, __half* seg, int p) {
        emit(r, [seg](int e, uint4 v) { st16(seg + e, v); }, p);
    }
    template <class Put>
    static CUKERN_DEVICE void emit(const Raw& r, Put put, int p) {
        int sc, m;
        k4_scale_min(r.s0, r.s1, r.s2, r.sub, sc, m);
        const float a = __half2float(__ushort_as_half(r.dm & 0xFFFF)) * sc;
        const float c = __half2float(__ushort_as_half(r.dm >> 16)) * m;
        const int sh = 4 * (r.sub & 1);
        const uint32_t q[4] = {r.q.x, r.q.y, r.q.z, r.q.w}, h[4] = {r.h.x, r.h.y, r.h.z, r.h.w};
        uint2 out[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            uint32_t v = (q[i] >> sh) & 0x0F0F0F0Fu;
            if (HIGH) v |= ((h[i] >> r.sub) & 0x01010101u) << 4;
            out[i] = affine4(v, a, c);
        }
        put(16 * p, make_uint4(out[0].x, out[0].y, out[1].x, out[1].y));
        put(16 * p + 8, make_uint4(out[2].x, out[2].y, out[3].x, out[3].y));
    }
};
template <> struct Deq<QT_Q4_K> : DeqK45<false> {};
template <> struct Deq<QT_Q5_K> : DeqK45<true> {};

template <> struct Deq<QT_Q6_K> {
    struct Raw { uint32_t ql[4], qh[4]; float a; int sub; };
    static CUKERN_DEVICE void load(Raw& r, const uint8_t* row, uint32_t kb, int p) {
        const uint8_t* blk = row + (size_t)(kb / 8) * 210;
        const int s = kb % 8, h = s / 4;  // sub-block, half of the super-block
        r.sub = s;
        const uint8_t* ql = blk + 64 * h + 32 * (s & 1) + 16 * p;
        const uint8_t* qh = blk + 128 + 32 * h + 16 * p;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            r.ql[i] = ld_u32_a2(ql + 4 * i);
            r.qh[i] = ld_u32_a2(qh + 4 * i);
        }
        r.a = __half2float(__ushort_as_half(ld_u16(blk + 208))) * (float)(int8_t)blk[192 + 2 * s + p];
    }
    static CUKERN_DEVICE void store(const Raw& r, __half* seg, int p) {
        emit(r, [seg](int e, uint4 v) { st16(seg + e, v); }, p);
    }
    template <class Put>
    static CUKERN_DEVICE void emit(const Raw& r, Put put, int p) {
        const int sl = 4 * ((r.sub & 3) >> 1), sh = 2 * (r.sub & 3);
        uint2 out[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t v = ((r.ql[i] >> sl) & 0x0F0F0F0Fu) | (((r.qh[i] >> sh) & 0x03030303u) << 4);
            out[i] = affine4(v, r.a, 32.0f * r.a);  // d * sc * (q - 32)
        }
        put(16 * p, make_uint4(out[0].x, out[0].y, out[1].x, out[1].y));
        put(16 * p + 8, make_uint4(out[2].x, out[2].y, out[3].x, out[3].y));
    }
};

}  // namespace mm
}  // namespace cukern
