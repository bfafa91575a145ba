// Hopper warpgroup MMA (wgmma.mma_async, sm_90a) as inline PTX: shared-memory matrix descriptors,
// fence / commit / wait, the f16 / bf16 shapes with f32 accumulators that flash attention uses (m64n64k16
// and m64n128k16 with A and B from shared memory; m64n64k16 / m64n128k16 with A from registers and an
// MN-major B; m64n32k16 / m64n64k16 with both operands MN-major in shared memory, for the backward's
// dQ = dS K from a stored dS^T), the m64n128k16 / m64n256k16 f16 shapes with A from registers and a
// K-major B that the quantized GEMM uses, and setmaxnreg.
//
// Layouts (8x8 "core matrices" of 8 rows x 16 bytes, each stored as 128 contiguous bytes):
//   * K-major operand (A = M x K or B = K x N with K contiguous per row): LBO = bytes between the two core
//     matrices of a k16 step (along K), SBO = bytes between core matrices 8 rows apart (along M / N);
//   * MN-major B (K x N with N contiguous per row: a core matrix is 8 K-rows of 8 N-elements): LBO = bytes
//     between core matrices 8 K-rows apart, SBO = bytes between core matrices 8 N-elements apart
//     (CuTe's canonical form ((8,n),(8,k)):((1,SBO),(8,LBO)) in elements); an MN-major A (M x K with M
//     contiguous) is described the same way, M in place of N.
// Fragments (warp w of the warpgroup, g = lane / 4, t = lane % 4): accumulator quad j of an m64nN tile is
// rows 16 w + g (elements 0, 1) and 16 w + g + 8 (elements 2, 3) x columns 8 j + 2 t + 0, 1, exactly
// mma.sync m16n8k16's C layout; a register A fragment of a k16 step is mma.sync's A fragment of that
// warp's 16 rows. So an S tile's quads, rounded in pairs to T, are the A operand of the next product.
//
// Accumulator registers are written asynchronously: read them only after wait<0>() (or the wait that
// covers their group) followed by pin(), which keeps the compiler from moving the reads above the wait.
#pragma once

#include "common/types.cuh"

namespace cukern {
namespace wg {

// Shared-memory matrix descriptor: start address, LBO and SBO in bytes (multiples of 16), layout 0: no
// swizzle, 1: 128-byte swizzle (atoms of 8 rows x 128 bytes, 1024-byte aligned; the 16-byte chunk c of row
// r stored at chunk c ^ (r % 8); K-major: SBO = bytes between 8-row groups, LBO unused, a k16 step inside
// an atom advances the start by 32 bytes; MN-major: LBO = bytes between 64-element blocks along M / N,
// SBO = bytes between 8-row groups along K).
CUKERN_DEVICE uint64_t desc(uint32_t saddr, uint32_t lbo, uint32_t sbo, uint32_t layout = 0) {
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | (uint64_t)(lbo >> 4) << 16 | (uint64_t)(sbo >> 4) << 32 |
           (uint64_t)layout << 62;
}

// Byte offset of (row r, 16-byte chunk c) in a tile of R rows stored in the 128-byte swizzled layout above
// (layout 1): blocks of 64 16-bit columns, each R rows of 128 bytes, one after the other.
template <int R>
CUKERN_DEVICE uint32_t swizzled_offset(int r, int c) {
    return (c / 8) * (R * 128) + r * 128 + ((c % 8) ^ (r % 8)) * 16;
}

CUKERN_DEVICE void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
CUKERN_DEVICE void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
CUKERN_DEVICE void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Generic-proxy writes of shared memory (stores, cp.async) made visible to the async proxy (wgmma); each
// writing thread, after its writes landed and before the barrier that publishes them.
CUKERN_DEVICE void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Orders register reads after the wait: an empty asm that "writes" each accumulator.
template <int J>
CUKERN_DEVICE void pin(float (&d)[J][4]) {
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

#define CUKERN_WG_QUAD(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define CUKERN_WG_ACC64 \
    CUKERN_WG_QUAD(0), CUKERN_WG_QUAD(1), CUKERN_WG_QUAD(2), CUKERN_WG_QUAD(3), \
    CUKERN_WG_QUAD(4), CUKERN_WG_QUAD(5), CUKERN_WG_QUAD(6), CUKERN_WG_QUAD(7)
#define CUKERN_WG_ACC128 \
    CUKERN_WG_ACC64, CUKERN_WG_QUAD(8), CUKERN_WG_QUAD(9), CUKERN_WG_QUAD(10), CUKERN_WG_QUAD(11), \
    CUKERN_WG_QUAD(12), CUKERN_WG_QUAD(13), CUKERN_WG_QUAD(14), CUKERN_WG_QUAD(15)

#define CUKERN_WG_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define CUKERN_WG_D128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// d (64 x N, f32; N = 64: d[8][4], N = 128: d[16][4]) = (accumulate ? d : 0) + A B: A 64 x 16 K-major
// (desc_a), B 16 x N K-major (desc_b).
template <typename T>
CUKERN_DEVICE void mma_ss(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, bool accumulate);
template <typename T>
CUKERN_DEVICE void mma_ss(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, bool accumulate);
// d (64 x N, f32; N = 32: d[4][4], N = 64: d[8][4]) = (accumulate ? d : 0) + A B with both operands MN-major
// in shared memory (wgmma's transpose flags, 16-bit types only): A 64 x 16 stored as 16 K-rows of 64
// M-elements (desc_a), B 16 x N stored as 16 K-rows of N-elements (desc_b).
template <typename T>
CUKERN_DEVICE void mma_ss_tt(float (&d)[4][4], uint64_t desc_a, uint64_t desc_b, bool accumulate);
template <typename T>
CUKERN_DEVICE void mma_ss_tt(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, bool accumulate);
// d (64 x N, f32; N = 64: d[8][4], N = 128: d[16][4]) += A B: A 64 x 16 in registers (a: this warp's
// mma.sync-style A fragment), B 16 x N MN-major (desc_b).
template <typename T>
CUKERN_DEVICE void mma_rs_mn(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b);
template <typename T>
CUKERN_DEVICE void mma_rs_mn(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b);

// A and B in shared memory: the function, N, the accumulator list and its constraints, the operand numbers of
// desc_a, desc_b and the flag, then the transpose flags of A and B ("0, 0": both K-major; "1, 1": both MN-major)
#define CUKERN_WG_SS(FN, CT, TY, N, DLIST, ACC, A, B, P, TRANS) \
    template <> \
    CUKERN_DEVICE void FN<CT>(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " DLIST \
                     ", " A ", " B ", p, 1, 1, " TRANS ";\n}\n" \
                     : ACC \
                     : "l"(desc_a), "l"(desc_b), "r"((int)accumulate)); \
    }
// A in registers, B MN-major: N, the accumulator list and its constraints, then the operand numbers of a0..a3,
// desc_b and the flag
#define CUKERN_WG_RSMN(CT, TY, N, DLIST, ACC, A0, A1, A2, A3, B, P) \
    template <> \
    CUKERN_DEVICE void mma_rs_mn<CT>(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " DLIST \
                     ", {" A0 ", " A1 ", " A2 ", " A3 "}, " B ", p, 1, 1, 1;\n}\n" \
                     : ACC \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)); \
    }
#define CUKERN_WG_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define CUKERN_WG_ACC32 CUKERN_WG_QUAD(0), CUKERN_WG_QUAD(1), CUKERN_WG_QUAD(2), CUKERN_WG_QUAD(3)

CUKERN_WG_SS(mma_ss, __half, "f16", 64, CUKERN_WG_D64, CUKERN_WG_ACC64, "%32", "%33", "%34", "0, 0")
CUKERN_WG_SS(mma_ss, __nv_bfloat16, "bf16", 64, CUKERN_WG_D64, CUKERN_WG_ACC64, "%32", "%33", "%34", "0, 0")
CUKERN_WG_SS(mma_ss, __half, "f16", 128, CUKERN_WG_D128, CUKERN_WG_ACC128, "%64", "%65", "%66", "0, 0")
CUKERN_WG_SS(mma_ss, __nv_bfloat16, "bf16", 128, CUKERN_WG_D128, CUKERN_WG_ACC128, "%64", "%65", "%66", "0, 0")
CUKERN_WG_SS(mma_ss_tt, __half, "f16", 32, CUKERN_WG_D32, CUKERN_WG_ACC32, "%16", "%17", "%18", "1, 1")
CUKERN_WG_SS(mma_ss_tt, __nv_bfloat16, "bf16", 32, CUKERN_WG_D32, CUKERN_WG_ACC32, "%16", "%17", "%18", "1, 1")
CUKERN_WG_SS(mma_ss_tt, __half, "f16", 64, CUKERN_WG_D64, CUKERN_WG_ACC64, "%32", "%33", "%34", "1, 1")
CUKERN_WG_SS(mma_ss_tt, __nv_bfloat16, "bf16", 64, CUKERN_WG_D64, CUKERN_WG_ACC64, "%32", "%33", "%34", "1, 1")
CUKERN_WG_RSMN(__half, "f16", 64, CUKERN_WG_D64, CUKERN_WG_ACC64, "%32", "%33", "%34", "%35", "%36", "%37")
CUKERN_WG_RSMN(__nv_bfloat16, "bf16", 64, CUKERN_WG_D64, CUKERN_WG_ACC64, "%32", "%33", "%34", "%35", "%36", "%37")
CUKERN_WG_RSMN(__half, "f16", 128, CUKERN_WG_D128, CUKERN_WG_ACC128, "%64", "%65", "%66", "%67", "%68", "%69")
CUKERN_WG_RSMN(__nv_bfloat16, "bf16", 128, CUKERN_WG_D128, CUKERN_WG_ACC128, "%64", "%65", "%66", "%67", "%68",
               "%69")
#undef CUKERN_WG_SS
#undef CUKERN_WG_RSMN
#undef CUKERN_WG_ACC32
#undef CUKERN_WG_D32

// d (64 x N, f32, the N / 2 accumulators of a thread, quad j at d[4j..4j+3]) += A B: A 64 x 16 f16 in
// registers (a0..a3: this warp's mma.sync-style A fragment), B 16 x N K-major (desc_b); N = 128, 256
// (the quantized GEMM's weight-in-registers product, matmul/gemm_wgr.cuh).
template <int N> struct MmaRsK;

#define CUKERN_WG_F8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
    "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define CUKERN_WG_F64(i) CUKERN_WG_F8(i), CUKERN_WG_F8(i + 8), CUKERN_WG_F8(i + 16), CUKERN_WG_F8(i + 24), \
    CUKERN_WG_F8(i + 32), CUKERN_WG_F8(i + 40), CUKERN_WG_F8(i + 48), CUKERN_WG_F8(i + 56)
#define CUKERN_WG_R0_63 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define CUKERN_WG_R64_127 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
// N, accumulators per thread, their operand list, then the operand numbers of a0..a3, desc_b and the
// scale-d flag; the accumulator constraints last
#define CUKERN_WG_RSK(N, NACC, DLIST, AREGS, DESC, PRED, ...) \
    template <> struct MmaRsK<N> { \
        static CUKERN_DEVICE void run(float (&d)[NACC], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, \
                                      uint64_t desc_b) { \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n" \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 {" DLIST "}, {" AREGS "}, " DESC \
                         ", p, 1, 1, 0;\n}\n" \
                         : __VA_ARGS__ \
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(1)); \
        } \
    };

CUKERN_WG_RSK(128, 64, CUKERN_WG_R0_63, "%64, %65, %66, %67", "%68", "%69", CUKERN_WG_F64(0))
CUKERN_WG_RSK(256, 128, CUKERN_WG_R0_63 ", " CUKERN_WG_R64_127, "%128, %129, %130, %131", "%132", "%133",
              CUKERN_WG_F64(0), CUKERN_WG_F64(64))

#undef CUKERN_WG_RSK
#undef CUKERN_WG_R64_127
#undef CUKERN_WG_R0_63
#undef CUKERN_WG_F64
#undef CUKERN_WG_F8

// Orders register reads (and reuse) after a wait: an empty asm that "writes" the register. A fragments
// in registers are read by the tensor cores until their group retires, so they are pinned after the
// wait too, before the registers are written again.
CUKERN_DEVICE void pin(float& x) { asm volatile("" : "+f"(x)::"memory"); }
CUKERN_DEVICE void pin(uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }

// Warpgroup register budget (sm_90a): takes effect when the kernel has a register cap at entry
// (__launch_bounds__(threads, 1)) and each warpgroup role is one branch of a single if/else.
template <int N>
CUKERN_DEVICE void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
CUKERN_DEVICE void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }

#undef CUKERN_WG_D128
#undef CUKERN_WG_D64
#undef CUKERN_WG_ACC128
#undef CUKERN_WG_ACC64
#undef CUKERN_WG_QUAD

}  // namespace wg
}  // namespace cukern
