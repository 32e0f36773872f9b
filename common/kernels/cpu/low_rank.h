#pragma once

// Grouped low-rank updates, the CPU form of Punica/S-LoRA's SGMV (many rows per group: prompt
// chunks) and BGMV (one row per group: decode): every group has its own pair of small
// matrices and its own rows, and one call serves a whole heterogeneous batch.
//
//   for each group g, row i in g.rows:  y[i] += g.scale * ((x[i] S_g^T + b_g) E_g)
//
// S = shrink [rank, in], E = expand [rank, out] (f32, bf16 or f16), b = shrink bias (f32,
// optional). LoRA: S = A, E = B^T. DiReFT: S = W1, b = b1, E = W2, with y == x (in place).

#include <cstdint>

#include "common/kernels/cpu/low_rank_layout.h"
#include "common/kernels/matrix.h"

namespace preft::kernels::cpu {

struct LowRankGroup {
  const int32_t* rows = nullptr;  // row indices into x and y; distinct across groups
  int64_t num_rows = 0;
  MatrixView shrink;
  MatrixView expand;
  const float* shrink_bias = nullptr;
  float scale = 1.0f;
  // This group's output rows, when they are not the call's `y` (so one call can update q, k
  // and v, which share their input, each with its own adapters).
  float* y = nullptr;
  int64_t y_stride = 0;
};

// x: [*, in] with row stride x_stride; y: [*, out] with row stride y_stride. x and y may be
// the same buffer (then in == out): each row is read in full before it is written.
// bf16 matrices on a CPU with AVX-512-BF16 go through vdpbf16ps for every row: x and the rank-r
// intermediate are rounded to bf16 (RNE), as the bf16 linears round x and as PEFT runs a bf16
// model. A row's result is then the same bits whatever its group's size and its neighbours in
// the call (the engine groups the rows of requests that share an adapter).
void LowRankAdd(const float* x, int64_t x_stride, float* y, int64_t y_stride,
                const LowRankGroup* groups, int64_t num_groups);

}  // namespace preft::kernels::cpu
