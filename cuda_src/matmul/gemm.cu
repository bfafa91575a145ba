// Matmul family, units "matmul_f16_<type>": the tiled quantized GEMMs on f16 tensor cores, one
// unit per weight type so that each compiles in a few seconds: gemm_f16 (mma.sync, gemm.cuh) and,
// in the same unit, gemm_wgr (Hopper wgmma, gemm_wgr.cuh; the unit is built for sm_90a on sm_90).
#include "matmul/gemm.cuh"
#include "matmul/gemm_wgr.cuh"
