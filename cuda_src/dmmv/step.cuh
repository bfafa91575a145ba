// How one warp reads and dequantizes 256 consecutive elements of a weight row (a "step").
//
// Every type maps the step the same way for the kernels: lane l owns two groups of four
// consecutive elements, [x0(l), x0(l) + 4) and [x1(l), x1(l) + 4), so the activations are read
// as two float4 per lane and, across the warp, every x load is a run of whole 128-byte lines.
// A group dequantizes to w_i = a * q_i + b (q_i small exact integers as f32, a and b the
// block's scale and offset), so the dot product costs one FMA per element plus two per group:
//     sum_i w_i x_i = a * sum_i q_i x_i + b * sum_i x_i,
// and sum_i x_i is shared by every row the warp works on.
//
// load() issues the global loads of one step (kept in a Raw so that several steps and rows can
// be in flight before any is decoded); decode() turns a Raw into the two groups. With TAIL,
// groups at or past `rem` elements (the row's last, partial step) load nothing and decode to
// zeros; the kernels zero the matching x too.
#pragma once

#include "common/quants.cuh"

namespace cukern {
namespace qmv {

constexpr int kStep = 256;  // elements per warp step

struct Group {
    float q[4];  // quant values (exact small integers, or the weights themselves for float types)
    float a, b;  // w_i = a * q_i + b
};

// Streaming loads of weights, read exactly once: keep them out of L1 (which holds x).
CUKERN_DEVICE uint32_t ld_stream_u32(const uint8_t* p) {  // p: 4-byte aligned
    uint32_t v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
CUKERN_DEVICE uint2 ld_stream_u64(const uint8_t* p) {  // p: 8-byte aligned
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
CUKERN_DEVICE uint4 ld_stream_u128(const uint8_t* p) {  // p: 16-byte aligned
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
CUKERN_DEVICE float4 ld_stream_f4(const uint8_t* p) {  // p: 16-byte aligned
    float4 v;
    asm("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}
// 2-byte aligned data (Q4_0, Q5_0, Q8_0, Q6_K): neighbouring lanes share sectors across
// instructions, so these go through L1.
CUKERN_DEVICE uint32_t ld_u16(const uint8_t* p) { return __ldg(reinterpret_cast<const unsigned short*>(p)); }
CUKERN_DEVICE uint32_t ld_u32_a2(const uint8_t* p) { return ld_u16(p) | (ld_u16(p + 2) << 16); }
CUKERN_DEVICE uint32_t ld_u8(const uint8_t* p) { return __ldg(p); }
CUKERN_DEVICE float half_bits_to_float(uint32_t h) { return __half2float(__ushort_as_half((unsigned short)h)); }

template <int QT> struct Step;

// ---------------------------------------------------------------- F32 / F16 / BF16
// lane l: elements 4l...4l+3 and 128+4l...128+4l+3 of the step
template <int QT>
struct FloatStep {
    static constexpr int kEsize = QTraits<QT>::kBytes;
    static constexpr int kStepBytes = kStep * kEsize;
    static CUKERN_DEVICE int x0(int lane) { return 4 * lane; }
    static CUKERN_DEVICE int x1(int lane) { return 128 + 4 * lane; }
    struct Raw { float4 v0, v1; };  // f32: the values; f16/bf16: 4 packed values in .x/.y
    template <bool TAIL>
    static CUKERN_DEVICE Raw load(const uint8_t* p, int lane, int rem) {
        Raw r{};
        const bool ok0 = !TAIL || x0(lane) < rem, ok1 = !TAIL || x1(lane) < rem;
        if (kEsize == 4) {
            if (ok0) r.v0 = ld_stream_f4(p + 4 * x0(lane));
            if (ok1) r.v1 = ld_stream_f4(p + 4 * x1(lane));
        } else {
            if (ok0) { const uint2 u = ld_stream_u64(p + 2 * x0(lane)); r.v0.x = __uint_as_float(u.x); r.v0.y = __uint_as_float(u.y); }
            if (ok1) { const uint2 u = ld_stream_u64(p + 2 * x1(lane)); r.v1.x = __uint_as_float(u.x); r.v1.y = __uint_as_float(u.y); }
        }
        return r;
    }
    static CUKERN_DEVICE void unpack(float4 v, Group& g) {
        g.a = 1.0f;
        g.b = 0.0f;
        if (kEsize == 4) {
            g.q[0] = v.x; g.q[1] = v.y; g.q[2] = v.z; g.q[3] = v.w;
        } else {
            const uint32_t u0 = __float_as_uint(v.x), u1 = __float_as_uint(v.y);
            if (QT == QT_F16) {
                const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u0));
                const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u1));
                g.q[0] = a.x; g.q[1] = a.y; g.q[2] = b.x; g.q[3] = b.y;
            } else {  // bf16 -> f32 is a 16-bit shift
                g.q[0] = __uint_as_float(u0 << 16); g.q[1] = __uint_as_float(u0 & 0xFFFF0000u);
                g.q[2] = __uint_as_float(u1 << 16); g.q[3] = __uint_as_float(u1 & 0xFFFF0000u);
            }
        }
    }
    static CUKERN_DEVICE void decode(const Raw& r, int, Group& g0, Group& g1) { unpack(r.v0, g0); unpack(r.v1, g1); }
};
template <> struct Step<QT_F32> : FloatStep<QT_F32> {};
template <> struct Step<QT_F16> : FloatStep<QT_F16> {};
template <> struct Step<QT_BF16> : FloatStep<QT_BF16> {};

// ---------------------------------------------------------------- Q4_0 / Q5_0 / MXFP4
// 8 blocks per step; lane l: block l/4, quant bytes 4t...4t+3 (t = l%4): low nibbles are
// elements 4t...4t+3 of the block, high nibbles 16+4t...16+4t+3.
struct Nibble32Map {
    static CUKERN_DEVICE int x0(int lane) { return 32 * (lane >> 2) + 4 * (lane & 3); }
    static CUKERN_DEVICE int x1(int lane) { return x0(lane) + 16; }
};

template <> struct Step<QT_Q4_0> : Nibble32Map {
    static constexpr int kStepBytes = 8 * 18;
    struct Raw { uint32_t d, qs; };
    template <bool TAIL>
    static CUKERN_DEVICE Raw load(const uint8_t* p, int lane, int rem) {
        Raw r{};
        if (!TAIL || x0(lane) < rem) {
            const uint8_t* blk = p + 18 * (lane >> 2);
            r.d = ld_u16(blk);
            r.qs = ld_u32_a2(blk + 2 + 4 * (lane & 3));
        }
        return r;
    }
    static CUKERN_DEVICE void decode(const Raw& r, int, Group& g0, Group& g1) {
        const float d = half_bits_to_float(r.d);
        bytes_to_float4(r.qs & 0x0F0F0F0Fu, g0.q);
        bytes_to_float4((r.qs >> 4) & 0x0F0F0F0Fu, g1.q);
        g0.a = g1.a = d;
        g0.b = g1.b = -8.0f * d;
    }
};

template <> struct Step<QT_Q5_0> : Nibble32Map {
    static constexpr int kStepBytes = 8 * 22;
    struct Raw { uint32_t d, qh, qs; };
    template <bool TAIL>
    static CUKERN_DEVICE Raw load(const uint8_t* p, int lane, int rem) {
        Raw r{};
        if (!TAIL || x0(lane) < rem) {
            const uint8_t* blk = p + 22 * (lane >> 2);
            r.d = ld_u16(blk);
            r.qh = ld_u32_a2(blk + 2);
            r.qs = ld_u32_a2(blk + 6 + 4 * (lane & 3));
        }
        return r;
    }
    static CUKERN_DEVICE void decode(const Raw& r, int lane, Group& g0, Group& g1) {
        const int t4 = 4 * (lane & 3);
        const float d = half_bits_to_float(r.d);
        bytes_to_float4((r.qs & 0x0F0F0F0Fu) | (spread_bits4(r.qh >> t4) << 4), g0.q);
        bytes_to_float4(((r.qs >> 4) & 0x0F0F0F0Fu) | (spread_bits4(r.qh >> (16 + t4)) << 4), g1.q);
        g0.a = g1.a = d;
        g0.b = g1.b = -16.0f * d;
    }
};

template <> struct Step<QT_MXFP4> : Nibble32Map {
    static constexpr int kStepBytes = 8 * 17;
    struct Raw { uint32_t e, qs; };
    template <bool TAIL>
    static CUKERN_DEVICE Raw load(const uint8_t* p, int lane, int rem) {
        Raw r{};
        if (!TAIL || x0(lane) < rem) {
            const uint8_t* blk = p + 17 * (lane >> 2);
            const uint8_t* q = blk + 1 + 4 * (lane & 3);
            r.e = ld_u8(blk);
            r.qs = ld_u8(q) | (ld_u8(q + 1) << 8) | (ld_u8(q + 2) << 16) | (ld_u8(q + 3) << 24);
        }
        return r;
    }
    static CUKERN_DEVICE void decode(const Raw& r, int, Group& g0, Group& g1) {
        // low 16 bits of qs: nibbles (lo0, hi0, lo1, hi1) -> elements (j, j+16, j+1, j+17)
        const uint32_t a = mxfp4_lookup4_biased(r.qs), b = mxfp4_lookup4_biased(r.qs >> 16);
        g0.q[0] = byte_to_float<0>(a); g1.q[0] = byte_to_float<1>(a);
        g0.q[1] = byte_to_float<2>(a); g1.q[1] = byte_to_float<3>(a);
        g0.q[2] = byte_to_float<0>(b); g1.q[2] = byte_to_float<1>(b);
        g0.q[3] = byte_to_float<2>(b); g1.q[3] = byte_to_float<3>(b);
        const float d = e8m0_to_float_half(r.e);
        g0.a = g1.a = d;
        g0.b = g1.b = -128.0f * d;  // the lookup is biased by +128
    }
};

// ---------------------------------------------------------------- Q8_0
// 8 blocks per step; lane l: elements 4l...4l+3 (block l/8) and 128+4l... (block 4+l/8)
template <> struct Step<QT_Q8_0> {
    static constexpr int kStepBytes = 8 * 34;
    static CUKERN_DEVICE int x0(int lane) { return 4 * lane; }
    static CUKERN_DEVICE int x1(int lane) { return 128 + 4 * lane; }
    struct Raw { uint32_t d0, q0, d1, q1; };
    template <bool TAIL>
    static CUKERN_DEVICE Raw load(const uint8_t* p, int lane, int rem) {
        Raw r{};
        const int t4 = 4 * (lane & 7);
        if (!TAIL || x0(lane) < rem) {
            const uint8_t* blk = p + 34 * (lane >> 3);
            r.d0 = ld_u16(blk);
            r.q0 = ld_u32_a2(blk + 2 + t4);
        }
        if (!TAIL || x1(lane) < rem) {
            const uint8_t* blk = p + 34 * (4 + (lane >> 3));
            r.d1 = ld_u16(blk);
            r.q1 = ld_u32_a2(blk + 2 + t4);
        }
        return r;
    }
    static CUKERN_DEVICE void decode(const Raw& r, int, Group& g0, Group& g1) {
        // int8 -> uint8 by flipping the sign bit; the +128 goes into b
        bytes_to_float4(r.q0 ^ 0x80808080u, g0.q);
        bytes_to_float4(r.q1 ^ 0x80808080u, g1.q);
        g0.a = half_bits_to_float(r.d0);
        g1.a = half_bits_to_float(r.d1);
        g0.b = -128.0f * g0.a;
        g1.b = -128.0f * g1.a;
    }
};

// ---------------------------------------------------------------- Q4_K / Q5_K
// one super-block per step; lane l: group g = l/8, quant bytes 4t...4t+3 (t = l%8) of the
// group's 32: elements 64g+4t... (sub-block 2g, low nibbles) and 64g+32+4t... (2g+1, high).
struct K4Map {
    static CUKERN_DEVICE int x0(int lane) { return 64 * (lane >> 3) + 4 * (lane & 7); }
    static CUKERN_DEVICE int x1(int lane) { return x0(lane) + 32; }
    struct Head { uint32_t dm, s0, s1, s2; };  // d, dmin as half2; the 12 scale bytes
    static CUKERN_DEVICE Head load_head(const uint8_t* p) {  // p: 16-byte aligned
        const uint4 v = ld_stream_u128(p);
        return Head{v.x, v.y, v.z, v.w};
    }
    // Scales and mins of sub-blocks 2g and 2g+1 (see k4_scale_min), both at once: the two
    // bytes of each pair sit side by side in the packed words, so 16-bit masks extract them.
    static CUKERN_DEVICE void scales(const Head& h, int lane, Group& g0, Group& g1) {
        const int g = lane >> 3, sh = 16 * (g & 1);
        const uint32_t a = h.s0 >> sh, b = h.s1 >> sh, c = h.s2 >> sh;
        const uint32_t sc = g < 2 ? a & 0x3F3Fu : (c & 0x0F0Fu) | ((a >> 2) & 0x3030u);
        const uint32_t mn = g < 2 ? b & 0x3F3Fu : ((c >> 4) & 0x0F0Fu) | ((b >> 2) & 0x3030u);
        const float2 dm = __half22float2(*reinterpret_cast<const __half2*>(&h.dm));
        g0.a = dm.x * byte_to_float<0>(sc);
        g1.a = dm.x * byte_to_float<1>(sc);
        g0.b = -dm.y * byte_to_float<0>(mn);
        g1.b = -dm.y * byte_to_float<1>(mn);
    }
};

template <> struct Step<QT_Q4_K> : K4Map {
    static constexpr int kStepBytes = 144;
    struct Raw { Head h; uint32_t qs; };
    template <bool TAIL>
    static CUKERN_DEVICE Raw load(const uint8_t* p, int lane, int) {
        Raw r;
        r.h = load_head(p);
        r.qs = ld_stream_u32(p + 16 + 4 * lane);  // group g bytes 4t: 16 + 32g + 4t = 16 + 4l
        return r;
    }
    static CUKERN_DEVICE void decode(const Raw& r, int lane, Group& g0, Group& g1) {
        scales(r.h, lane, g0, g1);
        bytes_to_float4(r.qs & 0x0F0F0F0Fu, g0.q);
        bytes_to_float4((r.qs >> 4) & 0x0F0F0F0Fu, g1.q);
    }
};

template <> struct Step<QT_Q5_K> : K4Map {
    static constexpr int kStepBytes = 176;
    struct Raw { Head h; uint32_t qh, qs; };
    template <bool TAIL>
    static CUKERN_DEVICE Raw load(const uint8_t* p, int lane, int) {
        Raw r;
        r.h = load_head(p);
        r.qh = ld_stream_u32(p + 16 + 4 * (lane & 7));  // qh bytes 4t...4t+3
        r.qs = ld_stream_u32(p + 48 + 4 * lane);
        return r;
    }
    static CUKERN_DEVICE void decode(const Raw& r, int lane, Group& g0, Group& g1) {
        const int g = lane >> 3;
        scales(r.h, lane, g0, g1);
        bytes_to_float4((r.qs & 0x0F0F0F0Fu) | (((r.qh >> (2 * g)) & 0x01010101u) << 4), g0.q);
        bytes_to_float4(((r.qs >> 4) & 0x0F0F0F0Fu) | (((r.qh >> (2 * g + 1)) & 0x01010101u) << 4), g1.q);
    }
};

// ---------------------------------------------------------------- Q6_K
// one super-block per step; lane l: half h = l/16, ql bytes 64h+4u...+3 (u = l%16): elements
// 128h+4u... (low nibbles) and 128h+64+4u... (high nibbles)
template <> struct Step<QT_Q6_K> {
    static constexpr int kStepBytes = 210;
    static CUKERN_DEVICE int x0(int lane) { return 128 * (lane >> 4) + 4 * (lane & 15); }
    static CUKERN_DEVICE int x1(int lane) { return x0(lane) + 64; }
    struct Raw { uint32_t ql, qh, sc0, sc1, d; };
    template <bool TAIL>
    static CUKERN_DEVICE Raw load(const uint8_t* p, int lane, int) {
        const int h = lane >> 4, u = lane & 15;
        Raw r;
        r.ql = ld_u32_a2(p + 64 * h + 4 * u);
        r.qh = ld_u32_a2(p + 128 + 32 * h + 4 * (u & 7));  // qh bytes (4u)%32 ...
        r.sc0 = ld_u8(p + 192 + 8 * h + (u >> 2));     // scale of element 128h + 4u
        r.sc1 = ld_u8(p + 192 + 8 * h + 4 + (u >> 2)); // scale of element 128h + 64 + 4u
        r.d = ld_u16(p + 208);
        return r;
    }
    static CUKERN_DEVICE void decode(const Raw& r, int lane, Group& g0, Group& g1) {
        const int s0 = 2 * ((lane & 15) >> 3);  // bit pair of the low group: 2 * ((4u) / 32)
        bytes_to_float4((r.ql & 0x0F0F0F0Fu) | (((r.qh >> s0) & 0x03030303u) << 4), g0.q);
        bytes_to_float4(((r.ql >> 4) & 0x0F0F0F0Fu) | (((r.qh >> (s0 + 4)) & 0x03030303u) << 4), g1.q);
        const float d = half_bits_to_float(r.d);
        g0.a = d * (float)(int8_t)r.sc0;
        g1.a = d * (float)(int8_t)r.sc1;
        g0.b = -32.0f * g0.a;
        g1.b = -32.0f * g1.a;
    }
};

}  // namespace qmv
}  // namespace cukern
