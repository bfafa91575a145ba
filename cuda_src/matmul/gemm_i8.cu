// Matmul family, units "matmul_i8_<type>": the tiled GEMM of GGUF weights against Q8_1
// activations on int8 tensor cores (gemm_i8.cuh), one unit per weight type.
#include "matmul/gemm_i8.cuh"
