// RoPE angle arithmetic shared by the families that rotate heads (elementwise's RoPE kernels, the
// dmmv family's q/k/v epilogue): the inverse frequency of a pair and the scaled cos/sin of its angle.
#pragma once

#include "common/types.cuh"

namespace cukern {

// scale * cos and scale * sin of pos * inv: the angle in half turns (pos * inv / pi, f64) is reduced to
// [-1, 1] before an f32 sincospif, which keeps f32 accuracy for positions ~1e5 and has no slow path for
// large arguments. scale: the params' attn_scale.
CUKERN_DEVICE void rope_sincos(int32_t pos, double inv, float scale, float& s, float& c) {
    double h = (double)pos * inv * 0.3183098861837907;  // 1 / pi
    h -= 2.0 * rint(0.5 * h);
    sincospif((float)h, &s, &c);
    s *= scale;
    c *= scale;
}

// inv_freq of pair j: freqs[j], or ratio^j by binary powering (<= 9 squarings for j < 512: a few f64 ulps,
// without the long latency of an f64 pow).
CUKERN_DEVICE double rope_inv_freq(uint32_t j, bool use_freqs, double ratio, const float* __restrict__ freqs) {
    if (use_freqs) return (double)freqs[j];
    double acc = 1.0, b = ratio;
    for (uint32_t e = j; e != 0; e >>= 1) {
        if (e & 1) acc *= b;
        b *= b;
    }
    return acc;
}

}  // namespace cukern
