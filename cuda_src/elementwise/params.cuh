// Parameter structs of the elementwise family, passed by value as the last
// kernel argument. cukern/params.py parses this file: keep to one field per
// line, fixed-width types, a trailing comment with meaning and units.
#pragma once

#include "common/types.cuh"

// rms_norm, residual_rms_norm: row-wise RMS norm of an [n_rows, n_cols] f32 matrix
struct RmsNormParams {
    uint32_t n_rows;      // rows (tokens)
    uint32_t n_cols;      // elements per row (hidden size)
    float eps;            // added to mean(x^2) before the reciprocal square root
    float weight_offset;  // y = x * rsqrt(mean(x^2) + eps) * (w + weight_offset); 1 for unit-offset weights
};

// add_scaled: y = a + alpha * b over n f32 elements (y may alias a: a += alpha * b)
// scale:      y = alpha * a                          (y may alias a)
struct AxpyParams {
    uint32_t n;   // elements
    float alpha;  // multiplier of b (add_scaled) or of a (scale)
};
