// Matmul family, units "matmul_moe_<type>": the grouped expert GEMMs of MoE prefill (moe_gemm.cuh),
// one unit per weight type, MXFP4 included (dequant_mxfp4.cuh).
#include "matmul/dequant_mxfp4.cuh"
#include "matmul/moe_gemm.cuh"
