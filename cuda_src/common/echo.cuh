// Layout probes for parameter structs (see cukern/params.py).
//
// The Python side parses each family's params.cuh into a NumPy dtype and
// generates a probe unit from these macros:
//   * CUKERN_ASSERT_*: compile-time checks that sizeof, alignof and every
//     offsetof equal the NumPy layout (run by the CPU tests through NVRTC);
//   * CUKERN_ECHO_*: a kernel that receives the struct by value and writes
//     its layout and every field back, field by field (run by the GPU tests),
//     which proves the by-value launch path as well as the layout.
#pragma once

#include "common/types.cuh"

#define CUKERN_ASSERT_SIZE(S, size, align)                                            \
    static_assert(sizeof(S) == (size), #S ": sizeof differs from the Python dtype");  \
    static_assert(alignof(S) == (align), #S ": alignof differs from the Python dtype");

#define CUKERN_ASSERT_FIELD(S, f, offset, size)                                            \
    static_assert(offsetof(S, f) == (offset), #S "." #f ": offset differs from the Python dtype"); \
    static_assert(sizeof(((S*)0)->f) == (size), #S "." #f ": size differs from the Python dtype");

// layout: [sizeof, alignof, offsetof(f0), offsetof(f1), ...]; out: sizeof(S) bytes
#define CUKERN_ECHO_BEGIN(S)                                                          \
    extern "C" __global__ void echo_##S(uint8_t* out, int64_t* layout, const S p) {   \
        typedef S echo_type;                                                          \
        int slot = 2;                                                                 \
        layout[0] = sizeof(S);                                                        \
        layout[1] = alignof(S);

#define CUKERN_ECHO_FIELD(f)                                                          \
        layout[slot++] = offsetof(echo_type, f);                                      \
        {                                                                             \
            const uint8_t* src = reinterpret_cast<const uint8_t*>(&p.f);              \
            for (unsigned i = 0; i < sizeof(p.f); ++i) out[offsetof(echo_type, f) + i] = src[i]; \
        }

#define CUKERN_ECHO_END }
