#include "common/kernels/cuda/ops.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/kernels/cuda/device_util.cuh"

namespace preft::kernels::cuda {
namespace {

constexpr int kThreads = 256;

unsigned Blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

__global__ void GatherRowsKernel(const void* table, DType dtype, int64_t cols,
                                 const int32_t* ids, float* out) {
  const int64_t t = blockIdx.x;
  const int64_t row = ids[t];
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    out[t * cols + i] = LoadAsF32(table, dtype, row * cols + i);
  }
}

// One block per token: a block-wide sum of squares, then the scaled copy. With kAdd the row
// is first x + delta, written back to x (each thread rereads only what it wrote).
template <bool kAdd>
__global__ void RmsNormKernel(float* x, const float* delta, const float* w, int64_t dim,
                              float eps, float* out) {
  __shared__ float partial[kThreads];
  float* row = x + blockIdx.x * dim;
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = row[i];
    if constexpr (kAdd) {
      v += delta[blockIdx.x * dim + i];
      row[i] = v;
    }
    acc += v * v;
  }
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  const float scale = rsqrtf(partial[0] / static_cast<float>(dim) + eps);
  float* dst = out + blockIdx.x * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = row[i] * scale * w[i];
}

// One block per token; thread i of each head handles the pair (i, i + half).
__global__ void RopeKernel(const int32_t* positions, const float* inv_freq, int64_t head_dim,
                           float* q, int64_t num_heads, float* k, int64_t num_kv_heads) {
  const int64_t t = blockIdx.x, half = head_dim / 2;
  const int64_t pairs = (num_heads + num_kv_heads) * half;
  for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int64_t h = p / half, i = p % half;
    float* v = h < num_heads ? q + (t * num_heads + h) * head_dim
                             : k + (t * num_kv_heads + (h - num_heads)) * head_dim;
    const float2 r = RotateHalfPair(v[i], v[i + half], positions[t], inv_freq[i]);
    v[i] = r.x;
    v[i + half] = r.y;
  }
}

__global__ void SiluMulKernel(const float* gate, const float* up, int64_t n, float* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) {
    const float g = gate[i];
    out[i] = g / (1.f + expf(-g)) * up[i];
  }
}

__global__ void AddKernel(float* y, const float* x, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] += x[i];
}

__global__ void RoundKernel(const float* x, int64_t n, __nv_bfloat16* xb) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) xb[i] = __float2bfloat16_rn(x[i]);
}

__global__ void AddBiasKernel(float* y, const float* bias, int64_t total, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < total) y[i] += bias[i % n];
}

__global__ void FillRandomKernel(__nv_bfloat16* dst, int64_t n, uint64_t seed, float bound) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(i + 1);  // SplitMix64
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  const float u = static_cast<float>(z >> 40) * 0x1.0p-24f;  // [0, 1)
  dst[i] = __float2bfloat16_rn((2.f * u - 1.f) * bound);
}

}  // namespace

int GatherRows(const void* table, DType dtype, int64_t cols, const int32_t* ids,
               int64_t num_tokens, float* out, void* stream) {
  if (num_tokens == 0) return 0;
  GatherRowsKernel<<<static_cast<unsigned>(num_tokens), kThreads, 0, AsStream(stream)>>>(
      table, dtype, cols, ids, out);
  return LaunchStatus();
}

int RmsNorm(const float* x, const float* weight, int64_t num_tokens, int64_t dim, float eps,
            float* out, void* stream) {
  if (num_tokens == 0) return 0;
  // x is only read without kAdd.
  RmsNormKernel<false><<<static_cast<unsigned>(num_tokens), kThreads, 0, AsStream(stream)>>>(
      const_cast<float*>(x), nullptr, weight, dim, eps, out);
  return LaunchStatus();
}

int AddRmsNorm(float* x, const float* delta, const float* weight, int64_t num_tokens,
               int64_t dim, float eps, float* out, void* stream) {
  if (num_tokens == 0) return 0;
  RmsNormKernel<true><<<static_cast<unsigned>(num_tokens), kThreads, 0, AsStream(stream)>>>(
      x, delta, weight, dim, eps, out);
  return LaunchStatus();
}

int ApplyRope(const int32_t* positions, int64_t num_tokens, const float* inv_freq,
              int64_t head_dim, float* q, int64_t num_heads, float* k, int64_t num_kv_heads,
              void* stream) {
  if (num_tokens == 0) return 0;
  RopeKernel<<<static_cast<unsigned>(num_tokens), kThreads, 0, AsStream(stream)>>>(
      positions, inv_freq, head_dim, q, num_heads, k, num_kv_heads);
  return LaunchStatus();
}

int SiluMulSeparate(const float* gate, const float* up, int64_t n, float* out, void* stream) {
  if (n == 0) return 0;
  SiluMulKernel<<<Blocks(n), kThreads, 0, AsStream(stream)>>>(gate, up, n, out);
  return LaunchStatus();
}

int AddInPlace(float* y, const float* x, int64_t n, void* stream) {
  if (n == 0) return 0;
  AddKernel<<<Blocks(n), kThreads, 0, AsStream(stream)>>>(y, x, n);
  return LaunchStatus();
}

int RoundToBf16(const float* x, int64_t n, uint16_t* xb, void* stream) {
  if (n == 0) return 0;
  RoundKernel<<<Blocks(n), kThreads, 0, AsStream(stream)>>>(x, n,
                                                    reinterpret_cast<__nv_bfloat16*>(xb));
  return LaunchStatus();
}

int AddBias(float* y, const float* bias, int64_t m, int64_t n, void* stream) {
  if (m * n == 0) return 0;
  AddBiasKernel<<<Blocks(m * n), kThreads, 0, AsStream(stream)>>>(y, bias, m * n, n);
  return LaunchStatus();
}

int FillRandomBf16(uint16_t* dst, int64_t n, uint64_t seed, float bound, void* stream) {
  if (n == 0) return 0;
  FillRandomKernel<<<Blocks(n), kThreads, 0, AsStream(stream)>>>(
      reinterpret_cast<__nv_bfloat16*>(dst), n, seed, bound);
  return LaunchStatus();
}

}  // namespace preft::kernels::cuda
