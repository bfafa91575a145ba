// Scratch probe (profiling/tune_dmmv_q8.py --probe only; no dispatch launches it): the int8 path's
// streaming with the order in which warps visit the matrix's items (row, chunk of 32 * LU units)
// as a parameter, to measure what the DRAM access pattern costs apart from the row bookkeeping.
// The sums it writes are not the matvec (rows split between warps are not combined).
//   ORDER 0: block b takes rows [b m / G, (b+1) m / G), warp w a contiguous share of its items
//   ORDER 1: the same rows per block, items dealt round-robin to its warps (item w, w + nw, ...)
//   ORDER 2: items dealt round-robin to all warps of the grid (global warp g: g, g + W, ...)
// COMPUTE 0 reads one word per lane and unit instead of the dot product.
#include "dmmv/params.cuh"
#include "dmmv/q8.cuh"

using namespace cukern;

template <int QT, int LU, int ST, int ORDER, int COMPUTE>
__global__ void __launch_bounds__(q8::kMaxWarps * 32) dmmv_q8_probe(
    float* __restrict__ y,             // [grid * nw] out: one garbage sum per warp
    const uint8_t* __restrict__ w,     // m rows from w + w_offset
    const float* __restrict__ x,       // [k]
    const DmmvParams p) {
    using U = q8::Unit<QT>;
    using S = q8::Stream<QT, LU, ST>;
    constexpr int BI = S::kIterBytes, SLOT = S::kSlotBytes, kIterUnits = S::kUnits;
    extern __shared__ __align__(16) uint8_t smem[];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    const q8::Smem<QT, LU, ST, 1> sm(smem, nw, p.k);
    const q8::XView<1> xv{sm.xq, sm.xi, p.k};
    uint8_t* ring = sm.ring(warp);
    uint64_t* bars = sm.bars + warp * ST;
    const uint32_t units = p.k / 32, ipr = (units + kIterUnits - 1) / kIterUnits;
    const uint8_t* base = w + p.w_offset;
    const uint8_t* end = base + (size_t)p.m * p.row_bytes;
    uint32_t first, stride, total;  // items first, first + stride, ... (total of them)
    if (ORDER == 2) {
        const uint32_t items = p.m * ipr, W = gridDim.x * nw, g = blockIdx.x * nw + warp;
        first = g, stride = W, total = g < items ? (items - g + W - 1) / W : 0;
    } else {
        const uint32_t r0 = (uint32_t)((uint64_t)p.m * blockIdx.x / gridDim.x);
        const uint32_t r1 = (uint32_t)((uint64_t)p.m * (blockIdx.x + 1) / gridDim.x);
        const uint32_t items = (r1 - r0) * ipr;
        if (ORDER == 1) {
            first = r0 * ipr + warp, stride = nw, total = warp < (int)items ? (items - warp + nw - 1) / nw : 0;
        } else {
            const q8::Share s(items, warp, nw);
            first = r0 * ipr + s.begin, stride = 1, total = s.end - s.begin;
        }
    }
    if (lane == 0) {
        for (int s = 0; s < ST; ++s) mbar_init(bars + s);
        mbar_init_fence();
    }
    __syncwarp();
    auto item_ptr = [&](uint32_t t) { const uint32_t i = first + t * stride; return base + (size_t)(i / ipr) * p.row_bytes + (size_t)(i % ipr) * BI; };
    auto issue = [&](uint32_t t) {
        if (t < total) {
            const uint32_t i = first + t * stride;
            const uint8_t* row = base + (size_t)(i / ipr) * p.row_bytes;
            const uint8_t* s = row + (size_t)(i % ipr) * BI;
            const uint8_t* e = row + min((i % ipr + 1) * BI, (uint32_t)p.row_bytes);
            const uint8_t* c0 = reinterpret_cast<const uint8_t*>(reinterpret_cast<size_t>(s) & ~size_t(15));
            const int n = (int)min((size_t)((e - c0 + 15) >> 4), (size_t)(end - c0) >> 4);
            if (lane == 0) {
                mbar_arrive_expect(bars + t % ST, 16u * n);
                if (n > 0) bulk_copy(ring + (t % ST) * SLOT, c0, 16u * n, bars + t % ST);
            }
        }
    };
    for (int t = 0; t < ST - 1; ++t) issue(t);
    for (int c = 0; c < 1; ++c) q8::quantize_x<QT>(x, p.k, sm.xq, sm.xi);
    __syncthreads();
    float acc[1] = {};
    for (uint32_t t = 0; t < total; ++t) {
        __syncwarp();
        issue(t + ST - 1);
        mbar_wait(bars + t % ST, (t / ST) & 1u);
        const uint32_t i = first + t * stride, it = i % ipr;
        const uint8_t* b = ring + (t % ST) * SLOT + (reinterpret_cast<size_t>(item_ptr(t)) & 15);
#pragma unroll
        for (int l = 0; l < LU; ++l) {
            const uint32_t u = it * kIterUnits + 32 * l + lane;
            if (u < units) {
                const uint8_t* blk = b + (32 * l + lane) / U::kBlockUnits * U::kBlockBytes;
                if (COMPUTE) U::template dot<1>(blk, q8::misalign4(blk), lane % U::kBlockUnits, u, xv, acc);
                else acc[0] += (float)blk[0];
            }
        }
    }
    const float s = warp_sum(acc[0]);
    if (lane == 0) y[blockIdx.x * nw + warp] = s;
}
