#include "common/kernels/cpu/linear.h"

#include <cblas.h>

#include <vector>

namespace preft::kernels::cpu {

// Straightforward version; the fast bf16 kernels replace the non-f32 branch.
void Linear(const float* x, int64_t m, const MatrixView& w, const float* bias, float* y) {
  const int64_t n = w.rows, k = w.cols;
  if (w.dtype == DType::kF32) {
    const float* wf = static_cast<const float*>(w.data);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.f, x, k, wf, k, 0.f, y, n);
  } else {
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; ++j) {
      std::vector<float> row(k);
      for (int64_t c = 0; c < k; ++c) row[c] = LoadAsF32(w.data, w.dtype, j * k + c);
      for (int64_t i = 0; i < m; ++i) {
        float acc = 0.f;
        const float* xi = x + i * k;
        for (int64_t c = 0; c < k; ++c) acc += xi[c] * row[c];
        y[i * n + j] = acc;
      }
    }
  }
  if (bias != nullptr) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) y[i * n + j] += bias[j];
  }
}

}  // namespace preft::kernels::cpu
