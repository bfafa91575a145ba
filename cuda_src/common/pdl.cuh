// Programmatic dependent launch (sm_90+; no-ops on older archs and harmless when the kernel was
// launched without the attribute, Dispatch._launch(..., pdl=True)):
//   pdl_launch_dependents(): the next kernel in the stream may be launched once every block of this
//     one has called it (or exited); it runs only where this grid leaves room on the SMs.
//   pdl_wait(): blocks until the previous kernel in the stream has completed and its memory
//     operations are visible. Before it a kernel may only touch memory that no kernel in flight
//     writes (model weights, say): no reads of activations, no writes at all.
//   pdl_enter(): pdl_wait(), then pdl_launch_dependents(): first thing in a kernel that has nothing
//     to do before the wait (the elementwise, tokens, KV-write and f32 matvec kernels). Its launch
//     and block start-up overlap the previous kernel's run, and the next kernel launches while it
//     runs; waiting first keeps that chain two kernels deep, so a kernel that reads before its own
//     wait (dmmv_q8's weights, decode_tc's K/V) overlaps only the kernel just before it.
#pragma once

#include "common/types.cuh"

namespace cukern {

CUKERN_DEVICE void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

CUKERN_DEVICE void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

CUKERN_DEVICE void pdl_enter() {
    pdl_wait();
    pdl_launch_dependents();
}

}  // namespace cukern
