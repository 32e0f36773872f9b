#pragma once

// Element-wise and normalisation ops of a decoder layer, on f32 activations.
// Each is parallel over tokens (OpenMP) and vectorised by the compiler.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "common/kernels/matrix.h"

namespace preft::kernels::cpu {

// FastExp's constants, shared with its vector form (ops.cc): the clamp that keeps 2^n a
// normal float, log2(e), ln 2 split in a high and a low part, and the polynomial, highest
// coefficient first.
namespace fast_exp {
inline constexpr float kMin = -87.33f, kMax = 88.f;
inline constexpr float kLog2e = 1.44269504f;
inline constexpr float kLn2Hi = 0.693359375f, kLn2Lo = 2.12194440e-4f;
inline constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                   4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace fast_exp

// exp(x) with ~1 ulp error (Cephes' expf polynomial), written in plain arithmetic so loops
// over it vectorise (std::exp stays a scalar libm call without -ffast-math).
inline float FastExp(float x) {
  using namespace fast_exp;
  x = std::min(std::max(x, kMin), kMax);
  const float n = std::floor(x * kLog2e + 0.5f);
  const float r = x - n * kLn2Hi + n * kLn2Lo;
  float p = kPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kPoly[i];
  const float y = p * r * r + r + 1.f;
  return y * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// out[t] = x[t] * rsqrt(mean(x[t]²) + eps) * weight, rows of `dim`. out may alias x.
void RmsNorm(const float* x, const float* weight, int64_t num_tokens, int64_t dim, float eps,
             float* out);

// Rotates q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim] in place with HF's
// rotate-half layout: pairs (i, i + head_dim/2) rotated by position[t] * inv_freq[i].
void ApplyRope(const int32_t* positions, int64_t num_tokens, const float* inv_freq,
               int64_t head_dim, float* q, int64_t num_heads, float* k, int64_t num_kv_heads);

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i]: gate and up side by side.
void SiluMul(const float* gate_up, int64_t num_tokens, int64_t inter, float* out);

// SiLU(gate) * up with separate inputs: out[i] = silu(gate[i]) * up[i].
void SiluMulSeparate(const float* gate, const float* up, int64_t n, float* out);

// y[i] += x[i].
void AddInPlace(float* y, const float* x, int64_t n);

// out[t, :] = row ids[t] of an embedding matrix (any dtype), as f32.
void GatherRows(const MatrixView& table, const int32_t* ids, int64_t num_tokens, float* out);

}  // namespace preft::kernels::cpu
