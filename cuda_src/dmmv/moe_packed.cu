// Token-batched MoE matvec over the work items of moe_route_pack (moe.cu): one block per
// (row block, item); an item is one expert and up to kPackCols of its slots, so the expert's
// weights are read once for all of them. The grid is sized for the worst-case item count and the
// blocks past the device-side count exit at once: no host readback, graph-capturable. Outputs (mode):
// 0 y[slot] = alpha v; 1 y[slot] += alpha v; 2 y[token] += alpha weights[slot] v, the down projection
// and the weighted sum over a token's experts (atomicAdd: the order of a token's terms is not fixed).
#include "dmmv/moe.cuh"

namespace {
// One work item's rows against NC of its slots (NC = 1 for a lone slot, which then costs what
// moe_dmmv costs, else kPackCols); columns past count repeat the last, never stored.
template <int QT, bool GLU, int NC>
CUKERN_DEVICE void packed_item(float* y, const uint8_t* const (&rows)[GLU ? 2 * kRows : kRows], const float* x,
                               const float* weights, const int* slots, int count, uint32_t row0, float* red,
                               const MoeParams& p) {
    constexpr int NR = GLU ? 2 * kRows : kRows;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    const float* xs[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const int slot = slots[min(c, count - 1)];
        xs[c] = x + (size_t)(p.x_per_slot ? slot : slot / p.top_k) * p.k;
    }
    float acc[NR][NC] = {};
    row_dots<QT, NR, NC, 0>(rows, xs, p.n_full, p.tail, warp, nw, lane, acc);
    block_reduce<NR, NC>(acc, red, warp, nw, lane);
    if (threadIdx.x < kRows * NC) {
        const int r = threadIdx.x / NC, c = threadIdx.x % NC;
        if (c < count && row0 + r < p.m) {
            const float v = GLU ? glu_act(p.act, red[threadIdx.x]) * red[kRows * NC + threadIdx.x] : red[threadIdx.x];
            const uint32_t s = slots[c];
            if (p.mode == 2)
                atomicAdd(y + (size_t)(s / p.top_k) * p.m + row0 + r,
                          p.alpha * weights[route_at(s, p.top_k, p.weights_stride)] * v);
            else if (p.mode == 1) y[(size_t)s * p.m + row0 + r] += p.alpha * v;
            else y[(size_t)s * p.m + row0 + r] = p.alpha * v;
        }
    }
}
}  // namespace

// grid: (ceil(m / kRows), max_items); block: NW warps. items[i] = (expert or -1, first packed
// slot, count <= kPackCols): written by moe_route_pack, as is n_items[0].
template <int QT, bool GLU>
__global__ void __launch_bounds__(kMaxWarps * 32) moe_dmmv_packed(
    float* __restrict__ y,             // [n_slots, m] out (mode 0, 1); [n_tokens, m] accumulated into (mode 2)
    const uint8_t* __restrict__ w,     // expert weights (gate weights with GLU)
    const uint8_t* __restrict__ w2,    // up weights (GLU); unused otherwise
    const float* __restrict__ x,       // [n_slots or n_tokens, k] f32 (x_per_slot)
    const float* __restrict__ weights, // [n_tokens, weights_stride] routing weights (top_k used; mode 2)
    const int* __restrict__ packed,    // [n_slots] slot ids grouped by expert
    const int* __restrict__ items,     // [max_items, 3] work items
    const int* __restrict__ n_items,   // [1] live work items
    const MoeParams p) {
    constexpr int NR = GLU ? 2 * kRows : kRows;
    __shared__ float red[kMaxWarps * NR * kPackCols];
    if (blockIdx.y >= (uint32_t)*n_items) return;  // the grid is sized for the worst case
    const int* item = items + 3 * blockIdx.y;
    const int e = item[0], first = item[1], count = item[2];
    const uint32_t row0 = blockIdx.x * kRows;
    if (e < 0) {  // the slots whose expert id was out of range (already flagged by the packer)
        if (p.mode != 0) return;  // accumulating: their terms are dropped
        for (int i = threadIdx.x; i < count * kRows; i += blockDim.x) {
            const uint32_t row = row0 + i % kRows;
            if (row < p.m) y[(size_t)packed[first + i / kRows] * p.m + row] = 0.0f;
        }
        return;
    }
    const uint8_t* rows[NR];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        const size_t off = (size_t)e * p.expert_bytes + (size_t)min(row0 + r, p.m - 1) * p.row_bytes;
        rows[r] = w + p.w_offset + off;
        if (GLU) rows[NR - kRows + r] = w2 + p.w2_offset + off;
    }
    const int* slots = packed + first;
    if (count == 1) packed_item<QT, GLU, 1>(y, rows, x, weights, slots, count, row0, red, p);
    else packed_item<QT, GLU, kPackCols>(y, rows, x, weights, slots, count, row0, red, p);
}

