// Tokens family: the two ends of a decode step, so that a whole step (embed, forward, sample,
// advance) is one CUDA graph with no host round trip.
//   embed.cuh   embedding rows of a quantized table gathered by device-side token ids
//   sample.cuh  greedy / temperature + top-k + top-p sampling, and the position advance
// The host side is cukern/tokens.py.
#include "tokens/embed.cuh"
#include "tokens/sample.cuh"
