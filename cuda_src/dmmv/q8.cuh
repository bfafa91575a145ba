// The int8 matvec path of the quantized types (Q4_0, Q5_0, Q8_0, MXFP4, Q4_K, Q5_K, Q6_K):
// x is quantized once per thread block to Q8_1-style int8 blocks in shared memory, and every
// 32-weight unit of a row is an integer dot product of four-weight words (__dp4a), scaled once
// per unit. Per weight that is about 1/4 of a dp4a plus the unpacking of its bits, where the f32
// path (core.cuh) needs a conversion and an FMA per weight; the f32 path was instruction-bound.
//
// Accuracy: the kernel computes W . x^ exactly up to f32 rounding, where x^ is x rounded per
// 32 elements to d * q, d = max|x| * f32(1/127), q = x * (1/d) rounded once to the nearest
// integer (ties to even) in [-127, 127]; cukern.reference.dmmv.quantize_q8 emulates x^ bit for
// bit. Against the exact x the normalised error of y is about 3e-5 for Gaussian x (the tests
// bound it).
//
// Work: a block owns a contiguous range of rows; its warps take equal shares of those rows' items
// (row, chunk of 32 * LU units), so a row may be split between warps (its parts are summed after
// the block's last barrier, in warp order). Weights reach shared memory by Hopper bulk copies (one
// cp.async.bulk per item by lane 0, completing on an mbarrier) or 16-byte cp.async by all lanes:
// each warp streams its share through a ring of ST slots, ST - 1 items in flight, across row
// boundaries. A slot holds the 16-byte-aligned window around the item's bytes, so any block
// alignment works (rows of Q4_0 blocks are only 2-byte aligned, MXFP4 1-byte): units are read from
// the slot at their byte offset, unaligned words by funnel shifts. Lane l computes units l, l + 32,
// ... of the item; its x comes from two planes (XView) so that a warp's loads are contiguous.
#pragma once

#include "common/mbarrier.cuh"
#include "common/mma.cuh"
#include "common/q8_1.cuh"
#include "common/quants.cuh"
#include "common/reduce.cuh"

namespace cukern {
namespace q8 {

constexpr int kMaxWarps = 32;  // warps per block: the host picks up to 32 (one block per SM)
constexpr int kUnitElems = 32;

// Per 32-element block of quantized x: the scale and the integer sums of its two halves.
struct alignas(8) XInfo {  // (8-aligned: one 8-byte shared-memory load)
    float d;     // max|x| / 127 (0 for an all-zero block)
    short s0;    // sum of q over elements 0...15
    short s1;    // sum of q over elements 16...31
};
static_assert(sizeof(XInfo) == 8, "XInfo");

// ------------------------------------------------------------------------------------- helpers
CUKERN_DEVICE float half_bits(uint32_t h) { return __half2float(__ushort_as_half((unsigned short)h)); }

// A shared-memory pointer's misalignment to 4 bytes.
CUKERN_DEVICE uint32_t misalign4(const uint8_t* p) { return (uint32_t)reinterpret_cast<size_t>(p) & 3u; }

// N little-endian words from shared memory at any byte alignment (reads N + 1 aligned words);
// mis: misalign4(p), which the caller may know for many p at once (a lane's units are a multiple
// of 4 bytes apart: one computation per warp iteration instead of one per unit).
template <int N>
CUKERN_DEVICE void lds_words(const uint8_t* p, uint32_t mis, uint32_t (&w)[N]) {
    // aligned by pointer arithmetic, not through an integer: the compiler then still knows p is
    // shared memory and emits LDS (an integer round trip made these generic loads)
    const uint32_t* b = reinterpret_cast<const uint32_t*>(p - mis);
    const uint32_t sh = 8u * mis;
    uint32_t prev = b[0];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const uint32_t next = b[i + 1];
        w[i] = __funnelshift_r(prev, next, sh);
        prev = next;
    }
}

// 32 bytes from 16-byte-aligned shared memory.
CUKERN_DEVICE void lds_32b(const uint8_t* p, uint32_t (&w)[8]) {
    const uint4 a = reinterpret_cast<const uint4*>(p)[0], b = reinterpret_cast<const uint4*>(p)[1];
    w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
    w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
}

CUKERN_DEVICE uint32_t spread_bits4_q8(uint32_t t) { return ((t & 15u) * 0x00204081u) & 0x01010101u; }

CUKERN_DEVICE uint32_t prmt_s(uint32_t a, uint32_t b, uint32_t sel) {  // prmt with sign-replicate mode
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// MXFP4: magnitudes of the four codes in the nibbles of sel's low 16 bits (doubled E2M1: 0, 1,
// 2, 3, 4, 6, 8, 12), as four int8 -- of the positive codes only: a code with its sign bit (bit 3)
// set selects prmt's sign-replicate mode, and every magnitude's sign is 0. With sel ^ 0x8888 the
// same lookup gives the magnitudes of the negative codes only. w . x = pos . x - neg . x.
// lo: the low table word 0x03020100, which the caller keeps in a register (XView::e2m1_lo: as a
// constant the compiler moved it into a register again before every prmt).
CUKERN_DEVICE uint32_t mxfp4_pos4(uint32_t lo, uint32_t sel) { return prmt_s(lo, 0x0C080604u, sel); }
CUKERN_DEVICE uint32_t mxfp4_neg4(uint32_t lo, uint32_t sel) { return prmt_s(lo, 0x0C080604u, sel ^ 0x8888u); }

// The 32 int8 of x for one unit of column c, and its XInfo.
struct XCol {
    const int8_t* q;    // [k] quantized x of this column
    const XInfo* info;  // [k / 32]
};

// A column's int8 x is kept in two planes of k/2 bytes: bytes 0...15 of every unit of 32, then
// bytes 16...31 (xq_offset), so that the 16-byte loads of a warp's 32 consecutive units are
// contiguous (no bank conflicts; a unit-major layout spaced them 32 bytes apart, two-way).
CUKERN_DEVICE uint32_t xq_offset(uint32_t k, uint32_t byte) {  // byte: of the column, element order
    return byte / 32 * 16 + (byte & 16 ? k / 2 : 0) + (byte & 15);
}

template <int NC>
struct XView {
    const int8_t* q;    // [NC][k] in planes (xq_offset)
    const XInfo* info;  // [NC][k / 32]
    uint32_t k;
    uint32_t e2m1_lo;   // 0x03020100: mxfp4_pos4's low table word in a register
    CUKERN_DEVICE XView(const int8_t* q_, const XInfo* info_, uint32_t k_) : q(q_), info(info_), k(k_) {
        // or-ed with threadIdx.y (0: blocks are 1-D), which the compiler cannot fold: as a known
        // constant it is copied into a register again before every prmt
        e2m1_lo = 0x03020100u | threadIdx.y;
    }
    // The view whose unit u is this one's unit u0 + u (a warp iteration's lane-relative view: its
    // units' addresses are then one base register plus immediate offsets).
    CUKERN_DEVICE XView at(uint32_t u0) const {
        XView v = *this;
        v.q += 16 * (size_t)u0;
        v.info += u0;
        return v;
    }
    CUKERN_DEVICE void unit(int c, uint32_t u, uint32_t (&v)[8], XInfo& xi) const {
        const int8_t* col = q + (size_t)c * k;
        const uint4 a = reinterpret_cast<const uint4*>(col)[u], b = reinterpret_cast<const uint4*>(col + k / 2)[u];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        const uint2 r = reinterpret_cast<const uint2*>(info)[(size_t)c * (k / 32) + u];  // one 8-byte load
        xi.d = __uint_as_float(r.x);
        xi.s0 = (short)(r.y & 0xFFFFu);
        xi.s1 = (short)(r.y >> 16);
    }
};

CUKERN_DEVICE int dot8(const uint32_t (&w)[8], const uint32_t (&x)[8], int from, int to, int s) {
#pragma unroll
    for (int i = from; i < to; ++i) s = __dp4a((int)w[i], (int)x[i], s);
    return s;
}

// As dot8 over all 8 words with w's bytes unsigned (0...255).
CUKERN_DEVICE int dot8_u(const uint32_t (&w)[8], const uint32_t (&x)[8]) {
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(s) : "r"(w[i]), "r"(x[i]));
    return s;
}

// Whether a type keeps x interleaved per 32-element block (byte 2j: element j, byte 2j+1: element
// 16+j, for j < 16: the order of the nibbles in the block's bytes) rather than in element order.
template <int QT>
CUKERN_DEVICE constexpr bool x_interleaved() { return QT == QT_MXFP4; }

// ------------------------------------------------------------------------------------- units
// Unit<QT>::dot<NC>(blk, mis, s, u, x, acc): acc[c] += (unit s of the block at blk) . x^[c] for
// the unit's 32 weights (unit u of the row). blk: the block's first byte in shared memory, mis:
// misalign4(blk).
//   kBlockUnits: units per GGUF block; kBlockBytes: its size.
//   kHoist: whole one-column iterations address a lane's units from one base computed once (fewer
//     instructions per unit); measured (H100, pdl) it gains MXFP4 1.3 points of copy
//     bandwidth at 4096x14336 and loses the other types 0-3, so only MXFP4 takes it.
template <int QT> struct Unit;

template <> struct Unit<QT_Q4_0> {  // w = d * (q - 8), q = nibble
    static constexpr int kBlockUnits = 1, kBlockBytes = 18;
    static constexpr bool kHoist = false;
    template <int NC>
    static CUKERN_DEVICE void dot(const uint8_t* b, uint32_t mis, int, uint32_t u, const XView<NC>& x, float (&acc)[NC]) {
        uint32_t q[4], w[8];
        lds_words<4>(b + 2, (mis + 2) & 3u, q);
        const float d = half_bits(*reinterpret_cast<const unsigned short*>(b));
#pragma unroll
        for (int i = 0; i < 4; ++i) { w[i] = q[i] & 0x0F0F0F0Fu; w[4 + i] = (q[i] >> 4) & 0x0F0F0F0Fu; }
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            uint32_t xv[8]; XInfo xi;
            x.unit(c, u, xv, xi);
            acc[c] += xi.d * d * (float)(dot8(w, xv, 0, 8, 0) - 8 * (xi.s0 + xi.s1));
        }
    }
};

template <> struct Unit<QT_Q5_0> {  // w = d * (q - 16), q = nibble | bit j of qh << 4
    static constexpr int kBlockUnits = 1, kBlockBytes = 22;
    static constexpr bool kHoist = false;
    template <int NC>
    static CUKERN_DEVICE void dot(const uint8_t* b, uint32_t mis, int, uint32_t u, const XView<NC>& x, float (&acc)[NC]) {
        uint32_t q[4], qh[1], w[8];
        lds_words<1>(b + 2, (mis + 2) & 3u, qh);
        lds_words<4>(b + 6, (mis + 2) & 3u, q);
        const float d = half_bits(*reinterpret_cast<const unsigned short*>(b));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[i] = (q[i] & 0x0F0F0F0Fu) | (spread_bits4_q8(qh[0] >> (4 * i)) << 4);
            w[4 + i] = ((q[i] >> 4) & 0x0F0F0F0Fu) | (spread_bits4_q8(qh[0] >> (16 + 4 * i)) << 4);
        }
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            uint32_t xv[8]; XInfo xi;
            x.unit(c, u, xv, xi);
            acc[c] += xi.d * d * (float)(dot8(w, xv, 0, 8, 0) - 16 * (xi.s0 + xi.s1));
        }
    }
};

template <> struct Unit<QT_Q8_0> {  // w = d * q, q int8
    static constexpr int kBlockUnits = 1, kBlockBytes = 34;
    static constexpr bool kHoist = false;
    template <int NC>
    static CUKERN_DEVICE void dot(const uint8_t* b, uint32_t mis, int, uint32_t u, const XView<NC>& x, float (&acc)[NC]) {
        uint32_t w[8];
        lds_words<8>(b + 2, (mis + 2) & 3u, w);
        const float d = half_bits(*reinterpret_cast<const unsigned short*>(b));
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            uint32_t xv[8]; XInfo xi;
            x.unit(c, u, xv, xi);
            acc[c] += xi.d * d * (float)dot8(w, xv, 0, 8, 0);
        }
    }
};

template <> struct Unit<QT_MXFP4> {  // w = 2^(e-127) * e2m1(code) = 2^(e-128) * doubled code
    static constexpr int kBlockUnits = 1, kBlockBytes = 17;
    static constexpr bool kHoist = true;
    template <int NC>
    static CUKERN_DEVICE void dot(const uint8_t* b, uint32_t mis, int, uint32_t u, const XView<NC>& x, float (&acc)[NC]) {
        uint32_t q[4], e;
        if constexpr (NC == 1) {
            // the block's 17 bytes from the 5 aligned words around it: e is byte mis of the first, the
            // quant words start at byte mis + 1 (the next word when mis = 3: funnel shifts clamped at 32);
            // one shared load fewer than a separate byte load of e (H100, pdl: 14336x4096 84.5 -> 86.2% of
            // copy, 4096x14336 unchanged); with more columns it spills
            const uint32_t* a = reinterpret_cast<const uint32_t*>(b - mis);
            uint32_t wd[5];
#pragma unroll
            for (int i = 0; i < 5; ++i) wd[i] = a[i];
#pragma unroll
            for (int i = 0; i < 4; ++i) q[i] = __funnelshift_rc(wd[i], wd[i + 1], 8u * mis + 8u);
            e = __byte_perm(wd[0], 0, 0x4440u | mis);
        } else {
            lds_words<4>(b + 1, (mis + 1) & 3u, q);
            e = b[0];
        }
        // 2^(e - 128): e8m0_to_float_half without its denormals (e < 2), which the kernels' FTZ
        // arithmetic flushes to zero in the first product anyway (two instructions instead of five)
        const float d = __uint_as_float((max(e, 1u) - 1u) << 23);
        // the nibbles of bytes 4i, 4i+1 (then 4i+2, 4i+3) in order are elements 4i, 16+4i, 4i+1, 17+4i
        // (then 4i+2, ...), which is where the interleaved x keeps them: x word 2i (2i+1)
        const uint32_t lo = x.e2m1_lo;
        auto dot = [&](const uint32_t (&xv)[8]) {
            int sp = 0, sn = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                sp = __dp4a((int)mxfp4_pos4(lo, q[i]), (int)xv[2 * i], sp);
                sn = __dp4a((int)mxfp4_neg4(lo, q[i]), (int)xv[2 * i], sn);
                sp = __dp4a((int)mxfp4_pos4(lo, q[i] >> 16), (int)xv[2 * i + 1], sp);
                sn = __dp4a((int)mxfp4_neg4(lo, q[i] >> 16), (int)xv[2 * i + 1], sn);
            }
            return sp - sn;
        };
#pragma unroll
        for (int c = 0; c < NC; ++c) {  // (the lookups are redone per column: kept, they would spill at NC = 8)
            uint32_t xv[8]; XInfo xi;
            x.unit(c, u, xv, xi);
            acc[c] += xi.d * d * (float)dot(xv);
        }
    }
};

// Q4_K / Q5_K: unit s = sub-block s (elements 32s...32s+31) of the 256-element super-block:
// qs bytes 32(s/2)...+31, low nibbles for even s, high for odd; w = d*sc*q - dmin*m.
// Q4_K masks the nibbles in place: an odd sub-block's bytes are then 16 q, dotted as unsigned
// bytes, and 1/16 goes into its scale (no shifts). Q5_K adds bit s of each qh byte as bit 4.
template <int QT>
struct UnitK45 {
    static constexpr bool k5 = QT == QT_Q5_K;
    static constexpr int kBlockUnits = 8, kBlockBytes = k5 ? 176 : 144;
    static constexpr bool kHoist = false;
    template <int NC>
    static CUKERN_DEVICE void dot(const uint8_t* b, uint32_t mis, int s, uint32_t u, const XView<NC>& x, float (&acc)[NC]) {
        const uint4 h = *reinterpret_cast<const uint4*>(b);  // d, dmin | 12 scale bytes
        // the 6-bit scales and mins of sub-blocks 4 (s / 4) ... + 3, one per byte (k4_scale_min for
        // four at once, selected rather than branched: the lanes of a warp hold both halves)
        const bool hi = s >= 4;
        const uint32_t sc4 = hi ? (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u) : h.y & 0x3F3F3F3Fu;
        const uint32_t m4 = hi ? ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u) : h.z & 0x3F3F3F3Fu;
        const int sb = 8 * (s & 3);
        const float2 dm = __half22float2(*reinterpret_cast<const __half2*>(&h.x));
        const float bm = dm.y * (float)((m4 >> sb) & 0xFF);
        float a = dm.x * (float)((sc4 >> sb) & 0xFF);
        uint32_t w[8];
        lds_32b(b + (k5 ? 48 : 16) + 32 * (s >> 1), w);
        if (k5) {
            uint32_t qh[8];
            lds_32b(b + 16, qh);
            const int sh = 4 * (s & 1), r = (s - 4) & 31;  // rotating qh right by s - 4 puts bit s of each byte at bit 4
#pragma unroll
            for (int i = 0; i < 8; ++i)
                w[i] = ((w[i] >> sh) & 0x0F0F0F0Fu) | (__funnelshift_r(qh[i], qh[i], r) & 0x10101010u);
        } else {
            const uint32_t mask = s & 1 ? 0xF0F0F0F0u : 0x0F0F0F0Fu;
            a *= s & 1 ? 0.0625f : 1.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) w[i] &= mask;
        }
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            uint32_t xv[8]; XInfo xi;
            x.unit(c, u, xv, xi);
            const int v = k5 ? dot8(w, xv, 0, 8, 0) : dot8_u(w, xv);
            acc[c] += xi.d * (a * (float)v - bm * (float)(xi.s0 + xi.s1));
        }
    }
};
template <> struct Unit<QT_Q4_K> : UnitK45<QT_Q4_K> {};
template <> struct Unit<QT_Q5_K> : UnitK45<QT_Q5_K> {};

// Q6_K: unit s (elements 32s...32s+31), half h = s/4, c = s%4: ql bytes 64h + 32(c&1)...,
// nibble c/2; qh bytes 32h..., bits 2c, 2c+1; scales[2s] for elements 0...15, [2s+1] for 16...31.
template <> struct Unit<QT_Q6_K> {
    static constexpr int kBlockUnits = 8, kBlockBytes = 210;
    static constexpr bool kHoist = false;
    template <int NC>
    static CUKERN_DEVICE void dot(const uint8_t* b, uint32_t mis, int s, uint32_t u, const XView<NC>& x, float (&acc)[NC]) {
        const int h = s >> 2, c4 = s & 3;
        uint32_t w[8], qh[8];
        lds_words<8>(b + 64 * h + 32 * (c4 & 1), mis, w);
        lds_words<8>(b + 128 + 32 * h, mis, qh);
        const int nsh = 4 * (c4 >> 1), hsh = 2 * c4;
#pragma unroll
        for (int i = 0; i < 8; ++i)  // rotating qh right by hsh - 4 puts bits hsh, hsh+1 of each byte at bits 4, 5
            w[i] = ((w[i] >> nsh) & 0x0F0F0F0Fu) | (__funnelshift_r(qh[i], qh[i], (hsh - 4) & 31) & 0x30303030u);
        const int sc0 = (int8_t)b[192 + 2 * s], sc1 = (int8_t)b[193 + 2 * s];
        const float d = half_bits(*reinterpret_cast<const unsigned short*>(b + 208));
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            uint32_t xv[8]; XInfo xi;
            x.unit(c, u, xv, xi);
            const int v = sc0 * (dot8(w, xv, 0, 4, 0) - 32 * xi.s0) + sc1 * (dot8(w, xv, 4, 8, 0) - 32 * xi.s1);
            acc[c] += xi.d * d * (float)v;
        }
    }
};

// The streaming shape: LU units per lane and iteration, ST ring slots per warp. Bytes of one warp
// iteration, and of one ring slot (the iteration's bytes, up to 15 leading bytes of its 16-byte
// window, and room for the one-word over-read of lds_words).
template <int QT, int LU, int ST>
struct Stream {
    static constexpr int kUnits = 32 * LU;  // units per iteration
    static constexpr int kIterBytes = kUnits / Unit<QT>::kBlockUnits * Unit<QT>::kBlockBytes;
    static constexpr int kSlotBytes = (kIterBytes + 32 + 15) / 16 * 16;
    static constexpr int kRingBytes = ST * kSlotBytes;  // per warp
    static_assert(32 % Unit<QT>::kBlockUnits == 0, "a lane's units start on block boundaries every 32 units");
    static_assert(32 / Unit<QT>::kBlockUnits * Unit<QT>::kBlockBytes % 4 == 0,
                  "a lane's units of one iteration share their misalignment (block_rows_x's whole iterations)");
};

// Dynamic shared memory of a block of nw warps: a header (ST mbarriers per warp, then the
// warps' partial row sums [2][nw][nc]), the warps' rings, then nc columns of int8 x and their
// XInfo (cukern/dmmv/q8.py _q8_smem mirrors this; tests/test_dmmv.py checks the two agree).
CUKERN_DEVICE constexpr uint32_t header_bytes(int nw, int st, int nc) {
    return (uint32_t)(nw * st * 8 + 2 * nw * nc * 4 + 15) / 16 * 16;
}
template <int QT, int LU, int ST>
CUKERN_DEVICE constexpr uint32_t smem_bytes(int nw, int nc, uint32_t k) {
    return header_bytes(nw, ST, nc) + nw * Stream<QT, LU, ST>::kRingBytes +
           nc * (k + k / 32 * (uint32_t)sizeof(XInfo));
}

// The block's shared memory carved up.
template <int QT, int LU, int ST, int NC>
struct Smem {
    uint64_t* bars;  // [nw][ST] mbarriers of the bulk copies
    float* part;     // [2][nw][NC] partial sums of the rows a warp shares with its neighbours
    uint8_t* rings;  // [nw] rings of ST slots
    int8_t* xq;      // [NC][k]
    XInfo* xi;       // [NC][k / 32]
    int nw;
    CUKERN_DEVICE Smem(uint8_t* smem, int nw_, uint32_t k) : nw(nw_) {
        bars = reinterpret_cast<uint64_t*>(smem);
        part = reinterpret_cast<float*>(smem + nw * ST * 8);
        rings = smem + header_bytes(nw, ST, NC);
        xq = reinterpret_cast<int8_t*>(rings + nw * Stream<QT, LU, ST>::kRingBytes);
        xi = reinterpret_cast<XInfo*>(xq + NC * k);
    }
    CUKERN_DEVICE uint8_t* ring(int warp) const { return rings + warp * Stream<QT, LU, ST>::kRingBytes; }
    CUKERN_DEVICE float* first(int warp) const { return part + warp * NC; }         // sums of its first row
    CUKERN_DEVICE float* last(int warp) const { return part + (nw + warp) * NC; }   // sums of its last row
};

CUKERN_DEVICE uint32_t dynamic_smem_bytes() {
    uint32_t r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// ------------------------------------------------------------------------------------- x
// The int8 of x * inv rounded once to the nearest integer, ties to even (|x * inv| <= 127.5), in
// the low byte: the FMA with 1.5 * 2^23 leaves the integer in the low mantissa bits. One FMA on
// the full-rate pipe where a float-to-int conversion takes the quarter-rate one: at k = 14336 the
// conversions alone held that pipe ~900 cycles per SM while x was quantized.
CUKERN_DEVICE uint32_t q8_round_bits(float x, float inv) { return __float_as_uint(fmaf(x, inv, 12582912.0f)); }

// The four values of v rounded (q8_round_bits) and packed as int8, v.x in the low byte.
CUKERN_DEVICE uint32_t q8_quantize4(float4 v, float inv) {
    return pack_low_bytes4(q8_round_bits(v.x, inv), q8_round_bits(v.y, inv), q8_round_bits(v.z, inv),
                           q8_round_bits(v.w, inv));
}

// 1/d correctly rounded for a normal d below 2^126: __frcp_rn's fast path (one approximation and
// one Newton step) without its range check and slow-path branch, which such a d never takes.
CUKERN_DEVICE float rcp_normal(float d) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
    return fmaf(r, fmaf(-d, r, 1.0f), r);
}

// Quantize float4s [g_begin, g_end) of a column of k floats (k % 32 == 0; g_begin and g_end
// multiples of 8: whole blocks of 32, g_end <= k / 4) into q / info; load(g) returns its float4 g
// (x's, or an activation computed from two inputs: quantize_glu in dmmv.cu). All threads of the
// block take part (blockDim.x a multiple of 32); the caller syncs afterwards.
// Four lanes per block of 32 (lane j of the four: elements 8j...8j+7, two float4s), so a warp
// quantizes 8 blocks per round and a thread's two rounds' four loads are in flight together.
// The block's max|x| takes two shuffles, its scale a multiplication and a reciprocal (every lane:
// a SIMT warp pays for one per round whichever lanes compute it), each value an FMA
// (q8_round_bits), its half sums two shuffles (SUMS; without, XInfo's sums are 0: for types whose
// dot products never read them, x_sums).
// At k = 14336 on 32 warps that is ~160 instructions per warp (SASS, one iteration, MXFP4); the
// 8-lanes-per-block layout with a division per block and a conversion per value took ~500, a
// quarter of the int8 matvec's instructions there (ncu source counters), all of them on the
// critical path between pdl_wait and the first dot product.
// IL: q interleaved per block (x_interleaved), else in element order.
template <bool IL, bool SUMS, class Load>
CUKERN_DEVICE void quantize_x_range(Load load, uint32_t k, uint32_t g_begin, uint32_t g_end, int8_t* q,
                                    XInfo* info) {
    constexpr int R = 2;                                          // rounds per iteration
    const uint32_t p_end = g_end / 2;                             // float4 pairs
    const int lane = threadIdx.x % 32, j = lane & 3;
    // where lane j's bytes of block b go: qj + 16 b (xq_offset of byte 32 b + 16 j, IL, or 32 b + 8 j)
    int8_t* const qj = q + (IL ? (size_t)(j & 1) * (k / 2) : (size_t)(j >> 1) * (k / 2) + 8 * (j & 1));
    for (uint32_t p0 = g_begin / 2 + threadIdx.x - lane; p0 < p_end; p0 += R * blockDim.x) {  // warp-uniform
        float4 v[R][2];
#pragma unroll
        for (int r = 0; r < R; ++r) {  // all loads first
            const uint32_t pr = p0 + r * blockDim.x + lane;
            const bool ok = pr < p_end;
            v[r][0] = ok ? load(2 * pr) : make_float4(0.f, 0.f, 0.f, 0.f);
            v[r][1] = ok ? load(2 * pr + 1) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (p0 + r * blockDim.x >= p_end) break;  // the warp's round is empty (warp-uniform)
            const uint32_t pr = p0 + r * blockDim.x + lane, blk = pr / 4;  // (groups of four lanes are
            const bool ok = pr < p_end;                                    // wholly in or out)
            const float4 a = v[r][0], b = v[r][1];
            float am = fmaxf(fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(a.z), fabsf(a.w))),
                             fmaxf(fmaxf(fabsf(b.x), fabsf(b.y)), fmaxf(fabsf(b.z), fabsf(b.w))));
            am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
            am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 2));
            // d < 2^121 for any finite x; flushed to 0 below 2^-126 (then inv and q are 0 too)
            const float d = am * (1.0f / 127.0f);
            const float inv = d > 0.0f ? rcp_normal(d) : 0.0f;
            const uint32_t w0 = q8_quantize4(a, inv), w1 = q8_quantize4(b, inv);
            int s = 0, other = 0;
            if (SUMS) {
                s = __dp4a((int)w0, 0x01010101, __dp4a((int)w1, 0x01010101, 0));
                s += __shfl_xor_sync(0xffffffffu, s, 1);            // half sum: lanes 0, 1 (0...15) or 2, 3
                other = __shfl_xor_sync(0xffffffffu, s, 2);
            }
            if (IL) {  // lanes 0 (1) and 2 (3) hold elements i and 16 + i of the block's first (last) 16 bytes
                const uint32_t u0 = __shfl_xor_sync(0xffffffffu, w0, 2), u1 = __shfl_xor_sync(0xffffffffu, w1, 2);
                if (ok && j < 2)
                    *reinterpret_cast<uint4*>(qj + 16 * (size_t)blk) =
                        make_uint4(__byte_perm(w0, u0, 0x5140), __byte_perm(w0, u0, 0x7362),
                                   __byte_perm(w1, u1, 0x5140), __byte_perm(w1, u1, 0x7362));
            } else if (ok) {
                *reinterpret_cast<uint2*>(qj + 16 * (size_t)blk) = make_uint2(w0, w1);
            }
            if (ok && j == 0) info[blk] = XInfo{d, (short)s, (short)other};
        }
    }
}

// Whether a type's dot products read XInfo's half sums (Q4_0, Q5_0, the K-quants: their offsets
// and minimums), or only d (Q8_0, MXFP4).
template <int QT>
CUKERN_DEVICE constexpr bool x_sums() { return QT != QT_Q8_0 && QT != QT_MXFP4; }

// The whole column x (quantize_x_range over all of it), for a matvec of type QT.
template <int QT>
CUKERN_DEVICE void quantize_x(const float* __restrict__ x, uint32_t k, int8_t* q, XInfo* info) {
    quantize_x_range<x_interleaved<QT>(), x_sums<QT>()>(
        [x](uint32_t g) { return __ldg(reinterpret_cast<const float4*>(x) + g); }, k, 0, k / 4, q, info);
}

// ------------------------------------------------------------------------------------- x, pre-quantized
// A column of x quantized ahead of the matvecs (cukern.dmmv.QuantizedX; the quantize_x kernel of
// dmmv.cu writes it) is the shared-memory image of quantize_x: k bytes of q in planes
// (xq_offset; interleaved per block for x_interleaved types), then k / 32 XInfo, the column padded
// to x_col_bytes(k) (cukern/dmmv.py _q8x_col_bytes mirrors it; quantize_x traps on a shorter
// stride). One quantization then serves every matvec that shares x (q, k and v; gate and up), and
// each block copies 1.25 bytes per element after pdl_wait instead of quantizing 4.
CUKERN_DEVICE constexpr uint32_t x_col_bytes(uint32_t k) { return (k + k / 4 + 15) / 16 * 16; }

// Copy one pre-quantized column (16-byte aligned) into q / info; all threads of the block take
// part; the caller syncs afterwards. Each thread issues its three loads of a unit (the unit's two
// q halves and its XInfo) before storing them. The loads bypass L1 (ld.global.cg): the column is
// rewritten between matvecs (quantize_x of the next input) that may share an SM under pdl, and a
// block reads it once.
CUKERN_DEVICE void load_x(const uint8_t* __restrict__ col, uint32_t k, int8_t* q, XInfo* info) {
    const uint32_t units = k / 32;
    const uint4* lo = reinterpret_cast<const uint4*>(col);           // plane 0: bytes 0...15 of each unit
    const uint4* hi = reinterpret_cast<const uint4*>(col + k / 2);   // plane 1: bytes 16...31
    const uint2* xi = reinterpret_cast<const uint2*>(col + k);       // XInfo as 8 bytes
    for (uint32_t u = threadIdx.x; u < units; u += blockDim.x) {
        const uint4 a = __ldcg(lo + u), b = __ldcg(hi + u);
        const uint2 c = __ldcg(xi + u);
        reinterpret_cast<uint4*>(q)[u] = a;
        reinterpret_cast<uint4*>(q + k / 2)[u] = b;
        reinterpret_cast<uint2*>(info)[u] = c;
    }
}

// ------------------------------------------------------------------------------------- rows
// The block's work: n_rows rows (local 0 ... n_rows-1), each cut into ipr items (row, chunk) of
// 32 * LU units (the row's last chunk may be shorter), items numbered row-major. Warp w of nw takes
// a contiguous share of the items, equal to one item (items / nw, the first items % nw warps one
// more), rows split wherever the shares fall (a whole-row split left up to a row per warp of tail).
struct Share {
    uint32_t begin, end;  // items [begin, end): items / nw each, the first items % nw warps one more
    CUKERN_DEVICE Share(uint32_t items, int w, int nw) {
        const uint32_t q = items / nw, r = items % nw;
        begin = q * w + min((uint32_t)w, r);
        end = begin + q + ((uint32_t)w < r ? 1 : 0);
    }
};

// Streams the block's rows (row_ptr(j): first byte of local row j in global memory) and calls
// store(j, sums) exactly once per row with its NC dot products: for a row inside one warp's share
// from lane 0 of that warp as soon as it is done, for a row split between warps from thread w of
// warp 0 after the block's last barrier (w: the warp holding the row's first item), summing the
// parts in warp order (deterministic). Each warp streams its share through its ring of ST slots,
// ST - 1 iterations in flight, across row boundaries; BULK: one cp.async.bulk per iteration by
// lane 0 completing on the slot's mbarrier, else 16-byte cp.async by all lanes.
// Start-up: every warp's first ST - 1 copies are issued, then wait() (all threads: the wait for
// the kernel this one depends on), then prepare() (all threads: it quantizes x and syncs the
// block); the ring's last slot is filled only after that (issued before prepare(), a probe
// measured 3-5 points of copy bandwidth lost, presumably its bytes delaying x's). end(j): the end
// of the weight matrix that holds local row j (copies stop there: reading past a row end inside the
// matrix is harmless, past the matrix it may leave the allocation); rows may come from several
// matrices (dmmv_q8_two interleaves the gate and up rows of dmmv_glu).
// EF (with BULK): the weight bulk copies carry an L2 evict-first policy (each byte is read once per
// launch), so that they do not push out of L2 what is read again: x (by every block, right after the
// wait) and y. The dense matvecs of dmmv.cu take it (H100, pdl, two runs in opposite orders: MXFP4
// 4096x14336 79.0 / 80.8 -> 80.6 / 82.0% of copy, 14336x4096 84.9 / 86.9 -> 87.5 / 88.9, Q4_K and
// Q5_K +0.8 to +1.8 points); the MoE kernels, whose token batches may read an expert twice, do not.
// Not the cp.async path: its copies run in a divergent loop over the item's pieces, and there the
// hinted form (cp_async16_policy) stopped with an illegal instruction (compute-sanitizer, H100).
// With EF and BULK, lane 0 also asks L2 for the warp's next l2_items items before wait() (dmmv_q8:
// DmmvParams::l2_items, which DmmvDispatch sets for MXFP4 at long k; more slack for the weight stream
// while x is quantized after the wait).
// x_of(j): the quantized x that local row j is dotted with (block_rows_x; block_rows: the block's
// NC columns, sm.xq / sm.xi, for every row; moe_down_q8 gives each slot's rows that slot's x).
template <int QT, int NC, int LU, int ST, bool BULK, bool EF = false, class RowPtr, class End, class XOf, class Wait,
          class Prepare, class Store>
CUKERN_DEVICE void block_rows_x(const Smem<QT, LU, ST, NC>& sm, uint32_t n_rows, RowPtr row_ptr, uint32_t row_bytes,
                                End end_of, XOf x_of, uint32_t k, Wait wait, Prepare prepare, Store store,
                                uint32_t l2_items = 0) {
    using U = Unit<QT>;
    using S = Stream<QT, LU, ST>;
    constexpr int BI = S::kIterBytes, SLOT = S::kSlotBytes, kIterUnits = S::kUnits;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    uint8_t* ring = sm.ring(warp);
    uint64_t* bars = sm.bars + warp * ST;
    const uint32_t units = k / kUnitElems;
    const uint32_t ipr = (units + kIterUnits - 1) / kIterUnits;  // items per row
    const Share share(n_rows * ipr, warp, nw);
    const uint64_t policy = EF && BULK ? l2_evict_first_policy() : 0;
    const int total = (int)(share.end - share.begin);
    const uint32_t first_row = share.begin / ipr;
    if (BULK) {
        if (lane == 0) {
#pragma unroll
            for (int s = 0; s < ST; ++s) mbar_init(bars + s);
            mbar_init_fence();
        }
        __syncwarp();
    }
    // the next item to copy: its row, first byte, the end of its row, its chunk in the row
    uint32_t irow = first_row;
    const uint8_t* is = row_ptr(first_row) + (size_t)(share.begin % ipr) * BI;
    const uint8_t* irow_end = row_ptr(first_row) + row_bytes;
    uint32_t iit = share.begin % ipr;
    auto issue = [&](int t) {
        if (t < total) {
            const uint8_t* end = end_of(irow);
            const uint8_t* e = iit + 1 == ipr ? irow_end : is + BI;
            const uint8_t* c0 = is - (reinterpret_cast<size_t>(is) & 15);
            uint8_t* dst = ring + (t % ST) * SLOT;
            // 16-byte pieces [c0, c0 + 16 n), of which those below `end` are copied asynchronously
            // and the matrix's last bytes (below e) by plain loads
            const int n = (int)((e - c0 + 15) >> 4);
            const int n_async = c0 + 16 * n <= end ? n : (int)((end - c0) >> 4);
            if (BULK) {
                if (lane == 0) {
                    mbar_arrive_expect(bars + t % ST, 16u * n_async);
                    if (n_async > 0) {
                        if (EF) bulk_copy_hint(dst, c0, 16u * n_async, bars + t % ST, policy);
                        else bulk_copy(dst, c0, 16u * n_async, bars + t % ST);
                    }
                }
            } else {
                for (int i = lane; i < n_async; i += 32) cp_async16(dst + 16 * i, c0 + 16 * i, 16);
            }
            if (n_async < n)
                for (int i = n_async * 16 + lane; c0 + i < e; i += 32) dst[i] = __ldg(c0 + i);
            if (++iit == ipr) {  // the next row's first chunk
                iit = 0;
                is = row_ptr(++irow);
                irow_end = is + row_bytes;
            } else {
                is += BI;
            }
        }
        if (!BULK) cp_async_commit();
    };
#pragma unroll
    for (int t = 0; t < ST - 1; ++t) issue(t);
    if (EF && BULK && lane == 0) {  // the next l2_items items into L2 while the previous kernel ends
        for (int t = ST - 1; t < ST - 1 + (int)l2_items && t < total; ++t) {
            const uint32_t item = share.begin + (uint32_t)t, r = item / ipr, c = item % ipr;
            const uint8_t* s = row_ptr(r) + (size_t)c * BI;
            const uint8_t* e = c + 1 == ipr ? row_ptr(r) + row_bytes : s + BI;
            const uint8_t* lim = end_of(r);  // whole 16-byte pieces inside the matrix, as issue() copies
            const uint8_t* a = s - (reinterpret_cast<size_t>(s) & 15);
            const int n = (int)(((e < lim ? e : lim) - a + 15) >> 4);
            const int n_in = a + 16 * n <= lim ? n : (int)((lim - a) >> 4);
            if (n_in > 0) prefetch_l2_bulk(a, 16u * n_in);
        }
    }
    wait();
    prepare();
    float acc[NC] = {};
    // the item being computed: its row j, chunk it, and its first byte's offset in its 16-byte window
    uint32_t j = first_row, it = share.begin % ipr;
    XView<NC> x = x_of(j);
    size_t cs = reinterpret_cast<size_t>(row_ptr(first_row)) + (size_t)it * BI;
    for (int t = 0; t < total; ++t) {
        __syncwarp();  // every lane is done with slot (t - 1) % ST, which the next copy refills
        issue(t + ST - 1);
        if (BULK) mbar_wait(bars + t % ST, (uint32_t)(t / ST) & 1u);
        else cp_async_wait<ST - 1>();
        __syncwarp();  // the other lanes' copies (and plain stores) of iteration t are visible
        const uint8_t* base = ring + (t % ST) * SLOT + (cs & 15);
        // a whole iteration with no per-unit bounds (one column: more columns amortise the bounds
        // and would spill with a second copy of the loop)
        if (NC == 1 && (it + 1) * kIterUnits <= units) {
            if (U::kHoist) {  // the lane's first block, misalignment and x view once, its units at constant offsets
                const uint8_t* lb = base + lane / U::kBlockUnits * U::kBlockBytes;
                const uint32_t mis = misalign4(lb);  // the same for every unit: 32 / kBlockUnits blocks apart
                const XView<NC> xl = x.at(it * kIterUnits + lane);
#pragma unroll
                for (int l = 0; l < LU; ++l)
                    U::template dot<NC>(lb + 32 * l / U::kBlockUnits * U::kBlockBytes, mis, lane % U::kBlockUnits,
                                        32 * l, xl, acc);
            } else {
#pragma unroll
                for (int l = 0; l < LU; ++l) {
                    const uint8_t* blk = base + (32 * l + lane) / U::kBlockUnits * U::kBlockBytes;
                    U::template dot<NC>(blk, misalign4(blk), lane % U::kBlockUnits, it * kIterUnits + 32 * l + lane, x,
                                        acc);
                }
            }
        } else
#pragma unroll
        for (int l = 0; l < LU; ++l) {  // units lane and lane + 32 ... of the iteration
            const uint32_t u = it * kIterUnits + 32 * l + lane;
            if (u < units) {
                const uint8_t* blk = base + (32 * l + lane) / U::kBlockUnits * U::kBlockBytes;
                U::template dot<NC>(blk, misalign4(blk), lane % U::kBlockUnits, u, x, acc);
            }
        }
        const bool row_done = ++it == ipr;
        cs += BI;
        if (row_done || t == total - 1) {  // the warp's part of row j is complete
            float sums[NC];
#pragma unroll
            for (int c = 0; c < NC; ++c) { sums[c] = warp_sum(acc[c]); acc[c] = 0.0f; }
            if (lane == 0) {
                const bool whole = j * ipr >= share.begin && (j + 1) * ipr <= share.end;
                float* part = j == first_row ? sm.first(warp) : sm.last(warp);
                if (whole) {
                    store(j, sums);
                } else {
#pragma unroll
                    for (int c = 0; c < NC; ++c) part[c] = sums[c];
                }
            }
            if (row_done) {
                it = 0;
                cs = reinterpret_cast<size_t>(row_ptr(++j));  // the next row's start
                x = x_of(j);
            }
        }
    }
    if (!BULK) cp_async_wait<0>();
    __syncthreads();  // every warp's parts are in shared memory
    if (threadIdx.x < (uint32_t)nw) {
        const int w = threadIdx.x;
        const Share mine(n_rows * ipr, w, nw);
        if (mine.end > mine.begin) {
            const uint32_t r = (mine.end - 1) / ipr;  // the warp's last row
            // w holds the first item of row r, and the row goes on past its share: w sums the parts
            if (r * ipr >= mine.begin && (r + 1) * ipr > mine.end) {
                const float* own = r == mine.begin / ipr ? sm.first(w) : sm.last(w);
                float sums[NC];
#pragma unroll
                for (int c = 0; c < NC; ++c) sums[c] = own[c];
                for (int v = w + 1; v < nw; ++v) {  // later warps whose share starts inside row r
                    const Share next(n_rows * ipr, v, nw);
                    if (next.end == next.begin) continue;
                    if (next.begin / ipr != r) break;
#pragma unroll
                    for (int c = 0; c < NC; ++c) sums[c] += sm.first(v)[c];
                }
                store(r, sums);
            }
        }
    }
}

template <int QT, int NC, int LU, int ST, bool BULK, bool EF = false, class RowPtr, class End, class Wait,
          class Prepare, class Store>
CUKERN_DEVICE void block_rows(const Smem<QT, LU, ST, NC>& sm, uint32_t n_rows, RowPtr row_ptr, uint32_t row_bytes,
                              End end_of, uint32_t k, Wait wait, Prepare prepare, Store store, uint32_t l2_items = 0) {
    block_rows_x<QT, NC, LU, ST, BULK, EF>(sm, n_rows, row_ptr, row_bytes, end_of,
                                           [&](uint32_t) { return XView<NC>{sm.xq, sm.xi, k}; }, k, wait, prepare,
                                           store, l2_items);
}

// The gate and up rows of outputs [r0, r0 + n_out) of two matrices (gate, up: their row 0; each m
// rows of row_bytes) streamed as one row sequence through block_rows, local row 2i the gate row and
// 2i + 1 the up row of output i, so that both dot products of an output come from one pass over the
// block's bytes; dots[j * NC + c] gets row j's products. The caller syncs before reading dots
// (dmmv_q8_two's GLU form, moe_dmmv_q8_glu).
template <int QT, int NC, int LU, int ST, bool BULK, bool EF = false, class Wait, class Prepare>
CUKERN_DEVICE void glu_rows(const Smem<QT, LU, ST, NC>& sm, uint32_t r0, uint32_t n_out, const uint8_t* gate,
                            const uint8_t* up, uint64_t row_bytes, uint32_t m, uint32_t k, Wait wait, Prepare prepare,
                            float* dots) {
    const uint8_t* const gate_end = gate + (size_t)m * row_bytes;
    const uint8_t* const up_end = up + (size_t)m * row_bytes;
    block_rows<QT, NC, LU, ST, BULK, EF>(
        sm, 2 * n_out, [&](uint32_t j) { return (j & 1 ? up : gate) + (size_t)(r0 + j / 2) * row_bytes; },
        (uint32_t)row_bytes, [&](uint32_t j) { return j & 1 ? up_end : gate_end; }, k, wait, prepare,
        [&](uint32_t j, const float (&v)[NC]) {
#pragma unroll
            for (int c = 0; c < NC; ++c) dots[j * NC + c] = v[c];
        });
}

}  // namespace q8
}  // namespace cukern
