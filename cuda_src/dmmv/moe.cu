// Mixture-of-experts matvecs over raw GGUF expert tensors ([n_experts, m, k], expert e at
// w_offset + e * expert_bytes), with the experts picked on the device from a routing buffer
// ids[n_tokens, top_k] (int32): nothing is read back to the host, so a decode step that routes
// and runs its experts can be captured in one CUDA graph.
//
//   moe_dmmv          every (token, slot) in one launch: y[slot] = W[ids[slot]] x[token or slot]
//                     (optionally gate + up + activation fused, as dmmv_glu)
//   moe_dmmv_q8       as moe_dmmv without GLU, on the int8 path of the quantized types (q8.cuh)
//   moe_dmmv_q8_glu   as moe_dmmv with GLU, on the int8 path
//   moe_route_pack    groups the slots by expert: counts, offsets, packed slot ids and a list of
//                     work items (expert, first packed slot, n <= kPackCols); count on the device
//   moe_count_experts per-expert slot counts only
//   moe_dmmv_packed   (moe_packed.cu, its own unit) one block per (row block, work item)
//   moe_down          y[t] (+)= sum_k weight[t, k] * W[ids[t, k]] h[t, k]: the down projection
//                     and the weighted sum over the token's experts in one pass, no atomics
//   moe_down_q8       as moe_down, on the int8 path
//
// An expert id outside [0, n_experts) is never dereferenced: its outputs are written as zeros
// (moe_down: its term is dropped) and bit 0 of err[0] is set; DmmvDispatch.check_errors()
// reports it outside the hot path.
#include "common/reduce.cuh"
#include "dmmv/moe.cuh"
#include "dmmv/q8.cuh"

// grid: (ceil(m / kRows), n_slots); block: NW warps
template <int QT, bool GLU>
__global__ void __launch_bounds__(kMaxWarps * 32) moe_dmmv(
    float* __restrict__ y,            // [n_slots, m] out
    int* __restrict__ err,            // [1] error bits, or-ed in
    const uint8_t* __restrict__ w,    // expert weights (gate weights with GLU)
    const uint8_t* __restrict__ w2,   // up weights (GLU); unused otherwise
    const float* __restrict__ x,      // [n_slots or n_tokens, k] f32 (x_per_slot)
    const int* __restrict__ ids,      // [n_tokens, ids_stride] expert of each slot (row-major, top_k used)
    const MoeParams p) {
    constexpr int NR = GLU ? 2 * kRows : kRows;
    __shared__ float red[kMaxWarps * NR];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    const uint32_t slot = blockIdx.y, row0 = blockIdx.x * kRows;
    const int e = ids[route_at(slot, p.top_k, p.ids_stride)];
    float* out = y + (size_t)slot * p.m;
    if (!expert_ok(e, p)) {
        if (threadIdx.x < kRows && row0 + threadIdx.x < p.m) out[row0 + threadIdx.x] = 0.0f;
        if (threadIdx.x == 0 && blockIdx.x == 0) atomicOr(err, kErrExpertId);
        return;
    }
    const uint8_t* rows[NR];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        const size_t off = (size_t)e * p.expert_bytes + (size_t)min(row0 + r, p.m - 1) * p.row_bytes;
        rows[r] = w + p.w_offset + off;
        if (GLU) rows[NR - kRows + r] = w2 + p.w2_offset + off;
    }
    const float* xs[1] = {x + (size_t)(p.x_per_slot ? slot : slot / p.top_k) * p.k};
    float acc[NR][1] = {};
    warp_dots<QT, NR, 1, 2>(rows, xs, p.n_full, p.tail, warp, nw, lane, acc);
    block_reduce<NR, 1>(acc, red, warp, nw, lane);
    if (threadIdx.x < kRows && row0 + threadIdx.x < p.m) {
        const float v = GLU ? glu_act(p.act, red[threadIdx.x]) * red[kRows + threadIdx.x] : red[threadIdx.x];
        out[row0 + threadIdx.x] = p.alpha * v;
    }
}

// grid: (blocks per slot, n_slots), sized by the host to the resident blocks; block: nw warps.
// Block b of a slot quantizes the slot's x into shared memory, then its warps stream rows
// [b m / G, (b + 1) m / G) of the expert (q8::Share) as dmmv_q8 does (q8::block_rows). Dynamic
// shared memory: q8::smem_bytes<QT, LU, ST>(nw, 1, k).
template <int QT, int LU, int ST, bool BULK>
__global__ void __launch_bounds__(q8::kMaxWarps * 32) moe_dmmv_q8(
    float* __restrict__ y,            // [n_slots, m] out
    int* __restrict__ err,            // [1] error bits, or-ed in
    const uint8_t* __restrict__ w,    // expert weights
    const float* __restrict__ x,      // [n_slots or n_tokens, k] f32 (x_per_slot)
    const int* __restrict__ ids,      // [n_tokens, ids_stride] expert of each slot (row-major, top_k used)
    const MoeParams p) {
    extern __shared__ __align__(16) uint8_t smem[];
    const int nw = blockDim.x / 32;
    if (q8::smem_bytes<QT, LU, ST>(nw, 1, p.k) > q8::dynamic_smem_bytes()) __trap();  // a launcher bug
    const uint32_t slot = blockIdx.y;
    const q8::Share rows(p.m, blockIdx.x, gridDim.x);  // this block's rows [r0, r1)
    const uint32_t r0 = rows.begin, r1 = rows.end;
    float* out = y + (size_t)slot * p.m + r0;
    const int e = ids[route_at(slot, p.top_k, p.ids_stride)];
    if (!expert_ok(e, p)) {
        for (uint32_t r = threadIdx.x; r < r1 - r0; r += blockDim.x) out[r] = 0.0f;
        if (threadIdx.x == 0 && blockIdx.x == 0) atomicOr(err, kErrExpertId);
        return;
    }
    const q8::Smem<QT, LU, ST, 1> sm(smem, nw, p.k);
    const uint8_t* base = w + p.w_offset + (size_t)e * p.expert_bytes;
    const float* xs = x + (size_t)(p.x_per_slot ? slot : slot / p.top_k) * p.k;
    q8::block_rows<QT, 1, LU, ST, BULK>(
        sm, r1 - r0, [&](uint32_t j) { return base + (size_t)(r0 + j) * p.row_bytes; }, (uint32_t)p.row_bytes,
        [&](uint32_t) { return base + (size_t)p.m * p.row_bytes; }, p.k, [] {},
        [&] {
            q8::quantize_x<QT>(xs, p.k, sm.xq, sm.xi);
            __syncthreads();
        },
        [&](uint32_t j, const float (&v)[1]) { out[j] = p.alpha * v[0]; });
}

// moe_dmmv_q8 with GLU: y[slot] = alpha * act(Wg[e] x) * (Wu[e] x), e = ids[slot]. Block b of a slot
// takes outputs [b m / G, (b + 1) m / G) and streams their gate and up rows of expert e as one row
// sequence (q8::glu_rows, as dmmv_q8_two does for dmmv_glu); the two
// dot products of an output meet in shared memory after x (2 floats per output: the host adds them
// to the dynamic size). Dynamic shared memory: q8::smem_bytes<QT, LU, ST>(nw, 1, k) + 8 * outputs.
template <int QT, int LU, int ST, bool BULK>
__global__ void __launch_bounds__(q8::kMaxWarps * 32) moe_dmmv_q8_glu(
    float* __restrict__ y,            // [n_slots, m] out
    int* __restrict__ err,            // [1] error bits, or-ed in
    const uint8_t* __restrict__ w,    // gate expert weights
    const uint8_t* __restrict__ w2,   // up expert weights, same type, shape and expert stride
    const float* __restrict__ x,      // [n_slots or n_tokens, k] f32 (x_per_slot)
    const int* __restrict__ ids,      // [n_tokens, ids_stride] expert of each slot (row-major, top_k used)
    const MoeParams p) {
    extern __shared__ __align__(16) uint8_t smem[];
    const int nw = blockDim.x / 32;
    const uint32_t slot = blockIdx.y;
    const q8::Share rows(p.m, blockIdx.x, gridDim.x);  // this block's outputs [r0, r0 + n_out)
    const uint32_t r0 = rows.begin, n_out = rows.end - rows.begin;
    const uint32_t x_end = q8::smem_bytes<QT, LU, ST>(nw, 1, p.k);
    if (x_end + 8u * n_out > q8::dynamic_smem_bytes()) __trap();  // a launcher bug
    float* out = y + (size_t)slot * p.m + r0;
    const int e = ids[route_at(slot, p.top_k, p.ids_stride)];
    if (!expert_ok(e, p)) {
        for (uint32_t r = threadIdx.x; r < n_out; r += blockDim.x) out[r] = 0.0f;
        if (threadIdx.x == 0 && blockIdx.x == 0) atomicOr(err, kErrExpertId);
        return;
    }
    const q8::Smem<QT, LU, ST, 1> sm(smem, nw, p.k);
    float* dots = reinterpret_cast<float*>(smem + x_end);  // [2 n_out]
    const uint8_t* const gate = w + p.w_offset + (size_t)e * p.expert_bytes;
    const uint8_t* const up = w2 + p.w2_offset + (size_t)e * p.expert_bytes;
    const float* xs = x + (size_t)(p.x_per_slot ? slot : slot / p.top_k) * p.k;
    q8::glu_rows<QT, 1, LU, ST, BULK>(sm, r0, n_out, gate, up, p.row_bytes, p.m, p.k, [] {},
                                      [&] {
                                          q8::quantize_x<QT>(xs, p.k, sm.xq, sm.xi);
                                          __syncthreads();
                                      },
                                      dots);
    __syncthreads();  // every row's dot product is in shared memory
    for (uint32_t i = threadIdx.x; i < n_out; i += blockDim.x)
        out[i] = p.alpha * (glu_act(p.act, dots[2 * i]) * dots[2 * i + 1]);
}

// grid: (ceil(m / kRows), n_tokens); block: NW warps
template <int QT>
__global__ void __launch_bounds__(kMaxWarps * 32) moe_down(
    float* __restrict__ y,               // [n_tokens, m] out (mode 0) or accumulated into (mode 1)
    int* __restrict__ err,               // [1] error bits, or-ed in
    const uint8_t* __restrict__ w,       // down-projection experts
    const float* __restrict__ h,         // [n_slots, k] f32: the activated expert outputs
    const int* __restrict__ ids,         // [n_tokens, ids_stride] expert ids (top_k used)
    const float* __restrict__ weights,   // [n_tokens, weights_stride] routing weights (top_k used)
    const MoeParams p) {
    __shared__ float red[kMaxWarps * kRows];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    const uint32_t t = blockIdx.y, row0 = blockIdx.x * kRows;
    float acc[kRows][1] = {};
    for (uint32_t j = 0; j < p.top_k; ++j) {
        const uint32_t slot = t * p.top_k + j;
        const int e = ids[route_at(slot, p.top_k, p.ids_stride)];
        if (!expert_ok(e, p)) {
            if (threadIdx.x == 0 && blockIdx.x == 0) atomicOr(err, kErrExpertId);
            continue;
        }
        const uint8_t* rows[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r)
            rows[r] = w + p.w_offset + (size_t)e * p.expert_bytes + (size_t)min(row0 + r, p.m - 1) * p.row_bytes;
        const float* xs[1] = {h + (size_t)slot * p.k};
        float part[kRows][1] = {};
        warp_dots<QT, kRows, 1, 2>(rows, xs, p.n_full, p.tail, warp, nw, lane, part);
        const float wt = weights[route_at(slot, p.top_k, p.weights_stride)];
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r][0] += wt * part[r][0];
    }
    block_reduce<kRows, 1>(acc, red, warp, nw, lane);
    if (threadIdx.x < kRows && row0 + threadIdx.x < p.m) {
        float* out = y + (size_t)t * p.m + row0 + threadIdx.x;
        const float v = p.alpha * red[threadIdx.x];
        *out = p.mode == 0 ? v : *out + v;
    }
}

// moe_down on the int8 path. grid: (blocks per token, n_tokens), sized by the host to the resident
// blocks. Block b of token t takes outputs [b m / G, (b + 1) m / G): it quantizes the h of each of
// the token's slots with a valid expert id (n_valid <= kMaxTopK) into shared memory, streams the rows
// of those outputs for every such slot as one row sequence (slot-major: local row v is output
// v % n_out of valid slot v / n_out, dotted with that slot's x^), keeps the dot products in shared
// memory, and sums them over the slots in slot order after the block's last barrier (no atomics).
// Dynamic shared memory: q8::smem_bytes<QT, LU, ST>(nw, 1, k) + (top_k - 1) (k + k / 4) bytes of x
// + 4 top_k bytes per output of the block (DmmvDispatch._q8_plan_dots).
constexpr int kMaxTopK = 16;
template <int QT, int LU, int ST, bool BULK>
__global__ void __launch_bounds__(q8::kMaxWarps * 32) moe_down_q8(
    float* __restrict__ y,               // [n_tokens, m] out (mode 0) or accumulated into (mode 1)
    int* __restrict__ err,               // [1] error bits, or-ed in
    const uint8_t* __restrict__ w,       // down-projection experts
    const float* __restrict__ h,         // [n_slots, k] f32: the activated expert outputs
    const int* __restrict__ ids,         // [n_tokens, ids_stride] expert ids (top_k used)
    const float* __restrict__ weights,   // [n_tokens, weights_stride] routing weights (top_k used)
    const MoeParams p) {
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ int valid[kMaxTopK];  // the token's slots (0 ... top_k - 1) with a valid expert, in order
    __shared__ int n_valid;
    const int nw = blockDim.x / 32;
    const uint32_t t = blockIdx.y;
    const q8::Share rows(p.m, blockIdx.x, gridDim.x);  // this block's outputs [r0, r0 + n_out)
    const uint32_t r0 = rows.begin, n_out = rows.end - rows.begin;
    const uint32_t xb = p.k + p.k / 4;  // shared bytes of one quantized column
    const uint32_t x_end = q8::smem_bytes<QT, LU, ST>(nw, 1, p.k) + (p.top_k - 1) * xb;
    if (p.top_k > kMaxTopK || x_end + 4u * p.top_k * n_out > q8::dynamic_smem_bytes()) __trap();  // a launcher bug
    if (threadIdx.x == 0) {
        int n = 0;
        for (uint32_t j = 0; j < p.top_k; ++j) {
            if (expert_ok(ids[(uint64_t)t * p.ids_stride + j], p)) valid[n++] = (int)j;
            else if (blockIdx.x == 0) atomicOr(err, kErrExpertId);
        }
        n_valid = n;
    }
    __syncthreads();
    const q8::Smem<QT, LU, ST, 1> sm(smem, nw, p.k);
    int8_t* const xq = sm.xq;                                                  // [top_k][k]
    q8::XInfo* const xi = reinterpret_cast<q8::XInfo*>(sm.xq + p.top_k * p.k);  // [top_k][k / 32]
    float* const dots = reinterpret_cast<float*>(smem + x_end);                 // [n_valid][n_out]
    const uint32_t nv = (uint32_t)n_valid;
    if (nv == 0) {  // no valid expert: the sum is empty
        for (uint32_t i = threadIdx.x; i < n_out; i += blockDim.x)
            if (p.mode == 0) y[(size_t)t * p.m + r0 + i] = 0.0f;
        return;
    }
    const size_t mat_bytes = (size_t)p.m * p.row_bytes;
    auto expert = [&](uint32_t v) {  // the expert matrix of local row v (block_rows also asks for row nv * n_out)
        return w + p.w_offset + (size_t)ids[(uint64_t)t * p.ids_stride + valid[min(v / n_out, nv - 1)]] * p.expert_bytes;
    };
    q8::block_rows_x<QT, 1, LU, ST, BULK>(
        sm, nv * n_out, [&](uint32_t v) { return expert(v) + (size_t)(r0 + v % n_out) * p.row_bytes; },
        (uint32_t)p.row_bytes, [&](uint32_t v) { return expert(v) + mat_bytes; },
        [&](uint32_t v) {
            const uint32_t c = min(v / n_out, nv - 1);
            return q8::XView<1>{xq + (size_t)c * p.k, xi + c * (p.k / 32), p.k};
        },
        p.k, [] {},
        [&] {
            for (uint32_t c = 0; c < nv; ++c)
                q8::quantize_x<QT>(h + (size_t)(t * p.top_k + valid[c]) * p.k, p.k, xq + (size_t)c * p.k,
                                   xi + c * (p.k / 32));
            __syncthreads();
        },
        [&](uint32_t v, const float (&d)[1]) { dots[v] = d[0]; });
    __syncthreads();  // every row's dot product is in shared memory
    for (uint32_t i = threadIdx.x; i < n_out; i += blockDim.x) {
        float acc = 0.0f;
        for (uint32_t c = 0; c < nv; ++c) acc += weights[(uint64_t)t * p.weights_stride + valid[c]] * dots[c * n_out + i];
        float* out = y + (size_t)t * p.m + r0 + i;
        const float v = p.alpha * acc;
        *out = p.mode == 0 ? v : *out + v;
    }
}

// ------------------------------------------------------------------------------- routing
namespace {
constexpr int kRouteThreads = 1024;  // one thread per bucket: n_experts + 1 <= 1024
}  // namespace

// One block of kRouteThreads. Bucket b < n_experts holds the slots routed to expert b; bucket
// n_experts the slots with an invalid id (flagged). Outputs:
//   counts[e]   slots routed to expert e                     [n_experts]
//   offsets[b]  first packed position of bucket b; offsets[n_experts] = valid slots  [n_experts + 1]
//   packed[i]   slot ids, grouped by bucket (order within a bucket unspecified)     [n_slots]
//   items[i]    (expert or -1, first packed position, count <= cols)                 [max_items, 3]
//   n_items[0]  live items
__global__ void __launch_bounds__(kRouteThreads) moe_route_pack(
    int* __restrict__ counts,        // [n_experts] out
    int* __restrict__ offsets,       // [n_experts + 1] out
    int* __restrict__ packed,        // [n_slots] out
    int* __restrict__ items,         // [max_items, 3] out
    int* __restrict__ n_items,       // [1] out
    int* __restrict__ err,           // [1] error bits, or-ed in
    const int* __restrict__ ids,     // [n_tokens, ids_stride] expert ids (top_k used)
    const RouteParams p) {
    __shared__ int cnt[kRouteThreads], fill[kRouteThreads], scratch[32];
    const int b = threadIdx.x;
    const int n_buckets = p.n_experts + 1;
    cnt[b] = 0;
    fill[b] = 0;
    __syncthreads();
    bool bad = false;
    for (uint32_t i = threadIdx.x; i < p.n_slots; i += blockDim.x) {
        const int e = ids[route_at(i, p.top_k, p.ids_stride)];
        const bool ok = e >= 0 && (uint32_t)e < p.n_experts;
        bad |= !ok;
        atomicAdd(&cnt[ok ? e : p.n_experts], 1);
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(err, kErrExpertId);
    const int c = b < n_buckets ? cnt[b] : 0;
    int n_valid_total;
    const int off = cukern::block_exclusive_scan(c, scratch, &n_valid_total);
    const int my_items = (c + p.cols - 1) / p.cols;
    int items_total;
    const int item0 = cukern::block_exclusive_scan(my_items, scratch, &items_total);
    __shared__ int offs[kRouteThreads];
    offs[b] = off;
    if (b < (int)p.n_experts) counts[b] = c;
    if (b < n_buckets) offsets[b] = off;  // offsets[n_experts]: first invalid slot = valid slots
    for (int j = 0; j < my_items && item0 + j < (int)p.max_items; ++j) {
        int* it = items + 3 * (item0 + j);
        it[0] = b < (int)p.n_experts ? b : -1;
        it[1] = off + j * p.cols;
        it[2] = min((int)p.cols, c - j * (int)p.cols);
    }
    if (b == 0) *n_items = min(items_total, (int)p.max_items);
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < p.n_slots; i += blockDim.x) {
        const int e = ids[route_at(i, p.top_k, p.ids_stride)];
        const int bucket = e >= 0 && (uint32_t)e < p.n_experts ? e : p.n_experts;
        packed[offs[bucket] + atomicAdd(&fill[bucket], 1)] = (int)i;
    }
}

// One block of kRouteThreads: counts[e] = slots routed to expert e; invalid ids are flagged.
__global__ void __launch_bounds__(kRouteThreads) moe_count_experts(
    int* __restrict__ counts,        // [n_experts] out
    int* __restrict__ err,           // [1] error bits, or-ed in
    const int* __restrict__ ids,     // [n_tokens, ids_stride] expert ids (top_k used)
    const RouteParams p) {
    __shared__ int cnt[kRouteThreads];
    cnt[threadIdx.x] = 0;
    __syncthreads();
    bool bad = false;
    for (uint32_t i = threadIdx.x; i < p.n_slots; i += blockDim.x) {
        const int e = ids[route_at(i, p.top_k, p.ids_stride)];
        if (e >= 0 && (uint32_t)e < p.n_experts) atomicAdd(&cnt[e], 1);
        else bad = true;
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(err, kErrExpertId);
    if (threadIdx.x < p.n_experts) counts[threadIdx.x] = cnt[threadIdx.x];
}
