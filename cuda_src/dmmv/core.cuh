// The loop every dmmv kernel shares: a block of NW warps computes NR weight rows against NC
// activation columns. Warp w takes steps w, w + NW, w + 2NW, ... of every row, lanes accumulate
// in f32, and block_reduce() sums over lanes (shuffles) and warps (shared memory). Two loop
// shapes: warp_dots issues the loads of U steps, then decodes them; warp_dots_pipe keeps the
// next step's loads in flight while it decodes the current one (row_dots picks).
//
// Bytes per step and row: Step<QT>::kStepBytes of weights (read once, from HBM), plus
// NC * 1 KiB of x (L1/L2 resident: shared by all NR rows of a warp and by every block).
#pragma once

#include "common/reduce.cuh"
#include "dmmv/step.cuh"

namespace cukern {
namespace qmv {

constexpr int kMaxWarps = 8;  // threads per block: 32 ... 256

// SX: x lies in shared memory (the normed-input kernels, NormedX), else in global memory.
template <bool SX>
CUKERN_DEVICE float4 ld_x4(const float* p) {
    return SX ? *reinterpret_cast<const float4*>(p) : __ldg(reinterpret_cast<const float4*>(p));
}

template <int NC, bool SX>
CUKERN_DEVICE void load_x(const float* const (&xs)[NC], size_t e0, size_t e1, bool ok0, bool ok1,
                          float4 (&xa)[NC], float4 (&xb)[NC]) {
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        xa[c] = ok0 ? ld_x4<SX>(xs[c] + e0) : make_float4(0.f, 0.f, 0.f, 0.f);
        xb[c] = ok1 ? ld_x4<SX>(xs[c] + e1) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

CUKERN_DEVICE float dot4(const float (&q)[4], float4 x) { return q[0] * x.x + q[1] * x.y + q[2] * x.z + q[3] * x.w; }
CUKERN_DEVICE float sum4(float4 x) { return (x.x + x.y) + (x.z + x.w); }

// A kernel's work before its first read of x, run inside the matvec loop (row_dots' lead): under
// programmatic dependent launch, pdl_wait() and the making of x (a NormedX's norms, a MergedX's merge).
struct NoLead {
    CUKERN_DEVICE void operator()() const {}
};
template <class L> struct IsNoLead { static constexpr bool value = false; };
template <> struct IsNoLead<NoLead> { static constexpr bool value = true; };

// One column where every warp's share of the full steps is at most one batch of U steps (a decode step's
// matvecs, k up to nw * U * 256 + the partial step): the warp's weights, the partial last step's included,
// are loaded before lead() runs. Weights are never written by a kernel in flight, so a kernel may load
// them before its pdl_wait, which lead() runs: their DRAM latency overlaps the wait for the previous
// kernel instead of following it.
template <int QT, int NR, int U, bool SX, class Lead>
CUKERN_DEVICE void warp_dots_short(const uint8_t* const (&rows)[NR], const float* x, int n_full, int tail, int warp,
                                   int nw, int lane, float (&acc)[NR][1], Lead& lead) {
    using S = Step<QT>;
    using Raw = typename S::Raw;
    const int o0 = S::x0(lane), o1 = S::x1(lane);
    const bool has_tail = tail > 0 && warp == n_full % nw;
    Raw raw[U + 1][NR];  // the warp's full steps warp + u nw, then the partial step
    bool live[U + 1];
#pragma unroll
    for (int u = 0; u <= U; ++u) {
        const int s = u < U ? warp + u * nw : n_full;
        live[u] = u < U ? s < n_full : has_tail;
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            const uint8_t* p = rows[r] + (size_t)s * S::kStepBytes;
            raw[u][r] = !live[u] ? Raw{} : u < U ? S::template load<false>(p, lane, kStep)
                                                 : S::template load<true>(p, lane, tail);
        }
    }
    lead();
#pragma unroll
    for (int u = 0; u <= U; ++u) {
        if (!live[u]) continue;
        const size_t e = (size_t)(u < U ? warp + u * nw : n_full) * kStep;
        const int lim = u < U ? kStep : tail;
        float4 xa, xb;
        {
            const float* const xs[1] = {x};
            float4 a[1], b[1];
            load_x<1, SX>(xs, e + o0, e + o1, o0 < lim, o1 < lim, a, b);
            xa = a[0];
            xb = b[0];
        }
        const float sa = sum4(xa), sb = sum4(xb);
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            Group g0, g1;
            S::decode(raw[u][r], lane, g0, g1);
            acc[r][0] += g0.a * dot4(g0.q, xa) + g0.b * sa + g1.a * dot4(g1.q, xb) + g1.b * sb;
        }
    }
}

// acc[r][c] += this lane's share of rows[r] . xs[c], over the steps of warp `warp` of `nw`.
// rows[r]: first byte of weight row r; xs[c]: column c of x (k floats, 16-byte aligned).
template <int QT, int NR, int NC, int U, bool SX = false>
CUKERN_DEVICE void warp_dots(const uint8_t* const (&rows)[NR], const float* const (&xs)[NC], int n_full,
                             int tail, int warp, int nw, int lane, float (&acc)[NR][NC]) {
    using S = Step<QT>;
    using Raw = typename S::Raw;
    const int o0 = S::x0(lane), o1 = S::x1(lane);
    for (int s0 = warp; s0 < n_full; s0 += nw * U) {
        Raw raw[U][NR];
        float4 xa[U][NC], xb[U][NC];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int s = s0 + u * nw;
            const bool live = U == 1 || s < n_full;
#pragma unroll
            for (int r = 0; r < NR; ++r)
                raw[u][r] = live ? S::template load<false>(rows[r] + (size_t)s * S::kStepBytes, lane, kStep) : Raw{};
            load_x<NC, SX>(xs, (size_t)s * kStep + o0, (size_t)s * kStep + o1, live, live, xa[u], xb[u]);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float sa[NC], sb[NC];
#pragma unroll
            for (int c = 0; c < NC; ++c) { sa[c] = sum4(xa[u][c]); sb[c] = sum4(xb[u][c]); }
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                Group g0, g1;
                S::decode(raw[u][r], lane, g0, g1);
#pragma unroll
                for (int c = 0; c < NC; ++c)
                    acc[r][c] += g0.a * dot4(g0.q, xa[u][c]) + g0.b * sa[c] + g1.a * dot4(g1.q, xb[u][c]) + g1.b * sb[c];
            }
        }
    }
    if (tail > 0 && warp == n_full % nw) {  // the partial last step (block-32 and float types only)
        const size_t s = n_full;
        float4 xa[NC], xb[NC];
        load_x<NC, SX>(xs, s * kStep + o0, s * kStep + o1, o0 < tail, o1 < tail, xa, xb);
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            Group g0, g1;
            S::decode(S::template load<true>(rows[r] + s * S::kStepBytes, lane, tail), lane, g0, g1);
#pragma unroll
            for (int c = 0; c < NC; ++c)
                acc[r][c] += g0.a * dot4(g0.q, xa[c]) + g0.b * sum4(xa[c]) + g1.a * dot4(g1.q, xb[c]) + g1.b * sum4(xb[c]);
        }
    }
}

// As warp_dots, software-pipelined: the loads of a warp's next step are issued before the
// current step is decoded, so each warp keeps a step of weights in flight while it computes.
template <int QT, int NR, int NC, bool SX = false>
CUKERN_DEVICE void warp_dots_pipe(const uint8_t* const (&rows)[NR], const float* const (&xs)[NC], int n_full,
                                  int tail, int warp, int nw, int lane, float (&acc)[NR][NC]) {
    using S = Step<QT>;
    using Raw = typename S::Raw;
    const int o0 = S::x0(lane), o1 = S::x1(lane);
    Raw cur[NR];
    float4 xa[NC], xb[NC];
    auto fetch = [&](int s, Raw (&raw)[NR], float4 (&a)[NC], float4 (&b)[NC]) {
        const bool live = s < n_full;
#pragma unroll
        for (int r = 0; r < NR; ++r)
            raw[r] = live ? S::template load<false>(rows[r] + (size_t)s * S::kStepBytes, lane, kStep) : Raw{};
        load_x<NC, SX>(xs, (size_t)s * kStep + o0, (size_t)s * kStep + o1, live, live, a, b);
    };
    fetch(warp, cur, xa, xb);
    for (int s = warp; s < n_full; s += nw) {
        Raw nxt[NR];
        float4 na[NC], nb[NC];
        fetch(s + nw, nxt, na, nb);
        float sa[NC], sb[NC];
#pragma unroll
        for (int c = 0; c < NC; ++c) { sa[c] = sum4(xa[c]); sb[c] = sum4(xb[c]); }
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            Group g0, g1;
            S::decode(cur[r], lane, g0, g1);
#pragma unroll
            for (int c = 0; c < NC; ++c)
                acc[r][c] += g0.a * dot4(g0.q, xa[c]) + g0.b * sa[c] + g1.a * dot4(g1.q, xb[c]) + g1.b * sb[c];
        }
#pragma unroll
        for (int r = 0; r < NR; ++r) cur[r] = nxt[r];
#pragma unroll
        for (int c = 0; c < NC; ++c) { xa[c] = na[c]; xb[c] = nb[c]; }
    }
    if (tail > 0 && warp == n_full % nw) {
        const size_t s = n_full;
        float4 ta[NC], tb[NC];
        load_x<NC, SX>(xs, s * kStep + o0, s * kStep + o1, o0 < tail, o1 < tail, ta, tb);
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            Group g0, g1;
            S::decode(S::template load<true>(rows[r] + s * S::kStepBytes, lane, tail), lane, g0, g1);
#pragma unroll
            for (int c = 0; c < NC; ++c)
                acc[r][c] += g0.a * dot4(g0.q, ta[c]) + g0.b * sum4(ta[c]) + g1.a * dot4(g1.q, tb[c]) + g1.b * sum4(tb[c]);
        }
    }
}

// Pick the loop: V = 0 batches U steps then decodes them; V = 1 pipelines one step ahead.
// SX: the columns of x are in shared memory.
// lead(): called once by every thread before x is read; with one column and a short row
// (warp_dots_short), after the warp's weight loads are issued.
template <int QT, int NR, int NC, int V, bool SX = false, class Lead = NoLead>
CUKERN_DEVICE void row_dots(const uint8_t* const (&rows)[NR], const float* const (&xs)[NC], int n_full, int tail,
                            int warp, int nw, int lane, float (&acc)[NR][NC], Lead lead = Lead{}) {
    if constexpr (NC == 1 && !IsNoLead<Lead>::value) {
        constexpr int U = V == 1 ? 1 : (NR <= 4 ? 2 : 1);  // the steps a warp loads at once in its loop
        if (nw * U >= n_full) {  // block-uniform
            warp_dots_short<QT, NR, U, SX>(rows, xs[0], n_full, tail, warp, nw, lane, acc, lead);
            return;
        }
    }
    lead();
    if (V == 1) warp_dots_pipe<QT, NR, NC, SX>(rows, xs, n_full, tail, warp, nw, lane, acc);
    else warp_dots<QT, NR, NC, (NR * NC <= 4 ? 2 : 1), SX>(rows, xs, n_full, tail, warp, nw, lane, acc);
}

// Sum acc over the block: on return, red[i] (i = r * NC + c) holds the total for every thread.
// red: shared, [kMaxWarps][NR * NC] floats.
template <int NR, int NC>
CUKERN_DEVICE void block_reduce(float (&acc)[NR][NC], float* red, int warp, int nw, int lane) {
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const float v = warp_sum(acc[r][c]);
            if (lane == 0) red[warp * NR * NC + r * NC + c] = v;
        }
    __syncthreads();
    if (threadIdx.x < NR * NC) {
        float v = 0.0f;
        for (int w = 0; w < nw; ++w) v += red[w * NR * NC + threadIdx.x];
        red[threadIdx.x] = v;  // warp 0's slot: read before written by this same thread only
    }
    __syncthreads();
}

// Warp sums of V values at once (V a power of two, at most 32): a butterfly that halves the values
// each lane carries at every step, V - 1 + 5 - log2(V) shuffles instead of 5 V. On return, lane l
// holds the total of value l >> (5 - log2 V); the lanes with l % (32 / V) == 0 hold one each.
template <int V>
CUKERN_DEVICE float warp_sum_many(float (&v)[V], int lane) {
    static_assert(V >= 1 && V <= 32 && (V & (V - 1)) == 0, "V: a power of two up to 32");
#pragma unroll
    for (int half = V / 2, offset = 16; half >= 1; half /= 2, offset /= 2) {
        const bool upper = lane & offset;  // this lane keeps the upper half of its values
#pragma unroll
        for (int i = 0; i < half; ++i) {
            const float send = upper ? v[i] : v[i + half];
            const float keep = upper ? v[i + half] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
        }
    }
    float t = v[0];
#pragma unroll
    for (int offset = 16 / V; offset >= 1; offset /= 2) t += __shfl_xor_sync(0xffffffffu, t, offset);
    return t;
}

// Sixteen int8 quants (a 16-byte load) as d * q in f32, exactly converted before the scaling: byte b
// becomes the float with bit pattern 0x4B0000(b ^ 0x80), i.e. 2^23 + 128 + b, and subtracting
// 2^23 + 128 leaves b (one byte permute and one add per quant, where a conversion instruction runs
// at a quarter of the FMA rate).
CUKERN_DEVICE void i8x16_to_float(uint4 raw, float d, float (&w)[16]) {
    constexpr float kBias = 8388736.0f;  // 2^23 + 128
    const uint32_t words[4] = {raw.x ^ 0x80808080u, raw.y ^ 0x80808080u, raw.z ^ 0x80808080u, raw.w ^ 0x80808080u};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            w[4 * i + j] = d * (__uint_as_float(__byte_perm(words[i], 0x4B000000u, 0x7540 + j)) - kBias);
}

CUKERN_DEVICE float silu(float g) { return g / (1.0f + expf(-g)); }
CUKERN_DEVICE float gelu_tanh(float g) {
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}
CUKERN_DEVICE float glu_act(uint32_t act, float g) { return act == 0 ? silu(g) : gelu_tanh(g); }
CUKERN_DEVICE float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

}  // namespace qmv
}  // namespace cukern
