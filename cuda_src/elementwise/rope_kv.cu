// Elementwise family, second unit: RoPE (NeoX / interleaved, partial, multi-section), its fusion
// with the per-head norm and the paged KV write, KV-cache writes and the Q/gate deinterleave;
// rope_vec.cuh holds the vectorised RoPE kernels the host prefers for head_dim = 32, 64, 128, 256.
// A unit of its own so that neither unit's NVRTC compile grows past ~10 s (cukern/elementwise.py
// declares it as ROPE_FAMILY and routes these kernels to it).
#include "elementwise/rope.cuh"
#include "elementwise/kv.cuh"
#include "elementwise/rope_vec.cuh"  // vectorised RoPE kernels for head_dim 32..256
