// Baseline kernels of Linear: AVX2 + FMA + F16C (the build's -march=x86-64-v3 floor) and plain
// C++. Weights (f32, bf16, f16) are widened to f32; x is used as is.

#include <immintrin.h>

#include <type_traits>
#include <vector>

#include "common/kernels/cpu/linear_driver.h"
#include "common/kernels/cpu/linear_kernels.h"
#include "common/kernels/cpu/simd_avx2.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace preft::kernels::cpu {
namespace {

inline __m128 Reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

template <DType kW, class Elem>
inline float WidenScalar(Elem v) {
  if constexpr (kW == DType::kF32) {
    return v;
  } else {
    return kW == DType::kBF16 ? Bf16ToF32(v) : F16ToF32(v);
  }
}

template <DType kW, class Elem>
inline __m256 Load8(const Elem* p) {
  if constexpr (kW == DType::kF32) {
    return _mm256_loadu_ps(p);
  } else {
    return Widen8<kW>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// As the AVX-512 FmaTile: per output 8 lanes over k in order, then a fixed tree and the
// scalar tail, whatever the tile, so its bits do not depend on m.
template <DType kW, int MR, int NR>
void FmaTile(const DotArgs& a, int64_t i0, int64_t j0) {
  using Elem = std::conditional_t<kW == DType::kF32, float, uint16_t>;
  const float* x = static_cast<const float*>(a.x) + i0 * a.ldx;
  const Elem* w = static_cast<const Elem*>(a.w) + j0 * a.k;
  const int64_t k = a.k, ldx = a.ldx;
  __m256 acc[MR][NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= k; c += 8) {
    __m256 xv[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(x + i * ldx + c);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const __m256 wv = Load8<kW>(w + j * k + c);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* y = a.y + (i0 + i) * a.n + j0;
    float out[NR];
    if constexpr (NR % 4 == 0) {
      for (int j = 0; j < NR; j += 4) {
        _mm_storeu_ps(out + j, Reduce4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]));
      }
    } else {
      for (int j = 0; j < NR; ++j) out[j] = Reduce1(acc[i][j]);
    }
    for (int j = 0; j < NR; ++j) {
      float s = out[j];
      for (int64_t t = c; t < k; ++t) s += x[i * ldx + t] * WidenScalar<kW>(w[j * k + t]);
      y[j] = a.bias != nullptr ? s + a.bias[j0 + j] : s;
    }
  }
}

template <DType kW>
constexpr DotKernelTable FmaTable() {
  DotKernelTable t;
  t.max_mr = 2;
  t.nr = 4;
  t.full[0] = FmaTile<kW, 1, 4>;
  t.full[1] = FmaTile<kW, 2, 4>;
  t.single[0] = FmaTile<kW, 1, 1>;
  t.single[1] = FmaTile<kW, 2, 1>;
  return t;
}

}  // namespace

void LinearFmaAvx2(const float* x, int64_t m, const void* w, DType w_dtype, int64_t n, int64_t k,
                  const float* bias, float* y) {
  static const DotKernelTable kF32 = FmaTable<DType::kF32>();
  static const DotKernelTable kBf16 = FmaTable<DType::kBF16>();
  static const DotKernelTable kF16 = FmaTable<DType::kF16>();
  DotArgs args{x, k, w, w_dtype, n, k, bias, y};
  RunDotKernel(args, m, w_dtype == DType::kF32 ? kF32 : w_dtype == DType::kBF16 ? kBf16 : kF16);
}

}  // namespace preft::kernels::cpu

#pragma GCC pop_options

namespace preft::kernels::cpu {

void LinearScalar(const float* x, int64_t m, const void* w, DType w_dtype, int64_t n, int64_t k,
                  const float* bias, float* y) {
#pragma omp parallel
  {
    std::vector<float> row(k);
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t c = 0; c < k; ++c) row[c] = LoadAsF32(w, w_dtype, j * k + c);
      for (int64_t i = 0; i < m; ++i) {
        const float* xi = x + i * k;
        float acc = 0.f;
        for (int64_t c = 0; c < k; ++c) acc += xi[c] * row[c];
        y[i * n + j] = bias != nullptr ? acc + bias[j] : acc;
      }
    }
  }
}

}  // namespace preft::kernels::cpu
