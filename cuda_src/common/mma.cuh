// Tensor-core building blocks as inline PTX (sm_80+): cp.async copies into shared memory,
// ldmatrix loads of 8x8 b16 tiles and mma.sync m16n8k16 with f32 accumulation.
//
// Fragment layouts of mma.sync.m16n8k16 (g = lane / 4, t = lane % 4), 2 b16 values per register:
//   A (16x16, row-major):  a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8, "col"):       b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C (16x8, f32):         c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g+8, 2t), (g+8, 2t+1)
#pragma once

#include "common/types.cuh"

namespace cukern {

CUKERN_DEVICE uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// Every shared-memory operand comes in two overloads: a generic pointer, or a 32-bit shared
// address (kernels that keep their shared addresses as integers get one base register plus an
// immediate offset per access).

// 16-byte global -> shared copy; src_bytes = 0 fills the destination with zeros (src not read).
CUKERN_DEVICE void cp_async16(uint32_t smem, const void* gmem, uint32_t src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(src_bytes));
}
CUKERN_DEVICE void cp_async16(void* smem, const void* gmem, uint32_t src_bytes) {
    cp_async16(smem_addr(smem), gmem, src_bytes);
}

// An L2 policy that evicts the lines it touches first (data read once: streamed K/V, a
// matvec's weights), for cp_async16_policy and bulk_copy_hint.
CUKERN_DEVICE uint64_t l2_evict_first_policy() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// cp_async16 (cp.async.cg, src_bytes of 16 copied, the rest zero-filled) under an L2 cache policy.
CUKERN_DEVICE void cp_async16_policy(void* smem, const void* gmem, uint32_t src_bytes, uint64_t policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_addr(smem)),
                 "l"(gmem), "r"(src_bytes), "l"(policy));
}

// Ask L2 to fetch `bytes` (a multiple of 16, 16-byte aligned) at src (a Hopper bulk prefetch; nothing before sm_90).
CUKERN_DEVICE void prefetch_l2_bulk(const void* src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
#endif
}

// Ask L2 to fetch every 128-byte line that holds one of the BYTES at src, one prefetch.global.L2 per line.
// decode_tc measured these better than one bulk prefetch per K/V slice (docs/notes/attention.md).
template <int BYTES>
CUKERN_DEVICE void prefetch_l2_lines(const void* src) {
    const uint64_t a = reinterpret_cast<uint64_t>(src);
    const uint64_t first = a & ~uint64_t(127), last = (a + BYTES - 1) & ~uint64_t(127);
#pragma unroll
    for (int l = 0; l < (BYTES + 239) / 128; ++l)  // at most this many lines, whatever src's alignment
        if (first + 128u * l <= last) asm volatile("prefetch.global.L2 [%0];" ::"l"(first + 128u * l) : "memory");
}

CUKERN_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// every cp.async of the thread, committed or not, has landed
CUKERN_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

template <int N>
CUKERN_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
CUKERN_DEVICE void ldmatrix_x4(uint32_t (&r)[4], uint32_t row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(row));
}
CUKERN_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* row) { ldmatrix_x4(r, smem_addr(row)); }

CUKERN_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(row));
}
CUKERN_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) { ldmatrix_x4_trans(r, smem_addr(row)); }

// c += a * b, m16n8k16, f32 accumulators; T is __half or __nv_bfloat16.
template <typename T>
CUKERN_DEVICE void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
CUKERN_DEVICE void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
CUKERN_DEVICE void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 values as one register of two T (round to nearest).
template <typename T>
CUKERN_DEVICE uint32_t pack2(float lo, float hi);

template <>
CUKERN_DEVICE uint32_t pack2<__half>(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

template <>
CUKERN_DEVICE uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

}  // namespace cukern
