// Elementwise family: the bandwidth-bound kernels of the decode and prefill loops, f32 activations (the
// f16 / bf16 instances of the norms, activations and RoPE are in act16.cu).
//   norms.cuh        RMS norm and its fusions (residual add, Gemma post-norm, accumulate, Q8_1 output),
//                    per-group norms (per-head Q/K norm, DeltaNet's grouped norm, gated RMS norm)
//   quantize.cuh     f32 -> Q8_1 rows
//   activations.cuh  gated activations and binary ops over (strided) rows
//   moe.cuh          router matvec (+ fused norm), softmax + top-k, expert weighted sum, shared expert
//   ssm.cuh          causal conv1d + SiLU, gated DeltaNet state update (baseline and tiled), its gates
// RoPE and the KV writes (rope.cuh, kv.cuh) are the second unit, rope_kv.cu.
// The host side (cukern/elementwise/) validates arguments and picks the template instance.
#include "elementwise/norms.cuh"
#include "elementwise/quantize.cuh"
#include "elementwise/activations.cuh"
#include "elementwise/moe.cuh"
#include "elementwise/ssm.cuh"
