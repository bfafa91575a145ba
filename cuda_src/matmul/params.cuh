// Parameter structs of the matmul family (quantized GEMMs for prefill, activation quantizers),
// passed by value as the last kernel argument. cukern/params.py parses this file: one field per
// line, fixed-width types, a trailing comment with meaning and units.
//
// Layouts shared by every kernel here (the dmmv family's): W is raw GGUF bytes, M rows of K
// elements, row r at byte w_offset + r * row_bytes; B and D are "column-major" K x N and M x N,
// i.e. NumPy [N, K] and [N, M] with one row per token (column c at element c * stride).
#pragma once

#include "common/types.cuh"

// gemm_f16 (gemm.cuh): D = W B on f16 tensor cores, W tiles dequantized to f16 in shared memory
struct GemmParams {
    uint64_t w_offset;   // bytes: where W (glu: the gate matrix) starts in w
    uint64_t w2_offset;  // bytes: where the up matrix starts in w2 (glu); unused otherwise
    uint64_t row_bytes;  // bytes per weight row: k / block_elems * block_bytes
    uint64_t b_stride;   // elements between consecutive token columns of b
    uint64_t d_stride;   // elements between consecutive token columns of d
    uint32_t m;          // weight rows: outputs per token (glu: rows of each matrix)
    uint32_t n;          // token columns
    uint32_t k;          // elements per weight row, a multiple of the weight block size
    uint32_t k_split;    // elements of K per blockIdx.z slice, a multiple of 256 (k when not split)
    uint32_t mode;       // 0: d = W b; 1: d += W b; 2: d = silu(Wg b) * (Wu b); 3: d = gelu_tanh(Wg b) * (Wu b)
    uint32_t atomic;     // 1: add into d with atomics (split K; d zeroed first by the host for mode 0)
    uint32_t raw16;      // 1: every weight row starts 16-byte aligned (cp.async path); 0: 2-byte copies
    uint32_t d_tma;      // gemm_wgr: 1: d written by tensor stores through its map td; 0: element stores
};

// quantize_q8 (quantize.cuh): f32 rows -> Q8_1 or Q8_0 blocks of 32 values
struct QuantizeParams {
    uint64_t x_stride;   // elements between consecutive rows of x
    uint64_t q_stride;   // bytes between consecutive rows of q
    uint32_t n_rows;     // rows (tokens)
    uint32_t n_cols;     // values per row, a multiple of 32
};

// dequantize_f16 (quantize.cuh): raw GGUF rows -> f16 [m, k]
struct DequantParams {
    uint64_t w_offset;   // bytes: where the matrix starts in w
    uint64_t row_bytes;  // bytes per weight row
    uint32_t m;          // rows
    uint32_t k;          // elements per row
};

// pack_wgr (packed_wgr.cuh): raw GGUF rows -> gemm_wgr's packed tile-major layout (k % 256 == 0)
struct PackParams {
    uint64_t w_offset;   // bytes: where the matrix (glu: the gate matrix) starts in w
    uint64_t w2_offset;  // bytes: where the up matrix starts in w2 (glu); unused otherwise
    uint64_t row_bytes;  // bytes per GGUF weight row
    uint32_t m;          // rows (glu: rows of each matrix)
    uint32_t k;          // elements per row, a multiple of 256
    uint32_t glu;        // 1: tiles of 64 gate and 64 up rows, interleaved as gemm_wgr's GLU reads them
};

// moe_gemm_f16 (moe_gemm.cuh): grouped expert GEMMs over a MoeRoute (slots grouped per expert)
struct MoeGemmParams {
    uint64_t w_offset;     // bytes: where expert 0 of W (glu: the gate tensor) starts in w
    uint64_t w2_offset;    // bytes: where expert 0 of the up tensor starts in w2 (glu); unused otherwise
    uint64_t row_bytes;    // bytes per weight row
    uint64_t expert_bytes; // bytes from one expert's matrix to the next
    uint64_t x_stride;     // elements between consecutive rows of x
    uint64_t d_stride;     // elements between consecutive slot rows of d
    uint64_t bias_expert;  // elements between experts' rows of the biases (glu, has_bias)
    uint64_t bias_row;     // elements between consecutive outputs of one expert's bias (glu, has_bias)
    uint32_t m;            // weight rows: outputs per slot (glu: rows of each matrix)
    uint32_t k;            // elements per weight row, a multiple of 32
    uint32_t n_slots;      // slots of the route (n_tokens * top_k): the packed list's length
    uint32_t n_experts;    // experts; offsets has n_experts + 1 entries (the last: first invalid slot)
    uint32_t top_k;        // slots per token: x row of slot s = s / top_k unless x_per_slot
    uint32_t x_per_slot;   // 1: x has one row per slot (x row = slot); 0: one per token
    uint32_t mode;         // 0: d = W x; 1: d += W x; glu: 2 silu, 3 gelu_tanh, 4 swiglu_oai of (gate, up)
    uint32_t raw16;        // 1: every weight row starts 16-byte aligned (cp.async path); 0: 2-byte copies
    uint32_t has_bias;     // glu: 1: gate and up biases added before the activation
    float alpha;           // swiglu_oai: sigmoid slope
    float limit;           // swiglu_oai: clamp of the gate (above) and of the linear input (both sides)
};
