#pragma once

// Element-wise and normalisation ops of a decoder layer on the GPU: the same contracts as
// common/kernels/cpu/ops.h, on device pointers (f32 activations), run on `stream`. Each
// returns 0 or the CUDA error of its launch.

#include <cstdint>

#include "common/kernels/dtype.h"

namespace preft::kernels::cuda {

// out[t, :] = row ids[t] of table [rows, cols] (f32, f16 or bf16) as f32.
int GatherRows(const void* table, DType dtype, int64_t cols, const int32_t* ids,
               int64_t num_tokens, float* out, void* stream);

// out[t] = x[t] * rsqrt(mean(x[t]²) + eps) * weight, rows of `dim`. out may alias x.
int RmsNorm(const float* x, const float* weight, int64_t num_tokens, int64_t dim, float eps,
            float* out, void* stream);

// x[t] += delta[t], then out[t] = RmsNorm(x[t]): a residual add and the norm after it in one
// pass, bit for bit AddInPlace then RmsNorm. out must not alias x or delta.
int AddRmsNorm(float* x, const float* delta, const float* weight, int64_t num_tokens,
               int64_t dim, float eps, float* out, void* stream);

// HF rotate-half RoPE in place on q [T, num_heads, head_dim] and k [T, num_kv_heads,
// head_dim]: pairs (i, i + head_dim/2) rotated by positions[t] * inv_freq[i] (angles in double,
// as the CPU kernel).
int ApplyRope(const int32_t* positions, int64_t num_tokens, const float* inv_freq,
              int64_t head_dim, float* q, int64_t num_heads, float* k, int64_t num_kv_heads,
              void* stream);

// out[i] = silu(gate[i]) * up[i]. out may alias gate.
int SiluMulSeparate(const float* gate, const float* up, int64_t n, float* out, void* stream);

// y[i] += x[i].
int AddInPlace(float* y, const float* x, int64_t n, void* stream);

// xb [m, k] = x rounded to bf16 (round to nearest even), the GEMM input.
int RoundToBf16(const float* x, int64_t n, uint16_t* xb, void* stream);

// y[r, :] += bias for m rows of n.
int AddBias(float* y, const float* bias, int64_t m, int64_t n, void* stream);

// dst[i] = bf16 of a uniform value in [-bound, bound), a pure function of (seed, i): random
// weights made on the device (benchmarks of checkpoints too large to write).
int FillRandomBf16(uint16_t* dst, int64_t n, uint64_t seed, float bound, void* stream);

}  // namespace preft::kernels::cuda
