#include "common/kernels/cpu/ops.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/kernels/cpu/silu_avx2.h"

namespace preft::kernels::cpu {

void RmsNorm(const float* x, const float* weight, int64_t num_tokens, int64_t dim, float eps,
             float* out) {
#pragma omp parallel for schedule(static) if (num_tokens > 1)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* row = x + t * dim;
    float* dst = out + t * dim;
    double ss = 0.0;  // double keeps the f32 model within 1e-6 of a float64 reference
    for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(row[i]) * row[i];
    const float scale = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
    for (int64_t i = 0; i < dim; ++i) dst[i] = weight[i] * (row[i] * scale);
  }
}

void ApplyRope(const int32_t* positions, int64_t num_tokens, const float* inv_freq,
               int64_t head_dim, float* q, int64_t num_heads, float* k, int64_t num_kv_heads) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (num_tokens > 1)
  for (int64_t t = 0; t < num_tokens; ++t) {
    float cos_v[512], sin_v[512];  // head_dim <= 1024
    for (int64_t i = 0; i < half; ++i) {
      // In double: closer to a float64 reference than HF's own f32 angles, never further.
      const double angle = static_cast<double>(positions[t]) * inv_freq[i];
      cos_v[i] = static_cast<float>(std::cos(angle));
      sin_v[i] = static_cast<float>(std::sin(angle));
    }
    auto rotate = [&](float* v, int64_t heads) {
      for (int64_t h = 0; h < heads; ++h) {
        float* p = v + (t * heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = p[i], b = p[i + half];
          p[i] = a * cos_v[i] - b * sin_v[i];
          p[i + half] = b * cos_v[i] + a * sin_v[i];
        }
      }
    };
    rotate(q, num_heads);
    rotate(k, num_kv_heads);
  }
}

namespace {

void SiluMulRange(const float* g, const float* u, int64_t n, float* o) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(o + i, SiluMul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
  }
  if (i < n) {
    alignas(32) float gt[8] = {}, ut[8] = {}, ot[8];
    std::memcpy(gt, g + i, (n - i) * sizeof(float));
    std::memcpy(ut, u + i, (n - i) * sizeof(float));
    _mm256_store_ps(ot, SiluMul8(_mm256_load_ps(gt), _mm256_load_ps(ut)));
    std::memcpy(o + i, ot, (n - i) * sizeof(float));
  }
}

}  // namespace

void SiluMul(const float* gate_up, int64_t num_tokens, int64_t inter, float* out) {
#pragma omp parallel for schedule(static) if (num_tokens > 1)
  for (int64_t t = 0; t < num_tokens; ++t) {
    SiluMulRange(gate_up + t * 2 * inter, gate_up + t * 2 * inter + inter, inter, out + t * inter);
  }
}

void SiluMulSeparate(const float* gate, const float* up, int64_t n, float* out) {
  constexpr int64_t kChunk = 4096;  // multiple of 8: whole vectors per chunk
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    SiluMulRange(gate + begin, up + begin, std::min(kChunk, n - begin), out + begin);
  }
}

void AddInPlace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void GatherRows(const MatrixView& table, const int32_t* ids, int64_t num_tokens, float* out) {
  const int64_t dim = table.cols;
  const size_t esize = DTypeSize(table.dtype);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const uint8_t* row = static_cast<const uint8_t*>(table.data) + ids[t] * dim * esize;
    float* dst = out + t * dim;
    if (table.dtype == DType::kF32) {
      std::memcpy(dst, row, dim * sizeof(float));
    } else {
      for (int64_t i = 0; i < dim; ++i) dst[i] = LoadAsF32(row, table.dtype, i);
    }
  }
}

}  // namespace preft::kernels::cpu
