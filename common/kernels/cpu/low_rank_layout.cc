#include "common/kernels/cpu/low_rank_layout.h"

#include <cstring>

#include "common/kernels/cpu/isa.h"

namespace preft::kernels::cpu {

bool LowRankChunkable(const MatrixView& m) {
  return m.dtype == DType::kBF16 && m.rows % 4 == 0 && m.rows <= kMaxRank &&
         m.cols % kChunkCols == 0 && m.cols <= kMaxExpandOut &&
         ActiveLinearIsa() >= LinearIsa::kAvx512Bf16;
}

void ChunkColumns(const uint16_t* src, int64_t rows, int64_t cols, bool paired, uint16_t* dst) {
  if (ColumnPaired(rows, paired)) {  // a transpose of [rows][cols / 2] column pairs
    for (int64_t p = 0; p < cols / 2; ++p) {
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(dst + (p * rows + r) * 2, src + r * cols + 2 * p, 2 * sizeof(uint16_t));
    }
    return;
  }
  for (int64_t c = 0; c < cols; c += kChunkCols) {
    if (!paired) {
      for (int64_t k = 0; k < rows; ++k) {
        std::memcpy(dst + ChunkedAt(k, c, rows), src + k * cols + c,
                    kChunkCols * sizeof(uint16_t));
      }
      continue;
    }
    for (int64_t k = 0; k < rows; k += 2) {
      uint16_t* out = dst + ChunkedAt(k, c, rows, true);
      for (int64_t j = 0; j < kChunkCols; ++j) {
        out[2 * j] = src[k * cols + c + j];
        out[2 * j + 1] = src[(k + 1) * cols + c + j];
      }
    }
  }
}

}  // namespace preft::kernels::cpu
