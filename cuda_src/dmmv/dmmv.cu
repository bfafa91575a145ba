// Quantized matrix-vector products over raw GGUF weights (the decode side of the dmmv family):
//   dmmv      y[c] = epilogue(W x[c]) for NC = 1, 2, 4, 8 columns (weights read once for all);
//             also the pair form (two matrices sharing x: blocks past blocks1 work on W2)
//   dmmv_split  as dmmv, on Q8_0 weights split into an int8 matrix and f16 scales (the LM head)
//   dmmv_split_tc  dmmv_split for 2, 4 or 8 columns on tensor cores (mma.sync, x as two f16 parts)
//   dmmv_glu  y[c] = epilogue(act(Wg x[c]) * (Wu x[c])): fused gate + up + SwiGLU / GEGLU
//   dmmv_nx, dmmv_glu_nx  dmmv (and pair) and dmmv_glu on x = rms_norm(residual + post(proj)),
//             computed by every block (the residual add and norm between a layer's matvecs folded in)
//   dmmv_nx3  dmmv_nx over three matrices, the third of its own type (q, k, v), one column
//   dmmv_mx   dmmv on x merged by every block from split attention states (o_proj after split-KV
//             decode: the merge folded in), one column
//   dmmv_q8   as dmmv (no pair), on the int8 path of the quantized types (q8.cuh); PQ: on x
//             already quantized by
//   quantize_x  f32 x into the int8 path's layout, once for every matvec that shares it
//   dmmv_q8_two  the pair form and dmmv_glu on the int8 path
// Epilogues (DmmvParams.mode): store alpha*v, accumulate y += alpha*v, and the sigmoid-gated
// accumulate y += alpha*sigmoid(gate[c])*v of the shared-expert path.
//
// Grid: one block per R rows (plus the blocks of W2); block: NW warps (host-chosen) that split
// the 256-element steps of those rows. Traffic: every weight byte once; x from L1/L2.
#include "common/pdl.cuh"
#include "dmmv/core.cuh"
#include "dmmv/params.cuh"
#include "dmmv/q8.cuh"

using namespace cukern;
using namespace cukern::qmv;

namespace {
constexpr int kRows = 2;  // default rows per block of dmmv, and dmmv_glu's (each warp works on all of them)

// Before pdl_wait (the weights are never written by a kernel in flight): ask L2 for every 128-byte
// line of the block's NR weight rows, so that the loads after the wait, which would otherwise wait on
// DRAM one step at a time, find them there while the previous kernel ends.
template <int NR>
CUKERN_DEVICE void prefetch_rows_l2(const uint8_t* const (&rows)[NR], uint64_t row_bytes) {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const uint64_t a = reinterpret_cast<uint64_t>(rows[r]);
        const uint64_t last = (a + row_bytes - 1) & ~uint64_t(127);
        for (uint64_t l = (a & ~uint64_t(127)) + 128u * threadIdx.x; l <= last; l += 128u * blockDim.x)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(l) : "memory");
    }
}

// The f32 kernels under programmatic dependent launch: the block's rows asked of L2, then row_dots loads
// each warp's first weights into registers and runs the kernel's lead (pdl_enter: the wait for the previous
// kernel, then the next one let in; x and y are touched only after it; then the making of x where the
// kernel makes it) while those loads are in flight.

template <class P>  // DmmvParams or DmmvNormParams
CUKERN_DEVICE void store(float* y, float v, int c, const float* gate, const P& p) {
    v *= p.alpha;
    if (p.mode == 0) *y = v;
    else if (p.mode == 1) *y += v;
    else *y += sigmoid(gate[c]) * v;
}

// Sum of one float per thread over the block, returned to every thread (red: >= nw floats, shared).
CUKERN_DEVICE float block_total(float v, float* red, int nw, int lane, int warp) {
    v = warp_sum(v);
    __syncthreads();  // red may still be read by a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < nw; ++i) t += red[i];
    return t;
}

CUKERN_DEVICE float4 fma4(float4 a, float s, float4 w, float off, float4 b) {  // a * s * (w + off) + b
    return make_float4(fmaf(a.x * s, w.x + off, b.x), fmaf(a.y * s, w.y + off, b.y), fmaf(a.z * s, w.z + off, b.z),
                       fmaf(a.w * s, w.w + off, b.w));
}
CUKERN_DEVICE float dot4f(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }

// The input of a normed-input kernel (DmmvDispatch's NormedX), computed by every block into shared
// memory xs [NC][k] (after pdl_wait):
//   r = residual                                    (p.post 0)
//     = residual + proj                             (p.post 1)
//     = residual + rms_norm(proj) * (w_post + off)  (p.post 2)
//   x = rms_norm(r) * (w_norm + off),  rms_norm(v) = v / sqrt(mean(v^2) + eps),  off = p.weight_offset
// and block 0 writes r to residual_out where p.write_out. The norm kernel between two matvecs of a
// decoder layer folded into the second: 2-4 k floats per column read by each block from L2 (a decode
// step's hidden state: a few KiB) and two block sums, where a kernel of its own costs a launch and a
// round trip through memory. A thread holds up to kNormItems float4s of each array in registers, all
// loaded at once (one L2 round trip per column: k <= 4 * 4 * 32 * warps, which the host's warp count
// keeps); longer rows take the strided loops of normed_x_loop, one round trip per item.
constexpr int kNormItems = 4;

CUKERN_DEVICE float4 post_add(float4 r, float4 v, float s, float4 w, float off, uint32_t post) {
    if (post == 1) return make_float4(r.x + v.x, r.y + v.y, r.z + v.z, r.w + v.w);
    if (post == 2) return fma4(v, s, w, off, r);
    return r;
}

template <int NC>
CUKERN_DEVICE void normed_x_loop(float* __restrict__ xs, const float* residual, const float* proj,
                                 const float* w_post, const float* w_norm, float* residual_out,
                                 const DmmvNormParams& p, float* red) {
    const int nw = blockDim.x / 32, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const uint32_t k4 = p.k / 4;
    const float off = p.weight_offset;
    const float4* wp4 = reinterpret_cast<const float4*>(w_post);
    const float4* wn4 = reinterpret_cast<const float4*>(w_norm);
    for (int c = 0; c < NC; ++c) {
        const float4* res = reinterpret_cast<const float4*>(residual + (size_t)c * p.x_stride);
        const float4* pr = reinterpret_cast<const float4*>(proj + (size_t)c * p.x_stride);
        float4* xc = reinterpret_cast<float4*>(xs + (size_t)c * p.k);
        float s_post = 1.0f;
        if (p.post == 2) {
            float ss = 0.0f;
            for (uint32_t i = threadIdx.x; i < k4; i += blockDim.x) ss += dot4f(pr[i], pr[i]);
            s_post = rsqrtf(block_total(ss, red, nw, lane, warp) / p.k + p.eps);
        }
        float ss = 0.0f;
        for (uint32_t i = threadIdx.x; i < k4; i += blockDim.x) {
            const float4 r = p.post ? post_add(res[i], pr[i], s_post, __ldg(wp4 + i), off, p.post) : res[i];
            xc[i] = r;
            ss += dot4f(r, r);
        }
        const float s = rsqrtf(block_total(ss, red, nw, lane, warp) / p.k + p.eps);
        float4* out = p.write_out && blockIdx.x == 0
                          ? reinterpret_cast<float4*>(residual_out + (size_t)c * p.x_stride) : nullptr;
        for (uint32_t i = threadIdx.x; i < k4; i += blockDim.x) {
            const float4 r = xc[i];
            if (out != nullptr) out[i] = r;
            xc[i] = fma4(r, s, __ldg(wn4 + i), off, make_float4(0.f, 0.f, 0.f, 0.f));
        }
    }
    __syncthreads();
}

template <int NC>
CUKERN_DEVICE void normed_x(float* __restrict__ xs, const float* residual, const float* proj, const float* w_post,
                            const float* w_norm, float* residual_out, const DmmvNormParams& p, float* red) {
    const uint32_t k4 = p.k / 4;
    if (k4 > kNormItems * blockDim.x) {
        normed_x_loop<NC>(xs, residual, proj, w_post, w_norm, residual_out, p, red);
        return;
    }
    const int nw = blockDim.x / 32, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const float off = p.weight_offset;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    float4 wp[kNormItems], wn[kNormItems];
#pragma unroll
    for (int j = 0; j < kNormItems; ++j) {
        const uint32_t i = threadIdx.x + j * blockDim.x;
        wn[j] = i < k4 ? __ldg(reinterpret_cast<const float4*>(w_norm) + i) : zero;
        wp[j] = i < k4 && p.post == 2 ? __ldg(reinterpret_cast<const float4*>(w_post) + i) : zero;
    }
    for (int c = 0; c < NC; ++c) {
        const float4* res = reinterpret_cast<const float4*>(residual + (size_t)c * p.x_stride);
        const float4* pr = reinterpret_cast<const float4*>(proj + (size_t)c * p.x_stride);
        float4 r[kNormItems], v[kNormItems];
#pragma unroll
        for (int j = 0; j < kNormItems; ++j) {
            const uint32_t i = threadIdx.x + j * blockDim.x;
            r[j] = i < k4 ? res[i] : zero;
            v[j] = i < k4 && p.post ? pr[i] : zero;
        }
        float s_post = 1.0f;
        if (p.post == 2) {
            float ss = 0.0f;
#pragma unroll
            for (int j = 0; j < kNormItems; ++j) ss += dot4f(v[j], v[j]);
            s_post = rsqrtf(block_total(ss, red, nw, lane, warp) / p.k + p.eps);
        }
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < kNormItems; ++j) {
            r[j] = post_add(r[j], v[j], s_post, wp[j], off, p.post);  // zero past k: adds nothing to ss
            ss += dot4f(r[j], r[j]);
        }
        const float s = rsqrtf(block_total(ss, red, nw, lane, warp) / p.k + p.eps);
        const bool out = p.write_out && blockIdx.x == 0;
        float4* xc = reinterpret_cast<float4*>(xs + (size_t)c * p.k);
        float4* rc = reinterpret_cast<float4*>(residual_out + (size_t)c * p.x_stride);
#pragma unroll
        for (int j = 0; j < kNormItems; ++j) {
            const uint32_t i = threadIdx.x + j * blockDim.x;
            if (i < k4) {
                if (out) rc[i] = r[j];
                xc[i] = fma4(r[j], s, wn[j], off, zero);
            }
        }
    }
    __syncthreads();
}

// The weight rows of block blockIdx.x of dmmv / dmmv_nx: R rows of matrix 1, or past p.blocks1 of
// matrix 2 (pair). Rows past m read row m - 1 again, never stored.
template <int R>
struct BlockRows {
    bool second;
    uint32_t m, row0;
    const uint8_t* rows[R];
    // R rows of m from row0 of the matrix at base (dmmv_nx3's matrix 3), stored through y
    CUKERN_DEVICE BlockRows(const uint8_t* base, uint32_t m_, uint32_t row0_, uint64_t row_bytes)
        : second(false), m(m_), row0(row0_) {
#pragma unroll
        for (int r = 0; r < R; ++r) rows[r] = base + (size_t)min(row0 + r, m - 1) * row_bytes;
    }
    template <class P>
    CUKERN_DEVICE BlockRows(const uint8_t* w, const uint8_t* w2, const P& p) {
        second = blockIdx.x >= p.blocks1;
        m = second ? p.m2 : p.m;
        row0 = (second ? blockIdx.x - p.blocks1 : blockIdx.x) * R;
        const uint8_t* base = second ? w2 + p.w2_offset : w + p.w_offset;
#pragma unroll
        for (int r = 0; r < R; ++r) rows[r] = base + (size_t)min(row0 + r, m - 1) * p.row_bytes;
    }
};

// dmmv's body after the entry: the block's dot products against x (SX: in shared memory) and the stores.
template <int QT, int NC, int R, int V, bool SX, class P, class Lead>
CUKERN_DEVICE void dmmv_rows(const BlockRows<R>& b, float* y, float* y2, const float* x, size_t x_stride,
                             const float* gate, const P& p, float* red, Lead lead) {
    if constexpr (NC != 1) lead();  // batches: lead first (row_dots loads one column's weights before it)
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    const float* xs[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) xs[c] = x + (size_t)c * x_stride;
    float acc[R][NC] = {};
    if constexpr (NC == 1) row_dots<QT, R, NC, V, SX>(b.rows, xs, p.n_full, p.tail, warp, nw, lane, acc, lead);
    else row_dots<QT, R, NC, V, SX>(b.rows, xs, p.n_full, p.tail, warp, nw, lane, acc);
    block_reduce<R, NC>(acc, red, warp, nw, lane);
    if (threadIdx.x < R * NC) {
        const int r = threadIdx.x / NC, c = threadIdx.x % NC;
        if (b.row0 + r < b.m) {
            float* out = b.second ? y2 + (size_t)c * p.y2_stride : y + (size_t)c * p.y_stride;
            store(out + b.row0 + r, red[threadIdx.x], c, gate, p);
        }
    }
}

// dmmv_glu's body after the entry: kRows gate rows then kRows up rows, act(gate . x) * (up . x) stored.
template <int QT, int NC, bool SX, class P, class Lead>
CUKERN_DEVICE void glu_rows(const uint8_t* const (&rows)[2 * kRows], uint32_t row0, float* y, const float* x,
                            size_t x_stride, const float* gate, const P& p, float* red, Lead lead) {
    if constexpr (NC != 1) lead();  // as dmmv_rows
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    const float* xs[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) xs[c] = x + (size_t)c * x_stride;
    float acc[2 * kRows][NC] = {};
    if constexpr (NC == 1) row_dots<QT, 2 * kRows, NC, 0, SX>(rows, xs, p.n_full, p.tail, warp, nw, lane, acc, lead);
    else row_dots<QT, 2 * kRows, NC, 0, SX>(rows, xs, p.n_full, p.tail, warp, nw, lane, acc);
    block_reduce<2 * kRows, NC>(acc, red, warp, nw, lane);
    if (threadIdx.x < kRows * NC) {
        const int r = threadIdx.x / NC, c = threadIdx.x % NC;
        if (row0 + r < p.m) {
            const float v = glu_act(p.act, red[threadIdx.x]) * red[kRows * NC + threadIdx.x];
            store(y + (size_t)c * p.y_stride + row0 + r, v, c, gate, p);
        }
    }
}

template <class P>
CUKERN_DEVICE void glu_block_rows(const uint8_t* w, const uint8_t* w2, const P& p, uint32_t row0,
                                  const uint8_t* (&rows)[2 * kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        const size_t row = min(row0 + r, p.m - 1);
        rows[r] = w + p.w_offset + row * p.row_bytes;
        rows[kRows + r] = w2 + p.w2_offset + row * p.row_bytes;
    }
}
}  // namespace

// R: rows per block; V: the loop variant (core.cuh row_dots). The FamilySpec instantiates the
// tuned defaults (_ONE_COL); tests/test_dmmv.py instantiates the others.
template <int QT, int NC, int R = kRows, int V = 0>
__global__ void __launch_bounds__(kMaxWarps * 32) dmmv(
    float* __restrict__ y,             // [NC, y_stride] out: y[c * y_stride + i], i < m
    float* __restrict__ y2,            // [NC, y2_stride] out of matrix 2 (pair); unused otherwise
    const uint8_t* __restrict__ w,     // raw GGUF bytes; matrix 1 = m rows from w + w_offset
    const uint8_t* __restrict__ w2,    // matrix 2 = m2 rows from w2 + w2_offset (pair)
    const float* __restrict__ x,       // [NC, x_stride] f32 columns, 16-byte aligned, k used
    const float* __restrict__ gate,    // [NC] gate logits for mode 2; unused otherwise
    const DmmvParams p) {
    __shared__ float red[kMaxWarps * R * NC];
    const BlockRows<R> b(w, w2, p);
    prefetch_rows_l2<R>(b.rows, p.row_bytes);
    dmmv_rows<QT, NC, R, V, false>(b, y, y2, x, p.x_stride, gate, p, red, [] { pdl_enter(); });
}

// dmmv (and its pair form) on a normed input (DmmvDispatch's NormedX, normed_x above): every block
// first computes its x into dynamic shared memory (NC * k floats), then runs dmmv's rows on it.
// Epilogues: store and accumulate (no gate).
template <int QT, int NC, int R, int V>
__global__ void __launch_bounds__(kMaxWarps * 32) dmmv_nx(
    float* __restrict__ y,             // [NC, y_stride] out: y[c * y_stride + i], i < m
    float* __restrict__ y2,            // [NC, y2_stride] out of matrix 2 (pair); unused otherwise
    const uint8_t* __restrict__ w,     // raw GGUF bytes; matrix 1 = m rows from w + w_offset
    const uint8_t* __restrict__ w2,    // matrix 2 = m2 rows from w2 + w2_offset (pair)
    const float* residual,             // [NC, x_stride] f32, 16-byte aligned, k used
    const float* proj,                 // [NC, x_stride] f32 (post 1, 2); unused otherwise
    const float* __restrict__ w_post,  // [k] f32 post-norm weight of proj (post 2); unused otherwise
    const float* __restrict__ w_norm,  // [k] f32 weight of the norm that makes x
    float* residual_out,               // [NC, x_stride] f32: r, written by block 0 (write_out)
    const DmmvNormParams p) {
    extern __shared__ __align__(16) float xsm[];  // [NC][k]
    __shared__ float red[kMaxWarps * R * NC];
    const BlockRows<R> b(w, w2, p);
    prefetch_rows_l2<R>(b.rows, p.row_bytes);
    dmmv_rows<QT, NC, R, V, true>(b, y, y2, xsm, p.k, static_cast<const float*>(nullptr), p, red, [&] {
        pdl_enter();
        normed_x<NC>(xsm, residual, proj, w_post, w_norm, residual_out, p, red);
    });
}

// Q8_0 weights split for streaming (DmmvDispatch.split_q8_0 -> SplitQ8): the quants as an int8
// matrix [m, k] and the block scales as f16 [m, k / 32], W[i, j] = scales[i, j / 32] * quants[i, j],
// the GGUF blocks' own values and bytes. dmmv reads a GGUF Q8_0 row (34-byte blocks) 2 bytes at a
// time; split, a lane reads 16 quants with one 16-byte load, which an LM head of 262144 rows
// needs to stream near copy bandwidth.
// Block: kSplitWarps warps; warp w takes R consecutive rows from row (blockIdx.x * kSplitWarps + w) R,
// lane l the 16-element chunks l, l + 32, ... of each, U of them per lane loaded at once (every load of
// a row of up to 32 U chunks in flight together). A chunk's quants become floats once and serve every
// column; x is read from L1 once per chunk and column for the R rows. The R * NC sums leave the warp
// through one butterfly (warp_sum_many). Traffic: k + k / 16 bytes of weights per row, read once; x
// from L1/L2.
constexpr int kSplitWarps = 8;

template <int NC, int R, int U>
__global__ void __launch_bounds__(kSplitWarps * 32) dmmv_split(
    float* __restrict__ y,             // [NC, y_stride] out: y[c * y_stride + i], i < m
    const uint8_t* __restrict__ q,     // [m, k] int8 quants, 16-byte aligned, k a multiple of 32
    const __half* __restrict__ s,      // [m, k / 32] f16 scales
    const float* __restrict__ x,       // [NC, x_stride] f32 columns, 16-byte aligned, k used
    const float* __restrict__ gate,    // [NC] gate logits for mode 2; unused otherwise
    const DmmvParams p) {
    static_assert(R * NC <= 32 && ((R * NC) & (R * NC - 1)) == 0, "R * NC: a power of two up to 32");
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const uint32_t row0 = (blockIdx.x * kSplitWarps + warp) * R;
    const uint32_t chunks = p.k / 16, blocks = p.k / 32;
    {  // the block's quants are one contiguous range: ask L2 for it before the wait
        const uint32_t first = blockIdx.x * kSplitWarps * R;
        const uint8_t* rows[1] = {q + (size_t)first * p.k};
        prefetch_rows_l2<1>(rows, (uint64_t)min(kSplitWarps * R, (int)(p.m - first)) * p.k);
    }
    pdl_enter();
    const uint8_t* qr[R];
    const __half* sr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const size_t row = min(row0 + r, p.m - 1);  // past m: recompute row m-1, never stored
        qr[r] = q + row * p.k;
        sr[r] = s + row * blocks;
    }
    float acc[R * NC] = {};
    for (uint32_t t0 = 0; t0 < chunks; t0 += 32 * U) {
        uint4 raw[U][R];
        float d[U][R];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t t = t0 + u * 32 + lane;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                raw[u][r] = t < chunks ? ld_stream_u128(qr[r] + 16 * t) : make_uint4(0, 0, 0, 0);
                d[u][r] = t < chunks ? __half2float(sr[r][t / 2]) : 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t t = t0 + u * 32 + lane;
            if (t >= chunks) break;  // the later u of this lane are past the row too
            float w[R][16];
#pragma unroll
            for (int r = 0; r < R; ++r) i8x16_to_float(raw[u][r], d[u][r], w[r]);
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const float4* xc = reinterpret_cast<const float4*>(x + (size_t)c * p.x_stride + 16 * t);
                const float4 xv[4] = {__ldg(xc), __ldg(xc + 1), __ldg(xc + 2), __ldg(xc + 3)};
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float a = acc[r * NC + c];
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        a += w[r][4 * e] * xv[e].x + w[r][4 * e + 1] * xv[e].y + w[r][4 * e + 2] * xv[e].z
                             + w[r][4 * e + 3] * xv[e].w;
                    acc[r * NC + c] = a;
                }
            }
        }
    }
    const float v = warp_sum_many<R * NC>(acc, lane);
    constexpr int kLanesPer = 32 / (R * NC);
    const int i = lane / kLanesPer, r = i / NC, c = i % NC;
    if (lane % kLanesPer == 0 && row0 + r < p.m) store(y + (size_t)c * p.y_stride + row0 + r, v, c, gate, p);
}

// dmmv_split on tensor cores for NC = 2, 4, 8 columns (DmmvDispatch picks it for those chunk widths on
// sm_80+; one column stays on dmmv_split): the same SplitQ8 weights and epilogues, the products by
// mma.sync m16n8k16 (f16 inputs, f32 accumulators), so that the weights stream without the f32
// kernel's per-column FMAs.
//
// Operands. A = 16 weight rows x 16 k of int8 quants as f16 (|q| <= 128: exact). B = 16 k x 8 columns n
// of x split into two f16 parts per element: hi = f16(x * 2^-e), lo = f16(x * 2^-e - hi), 2^-e a power
// of two per column, from the column's max |x| = M, so that max |x * 2^-e| lies in [2^14, 2^15): hi
// never overflows, and lo is normal (11 more bits) for |x| >= ~2^-17 M. B column n < NC is hi of x
// column n, NC <= n < 2 NC lo of column n - NC (one B operand per k-step for NC <= 4), n >= 2 NC zero;
// NC = 8 takes a hi and a lo B operand per k-step (kSets = 2), both into the same accumulators. Each
// (row, 32-block) is two k-steps; their products are summed in a zeroed f32 tile and added into the
// row's accumulator times the block's f16 scale (W = scale * q exactly); at the end the hi and lo sums
// of a column are added and scaled back by 2^e.
// Error: the f16 products are exact; x is represented as hi + lo with |x 2^-e - hi - lo| <=
// max(2^-22 |x 2^-e|, 2^-25) (hi's rounding error <= 2^-11 |x 2^-e| is rounded again into lo; 2^-25
// is half of f16's least subnormal), so each element of x contributes an error of at most
// 2^-22 |x_i| + 2^-39 M, and |result - W x| <= sum_i |W_ij| (2^-22 |x_i| + 2^-39 M) plus the f32
// summation error (the tensor core's additions of 16 products, which may truncate, and the f32 adds
// of the blocks): the f32 kernel's accuracy for any finite x.
//
// Layout. A warp owns RT tiles of 16 consecutive rows; it walks k in chunks of 64 (two 32-blocks).
// Lane (g, t) = (lane / 4, lane % 4) loads rows g and g + 8 of each tile at elements 64 c + 16 t ...
// + 15 (one 16-byte load per row), so lanes t < 2 hold block 2c and lanes t >= 2 block 2c + 1; one
// exchange of 8 bytes with lane t ^ 2 leaves each lane 8 quants of either block, at offset off(t) =
// 16 (t & 1) + 8 (t >> 1) within the block, 4 per k-step: the A fragment's (2t, 2t+1, 2t+8, 2t+9) are
// those 4 consecutive k (the k order within a k-step is the same permutation for A and B). x is
// converted once per block into shared memory as 2 NC rows of f16 (row n: B column n), read as one
// 16-byte load per lane, block half and B operand (conflict-free: rows are k | 32 halves apart). The
// next chunk's loads are issued before the current chunk is computed; the first chunk's (and an L2
// prefetch of all the block's rows) before pdl_wait.
// Grid: one block per kSplitTcWarps * RT * 16 rows (past m: row m - 1 again, never stored); dynamic
// shared memory 2 NC (k | 32) halves. Traffic: k + k / 16 bytes of weights per row, read once; x once
// per block from L2.
constexpr int kSplitTcWarps = 8;

// Four int8 quants (the bytes of w, elements e ... e + 3) as two f16 pairs, exactly: (e, e + 1) in lo,
// (e + 2, e + 3) in hi. q + 128 is put into the low byte of 1024 (0x6400, ulp 1) and 1152 subtracted.
CUKERN_DEVICE void i8x4_to_f16x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
    const uint32_t u = w ^ 0x80808080u;
    const __half2 bias = __half2half2(__ushort_as_half((unsigned short)0x6480u));  // 1152
    uint32_t a = __byte_perm(u, 0x6464u, 0x4140u), b = __byte_perm(u, 0x6464u, 0x4342u);
    const __half2 ha = __hsub2(*reinterpret_cast<const __half2*>(&a), bias);
    const __half2 hb = __hsub2(*reinterpret_cast<const __half2*>(&b), bias);
    lo = *reinterpret_cast<const uint32_t*>(&ha);
    hi = *reinterpret_cast<const uint32_t*>(&hb);
}

// One 64-element chunk of a warp's RT tiles as loaded: rows g and g + 8 of each tile.
template <int RT>
struct TcChunk {
    uint4 w[RT][2];     // quants 64 c + 16 t ... + 15 (zero past k)
    uint32_t d[RT][2];  // f16 scales of blocks 2c (low half) and 2c + 1 (high half; zero past k)
};

template <int RT>
CUKERN_DEVICE void tc_load(TcChunk<RT>& ch, const uint8_t* const (&qr)[RT][2],
                           const unsigned short* const (&sr)[RT][2], uint32_t c, uint32_t chunks, uint32_t k,
                           int t) {
    const bool in = c < chunks, two = in && 64 * c + 32 < k;  // two: the chunk's second block exists
    const bool mine = t < 2 ? in : two;
    const bool pair = (k & 63) == 0;  // k / 32 even: each row's scales 2c, 2c + 1 are one aligned word
#pragma unroll
    for (int i = 0; i < RT; ++i) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            ch.w[i][r] = mine ? ld_stream_u128(qr[i][r] + 64 * c) : make_uint4(0, 0, 0, 0);
            if (pair) {
                ch.d[i][r] = in ? __ldg(reinterpret_cast<const unsigned int*>(sr[i][r] + 2 * c)) : 0u;
            } else {
                const uint32_t d0 = in ? (uint32_t)__ldg(sr[i][r] + 2 * c) : 0u;
                const uint32_t d1 = two ? (uint32_t)__ldg(sr[i][r] + 2 * c + 1) : 0u;
                ch.d[i][r] = d0 | (d1 << 16);
            }
        }
    }
}

// One tile's chunk: the 8-byte exchange, then per block h (the second only where it exists) its two
// k-steps' MMAs against the B fragments b[set][h] into a zeroed tile, added to acc times the scales.
template <int NSETS>
CUKERN_DEVICE void tc_tile(float (&acc)[4], const uint4 (&w)[2], const uint32_t (&d)[2],
                           const uint4 (&b)[NSETS][2], bool two, int t) {
    uint2 blk[2][2];  // [h][row g, g + 8]: 8 quants of block 2c + h at off(t)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const bool low = t < 2;  // holds block 2c; sends its second half, receives lane t ^ 2's first
        const uint32_t r0 = __shfl_xor_sync(0xFFFFFFFFu, low ? w[r].z : w[r].x, 2);
        const uint32_t r1 = __shfl_xor_sync(0xFFFFFFFFu, low ? w[r].w : w[r].y, 2);
        blk[0][r] = low ? make_uint2(w[r].x, w[r].y) : make_uint2(r0, r1);
        blk[1][r] = low ? make_uint2(r0, r1) : make_uint2(w[r].z, w[r].w);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (h == 1 && !two) break;
        float tile[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            uint32_t a[4];  // a0 (row g, k 2t..), a1 (g + 8, 2t..), a2 (g, 2t + 8..), a3 (g + 8, 2t + 8..)
            i8x4_to_f16x4(j ? blk[h][0].y : blk[h][0].x, a[0], a[2]);
            i8x4_to_f16x4(j ? blk[h][1].y : blk[h][1].x, a[1], a[3]);
#pragma unroll
            for (int s = 0; s < NSETS; ++s)
                mma16816<__half>(tile, a, j ? b[s][h].z : b[s][h].x, j ? b[s][h].w : b[s][h].y);
        }
        const float2 d0 = __half22float2(*reinterpret_cast<const __half2*>(&d[0]));
        const float2 d1 = __half22float2(*reinterpret_cast<const __half2*>(&d[1]));
        const float s0 = h ? d0.y : d0.x, s1 = h ? d1.y : d1.x;  // rows g, g + 8
        acc[0] = fmaf(s0, tile[0], acc[0]);
        acc[1] = fmaf(s0, tile[1], acc[1]);
        acc[2] = fmaf(s1, tile[2], acc[2]);
        acc[3] = fmaf(s1, tile[3], acc[3]);
    }
}

CUKERN_DEVICE float pow2f(int e) { return __int_as_float((e + 127) << 23); }  // e in [-126, 127]

template <int NC, int RT>
__global__ void __launch_bounds__(kSplitTcWarps * 32) dmmv_split_tc(
    float* __restrict__ y,             // [NC, y_stride] out: y[c * y_stride + i], i < m
    const uint8_t* __restrict__ q,     // [m, k] int8 quants, 16-byte aligned, k a multiple of 32
    const __half* __restrict__ s,      // [m, k / 32] f16 scales
    const float* __restrict__ x,       // [NC, x_stride] f32 columns, 16-byte aligned, k used
    const float* __restrict__ gate,    // [NC] gate logits for mode 2; unused otherwise
    const DmmvParams p) {
    static_assert(NC == 2 || NC == 4 || NC == 8, "NC: 2, 4 or 8 (one column takes dmmv_split)");
    constexpr int kSets = NC == 8 ? 2 : 1;     // B operands per k-step
    constexpr int kRows = kSplitTcWarps * RT * 16;  // rows per block
    extern __shared__ __align__(16) __half xh[];  // [2 NC][k | 32]: row n < NC hi of column n, NC + c lo of c
    __shared__ float red[kSplitTcWarps][NC];
    __shared__ float fwd[NC][2], back[NC][2];  // per column: 2^-e and 2^e, each as two powers of two
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const uint32_t k = p.k, chunks = (k + 63) / 64, xs_stride = k | 32;
    const uint32_t first = blockIdx.x * kRows, row0 = first + warp * RT * 16;
    {  // the block's quants and scales are two contiguous ranges: ask L2 for them before the wait
        const uint32_t rows = min((uint32_t)kRows, p.m - first);
        const uint8_t* qa[1] = {q + (size_t)first * k};
        const uint8_t* sa[1] = {reinterpret_cast<const uint8_t*>(s + (size_t)first * (k / 32))};
        prefetch_rows_l2<1>(qa, (uint64_t)rows * k);
        prefetch_rows_l2<1>(sa, (uint64_t)rows * (k / 16));
    }
    const uint8_t* qr[RT][2];
    const unsigned short* sr[RT][2];
#pragma unroll
    for (int i = 0; i < RT; ++i) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const size_t row = min(row0 + 16 * i + 8 * r + g, p.m - 1);  // past m: row m-1 again, never stored
            qr[i][r] = q + row * k + 16 * t;
            sr[i][r] = reinterpret_cast<const unsigned short*>(s) + row * (k / 32);
        }
    }
    TcChunk<RT> cur;
    tc_load<RT>(cur, qr, sr, 0, chunks, k, t);  // weights only: before the wait
    pdl_enter();

    // x into shared memory: per column its max |x|, the scale, then hi and lo of every element
    const uint32_t k4 = k / 4;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float mx[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        mx[c] = 0.0f;
        for (uint32_t i = threadIdx.x; i < k4; i += kSplitTcWarps * 32) {
            const float4 v = __ldg(x4 + (size_t)c * (p.x_stride / 4) + i);
            mx[c] = fmaxf(mx[c], fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
        }
        mx[c] = warp_max(mx[c]);
    }
    if (lane == 0) {
#pragma unroll
        for (int c = 0; c < NC; ++c) red[warp][c] = mx[c];
    }
    __syncthreads();
    if (threadIdx.x < NC) {
        float m = 0.0f;
        for (int w = 0; w < kSplitTcWarps; ++w) m = fmaxf(m, red[w][threadIdx.x]);
        int e2 = 0;  // m = f 2^e2, f in [0.5, 1): m 2^(15 - e2) in [2^14, 2^15)
        if (m > 0.0f && m <= 3.402823466e38f) frexpf(m, &e2);
        const int sh = 15 - e2, a = sh / 2, b = sh - a;  // sh in [-113, 163]: a, b in [-57, 82]
        fwd[threadIdx.x][0] = pow2f(a);
        fwd[threadIdx.x][1] = pow2f(b);
        back[threadIdx.x][0] = pow2f(-a);
        back[threadIdx.x][1] = pow2f(-b);
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const float f0 = fwd[c][0], f1 = fwd[c][1];
        uint2* hi = reinterpret_cast<uint2*>(xh + (size_t)c * xs_stride);
        uint2* lo = reinterpret_cast<uint2*>(xh + (size_t)(NC + c) * xs_stride);
        for (uint32_t i = threadIdx.x; i < k4; i += kSplitTcWarps * 32) {
            const float4 v = __ldg(x4 + (size_t)c * (p.x_stride / 4) + i);
            const float e[4] = {v.x * f0 * f1, v.y * f0 * f1, v.z * f0 * f1, v.w * f0 * f1};
            __half h[4], l[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                h[j] = __float2half_rn(e[j]);
                l[j] = __float2half_rn(e[j] - __half2float(h[j]));
            }
            const __half2 h01 = __halves2half2(h[0], h[1]), h23 = __halves2half2(h[2], h[3]);
            const __half2 l01 = __halves2half2(l[0], l[1]), l23 = __halves2half2(l[2], l[3]);
            hi[i] = make_uint2(*reinterpret_cast<const uint32_t*>(&h01), *reinterpret_cast<const uint32_t*>(&h23));
            lo[i] = make_uint2(*reinterpret_cast<const uint32_t*>(&l01), *reinterpret_cast<const uint32_t*>(&l23));
        }
    }
    __syncthreads();

    float acc[RT][4] = {};
    const int off = 16 * (t & 1) + 8 * (t >> 1);
    for (uint32_t c = 0; c < chunks; ++c) {
        TcChunk<RT> nxt;
        tc_load<RT>(nxt, qr, sr, c + 1, chunks, k, t);  // in flight while this chunk is computed
        const bool two = 64 * c + 32 < k;
        uint4 b[kSets][2];
#pragma unroll
        for (int st = 0; st < kSets; ++st) {
            const int n = 8 * st + g;  // B column n: shared row n
#pragma unroll
            for (int h = 0; h < 2; ++h)
                b[st][h] = n < 2 * NC && (h == 0 || two)
                               ? *reinterpret_cast<const uint4*>(xh + (size_t)n * xs_stride + 64 * c + 32 * h + off)
                               : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < RT; ++i) tc_tile<kSets>(acc[i], cur.w[i], cur.d[i], b, two, t);
        cur = nxt;
    }

    // C fragment: acc[i][e] is row 16 i + g + 8 (e / 2), B column n = 2t + e % 2
#pragma unroll
    for (int i = 0; i < RT; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float v = acc[i][e];
            if (kSets == 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, NC / 2);  // lane t < NC/2: hi + lo of column n
            const int n = 2 * t + (e & 1);
            const uint32_t row = row0 + 16 * i + g + 8 * (e >> 1);
            if (n < NC && row < p.m)
                store(y + (size_t)n * p.y_stride + row, v * back[n][0] * back[n][1], n, gate, p);
        }
    }
}

// dmmv_nx with a third matrix of its own type (a decoder layer's q, k and v in one launch; one
// column): blocks [0, blocks1) take R rows of matrix 1, [blocks1, blocks2) R rows of matrix 2 (both
// type QT, loop variant V), [blocks2, grid) R3 rows of matrix 3 (type QT3, variant V3).
template <int QT, int R, int V, int QT3, int R3, int V3>
__global__ void __launch_bounds__(kMaxWarps * 32) dmmv_nx3(
    float* __restrict__ y,             // [m] out of matrix 1
    float* __restrict__ y2,            // [m2] out of matrix 2
    float* __restrict__ y3,            // [m3] out of matrix 3
    const uint8_t* __restrict__ w,     // raw GGUF bytes; matrix 1 = m rows from w + w_offset
    const uint8_t* __restrict__ w2,    // matrix 2 = m2 rows from w2 + w2_offset (type QT)
    const uint8_t* __restrict__ w3,    // matrix 3 = m3 rows from w3 + w3_offset (type QT3)
    const float* residual,             // [x_stride] f32, 16-byte aligned, k used
    const float* proj,                 // [x_stride] f32 (post 1, 2); unused otherwise
    const float* __restrict__ w_post,  // [k] f32 post-norm weight of proj (post 2); unused otherwise
    const float* __restrict__ w_norm,  // [k] f32 weight of the norm that makes x
    float* residual_out,               // [x_stride] f32: r, written by block 0 (write_out)
    const DmmvNormParams p) {
    extern __shared__ __align__(16) float xsm[];  // [k]
    __shared__ float red[kMaxWarps * (R > R3 ? R : R3)];
    if (blockIdx.x >= p.blocks2) {
        const BlockRows<R3> b(w3 + p.w3_offset, p.m3, (blockIdx.x - p.blocks2) * R3, p.row_bytes3);
        prefetch_rows_l2<R3>(b.rows, p.row_bytes3);
        dmmv_rows<QT3, 1, R3, V3, true>(b, y3, y3, xsm, p.k, static_cast<const float*>(nullptr), p, red, [&] {
            pdl_enter();
            normed_x<1>(xsm, residual, proj, w_post, w_norm, residual_out, p, red);
        });
    } else {
        const BlockRows<R> b(w, w2, p);
        prefetch_rows_l2<R>(b.rows, p.row_bytes);
        dmmv_rows<QT, 1, R, V, true>(b, y, y2, xsm, p.k, static_cast<const float*>(nullptr), p, red, [&] {
            pdl_enter();
            normed_x<1>(xsm, residual, proj, w_post, w_norm, residual_out, p, red);
        });
    }
}

// x of dmmv_mx (DmmvDispatch's MergedX) into shared memory, in two passes. First warp w weighs the
// states of heads w, w + nw, ...: M = the largest LSE (or the sink), den = sum_s exp(lse - M) (+ the
// sink's), kept as (M, 1 / den) in st; an empty state (LSE -inf) weighs nothing, and a head with no
// keys and no sink gets x = 0 (merge_states' rule). Then every thread takes float4 columns of the
// heads and sums their states kMergeUnroll at a time, the loads of a group issued together before
// any is weighed (an empty state's O is loaded but never added). Reads n_states * (head_dim + 1)
// floats a head from L2 (a decode step's partials: a few to some tens of KiB).
constexpr int kMergeUnroll = 4;

CUKERN_DEVICE void merged_x(float* __restrict__ xs, float* __restrict__ st, const float* o_part,
                            const float* lse_part, const float* sinks, const DmmvMergeParams& p) {
    const int nw = blockDim.x / 32, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const uint32_t ns = p.n_states, nh = p.n_heads, d4 = p.head_dim / 4;
    for (uint32_t h = warp; h < nh; h += nw) {
        const float* l = lse_part + h;  // state s at l[s * nh]
        float sk = p.has_sinks ? sinks[p.sink_offset + h] : -INFINITY;
        if ((__float_as_uint(sk) & 0x7fffffffu) > 0x7f800000u) sk = -INFINITY;  // NaN: no sink (bit test: fast math)
        float mx = sk;
        for (uint32_t s = lane; s < ns; s += 32) mx = fmaxf(mx, l[(size_t)s * nh]);
        mx = warp_max(mx);
        const float mu = mx == -INFINITY ? 0.0f : mx;
        float den = 0.0f;
        for (uint32_t s = lane; s < ns; s += 32) den += __expf(l[(size_t)s * nh] - mu);
        den = warp_sum(den);
        den += __expf(sk - mu);  // 0 without a sink
        if (lane == 0) {
            st[2 * h] = mu;
            st[2 * h + 1] = den > 0.0f ? 1.0f / den : 0.0f;
        }
    }
    __syncthreads();
    const size_t state4 = (size_t)nh * d4;  // float4s from one state to the next
    for (uint32_t i = threadIdx.x; i < nh * d4; i += blockDim.x) {
        const uint32_t h = i / d4;
        const float mu = st[2 * h], inv = st[2 * h + 1];
        const float* l = lse_part + h;
        const float4* o4 = reinterpret_cast<const float4*>(o_part) + i;  // (h, column) of state 0
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (uint32_t s0 = 0; s0 < ns; s0 += kMergeUnroll) {
            float e[kMergeUnroll];
            float4 v[kMergeUnroll];
#pragma unroll
            for (int u = 0; u < kMergeUnroll; ++u) {
                const bool in = s0 + u < ns;
                e[u] = in ? l[(size_t)(s0 + u) * nh] : -INFINITY;
                v[u] = in ? o4[(s0 + u) * state4] : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int u = 0; u < kMergeUnroll; ++u) {
                const float ws = __expf(e[u] - mu);
                if (ws > 0.0f) {
                    acc.x = fmaf(ws, v[u].x, acc.x);
                    acc.y = fmaf(ws, v[u].y, acc.y);
                    acc.z = fmaf(ws, v[u].z, acc.z);
                    acc.w = fmaf(ws, v[u].w, acc.w);
                }
            }
        }
        reinterpret_cast<float4*>(xs)[i] = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    }
    __syncthreads();
}

// dmmv on x merged from split attention states (merged_x above), one column: the attention output
// projection after a split-KV decode with the merge folded in, where a merge launch of its own costs
// a launch and a round trip through memory. Epilogues: store and accumulate.
template <int QT, int R, int V>
__global__ void __launch_bounds__(kMaxWarps * 32) dmmv_mx(
    float* __restrict__ y,             // [m] out
    const uint8_t* __restrict__ w,     // raw GGUF bytes; the matrix = m rows from w + w_offset
    const float* o_part,               // [n_states, n_heads, head_dim] f32 normalised partial outputs, 16-byte aligned
    const float* lse_part,             // [n_states, n_heads] f32 their natural-log LSE (-inf: no keys)
    const float* __restrict__ sinks,   // [sink_offset + n_heads] f32 natural-log sink logits, NaN: none (has_sinks)
    const DmmvMergeParams p) {
    extern __shared__ __align__(16) float xsm[];  // [k] x, then [n_heads][2] each head's (M, 1 / den)
    __shared__ float red[kMaxWarps * R];
    const BlockRows<R> b(w, w, p);
    prefetch_rows_l2<R>(b.rows, p.row_bytes);
    pdl_enter();
    merged_x(xsm, xsm + p.k, o_part, lse_part, sinks, p);  // before any weight load: its registers are many
    dmmv_rows<QT, 1, R, V, true>(b, y, y, xsm, p.k, static_cast<const float*>(nullptr), p, red, NoLead{});
}

template <int QT, int NC>
__global__ void __launch_bounds__(kMaxWarps * 32) dmmv_glu(
    float* __restrict__ y,             // [NC, y_stride] out: act(gate . x) * (up . x)
    const uint8_t* __restrict__ w,     // gate matrix: m rows from w + w_offset
    const uint8_t* __restrict__ w2,    // up matrix: m rows from w2 + w2_offset, same type and k
    const float* __restrict__ x,       // [NC, x_stride] f32 columns, 16-byte aligned
    const float* __restrict__ gate,    // [NC] gate logits for mode 2; unused otherwise
    const DmmvParams p) {
    __shared__ float red[kMaxWarps * 2 * kRows * NC];
    const uint32_t row0 = blockIdx.x * kRows;
    const uint8_t* rows[2 * kRows];  // gate rows, then up rows
    glu_block_rows(w, w2, p, row0, rows);
    prefetch_rows_l2<2 * kRows>(rows, p.row_bytes);
    glu_rows<QT, NC, false>(rows, row0, y, x, p.x_stride, gate, p, red, [] { pdl_enter(); });
}

// dmmv_glu on a normed input (NormedX), as dmmv_nx: the FFN's gate + up + activation with the norm
// before it (and the residual add before that) computed by every block.
template <int QT, int NC>
__global__ void __launch_bounds__(kMaxWarps * 32) dmmv_glu_nx(
    float* __restrict__ y,             // [NC, y_stride] out: act(gate . x) * (up . x)
    const uint8_t* __restrict__ w,     // gate matrix: m rows from w + w_offset
    const uint8_t* __restrict__ w2,    // up matrix: m rows from w2 + w2_offset, same type and k
    const float* residual,             // [NC, x_stride] f32, 16-byte aligned, k used
    const float* proj,                 // [NC, x_stride] f32 (post 1, 2); unused otherwise
    const float* __restrict__ w_post,  // [k] f32 post-norm weight of proj (post 2); unused otherwise
    const float* __restrict__ w_norm,  // [k] f32 weight of the norm that makes x
    float* residual_out,               // [NC, x_stride] f32: r, written by block 0 (write_out)
    const DmmvNormParams p) {
    extern __shared__ __align__(16) float xsm[];  // [NC][k]
    __shared__ float red[kMaxWarps * 2 * kRows * NC];
    const uint32_t row0 = blockIdx.x * kRows;
    const uint8_t* rows[2 * kRows];
    glu_block_rows(w, w2, p, row0, rows);
    prefetch_rows_l2<2 * kRows>(rows, p.row_bytes);
    glu_rows<QT, NC, true>(rows, row0, y, xsm, p.k, static_cast<const float*>(nullptr), p, red, [&] {
        pdl_enter();
        normed_x<NC>(xsm, residual, proj, w_post, w_norm, residual_out, p, red);
    });
}

// The int8 path (q8.cuh): a persistent grid (the host sizes it to the resident blocks), block b
// taking rows [b m / G, (b + 1) m / G) (q8::Share: m / G each, the first m % G one more); each
// block quantizes its NC columns of x into shared memory once, then its warps stream equal shares
// of those rows (q8::block_rows) with LU units per lane and iteration through rings of ST slots
// (BULK: Hopper bulk copies, else cp.async). Dynamic shared memory: q8::smem_bytes<QT, LU, ST>(nw, NC, k).
// Under programmatic dependent launch the first ST - 1 weight chunks of every warp are in flight
// before pdl_wait() (and p.l2_items more are asked of L2); x, gate and y are touched only after it.
// The weights stream with an L2 evict-first policy (q8::block_rows_x, EF).
// PQ: x is already quantized (quantize_x below): each block copies its columns instead.
template <int QT, int NC, int LU, int ST, bool BULK, bool PQ = false>
__global__ void __launch_bounds__(q8::kMaxWarps * 32) dmmv_q8(
    float* __restrict__ y,             // [NC, y_stride] out: y[c * y_stride + i], i < m
    const uint8_t* __restrict__ w,     // raw GGUF bytes; m rows from w + w_offset
    const void* __restrict__ x,        // [NC, x_stride] f32 columns, 16-byte aligned, k used; PQ: [NC]
                                       // pre-quantized columns of x_stride bytes (q8::load_x)
    const float* __restrict__ gate,    // [NC] gate logits for mode 2; unused otherwise
    const DmmvParams p) {
    extern __shared__ __align__(16) uint8_t smem[];
    pdl_launch_dependents();
    const int nw = blockDim.x / 32;
    if (q8::smem_bytes<QT, LU, ST>(nw, NC, p.k) > q8::dynamic_smem_bytes()) __trap();  // a launcher bug
    const q8::Smem<QT, LU, ST, NC> sm(smem, nw, p.k);
    const q8::Share rows(p.m, blockIdx.x, gridDim.x);  // this block's rows [r0, r1)
    const uint32_t r0 = rows.begin, r1 = rows.end;
    const uint8_t* base = w + p.w_offset;
    q8::block_rows<QT, NC, LU, ST, BULK, true>(
        sm, r1 - r0, [&](uint32_t j) { return base + (size_t)(r0 + j) * p.row_bytes; }, (uint32_t)p.row_bytes,
        [&](uint32_t) { return base + (size_t)p.m * p.row_bytes; }, p.k,
        [] { pdl_wait(); },
        [&] {
            for (int c = 0; c < NC; ++c) {
                int8_t* q = sm.xq + (size_t)c * p.k;
                q8::XInfo* info = sm.xi + c * (p.k / 32);
                if (PQ) q8::load_x(static_cast<const uint8_t*>(x) + (size_t)c * p.x_stride, p.k, q, info);
                else q8::quantize_x<QT>(static_cast<const float*>(x) + (size_t)c * p.x_stride, p.k, q, info);
            }
            __syncthreads();
        },
        [&](uint32_t j, const float (&v)[NC]) {
#pragma unroll
            for (int c = 0; c < NC; ++c) {  // the store epilogue; its sigmoid by a fast division: an IEEE
                                            // one calls a slow path, and a call in the row loop costs it
                const float f = p.mode == 2 ? __fdividef(p.alpha, 1.0f + __expf(-gate[c])) : p.alpha;
                float* out = y + (size_t)c * p.y_stride + r0 + j;
                *out = p.mode == 0 ? f * v[c] : *out + f * v[c];
            }
        }, p.l2_items);
}

// The int8 path of the two-matrix forms (DmmvDispatch.dmmv_pair / dmmv_glu), grid and x as dmmv_q8:
//   GLU false (pair): y = W1 x, y2 = W2 x; blocks [0, blocks1) take balanced row ranges of W1, the
//     others of W2 (the host splits the grid by the matrices' rows);
//   GLU true: y = epilogue(act(Wg x) * (Wu x)) (act: p.act, epilogue: p.mode 0 store, 1 accumulate,
//     times alpha); block b takes outputs [b m / G, (b + 1) m / G) and streams their gate and up rows
//     as one sequence (local row 2i: gate row i, 2i + 1: up row i), so the two dot products of an
//     output come from one pass over the block's bytes; they land in shared memory after x's
//     (2 NC floats per output: the host adds them to the dynamic size) and are combined after the
//     block's last barrier.
template <int QT, int NC, int LU, int ST, bool BULK, bool GLU>
__global__ void __launch_bounds__(q8::kMaxWarps * 32) dmmv_q8_two(
    float* __restrict__ y,             // [NC, y_stride] out (pair: of W1)
    float* __restrict__ y2,            // pair: [NC, y2_stride] out of W2; GLU: unused
    const uint8_t* __restrict__ w,     // W1 / the gate matrix: rows from w + w_offset
    const uint8_t* __restrict__ w2,    // W2 / the up matrix: rows from w2 + w2_offset, same type and k
    const float* __restrict__ x,       // [NC, x_stride] f32 columns, 16-byte aligned, k used
    const DmmvParams p) {
    extern __shared__ __align__(16) uint8_t smem[];
    pdl_launch_dependents();
    const int nw = blockDim.x / 32;
    const bool second = !GLU && blockIdx.x >= p.blocks1;  // pair: a block of W2
    const q8::Share rows = GLU ? q8::Share(p.m, blockIdx.x, gridDim.x)
                         : second ? q8::Share(p.m2, blockIdx.x - p.blocks1, gridDim.x - p.blocks1)
                                  : q8::Share(p.m, blockIdx.x, p.blocks1);
    const uint32_t r0 = rows.begin, n_out = rows.end - rows.begin;
    const uint32_t x_end = q8::smem_bytes<QT, LU, ST>(nw, NC, p.k);
    if (x_end + (GLU ? 8u * n_out * NC : 0u) > q8::dynamic_smem_bytes()) __trap();  // a launcher bug
    const q8::Smem<QT, LU, ST, NC> sm(smem, nw, p.k);
    const auto prepare = [&] {
        for (int c = 0; c < NC; ++c)
            q8::quantize_x<QT>(x + (size_t)c * p.x_stride, p.k, sm.xq + (size_t)c * p.k, sm.xi + c * (p.k / 32));
        __syncthreads();
    };
    const uint8_t* const mat1 = w + p.w_offset;
    const uint8_t* const mat2 = w2 + p.w2_offset;
    if (GLU) {
        float* dots = reinterpret_cast<float*>(smem + x_end);  // [2 n_out][NC]
        q8::glu_rows<QT, NC, LU, ST, BULK, true>(sm, r0, n_out, mat1, mat2, p.row_bytes, p.m, p.k,
                                                 [] { pdl_wait(); }, prepare, dots);
        __syncthreads();  // every row's dot products are in shared memory
        for (uint32_t i = threadIdx.x; i < n_out * NC; i += blockDim.x) {
            const uint32_t c = i / n_out, r = i % n_out;
            const float v = p.alpha * (glu_act(p.act, dots[2 * r * NC + c]) * dots[(2 * r + 1) * NC + c]);
            float* out = y + (size_t)c * p.y_stride + r0 + r;
            *out = p.mode == 1 ? *out + v : v;
        }
    } else {
        const uint8_t* const mat = second ? mat2 : mat1;
        const uint8_t* const end = mat + (size_t)(second ? p.m2 : p.m) * p.row_bytes;
        float* const out = second ? y2 : y;
        const uint32_t stride = second ? p.y2_stride : p.y_stride;
        q8::block_rows<QT, NC, LU, ST, BULK, true>(
            sm, n_out, [&](uint32_t j) { return mat + (size_t)(r0 + j) * p.row_bytes; }, (uint32_t)p.row_bytes,
            [&](uint32_t) { return end; }, p.k, [] { pdl_wait(); }, prepare,
            [&](uint32_t j, const float (&v)[NC]) {
#pragma unroll
                for (int c = 0; c < NC; ++c) out[(size_t)c * stride + r0 + j] = v[c];
            });
    }
}

// x quantized once for the int8 path (DmmvDispatch.quantize_x -> QuantizedX): column c of out is
// q8::load_x's image of x[c] (int8 planes, XInfo; IL: interleaved for MXFP4), x_col_bytes(k)
// bytes. Grid (n, ceil(k / 4 / chunk4)): block (c, b) quantizes float4s [b chunk4, (b + 1) chunk4)
// of column c, 4 lanes per 32 elements (q8::quantize_x_range). Traffic: 4 bytes read, 1.25 written per element.
// Programmatic dependent launch: x is read and out written only after pdl_wait (a matvec still
// reading the previous contents of out has completed by then).
// The body of quantize_x and quantize_glu: block (c, b) quantizes float4s [b chunk4, (b + 1) chunk4)
// of column c, whose float4 g column(c * x_stride)(g) returns (after pdl_wait).
template <bool IL, class Column>
CUKERN_DEVICE void quantize_chunk(uint8_t* __restrict__ out, const QuantizeXParams& p, Column column) {
    pdl_launch_dependents();
    if (p.out_stride < q8::x_col_bytes(p.k) || p.chunk4 % 8) __trap();  // a launcher bug
    pdl_wait();
    const uint32_t c = blockIdx.x, g0 = blockIdx.y * p.chunk4, g1 = min(g0 + p.chunk4, p.k / 4);
    uint8_t* col = out + (size_t)c * p.out_stride;
    q8::quantize_x_range<IL, true>(column((size_t)c * p.x_stride), p.k, g0, g1, reinterpret_cast<int8_t*>(col),
                                   reinterpret_cast<q8::XInfo*>(col + p.k));
}

template <bool IL>
__global__ void __launch_bounds__(256) quantize_x(
    uint8_t* __restrict__ out,      // [n, out_stride] bytes, 16-byte aligned
    const float* __restrict__ x,    // [n, x_stride] f32 columns, 16-byte aligned
    const QuantizeXParams p) {
    quantize_chunk<IL>(out, p, [x](size_t off) {
        const float4* xc = reinterpret_cast<const float4*>(x + off);
        return [xc](uint32_t g) { return __ldg(xc + g); };
    });
}

// The gated activation of the FFN quantized for the down projection's int8 matvec
// (DmmvDispatch.quantize_glu): out = quantize_x(act(gate) * up), act = SiLU (ACT 0) or GELU, tanh
// form (ACT 1), in f32 as dmmv_glu computes it (qmv::glu_act). It replaces the elementwise
// SwiGLU/GEGLU kernel before the down matvec: 8 bytes read and 1.25 written per element instead of
// 8 read and 4 written, and the matvec's blocks copy 1.25 bytes per element instead of quantizing
// 4. Grid, layout and programmatic dependent launch as quantize_x; gate and up share x_stride.
template <bool IL, int ACT>
__global__ void __launch_bounds__(256) quantize_glu(
    uint8_t* __restrict__ out,      // [n, out_stride] bytes, 16-byte aligned
    const float* __restrict__ gate, // [n, x_stride] f32 columns, 16-byte aligned
    const float* __restrict__ up,   // [n, x_stride] f32 columns, 16-byte aligned
    const QuantizeXParams p) {
    quantize_chunk<IL>(out, p, [gate, up](size_t off) {
        const float4* gc = reinterpret_cast<const float4*>(gate + off);
        const float4* uc = reinterpret_cast<const float4*>(up + off);
        return [gc, uc](uint32_t g) {
            const float4 a = __ldg(gc + g), b = __ldg(uc + g);
            return make_float4(qmv::glu_act(ACT, a.x) * b.x, qmv::glu_act(ACT, a.y) * b.y,
                               qmv::glu_act(ACT, a.z) * b.z, qmv::glu_act(ACT, a.w) * b.w);
        };
    });
}

// out = W in f32, one element per thread (grid-stride): the per-element dequantization of
// common/quants.cuh, for tests and for the odd caller that needs a dense copy.
template <int QT>
__global__ void dequantize(
    float* __restrict__ out,          // [m, k] out
    const uint8_t* __restrict__ w,    // m rows from w + w_offset
    const DequantParams p) {
    using T = QTraits<QT>;
    const size_t n = (size_t)p.m * p.k;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t row = i / p.k;
        const uint32_t col = i % p.k;
        const uint8_t* blk = w + p.w_offset + row * p.row_bytes + (size_t)(col / T::kElems) * T::kBytes;
        out[i] = dequant(reinterpret_cast<const typename T::Block*>(blk), col % T::kElems);
    }
}
