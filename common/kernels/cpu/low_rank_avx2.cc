// The baseline low-rank kernels: AVX2 + FMA + F16C (the build's -march=x86-64-v3 floor) on
// f32, bf16 or f16 matrices widened to f32, for decode rows (BGMV) and prompt rows (SGMV). Also
// where bf16 matrices on AVX-512 CPUs without AVX-512-BF16 turn to low_rank_avx512.cc.

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "common/kernels/cpu/cpu_features.h"
#include "common/kernels/cpu/low_rank_kernels.h"
#include "common/kernels/cpu/simd_avx2.h"

namespace preft::kernels::cpu::low_rank_internal {

// z[r][k] = x[rows[r]] . S[k] (+ b[k]) for up to kRowsPerItem rows, four rows per pass over S.
template <DType T>
void Shrink(const float* x, int64_t x_stride, const int32_t* rows, int64_t n, const MatrixView& s,
            const float* bias, float* z) {
  const int64_t rank = s.rows, in = s.cols, vec_end = in & ~int64_t{7};
  if (n == 1) {  // a decode row (BGMV): bandwidth-bound on S, two chains for latency
    const float* xr = x + rows[0] * x_stride;
    if constexpr (T == DType::kBF16) {
      if (GetCpuFeatures().avx512 && in <= kMaxExpandOut) {
        ShrinkRowBf16Avx512(xr, static_cast<const uint16_t*>(s.data), rank, in, bias, z);
        return;
      }
    }
    // One chain per rank row, the sums of the four-row pass below lane for lane (a row's bits
    // may not depend on its group's size); S streams from memory, so latency is hidden.
    for (int64_t k = 0; k < rank; ++k) {
      const void* srow = static_cast<const uint8_t*>(s.data) + k * in * DTypeSize(T);
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < vec_end; i += 8) {
        if (i % 16 == 0) {
          _mm_prefetch(static_cast<const char*>(srow) + (i + kPrefetchElems) * DTypeSize(T),
                       _MM_HINT_T0);
        }
        acc = _mm256_fmadd_ps(Load8<T>(srow, i), _mm256_loadu_ps(xr + i), acc);
      }
      float sum = Reduce1(acc);
      for (int64_t i = vec_end; i < in; ++i) sum += LoadAsF32(srow, T, i) * xr[i];
      z[k] = sum + (bias != nullptr ? bias[k] : 0.0f);
    }
    return;
  }
  if constexpr (T == DType::kBF16) {
    if (GetCpuFeatures().avx512) {
      ShrinkRowsBf16Avx512(x, x_stride, rows, n, static_cast<const uint16_t*>(s.data), rank, in,
                           bias, z);
      return;
    }
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
  if constexpr (T == DType::kBF16) {
    if (GetCpuFeatures().avx512) {
      const auto* ew = static_cast<const uint16_t*>(e.data);
      if (n == 1 && out <= kMaxExpandOut) {
        ExpandRowBf16Avx512(z, ew, rank, out, scale, y + rows[0] * y_stride);
      } else {
        ExpandRowsBf16Avx512(z, rows, n, ew, rank, out, scale, y, y_stride);
      }
      return;
    }
  }
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
      for (; o < out; ++o) t[o] = std::fma(z[k], LoadAsF32(erow, T, o), t[o]);
    }
    float* yr = y + rows[0] * y_stride;
    int64_t o = 0;
    for (; o < vec8_end; o += 8) {
      _mm256_storeu_ps(yr + o, _mm256_fmadd_ps(sc, _mm256_load_ps(t + o), _mm256_loadu_ps(yr + o)));
    }
    for (; o < out; ++o) yr[o] = std::fma(scale, t[o], yr[o]);
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
      // Scalar FMAs: the same operations as a vector lane, so an output's bits do not
      // depend on whether a decode row's vector loop (8 wide) or this one (16) reached it.
      for (int64_t o = vec_end; o < out; ++o) {
        float sum = 0;
        for (int64_t k = 0; k < rank; ++k) {
          sum = std::fma(zr[j][k], LoadAsF32(base + k * row_bytes, T, o), sum);
        }
        yr[o] = std::fma(scale, sum, yr[o]);
      }
    }
  }
}

// The dtypes LowRankAdd takes.
template void Shrink<DType::kF32>(const float*, int64_t, const int32_t*, int64_t, const MatrixView&,
                                  const float*, float*);
template void Shrink<DType::kBF16>(const float*, int64_t, const int32_t*, int64_t,
                                   const MatrixView&, const float*, float*);
template void Shrink<DType::kF16>(const float*, int64_t, const int32_t*, int64_t, const MatrixView&,
                                  const float*, float*);
template void Expand<DType::kF32>(const float*, const int32_t*, int64_t, const MatrixView&, float,
                                  float*, int64_t);
template void Expand<DType::kBF16>(const float*, const int32_t*, int64_t, const MatrixView&, float,
                                   float*, int64_t);
template void Expand<DType::kF16>(const float*, const int32_t*, int64_t, const MatrixView&, float,
                                  float*, int64_t);

}  // namespace preft::kernels::cpu::low_rank_internal
