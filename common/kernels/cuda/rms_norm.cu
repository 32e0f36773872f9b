#include "common/kernels/cuda/rms_norm.cuh"

#include <cuda_runtime.h>

namespace preft::kernels::cuda {
namespace {

// One block per token; a block-wide sum of squares, then a scaled copy.
__global__ void RmsNormKernel(const float* x, const float* w, float* out, int64_t dim, float eps) {
  extern __shared__ float partial[];
  const float* row = x + blockIdx.x * dim;
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) acc += row[i] * row[i];
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  float scale = rsqrtf(partial[0] / static_cast<float>(dim) + eps);
  float* dst = out + blockIdx.x * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = row[i] * scale * w[i];
}

}  // namespace

int RmsNorm(const float* x, const float* weight, float* out, int64_t num_tokens, int64_t dim,
            float eps, void* stream) {
  constexpr int kThreads = 256;
  RmsNormKernel<<<static_cast<unsigned>(num_tokens), kThreads, kThreads * sizeof(float),
                  static_cast<cudaStream_t>(stream)>>>(x, weight, out, dim, eps);
  return static_cast<int>(cudaGetLastError());
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

}  // namespace preft::kernels::cuda
