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

// Chunked matrices (MatrixView::chunked, [cols / 32][rows][32]) are these kernels' faster
// layout for bf16 adapters: each matrix one sequential stream (the multi-LoRA decode step is
// bound by streaming them). A group's shrink and expand are chunked together or not at all,
// the expand with its rows paired (MatrixView::paired, the shrink not), and only matrices for
// which LowRankChunkable holds: bf16, rows a multiple of 4, cols of 32, on a CPU with
// AVX-512-BF16. Results are bit-identical to the row-major layout's, except for shrinks of
// rank 16, 32, ... (stored by column pairs, kernels::ColumnPaired), whose sums run in an order
// of their own (the same for every row and group size): equal to rounding.
bool LowRankChunkable(const MatrixView& m);
// dst = src [rows, cols] row-major, chunked (rows paired if `paired`; by column pairs where
// ColumnPaired). cols a multiple of 32.
void ChunkColumns(const uint16_t* src, int64_t rows, int64_t cols, bool paired, uint16_t* dst);

}  // namespace preft::kernels::cpu
