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

}  // namespace cukern
