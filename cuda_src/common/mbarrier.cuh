// Hopper's asynchronous copies and the shared-memory mbarriers that count their completion (sm_90):
// the 1-D bulk copy, the 2-D tensor copy (TMA, through a tensor map the host encodes) both ways, and
// the arrive / wait operations of producer-consumer rings.
//
// Phases: a barrier initialised with count c completes a phase when c arrivals (and all expected
// transaction bytes) have come; a waiter on completion number j (0-based) passes parity j & 1.
#pragma once

#include "common/mma.cuh"

namespace cukern {

// The host's CUtensorMap (cuTensorMapEncodeTiled), passed by value as a __grid_constant__ kernel
// argument; the copy engine reads it from the parameter space.
struct alignas(64) TensorMap {
    uint64_t opaque[16];
};

CUKERN_DEVICE void mbar_init(uint64_t* bar, uint32_t count = 1) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
CUKERN_DEVICE void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// One arrival (release: this thread's earlier memory accesses are ordered before the phase completes).
CUKERN_DEVICE void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// Arrive (the barrier's one arrival per phase) and expect `bytes` more of copies.
CUKERN_DEVICE void mbar_arrive_expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}
// One arrival once every cp.async this thread issued before has landed (counts as the thread's
// arrival: the barrier's count includes it).
CUKERN_DEVICE void mbar_arrive_cp_async(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// The waiting thread may be suspended until the phase completes or the hint (ns) runs out, rather
// than retrying after a system-dependent time (ncu, 14336x4096: 3-8% fewer instructions issued).
CUKERN_DEVICE void mbar_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(smem_addr(bar)), "r"(parity), "r"(10000000u)
            : "memory");
    } while (!done);
}
// bytes (a multiple of 16) from 16-byte-aligned global src to 16-byte-aligned shared dst.
CUKERN_DEVICE void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}
// bulk_copy under an L2 cache policy (l2_evict_first_policy in common/mma.cuh).
CUKERN_DEVICE void bulk_copy_hint(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint64_t policy) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
        ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
        : "memory");
}
// The box of a 2-D tensor map at element coordinates (c0 inner, c1 outer) into shared dst (aligned
// as the map's swizzle needs); out-of-range elements are zero-filled and still counted in bytes.
CUKERN_DEVICE void tma_load_2d(void* dst, const TensorMap* map, int32_t c0, int32_t c1, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
        : "memory");
}
// The box at shared src (laid out as the map's swizzle puts it) into a 2-D tensor map at element
// coordinates (c0 inner, c1 outer); elements outside the tensor are not written. ADD: each element
// added to memory (f32 atomically, one addition per element) instead of stored. Completion through
// bulk groups: bulk_commit, then bulk_wait_read before src is reused or the block exits.
template <bool ADD>
CUKERN_DEVICE void tma_store_2d(const TensorMap* map, const void* src, int32_t c0, int32_t c1) {
    if (ADD)
        asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], [%1];"
                     ::"l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(src)), "r"(c0), "r"(c1)
                     : "memory");
    else
        asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];"
                     ::"l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(src)), "r"(c0), "r"(c1)
                     : "memory");
}
CUKERN_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// This thread's committed bulk stores have read their shared sources (their writes may still be in flight).
CUKERN_DEVICE void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
CUKERN_DEVICE void tma_prefetch_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

}  // namespace cukern
