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
}  // namespace
