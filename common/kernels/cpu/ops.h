#pragma once

// Element-wise and normalisation ops of a decoder layer, on f32 activations.
// Each is parallel over tokens (OpenMP) and vectorised by the compiler.

#include <cstdint>

#include "common/kernels/matrix.h"

namespace preft::kernels::cpu {

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
