// Scalar types and conversions shared by every cukern family.
//
// NVRTC ships no C/C++ standard headers, so the fixed-width integer types
// are declared here (identical typedefs may be repeated, so this is safe
// alongside toolkit headers that declare them too). Half and bfloat16 come
// from the CUDA headers that the runtime puts on NVRTC's include path.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

#ifndef INFINITY  // NVRTC has no <math.h>
#define INFINITY __int_as_float(0x7f800000)
#endif

// NVRTC has no <cstddef> and no __builtin_offsetof; its front end (EDG) offers
// __INTADDR__, which keeps offsetof a constant expression (usable in static_assert).
#ifndef offsetof
#ifdef __CUDACC_RTC__
#define offsetof(type, member) ((unsigned long long)__INTADDR__(&(((type*)0)->member)))
#else
#define offsetof(type, member) __builtin_offsetof(type, member)
#endif
#endif

#define CUKERN_DEVICE __device__ __forceinline__

namespace cukern {

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Loads and stores that convert between a storage type and f32 arithmetic.
CUKERN_DEVICE float to_float(float x) { return x; }
CUKERN_DEVICE float to_float(__half x) { return __half2float(x); }
CUKERN_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> CUKERN_DEVICE T from_float(float x);
template <> CUKERN_DEVICE float from_float<float>(float x) { return x; }
template <> CUKERN_DEVICE __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> CUKERN_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

}  // namespace cukern
