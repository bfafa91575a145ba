// Scratch unit (profiling/probe_matmul_wgs.py only; no dispatch launches it): the gemm_wgs experiment.
#include "matmul/params.cuh"
#include "matmul/gemm_wgs.cuh"
