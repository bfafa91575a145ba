// GGUF weight formats on the device: block structs laid out byte for byte as
// GGUF stores them, per-element / per-pair dequantization, the K-quant
// sub-block scale/min extraction, and the bit tricks the matvec and matmul
// kernels use to turn packed quants into f32 without integer conversions.
//
// A weight tensor is uploaded as its raw GGUF bytes: row r of an M x K tensor
// of type T starts at byte r * (K / block_elems(T)) * block_bytes(T), and a
// row is K / block_elems(T) consecutive blocks. Blocks are only 2-byte
// aligned for most types (MXFP4: 1-byte), so readers here never cast a block
// pointer to a wider type than its alignment allows.
//
// Type ids are GGML's (gguf.GGMLQuantizationType). The layouts, per block:
//   Q4_0  (32 el, 18 B): f16 d; u8 qs[16]     w[j] = d*((qs[j]&15)-8), w[j+16] = d*((qs[j]>>4)-8)
//   Q5_0  (32 el, 22 B): f16 d; u8 qh[4]; u8 qs[16]
//                        5-bit q = nibble | bit j of (u32)qh << 4, w = d*(q-16)
//   Q8_0  (32 el, 34 B): f16 d; i8 qs[32]     w[j] = d*qs[j]
//   MXFP4 (32 el, 17 B): u8 e (E8M0); u8 qs[16], nibbles as Q4_0, FP4 E2M1 codes,
//                        w = 2^(e-127) * e2m1(code) (computed as half-scale * doubled code)
//   Q4_K (256 el, 144 B): f16 d, dmin; u8 scales[12] (8 x 6-bit scale, 8 x 6-bit min);
//                        u8 qs[128]: 4 groups of 32 bytes, group g byte j: low nibble ->
//                        element 64g+j (sub-block 2g), high -> 64g+32+j (sub-block 2g+1);
//                        w = d*sc[s]*q - dmin*m[s]
//   Q5_K (256 el, 176 B): as Q4_K plus u8 qh[32] before qs: bit s of qh[j] is the fifth
//                        bit of element 32s+j
//   Q6_K (256 el, 210 B): u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d. Half h (128 el):
//                        ql[64h+j] low nibble -> 128h+j, high -> 128h+64+j; bits 2s..2s+1 of
//                        qh[32h+j] -> element 128h+32s+j; w = d*scales[el/16]*(q-32)
//   F32 / F16 / BF16: one element per "block".
#pragma once

#include "common/types.cuh"

namespace cukern {

// ----------------------------------------------------------------------------------- type ids
enum QType : int {
    QT_F32 = 0,
    QT_F16 = 1,
    QT_Q4_0 = 2,
    QT_Q5_0 = 6,
    QT_Q8_0 = 8,
    QT_Q4_K = 12,
    QT_Q5_K = 13,
    QT_Q6_K = 14,
    QT_BF16 = 30,
    QT_MXFP4 = 39,
};

constexpr int QK_K = 256;  // elements per K-quant super-block

// ----------------------------------------------------------------------------------- blocks
struct BlockQ4_0 { __half d; uint8_t qs[16]; };
struct BlockQ5_0 { __half d; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ8_0 { __half d; int8_t qs[32]; };
struct BlockMXFP4 { uint8_t e; uint8_t qs[16]; };
struct BlockQ4_K { __half d; __half dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct BlockQ5_K { __half d; __half dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; __half d; };

static_assert(sizeof(BlockQ4_0) == 18, "block_q4_0");
static_assert(sizeof(BlockQ5_0) == 22, "block_q5_0");
static_assert(sizeof(BlockQ8_0) == 34, "block_q8_0");
static_assert(sizeof(BlockMXFP4) == 17, "block_mxfp4");
static_assert(sizeof(BlockQ4_K) == 144, "block_q4_K");
static_assert(sizeof(BlockQ5_K) == 176, "block_q5_K");
static_assert(sizeof(BlockQ6_K) == 210, "block_q6_K");

// Elements and bytes per block, and the block struct, of each type.
template <int QT> struct QTraits;
template <> struct QTraits<QT_F32> { using Block = float; static constexpr int kElems = 1, kBytes = 4; };
template <> struct QTraits<QT_F16> { using Block = __half; static constexpr int kElems = 1, kBytes = 2; };
template <> struct QTraits<QT_BF16> { using Block = __nv_bfloat16; static constexpr int kElems = 1, kBytes = 2; };
template <> struct QTraits<QT_Q4_0> { using Block = BlockQ4_0; static constexpr int kElems = 32, kBytes = 18; };
template <> struct QTraits<QT_Q5_0> { using Block = BlockQ5_0; static constexpr int kElems = 32, kBytes = 22; };
template <> struct QTraits<QT_Q8_0> { using Block = BlockQ8_0; static constexpr int kElems = 32, kBytes = 34; };
template <> struct QTraits<QT_MXFP4> { using Block = BlockMXFP4; static constexpr int kElems = 32, kBytes = 17; };
template <> struct QTraits<QT_Q4_K> { using Block = BlockQ4_K; static constexpr int kElems = QK_K, kBytes = 144; };
template <> struct QTraits<QT_Q5_K> { using Block = BlockQ5_K; static constexpr int kElems = QK_K, kBytes = 176; };
template <> struct QTraits<QT_Q6_K> { using Block = BlockQ6_K; static constexpr int kElems = QK_K, kBytes = 210; };

// ----------------------------------------------------------------------------------- scalars
// E8M0 exponent -> half the scale it encodes, 2^(e-128): MXFP4 multiplies it by doubled E2M1
// values, which are integers. e < 2 gives an f32 denormal (flushed to 0 under -ftz).
CUKERN_DEVICE float e8m0_to_float_half(uint32_t e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

// Doubled E2M1 values of the 16 FP4 codes: 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives, x2.
__device__ __constant__ const int8_t kE2M1Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Q4_K / Q5_K: 6-bit scale and min of sub-block j (0...7) from the 12 packed bytes.
//   j < 4: sc = s[j] & 63,                        m = s[j+4] & 63
//   j >= 4: sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4, m = (s[j+4] >> 4) | (s[j] >> 6) << 4
CUKERN_DEVICE void k4_scale_min(const uint8_t* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// The same from the 12 bytes held as three u32 words (little-endian), j = 0...7 at run time.
// Byte i of each word is picked by shifts (no indexed register array, which would go to local memory).
CUKERN_DEVICE void k4_scale_min(uint32_t s0, uint32_t s1, uint32_t s2, int j, int& sc, int& m) {
    const int sh = 8 * (j & 3);
    const int b0 = (s0 >> sh) & 0xFF, b1 = (s1 >> sh) & 0xFF, b2 = (s2 >> sh) & 0xFF;
    if (j < 4) {
        sc = b0 & 63;
        m = b1 & 63;
    } else {
        sc = (b2 & 15) | ((b0 >> 6) << 4);
        m = (b2 >> 4) | ((b1 >> 6) << 4);
    }
}

// ----------------------------------------------------------------------------------- per element
// Element i of a block, in f32: the slow, obviously-correct path (tests, gathers, odd shapes).
CUKERN_DEVICE float dequant(const float* b, int) { return *b; }
CUKERN_DEVICE float dequant(const __half* b, int) { return __half2float(*b); }
CUKERN_DEVICE float dequant(const __nv_bfloat16* b, int) { return __bfloat162float(*b); }

// The stored quant of element i of a block, before the format's offset (Q8_0: the int8 itself):
// the integers that dequant below scales, and that gemm_wgr's packer (matmul/packed_wgr.cuh) rewrites.
CUKERN_DEVICE int quant(const BlockQ4_0* b, int i) {  // i: 0...31
    return i < 16 ? (b->qs[i] & 15) : (b->qs[i - 16] >> 4);
}

CUKERN_DEVICE int quant(const BlockQ5_0* b, int i) {  // i: 0...31
    const int lo = i < 16 ? (b->qs[i] & 15) : (b->qs[i - 16] >> 4);
    return lo | ((b->qh[i >> 3] >> (i & 7)) & 1) << 4;
}

CUKERN_DEVICE int quant(const BlockQ8_0* b, int i) { return b->qs[i]; }

CUKERN_DEVICE int quant(const BlockQ4_K* b, int i) {  // i: 0...255
    const int s = i / 32, j = i % 32, g = i / 64;
    return (s & 1) ? (b->qs[32 * g + j] >> 4) : (b->qs[32 * g + j] & 15);
}

CUKERN_DEVICE int quant(const BlockQ5_K* b, int i) {  // i: 0...255
    const int s = i / 32, j = i % 32, g = i / 64;
    const int lo = (s & 1) ? (b->qs[32 * g + j] >> 4) : (b->qs[32 * g + j] & 15);
    return lo | (((b->qh[j] >> s) & 1) << 4);
}

CUKERN_DEVICE int quant(const BlockQ6_K* b, int i) {  // i: 0...255
    const int h = i / 128, e = i % 128;  // half, element within the half (0...127)
    const int lo = e < 64 ? (b->ql[64 * h + e] & 15) : (b->ql[64 * h + e - 64] >> 4);
    const int hi = (b->qh[32 * h + e % 32] >> (2 * (e / 32))) & 3;
    return lo | hi << 4;
}

CUKERN_DEVICE float dequant(const BlockQ4_0* b, int i) { return __half2float(b->d) * (float)(quant(b, i) - 8); }

CUKERN_DEVICE float dequant(const BlockQ5_0* b, int i) { return __half2float(b->d) * (float)(quant(b, i) - 16); }

CUKERN_DEVICE float dequant(const BlockQ8_0* b, int i) { return __half2float(b->d) * (float)quant(b, i); }

CUKERN_DEVICE float dequant(const BlockMXFP4* b, int i) {  // i: 0...31
    const int code = i < 16 ? (b->qs[i] & 15) : (b->qs[i - 16] >> 4);
    return e8m0_to_float_half(b->e) * (float)kE2M1Doubled[code];
}

CUKERN_DEVICE float dequant(const BlockQ4_K* b, int i) {  // i: 0...255
    int sc, m;
    k4_scale_min(b->scales, i / 32, sc, m);
    return __half2float(b->d) * sc * quant(b, i) - __half2float(b->dmin) * m;
}

CUKERN_DEVICE float dequant(const BlockQ5_K* b, int i) {  // i: 0...255
    int sc, m;
    k4_scale_min(b->scales, i / 32, sc, m);
    return __half2float(b->d) * sc * quant(b, i) - __half2float(b->dmin) * m;
}

CUKERN_DEVICE float dequant(const BlockQ6_K* b, int i) {  // i: 0...255
    return __half2float(b->d) * b->scales[i / 16] * (float)(quant(b, i) - 32);
}

// Elements (i, i+1), i even: the pair form the f16/f32 matmul tile loaders consume.
template <class Block>
CUKERN_DEVICE float2 dequant2(const Block* b, int i) { return make_float2(dequant(b, i), dequant(b, i + 1)); }

template <class Block>
CUKERN_DEVICE __half2 dequant2_half(const Block* b, int i) { return __floats2half2_rn(dequant(b, i), dequant(b, i + 1)); }

// ----------------------------------------------------------------------------------- fast paths
// Byte k of v (0...255) as an exact f32, via the 2^23 magic number: place the byte in the low
// mantissa bits of 2^23 (prmt), subtract 2^23. Two fast instructions instead of an I2F.
template <int K>
CUKERN_DEVICE float byte_to_float(uint32_t v) {
    static_assert(K >= 0 && K < 4, "byte index");
    return __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7440 | K)) - 8388608.0f;
}

// The four bytes of v as f32: out[k] = byte k of v.
CUKERN_DEVICE void bytes_to_float4(uint32_t v, float (&out)[4]) {
    out[0] = byte_to_float<0>(v);
    out[1] = byte_to_float<1>(v);
    out[2] = byte_to_float<2>(v);
    out[3] = byte_to_float<3>(v);
}

// Bits 0...3 of t spread to bit 0 of bytes 0...3 (the Q5 high bits of four elements).
CUKERN_DEVICE uint32_t spread_bits4(uint32_t t) { return ((t & 15u) * 0x00204081u) & 0x01010101u; }

// PTX prmt in its default mode: like __byte_perm, but a selector nibble with bit 3 set
// replicates the sign (msb) of the selected byte (__byte_perm ignores bit 3).
CUKERN_DEVICE uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// MXFP4: four codes, one per nibble of the 16 bits of sel (nibble k -> out byte k), looked up
// as doubled E2M1 values biased by +128 (so the result bytes are unsigned). prmt looks up 3-bit
// indices in 8 bytes; the sign (bit 3 of each nibble) picks between the positive and the
// negative table, spread to byte masks by prmt's sign-replicate mode.
CUKERN_DEVICE uint32_t mxfp4_lookup4_biased(uint32_t sel) {
    constexpr uint32_t kPos0 = 0x83828180u, kPos1 = 0x8C888684u;  // 128 + {0,1,2,3}, 128 + {4,6,8,12}
    constexpr uint32_t kNeg0 = 0x7D7E7F80u, kNeg1 = 0x74787A7Cu;  // 128 - {0,1,2,3}, 128 - {4,6,8,12}
    const uint32_t idx = sel & 0x7777u;
    const uint32_t pos = __byte_perm(kPos0, kPos1, idx);
    const uint32_t neg = __byte_perm(kNeg0, kNeg1, idx);
    // sign of nibble k is bit 4k+3: bytes 0/1 of (sel << 4) hold nibbles 0 and 2 in their msb,
    // bytes 0/1 of sel hold nibbles 1 and 3; selector 8+n replicates the msb of byte n.
    const uint32_t mask = prmt(sel << 4, sel, 0xD9C8);
    return (pos & ~mask) | (neg & mask);
}

}  // namespace cukern
