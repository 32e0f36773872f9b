#include "common/kernels/cuda/low_rank.cuh"

#include <cuda_runtime.h>

#include "common/kernels/cuda/device_util.cuh"

namespace preft::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// One block per item: each warp takes rank rows of the shrink (a dot product over `in`),
// then every thread sums its outputs over the rank.
__global__ void LowRankKernel(const float* x, int64_t x_stride, float* y, int64_t y_stride,
                              const LowRankGroup* groups, const LowRankItem* items) {
  __shared__ float z[kMaxLowRank];
  const LowRankItem item = items[blockIdx.x];
  const LowRankGroup g = groups[item.group];
  const float* xr = x + item.row * x_stride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int64_t k = warp; k < g.rank; k += warps) {
    float s = 0.f;
    for (int64_t i = lane; i < g.in; i += 32) s += LoadAsF32(g.shrink, g.dtype, k * g.in + i) * xr[i];
    s = WarpSum(s);
    if (lane == 0) z[k] = s + (g.shrink_bias != nullptr ? g.shrink_bias[k] : 0.f);
  }
  __syncthreads();  // x's row is read in full before y's (perhaps the same) row is written
  float* yr = g.y != nullptr ? g.y + item.row * g.y_stride : y + item.row * y_stride;
  for (int64_t o = threadIdx.x; o < g.out; o += blockDim.x) {
    float s = 0.f;
    for (int64_t k = 0; k < g.rank; ++k) s += z[k] * LoadAsF32(g.expand, g.dtype, k * g.out + o);
    yr[o] += g.scale * s;
  }
}

}  // namespace

int LowRankAdd(const float* x, int64_t x_stride, float* y, int64_t y_stride,
               const LowRankGroup* groups, const LowRankItem* items, int64_t num_items,
               void* stream) {
  if (num_items == 0) return 0;
  LowRankKernel<<<static_cast<unsigned>(num_items), kThreads, 0,
                  AsStream(stream)>>>(x, x_stride, y, y_stride, groups, items);
  return LaunchStatus();
}

}  // namespace preft::kernels::cuda
