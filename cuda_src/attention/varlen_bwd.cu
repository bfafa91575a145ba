// Attention family: the backward of the varlen forward (dQ, dK, dV of packed sequences from the forward's
// output and natural-log LSE), a unit of its own per element type. See varlen_bwd.cuh.
#include "attention/varlen_bwd.cuh"
