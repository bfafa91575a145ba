// Matmul family, unit "matmul": one-pass activation quantizers (f32 -> Q8_1 / Q8_0) and the
// whole-matrix dequantizer to f16 (quantize.cuh).
#include "matmul/quantize.cuh"
