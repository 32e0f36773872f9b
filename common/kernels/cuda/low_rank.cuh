#pragma once

// Grouped low-rank updates on the GPU (LoRA and DiReFT in heterogeneous batches): the
// contract of common/kernels/cpu/low_rank.h, with the groups and their rows in device arrays.
//
//   for each item (row r of group g):  y_g[r] += g.scale * ((x[r] S_gᵀ + b_g) E_g)

#include <cstdint>

#include "common/kernels/dtype.h"

namespace preft::kernels::cuda {

inline constexpr int64_t kMaxLowRank = 1024;

struct LowRankGroup {
  const void* shrink = nullptr;  // [rank, in], device
  const void* expand = nullptr;  // [rank, out], device
  DType dtype = DType::kBF16;    // of shrink and expand
  int64_t rank = 0;              // <= kMaxLowRank
  int64_t in = 0;
  int64_t out = 0;
  const float* shrink_bias = nullptr;  // [rank] or null, device
  float scale = 1.f;
  float* y = nullptr;  // this group's output rows; null: the call's y
  int64_t y_stride = 0;
};

struct LowRankItem {
  int32_t row;    // into x and y
  int32_t group;  // into the groups array
};

// x: rows of stride x_stride; y: rows of stride y_stride. x and y may be one buffer (DiReFT
// in place): a row is read in full before it is written. Rows are distinct across items.
int LowRankAdd(const float* x, int64_t x_stride, float* y, int64_t y_stride,
               const LowRankGroup* groups, const LowRankItem* items, int64_t num_items,
               void* stream);

}  // namespace preft::kernels::cuda
