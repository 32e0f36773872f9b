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
  // they read it (see cpu/low_rank.h).
  bool chunked = false;
};

inline constexpr int64_t kChunkCols = 32;

// Where element (r, c) of a chunked matrix of `rows` rows lives.
inline int64_t ChunkedAt(int64_t r, int64_t c, int64_t rows) {
  return c / kChunkCols * rows * kChunkCols + r * kChunkCols + c % kChunkCols;
}

}  // namespace preft::kernels
