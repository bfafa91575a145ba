// SSM / gated DeltaNet pieces of hybrid models (Qwen3.5/3.6-style linear attention layers).
#pragma once

#include "common/pdl.cuh"
#include "common/types.cuh"
#include "common/reduce.cuh"
#include "elementwise/params.cuh"

namespace cukern {
namespace ew {
constexpr int CONV_CHUNK = 16;  // tokens per chunk of a thread's span in conv1d_silu (>= kernel_size - 1)
constexpr int CONV_IP_CHANNELS = 32;  // conv1d_silu_in_place: channels per block (one warp's row)
constexpr int CONV_IP_SPANS = 32;     // conv1d_silu_in_place: spans per block at most (1024 threads)

// Walk tokens [t0, t1) of channel c: win holds the inputs t0 - (K - 1) .. t0 - 1 on entry (oldest first) and
// t1 - (K - 1) .. t1 - 1 on exit. In chunks of CONV_CHUNK tokens: all loads of a chunk are issued before its
// first store, and every x[t] is read before y[t] is written, so y may be x for this thread's own tokens.
template <int K>
CUKERN_DEVICE void conv_walk(float* y, const float* x, const float (&taps)[K], float (&win)[K - 1], int t0, int t1,
                             uint64_t C, uint32_t c) {
    constexpr int CH = CONV_CHUNK;
    for (int tc = t0; tc < t1; tc += CH) {
        float xin[CH];  // the chunk's inputs
#pragma unroll
        for (int i = 0; i < CH; ++i) xin[i] = tc + i < t1 ? x[(uint64_t)(tc + i) * C + c] : 0.f;
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            if (tc + i >= t1) break;
            float acc = taps[K - 1] * xin[i];
#pragma unroll
            for (int j = 0; j < K - 1; ++j) acc += taps[j] * win[j];
#pragma unroll
            for (int j = 0; j < K - 2; ++j) win[j] = win[j + 1];
            win[K - 2] = xin[i];
            y[(uint64_t)(tc + i) * C + c] = acc / (1.0f + expf(-acc));
        }
    }
}

// Write the new state entries next[j] = input n_tokens - (K - 1) + j (j = 0 oldest) of channel c. Shifting:
// every row j. Ring: only the rows of the inputs this call adds (an entry that is an old one keeps its row);
// the new oldest entry's row is state_offset + n_tokens mod (K - 1).
template <int K>
CUKERN_DEVICE void conv_state_store(float* state, const float (&next)[K - 1], const ConvParams& p, uint64_t C,
                                    uint32_t c) {
    const uint32_t shift = p.ring ? p.n_tokens % (K - 1) : 0;  // the new oldest entry's row, relative
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
        const int tau = (int)p.n_tokens - (K - 1) + j;
        if (p.ring && tau < 0) continue;  // a ring keeps an old entry in its row
        state[(uint64_t)(p.ring ? (p.state_offset + shift + j) % (K - 1) : j) * C + c] = next[j];
    }
}
}  // namespace ew
}  // namespace cukern

// Depthwise causal conv1d + SiLU over n_tokens tokens, with a state of the K - 1 previous inputs:
//   in_tau = x[tau] for tau >= 0, the state's entry K - 1 + tau (oldest first) for -(K - 1) <= tau < 0
//   y[t, c] = silu(sum_{j < K} w[c, j] * in_{t - K + 1 + j}[c])
// and afterwards the state holds the last K - 1 inputs. Two state layouts:
//   ring = 0: row j is entry j (oldest first); the rows shift by n_tokens at each call
//   ring = 1: a ring: entry j lives in row (state_offset + j) % (K - 1), state_offset being the oldest
//             entry's row; a call writes only the rows of the inputs it adds, and the next call's
//             state_offset is (state_offset + n_tokens) % (K - 1)
// Two kernels: conv1d_silu (y distinct from x) and conv1d_silu_in_place (y is x). Both read x, w and the
// state's K - 1 rows once and write y and the new state (ring: only the rows of the added inputs); the K - 1
// halo inputs of each span are read twice (L2 hits).
//
// conv1d_silu: thread (span, c) computes tokens [span * tokens_per_thread, +tokens_per_thread) of channel c
// (tokens_per_thread = CONV_CHUNK). Span 0 is the only reader of the old state and the only writer of the
// new one, so the update is race-free; it gathers the new entries from x (or the old state) when it does not
// hold them.
// grid: (ceil(n_channels / 128), ceil(n_tokens / tokens_per_thread)), block: 128.
template <int K, typename TW>
__global__ void __launch_bounds__(128) conv1d_silu(
    float* y,                     // [n_tokens, n_channels]; not overlapping x
    float* __restrict__ state,    // [K - 1, n_channels] in/out (rows: ring = 0 oldest first, else a ring)
    const float* x,               // [n_tokens, n_channels]
    const TW* __restrict__ w,     // [n_channels, K] taps, oldest first (f32 or f16)
    const ConvParams p) {
    cukern::pdl_enter();
    static_assert(K >= 2 && K <= 8, "kernel_size 2..8");
    const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= p.n_channels) return;
    const int t0 = blockIdx.y * p.tokens_per_thread;
    const int t1 = min(t0 + (int)p.tokens_per_thread, (int)p.n_tokens);
    const uint64_t C = p.n_channels;
    // row of state entry j (0 oldest .. K - 2), both layouts
    auto row = [&](int j) -> uint64_t { return p.ring ? (p.state_offset + j) % (K - 1) : j; };
    float taps[K], win[K - 1];
#pragma unroll
    for (int j = 0; j < K; ++j) taps[j] = cukern::to_float(w[c * K + j]);
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
        const int tau = t0 - (K - 1) + j;
        win[j] = tau < 0 ? state[row(K - 1 + tau) * C + c] : x[(uint64_t)tau * C + c];
    }
    cukern::ew::conv_walk<K>(y, x, taps, win, t0, t1, C, c);
    if (t0 != 0) return;
    // new entry j = input tau = n_tokens - (K - 1) + j (an old state entry when tau < 0). One span: win
    // holds them; else gather (this thread alone reads the old state, so gather first, then write).
    float next[K - 1];
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
        const int tau = (int)p.n_tokens - (K - 1) + j;
        next[j] = t1 == (int)p.n_tokens ? win[j]
                  : tau < 0 ? state[row(K - 1 + tau) * C + c] : x[(uint64_t)tau * C + c];
    }
    cukern::ew::conv_state_store<K>(state, next, p, C, c);
}

// conv1d_silu_in_place (y is x): one block holds every token of CONV_IP_CHANNELS channels, split into
// blockDim.y spans of tokens_per_thread tokens (the last one shorter or empty); thread (c, span) computes
// tokens [span * tokens_per_thread, +tokens_per_thread) of channel c. Each thread reads its K - 1 halo inputs
// (x of the K - 1 tokens before its span, in another span's range, or the old state for tau < 0) into
// registers, then the block synchronises, then each thread walks its span reading x[t] before writing y[t]:
// every input read across a span boundary was read before any thread wrote. The thread whose span holds
// token n_tokens - 1 ends with the last K - 1 inputs in its window and writes the new state; the old state is
// only read before the barrier, so the update is race-free. Threads of channels >= n_channels only skip
// their loads and stores: all of them reach the barrier.
// grid: (ceil(n_channels / CONV_IP_CHANNELS)), block: (CONV_IP_CHANNELS, spans <= CONV_IP_SPANS).
template <int K, typename TW>
__global__ void __launch_bounds__(cukern::ew::CONV_IP_CHANNELS * cukern::ew::CONV_IP_SPANS) conv1d_silu_in_place(
    float* xy,                    // [n_tokens, n_channels] in: x, out: y
    float* __restrict__ state,    // [K - 1, n_channels] in/out (rows: ring = 0 oldest first, else a ring)
    const TW* __restrict__ w,     // [n_channels, K] taps, oldest first (f32 or f16)
    const ConvParams p) {
    cukern::pdl_enter();
    static_assert(K >= 2 && K <= 8, "kernel_size 2..8");
    const uint32_t c = blockIdx.x * cukern::ew::CONV_IP_CHANNELS + threadIdx.x;
    const bool active = c < p.n_channels;
    const int n = (int)p.n_tokens;
    const int t0 = min((int)(threadIdx.y * p.tokens_per_thread), n);  // 0 ... n_tokens
    const int t1 = min(t0 + (int)p.tokens_per_thread, n);
    const uint64_t C = p.n_channels;
    float taps[K], win[K - 1];
    if (active) {
#pragma unroll
        for (int j = 0; j < K; ++j) taps[j] = cukern::to_float(w[c * K + j]);
#pragma unroll
        for (int j = 0; j < K - 1; ++j) {
            const int tau = t0 - (K - 1) + j;  // -(K - 1) ... n_tokens - 1
            win[j] = tau >= 0 ? xy[(uint64_t)tau * C + c]
                     : state[(p.ring ? (p.state_offset + K - 1 + tau) % (K - 1) : K - 1 + tau) * C + c];
        }
    }
    __syncthreads();  // every halo input is in registers before any thread writes y
    if (!active) return;
    cukern::ew::conv_walk<K>(xy, xy, taps, win, t0, t1, C, c);
    if (t0 >= t1 || t1 != n) return;  // the span holding token n_tokens - 1 writes the state
    cukern::ew::conv_state_store<K>(state, win, p, C, c);
}

// Gated delta rule, one sequence, tokens in order. Per value head h (q/k head hq = h / (n_v / n_qk)),
// state S_h [dk, dv], per token t:
//   (qk_l2norm: q[t, hq] and k[t, hq] replaced by x * rsqrt(sum(x^2) + norm_eps) first)
//   S = exp(g[t, h]) * S
//   delta = beta[t, h] * (v[t, h] - S^T k[t, hq])
//   S = S + k[t, hq] delta^T
//   o[t, h] = S^T (q_scale * q[t, hq])
// Column j of S only ever needs column j, so columns are independent.
// Baseline: one thread per (head, column), S streamed from memory at each token (L1/L2 hits).
// grid: (ceil(dv / 64), n_v_heads), block: 64.
__global__ void __launch_bounds__(64) deltanet(
    float* __restrict__ o,           // [n_tokens, n_v_heads, dv]
    float* __restrict__ S,           // [n_v_heads, dk, dv] in/out state
    const float* __restrict__ q,     // [n_tokens, n_qk_heads, dk]
    const float* __restrict__ k,     // [n_tokens, n_qk_heads, dk]
    const float* __restrict__ v,     // [n_tokens, n_v_heads, dv]
    const float* __restrict__ g,     // [n_tokens, n_v_heads] log of the decay (<= 0)
    const float* __restrict__ beta,  // [n_tokens, n_v_heads] write strength in [0, 1]
    const DeltaNetParams p) {
    cukern::pdl_enter();
    const uint32_t h = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= p.dv) return;
    const uint32_t hq = h / (p.n_v_heads / p.n_qk_heads);
    float* Sh = S + (uint64_t)h * p.dk * p.dv + j;  // column j, row stride dv
    for (uint32_t t = 0; t < p.n_tokens; ++t) {
        const float* kt = k + ((uint64_t)t * p.n_qk_heads + hq) * p.dk;
        const float* qt = q + ((uint64_t)t * p.n_qk_heads + hq) * p.dk;
        const float decay = expf(g[(uint64_t)t * p.n_v_heads + h]);
        float kv = 0.f, kk = 0.f, qq = 0.f;
        for (uint32_t i = 0; i < p.dk; ++i) {
            kv += Sh[(uint64_t)i * p.dv] * kt[i];
            if (p.qk_l2norm) { kk += kt[i] * kt[i]; qq += qt[i] * qt[i]; }
        }
        const float rk = p.qk_l2norm ? rsqrtf(kk + p.norm_eps) : 1.f;  // k's and q's norm factors
        const float rq = p.qk_l2norm ? rsqrtf(qq + p.norm_eps) : 1.f;
        const uint64_t vo = ((uint64_t)t * p.n_v_heads + h) * p.dv + j;
        // rk * delta: the update k_n delta^T is k (rk delta)^T
        const float delta = rk * beta[(uint64_t)t * p.n_v_heads + h] * (v[vo] - decay * rk * kv);
        float out = 0.f;
        for (uint32_t i = 0; i < p.dk; ++i) {
            const float s = decay * Sh[(uint64_t)i * p.dv] + kt[i] * delta;
            Sh[(uint64_t)i * p.dv] = s;
            out += s * qt[i];
        }
        o[vo] = p.q_scale * rq * out;
    }
}

// Tiled variant: the state stays in registers for all tokens. 8 adjacent lanes share a column, each
// holding DK / 8 rows (row r + 8 m for lane slice r, so the staged k/q reads are bank-conflict free).
// The block's [DK, 16] state tile goes through shared memory on the way in and out (delta_tile_io), so
// that those accesses are whole 64-byte row segments, every load in flight at once (a loop whose trip
// count was only known at run time serialised them and doubled the decode time). k, q, g and beta of DELTA_CHUNK tokens are staged in shared memory
// with one round of loads (and v in registers), so the per-token cost is arithmetic, not load latency.
// Must agree with deltanet (the tests compare both against the reference).
// grid: (ceil(dv / 16), n_v_heads), block: 128 = 16 columns x 8 row slices.
constexpr int DELTA_CHUNK = 8;
constexpr int DELTA_THREADS = 128;  // deltanet_tiled's block

namespace cukern {
namespace ew {
// Move a block's [DK, 16] state tile (columns col0 .. col0 + 15 of the row-major [DK, dv] state Sh) between
// global memory and the padded shared tile, LOAD: in, else out (columns >= dv are zero-filled / skipped).
// Every thread issues all of its loads before its first shared store (trip counts are compile-time), so
// the tile's latency is paid once. vec: dv % 4 == 0 and Sh 16-byte aligned, so a 16-column row segment is
// 4 whole float4s (each in range or out of it); else scalar elements.
template <int DK, bool LOAD>
CUKERN_DEVICE void delta_tile_io(float (&tile)[DK][17], float* Sh, uint32_t dv, uint32_t col0, bool vec) {
    if (vec) {
        constexpr int N = DK * 4 / DELTA_THREADS;  // float4s per thread
        float4 t[N];
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const uint32_t idx = threadIdx.x + i * DELTA_THREADS, row = idx / 4, c = 4 * (idx % 4);
            float4* g = reinterpret_cast<float4*>(Sh + (uint64_t)row * dv + col0 + c);
            if (LOAD) t[i] = col0 + c < dv ? *g : make_float4(0.f, 0.f, 0.f, 0.f);
            else if (col0 + c < dv) *g = make_float4(tile[row][c], tile[row][c + 1], tile[row][c + 2], tile[row][c + 3]);
        }
        if (LOAD) {
#pragma unroll
            for (int i = 0; i < N; ++i) {
                const uint32_t idx = threadIdx.x + i * DELTA_THREADS, row = idx / 4, c = 4 * (idx % 4);
                tile[row][c] = t[i].x; tile[row][c + 1] = t[i].y; tile[row][c + 2] = t[i].z; tile[row][c + 3] = t[i].w;
            }
        }
        return;
    }
    constexpr int N = DK * 16 / DELTA_THREADS;  // elements per thread
    float t[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const uint32_t idx = threadIdx.x + i * DELTA_THREADS, row = idx / 16, c = idx % 16;
        float* g = Sh + (uint64_t)row * dv + col0 + c;
        if (LOAD) t[i] = col0 + c < dv ? *g : 0.f;
        else if (col0 + c < dv) *g = tile[row][c];
    }
    if (LOAD) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const uint32_t idx = threadIdx.x + i * DELTA_THREADS;
            tile[idx / 16][idx % 16] = t[i];
        }
    }
}
}  // namespace ew
}  // namespace cukern

template <int DK>
__global__ void __launch_bounds__(DELTA_THREADS) deltanet_tiled(
    float* __restrict__ o, float* __restrict__ S, const float* __restrict__ q,  // as deltanet
    const float* __restrict__ k, const float* __restrict__ v, const float* __restrict__ g,
    const float* __restrict__ beta, const DeltaNetParams p) {
    cukern::pdl_enter();
    constexpr int R = 8, M = DK / R, CH = DELTA_CHUNK;  // row slices per column, rows per thread
    __shared__ float ks[CH][DK], qs[CH][DK], gs[CH], bs[CH];
    __shared__ float tile[DK][17];  // [row][column of this block], padded against bank conflicts
    const uint32_t h = blockIdx.y;
    const uint32_t r = threadIdx.x % R;                    // 0..7: rows r + R m, m < M
    const uint32_t j = blockIdx.x * 16 + threadIdx.x / R;  // column
    const bool active = j < p.dv;
    const uint32_t hq = h / (p.n_v_heads / p.n_qk_heads);
    const uint32_t col0 = blockIdx.x * 16, cl = threadIdx.x / R;  // first column of the block, column in block
    float* Sh = S + (uint64_t)h * DK * p.dv;
    const bool vec = p.dv % 4 == 0 && reinterpret_cast<uint64_t>(S) % 16 == 0;  // whole float4s per row segment
    cukern::ew::delta_tile_io<DK, true>(tile, Sh, p.dv, col0, vec);
    __syncthreads();
    float s[M];
#pragma unroll
    for (int m = 0; m < M; ++m) s[m] = tile[r + R * m][cl];
    for (uint32_t t0 = 0; t0 < p.n_tokens; t0 += CH) {
        const uint32_t n = min((uint32_t)CH, p.n_tokens - t0);
        __syncthreads();  // the previous chunk's staging is no longer read
        for (uint32_t idx = threadIdx.x; idx < n * DK; idx += blockDim.x) {
            const uint64_t src = ((uint64_t)(t0 + idx / DK) * p.n_qk_heads + hq) * DK + idx % DK;
            ks[idx / DK][idx % DK] = k[src];
            qs[idx / DK][idx % DK] = q[src];
        }
        if (threadIdx.x < n) {
            gs[threadIdx.x] = expf(g[(uint64_t)(t0 + threadIdx.x) * p.n_v_heads + h]);
            bs[threadIdx.x] = beta[(uint64_t)(t0 + threadIdx.x) * p.n_v_heads + h];
        }
        float vv[CH];
#pragma unroll
        for (int tt = 0; tt < CH; ++tt)
            vv[tt] = active && tt < n ? v[((uint64_t)(t0 + tt) * p.n_v_heads + h) * p.dv + j] : 0.f;
        __syncthreads();
#pragma unroll
        for (int tt = 0; tt < CH; ++tt) {
            if (tt >= n) break;
            const float decay = gs[tt];
            float kv = 0.f, kk = 0.f, qq = 0.f;
#pragma unroll
            for (int m = 0; m < M; ++m) kv += s[m] * ks[tt][r + R * m];
            kv += __shfl_xor_sync(0xffffffffu, kv, 1);
            kv += __shfl_xor_sync(0xffffffffu, kv, 2);
            kv += __shfl_xor_sync(0xffffffffu, kv, 4);
            float rk = 1.f, rq = 1.f;  // k's and q's norm factors (qk_l2norm: uniform branch)
            if (p.qk_l2norm) {
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    kk += ks[tt][r + R * m] * ks[tt][r + R * m];
                    qq += qs[tt][r + R * m] * qs[tt][r + R * m];
                }
#pragma unroll
                for (int lane = 1; lane < R; lane *= 2) {
                    kk += __shfl_xor_sync(0xffffffffu, kk, lane);
                    qq += __shfl_xor_sync(0xffffffffu, qq, lane);
                }
                rk = rsqrtf(kk + p.norm_eps);
                rq = rsqrtf(qq + p.norm_eps);
            }
            const float delta = rk * bs[tt] * (vv[tt] - decay * rk * kv);  // rk * delta, as deltanet
            float out = 0.f;
#pragma unroll
            for (int m = 0; m < M; ++m) {
                s[m] = decay * s[m] + ks[tt][r + R * m] * delta;
                out += s[m] * qs[tt][r + R * m];
            }
            out += __shfl_xor_sync(0xffffffffu, out, 1);
            out += __shfl_xor_sync(0xffffffffu, out, 2);
            out += __shfl_xor_sync(0xffffffffu, out, 4);
            if (active && r == 0) o[((uint64_t)(t0 + tt) * p.n_v_heads + h) * p.dv + j] = p.q_scale * rq * out;
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) tile[r + R * m][cl] = s[m];
    __syncthreads();
    cukern::ew::delta_tile_io<DK, false>(tile, Sh, p.dv, col0, vec);
}

// DeltaNet's per-head gates from the beta/alpha logits of the in-projection (Qwen3-Next's ssm_ba), n_tokens tokens:
//   beta[t, h] = sigmoid(b[t, h]),   g[t, h] = a[h] * softplus(alpha[t, h] + dt_bias[h])
// Value head h = kh * group + r (key head kh, 0 <= r < group) reads ba row t at kh * 2 * group + r (b) and
// kh * 2 * group + group + r (alpha): the GGUF's per-key-head [b(group) | alpha(group)] layout (group = n_v_heads:
// one [b | alpha] row). a = -exp(A_log), as the GGUF stores it. softplus(x) = x above 20, log1p(exp(x)) else.
// grid: (ceil(n_tokens * n_v_heads / 256)), block: 256. Bytes per token: 2 n_v floats read, 2 n_v written
// (a and dt_bias from L1/L2).
__global__ void __launch_bounds__(256) deltanet_gates(
    float* __restrict__ g,              // [n_tokens, n_v_heads] log of the decay (<= 0 where a <= 0)
    float* __restrict__ beta,           // [n_tokens, n_v_heads] write strength in (0, 1)
    const float* __restrict__ ba,       // [n_tokens, 2 * n_v_heads] per key head: group b logits, group alphas
    const float* __restrict__ a,        // [n_v_heads] -exp(A_log)
    const float* __restrict__ dt_bias,  // [n_v_heads] added to alpha before the softplus
    const DeltaNetGateParams p) {
    cukern::pdl_enter();
    const uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;  // 0 ... n_tokens * n_v_heads - 1
    if (i >= (uint64_t)p.n_tokens * p.n_v_heads) return;
    const uint32_t t = (uint32_t)(i / p.n_v_heads), h = (uint32_t)(i % p.n_v_heads);
    const uint32_t kh = h / p.group, r = h % p.group;
    const float* row = ba + (uint64_t)t * 2 * p.n_v_heads + (uint64_t)kh * 2 * p.group;
    const float b = row[r], x = row[p.group + r] + dt_bias[h];
    beta[i] = 1.0f / (1.0f + expf(-b));
    g[i] = a[h] * (x > 20.0f ? x : log1pf(expf(x)));
}
