// Elementwise family: the bandwidth-bound kernels of the decode and prefill loops, f32 activations.
//   norms.cuh        RMS norm and its fusions (residual add, Gemma post-norm, accumulate, Q8_1 output),
//                    per-group norms (per-head Q/K norm, DeltaNet's grouped norm, gated RMS norm)
//   activations.cuh  gated activations and binary ops over (strided) rows
//   rope.cuh         RoPE (NeoX / interleaved, partial, multi-section), fused norm + RoPE + KV write
//   kv.cuh           KV-cache writes (paged and contiguous), Q/gate deinterleave
//   moe.cuh          router matvec (+ fused norm), softmax + top-k, expert weighted sum, shared expert
//   ssm.cuh          causal conv1d + SiLU, gated DeltaNet state update (baseline and tiled)
// The host side (cukern/elementwise.py) validates arguments and picks the template instance.
#include "elementwise/norms.cuh"
#include "elementwise/activations.cuh"
#include "elementwise/rope.cuh"
#include "elementwise/kv.cuh"
#include "elementwise/moe.cuh"
#include "elementwise/ssm.cuh"
