#pragma once

#include <cstdint>

#include "common/kernels/dtype.h"

namespace preft::kernels {

// A borrowed 2-D weight matrix, [rows, cols] row-major, in its checkpoint dtype (usually
// straight from a memory-mapped safetensors file). For nn.Linear: rows = out, cols = in.
struct MatrixView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  // Columns in chunks of kChunkCols: [cols / 32][rows][32], each chunk's rows together. The
  // CPU low-rank kernels' layout for adapter matrices (one sequential stream per matrix); only
  // they read it (see cpu/low_rank.h). Unpaired with rows a multiple of 16 (a shrink of rank
  // 16, 32, ...): by column pairs instead, [cols / 2][rows][2] (ColumnPaired), so that a
  // 64-byte line holds 16 rows' values for one pair of columns.
  bool chunked = false;
  // With chunked: each chunk's rows interleaved in pairs, [cols / 32][rows / 2][32][2] (rows
  // even), so a 64-byte line holds two rows' values for 16 columns: the vdpbf16ps operand of
  // an expand over rank pairs, loaded as is. The layout of chunked expand matrices.
  bool paired = false;
};

inline constexpr int64_t kChunkCols = 32;

// Whether a chunked matrix of `rows` rows is stored by column pairs (see MatrixView::chunked).
inline bool ColumnPaired(int64_t rows, bool paired) { return !paired && rows % 16 == 0; }

// Where element (r, c) of a chunked matrix of `rows` rows lives.
inline int64_t ChunkedAt(int64_t r, int64_t c, int64_t rows, bool paired = false) {
  if (ColumnPaired(rows, paired)) return (c / 2 * rows + r) * 2 + c % 2;
  const int64_t chunk = c / kChunkCols * rows * kChunkCols;
  return paired ? chunk + r / 2 * 2 * kChunkCols + c % kChunkCols * 2 + r % 2
                : chunk + r * kChunkCols + c % kChunkCols;
}

}  // namespace preft::kernels
