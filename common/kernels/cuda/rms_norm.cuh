#pragma once

// CUDA kernels (no absl, protobuf or gRPC here: nvcc sees only these headers).

#include <cstdint>

namespace preft::kernels::cuda {

// out[t, :] = x[t, :] * rsqrt(mean(x[t, :]^2) + eps) * weight, for t in [0, num_tokens).
// Device pointers; runs on `stream` (a cudaStream_t passed as void* to keep CUDA types out of
// callers). Returns 0 on success or the CUDA error code.
int RmsNorm(const float* x, const float* weight, float* out, int64_t num_tokens, int64_t dim,
            float eps, void* stream);

// Number of CUDA devices visible (0 without a GPU or driver).
int DeviceCount();

}  // namespace preft::kernels::cuda
