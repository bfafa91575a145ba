// Attention family, unit 2 of 2: tensor-core prefill over the paged cache and the varlen
// (packed contiguous Q/K/V) forward, both from the one kernel template in prefill.cuh.
// Each element type is its own FamilySpec (name expressions pick the instantiations), so a unit
// compiles in a few seconds.
#include "attention/prefill.cuh"
