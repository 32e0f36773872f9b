#pragma once

// Helpers shared by the .cu files of this folder (CUDA code only): stream and launch status
// plumbing for the wrappers, loads and warp reductions for the kernels.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/kernels/dtype.h"

namespace preft::kernels::cuda {

// The stream callers pass as void* (nullptr: the default stream).
inline cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

// What a wrapper returns after its launch: 0 or the launch's CUDA error.
inline int LaunchStatus() { return static_cast<int>(cudaGetLastError()); }

__device__ inline float LoadAsF32(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kF16: return __half2float(static_cast<const __half*>(base)[i]);
    case DType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  }
  return 0.f;
}

// Eight bf16 or f16 values (one 16-byte load: `raw`) widened to f32.
__device__ inline void Widen8(uint4 raw, DType dtype, float v[8]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f =
        dtype == DType::kBF16
            ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[j]))
            : __half22float2(*reinterpret_cast<const __half2*>(&words[j]));
    v[2 * j] = f.x;
    v[2 * j + 1] = f.y;
  }
}

// Whether p may be read in 16-byte vectors.
__host__ __device__ inline bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// HF rotate-half RoPE of one pair (a, b) = (v[i], v[i + half]) of a head at `position`, the
// angle in double as the CPU kernel computes it: (a cos - b sin, b cos + a sin).
__device__ inline float2 RotateHalfPair(float a, float b, int32_t position, float inv_freq) {
  double s, c;
  sincos(static_cast<double>(position) * inv_freq, &s, &c);
  const float cf = static_cast<float>(c), sf = static_cast<float>(s);
  return make_float2(a * cf - b * sf, b * cf + a * sf);
}

__device__ inline float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

__device__ inline float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace preft::kernels::cuda
