// Synchronisation between threads of a block (named barriers) and between blocks (a device-scope
// acquire-release counter, relaxed loads and stores of polled words).
#pragma once

#include "common/types.cuh"

namespace cukern {

// Named barrier `id` of n threads (a multiple of 32): wait for it, or only arrive at it.
CUKERN_DEVICE void named_bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
CUKERN_DEVICE void named_bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }

// atomicAdd with acquire-release semantics at device scope (returns the old value): releases what the
// calling thread wrote (and, after a barrier, what its block wrote: a release is cumulative), acquires
// what the blocks that added before it released.
CUKERN_DEVICE int32_t atomic_add_acq_rel_gpu(int32_t* p, int32_t v) {
    int32_t old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// Relaxed (strong, unordered) device-scope accesses, for words one block writes and another polls: each
// 32-bit element is read or written whole (a vector access is one such access per element).
CUKERN_DEVICE void st_relaxed_gpu(float* p, float v) {
    asm volatile("st.relaxed.gpu.global.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}
CUKERN_DEVICE float ld_relaxed_gpu(const float* p) {
    float v;
    asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
CUKERN_DEVICE float4 ld_relaxed_gpu(const float4* p) {
    float4 v;
    asm volatile("ld.relaxed.gpu.global.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p));
    return v;
}

}  // namespace cukern
