#include "common/kernels/cpu/low_rank.h"

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "common/base/check.h"
#include "common/kernels/cpu/simd_avx2.h"

namespace preft::kernels::cpu {
namespace {

// Rows handled by one work item: enough to reuse each loaded shrink/expand row a few times,
// few enough that a 64-row prompt chunk still spreads over the threads.
constexpr int64_t kRowsPerItem = 8;
constexpr int64_t kMaxRank = 1024;
// Widest output a decode row's expand sums on the stack (Llama 3.1 70B's MLP is 28672).
constexpr int64_t kMaxExpandOut = 32768;
// Elements ahead at which a decode row's shrink and expand prefetch S and E (64 rows on 64
// adapters: 1.56-2.08 x the byte bound without, 1.26-1.37 with).
constexpr int64_t kPrefetchElems = 1024;

// z[r][k] = x[rows[r]] . S[k] (+ b[k]) for up to kRowsPerItem rows, four rows per pass over S.
template <DType T>
void Shrink(const float* x, int64_t x_stride, const int32_t* rows, int64_t n, const MatrixView& s,
            const float* bias, float* z) {
  const int64_t rank = s.rows, in = s.cols, vec_end = in & ~int64_t{7};
  if (n == 1) {  // a decode row (BGMV): bandwidth-bound on S, two chains for latency
    const float* xr = x + rows[0] * x_stride;
    const int64_t vec2_end = in & ~int64_t{15};
    for (int64_t k = 0; k < rank; ++k) {
      const void* srow = static_cast<const uint8_t*>(s.data) + k * in * DTypeSize(T);
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i < vec2_end; i += 16) {
        _mm_prefetch(static_cast<const char*>(srow) + (i + kPrefetchElems) * DTypeSize(T),
                     _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(Load8<T>(srow, i), _mm256_loadu_ps(xr + i), a0);
        a1 = _mm256_fmadd_ps(Load8<T>(srow, i + 8), _mm256_loadu_ps(xr + i + 8), a1);
      }
      for (; i < vec_end; i += 8)
        a0 = _mm256_fmadd_ps(Load8<T>(srow, i), _mm256_loadu_ps(xr + i), a0);
      float sum = Reduce1(_mm256_add_ps(a0, a1));
      for (; i < in; ++i) sum += LoadAsF32(srow, T, i) * xr[i];
      z[k] = sum + (bias != nullptr ? bias[k] : 0.0f);
    }
    return;
  }
  // Two rank rows x four activation rows per pass: each loaded x vector feeds two rank rows,
  // each loaded S vector four activation rows (8 FMAs per 6 loads).
  const size_t srow_bytes = in * DTypeSize(T);
  for (int64_t k = 0; k < rank; k += 2) {
    const int64_t kn = std::min<int64_t>(2, rank - k);
    const void* srow[2] = {static_cast<const uint8_t*>(s.data) + k * srow_bytes,
                           static_cast<const uint8_t*>(s.data) + (k + kn - 1) * srow_bytes};
    for (int64_t r0 = 0; r0 < n; r0 += 4) {
      const int64_t m = std::min<int64_t>(4, n - r0);
      const float* xr[4];
      for (int64_t j = 0; j < 4; ++j) xr[j] = x + rows[r0 + std::min(j, m - 1)] * x_stride;
      __m256 acc[4][2];
      for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
      for (int64_t i = 0; i < vec_end; i += 8) {
        const __m256 w0 = Load8<T>(srow[0], i), w1 = Load8<T>(srow[1], i);
        for (int64_t j = 0; j < 4; ++j) {
          const __m256 xv = _mm256_loadu_ps(xr[j] + i);
          acc[j][0] = _mm256_fmadd_ps(w0, xv, acc[j][0]);
          acc[j][1] = _mm256_fmadd_ps(w1, xv, acc[j][1]);
        }
      }
      for (int64_t j = 0; j < m; ++j) {
        for (int64_t q = 0; q < kn; ++q) {
          float sum = Reduce1(acc[j][q]);
          for (int64_t i = vec_end; i < in; ++i) sum += LoadAsF32(srow[q], T, i) * xr[j][i];
          z[(r0 + j) * rank + k + q] = sum + (bias != nullptr ? bias[k + q] : 0.0f);
        }
      }
    }
  }
}

// y[rows[r]] += scale * z[r] E, four rows per pass over E (each loaded E vector feeds four
// rows' accumulators), 16 outputs at a time with the rank loop inside.
template <DType T>
void Expand(const float* z, const int32_t* rows, int64_t n, const MatrixView& e, float scale,
            float* y, int64_t y_stride) {
  const int64_t rank = e.rows, out = e.cols, vec_end = out & ~int64_t{15};
  const size_t row_bytes = out * DTypeSize(T);
  const uint8_t* base = static_cast<const uint8_t*>(e.data);
  const __m256 sc = _mm256_set1_ps(scale);
  if (n == 1 && out <= kMaxExpandOut) {
    // A decode row (BGMV): E streamed once in memory order, row by row, into an L1-resident
    // sum (strips of 16 outputs across all rank rows made 2 x rank concurrent streams, which
    // the prefetchers did not keep up with).
    alignas(64) float t[kMaxExpandOut];
    const int64_t vec8_end = out & ~int64_t{7};
    std::fill(t, t + out, 0.f);
    for (int64_t k = 0; k < rank; ++k) {
      const void* erow = base + k * row_bytes;
      const __m256 zk = _mm256_set1_ps(z[k]);
      int64_t o = 0;
      for (; o < vec8_end; o += 8) {
        if (o % 32 == 0) {
          _mm_prefetch(static_cast<const char*>(erow) + (o + kPrefetchElems) * DTypeSize(T),
                       _MM_HINT_T0);
        }
        _mm256_store_ps(t + o, _mm256_fmadd_ps(zk, Load8<T>(erow, o), _mm256_load_ps(t + o)));
      }
      for (; o < out; ++o) t[o] += z[k] * LoadAsF32(erow, T, o);
    }
    float* yr = y + rows[0] * y_stride;
    int64_t o = 0;
    for (; o < vec8_end; o += 8) {
      _mm256_storeu_ps(yr + o, _mm256_fmadd_ps(sc, _mm256_load_ps(t + o), _mm256_loadu_ps(yr + o)));
    }
    for (; o < out; ++o) yr[o] += scale * t[o];
    return;
  }
  for (int64_t r0 = 0; r0 < n; r0 += 4) {
    const int64_t m = std::min<int64_t>(4, n - r0);
    const float* zr[4];
    for (int64_t j = 0; j < 4; ++j) zr[j] = z + (r0 + std::min(j, m - 1)) * rank;
    for (int64_t o = 0; o < vec_end; o += 16) {
      __m256 acc[4][2];
      for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
      for (int64_t k = 0; k < rank; ++k) {
        const void* erow = base + k * row_bytes;
        const __m256 e0 = Load8<T>(erow, o), e1 = Load8<T>(erow, o + 8);
        for (int64_t j = 0; j < 4; ++j) {
          const __m256 zk = _mm256_broadcast_ss(zr[j] + k);
          acc[j][0] = _mm256_fmadd_ps(zk, e0, acc[j][0]);
          acc[j][1] = _mm256_fmadd_ps(zk, e1, acc[j][1]);
        }
      }
      for (int64_t j = 0; j < m; ++j) {
        float* yr = y + rows[r0 + j] * y_stride + o;
        _mm256_storeu_ps(yr, _mm256_fmadd_ps(sc, acc[j][0], _mm256_loadu_ps(yr)));
        _mm256_storeu_ps(yr + 8, _mm256_fmadd_ps(sc, acc[j][1], _mm256_loadu_ps(yr + 8)));
      }
    }
    for (int64_t j = 0; j < m; ++j) {
      float* yr = y + rows[r0 + j] * y_stride;
      for (int64_t o = vec_end; o < out; ++o) {
        float sum = 0;
        for (int64_t k = 0; k < rank; ++k) sum += zr[j][k] * LoadAsF32(base + k * row_bytes, T, o);
        yr[o] += scale * sum;
      }
    }
  }
}

template <DType T>
void RunItem(const float* x, int64_t x_stride, float* y, int64_t y_stride, const LowRankGroup& g,
             int64_t begin, int64_t end, float* z) {
  Shrink<T>(x, x_stride, g.rows + begin, end - begin, g.shrink, g.shrink_bias, z);
  Expand<T>(z, g.rows + begin, end - begin, g.expand, g.scale, g.y != nullptr ? g.y : y,
            g.y != nullptr ? g.y_stride : y_stride);
}

struct Item {
  int32_t group;
  int32_t begin, end;
};

}  // namespace

void LowRankAdd(const float* x, int64_t x_stride, float* y, int64_t y_stride,
                const LowRankGroup* groups, int64_t num_groups) {
  std::vector<Item> items;
  for (int64_t g = 0; g < num_groups; ++g) {
    const LowRankGroup& gr = groups[g];
    PREFT_CHECK(gr.shrink.rows == gr.expand.rows && gr.shrink.rows <= kMaxRank);
    PREFT_CHECK(gr.shrink.dtype == gr.expand.dtype);
    for (int64_t b = 0; b < gr.num_rows; b += kRowsPerItem) {
      items.push_back({static_cast<int32_t>(g), static_cast<int32_t>(b),
                       static_cast<int32_t>(std::min(gr.num_rows, b + kRowsPerItem))});
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  auto run = [&](int64_t i, float* z) {
    const LowRankGroup& g = groups[items[i].group];
    switch (g.shrink.dtype) {
      case DType::kF32:
        RunItem<DType::kF32>(x, x_stride, y, y_stride, g, items[i].begin, items[i].end, z);
        break;
      case DType::kBF16:
        RunItem<DType::kBF16>(x, x_stride, y, y_stride, g, items[i].begin, items[i].end, z);
        break;
      case DType::kF16:
        RunItem<DType::kF16>(x, x_stride, y, y_stride, g, items[i].begin, items[i].end, z);
        break;
    }
  };
  // Tiny work (one decode row, say) is not worth waking the thread team.
  if (num_items <= 1) {
    alignas(64) float z[kRowsPerItem * kMaxRank];
    for (int64_t i = 0; i < num_items; ++i) run(i, z);
    return;
  }
#pragma omp parallel
  {
    alignas(64) float z[kRowsPerItem * kMaxRank];
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) run(i, z);
  }
}

}  // namespace preft::kernels::cpu
