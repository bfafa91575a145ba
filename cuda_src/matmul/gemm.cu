// Matmul family, units "matmul_f16_<type>": the tiled quantized GEMM on f16 tensor cores
// (gemm.cuh), one unit per weight type so that each compiles in a few seconds.
#include "matmul/gemm.cuh"
