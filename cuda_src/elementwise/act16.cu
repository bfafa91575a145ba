// Elementwise family, 16-bit activation units (elementwise_f16, elementwise_bf16): the f16 or bf16
// instances of the kernels templated on the activation type T: row norms, group norms (norms.cuh), binary
// ops and gated activations (activations.cuh), rope / rms_norm_rope (rope.cuh, rope_vec.cuh). The f32
// instances stay in elementwise.cu and rope_kv.cu, so an f32 model compiles no 16-bit kernel, and each
// 16-bit unit only its type's (cukern/elementwise/dispatch.py lists them).
#include "elementwise/norms.cuh"
#include "elementwise/activations.cuh"
#include "elementwise/rope_vec.cuh"
