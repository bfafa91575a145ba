// What the MoE units (moe.cu, moe_packed.cu) share: rows per block, work-item width, error bits.
#pragma once

#include "dmmv/core.cuh"
#include "dmmv/params.cuh"

using namespace cukern;
using namespace cukern::qmv;

namespace {
constexpr int kRows = 2;      // weight rows per block
constexpr int kPackCols = 4;  // slots per work item of moe_dmmv_packed
constexpr int kErrExpertId = 1;

CUKERN_DEVICE bool expert_ok(int e, const MoeParams& p) { return e >= 0 && (uint32_t)e < p.n_experts; }
// Entry of slot s (token s / top_k, its (s % top_k)-th expert) in a routing array ([n_tokens, top_k] entries
// whose rows are stride entries apart: a RouteSlot half, one layer of a per-layer capture)
CUKERN_DEVICE uint64_t route_at(uint32_t s, uint32_t top_k, uint32_t stride) {
    return (uint64_t)(s / top_k) * stride + s % top_k;
}
}  // namespace
