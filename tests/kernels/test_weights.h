#pragma once

// Random weight matrices in f32, bf16 or f16 for kernel tests, with the f32 values they hold.

#include <cstdint>
#include <random>
#include <vector>

#include "common/kernels/dtype.h"
#include "common/kernels/matrix.h"

namespace preft::kernels::cpu {

// A weight in one dtype, with the f32 values it stands for.
struct Weight {
  DType dtype;
  std::vector<float> values;  // [n, k]
  std::vector<uint16_t> half;
  MatrixView View(int64_t n, int64_t k) const {
    return {dtype == DType::kF32 ? static_cast<const void*>(values.data()) : half.data(), dtype, n,
            k};
  }
};

inline Weight MakeWeight(DType dtype, int64_t n, int64_t k, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  Weight w{dtype, std::vector<float>(n * k), {}};
  if (dtype != DType::kF32) w.half.resize(n * k);
  for (int64_t i = 0; i < n * k; ++i) {
    const float v = dist(rng);
    if (dtype == DType::kBF16) {
      w.half[i] = F32ToBf16(v);
      w.values[i] = Bf16ToF32(w.half[i]);
    } else if (dtype == DType::kF16) {
      w.half[i] = F32ToF16(v);
      w.values[i] = F16ToF32(w.half[i]);
    } else {
      w.values[i] = v;
    }
  }
  return w;
}

}  // namespace preft::kernels::cpu
