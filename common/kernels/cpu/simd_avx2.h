#pragma once

// AVX2 helpers shared by the CPU kernels (the x86-64-v3 baseline: AVX2, FMA, F16C).

#include <immintrin.h>

#include <cstdint>

#include "common/kernels/dtype.h"

namespace preft::kernels::cpu {

// The sum of a vector's eight lanes.
inline float Reduce1(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight bf16 or f16 values widened to f32.
template <DType kW>
inline __m256 Widen8(__m128i v) {
  if constexpr (kW == DType::kBF16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  } else {
    return _mm256_cvtph_ps(v);
  }
}

// Eight weights as f32 from f32, bf16 or f16 storage, starting at element i.
template <DType kW>
inline __m256 Load8(const void* base, int64_t i) {
  if constexpr (kW == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    return Widen8<kW>(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i)));
  }
}

}  // namespace preft::kernels::cpu
