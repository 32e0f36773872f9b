#include "common/kernels/cuda/low_rank.cuh"

#include <cuda_runtime.h>

#include "common/kernels/cuda/device_util.cuh"

namespace preft::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// One block per (item, target): each warp takes rank rows of the shrink (a dot product over
// `in`), then every thread sums its outputs over the rank.
__global__ void LowRankKernel(const float* x, int64_t x_stride, const LowRankPair* const* tables,
                              const LowRankItem* items, LowRankTargets targets) {
  __shared__ float z[kMaxLowRank];
  const LowRankItem item = items[blockIdx.x];
  const LowRankTargets::Target t = targets.target[blockIdx.y];
  const LowRankPair p = tables[item.adapter][t.entry];
  if (p.shrink == nullptr) return;
  const float* xr = x + item.row * x_stride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int64_t k = warp; k < p.rank; k += warps) {
    float s = 0.f;
    for (int64_t i = lane; i < p.in; i += 32) s += LoadAsF32(p.shrink, p.dtype, k * p.in + i) * xr[i];
    s = WarpSum(s);
    if (lane == 0) z[k] = s + (p.shrink_bias != nullptr ? p.shrink_bias[k] : 0.f);
  }
  __syncthreads();  // x's row is read in full before y's (perhaps the same) row is written
  float* yr = t.y + item.row * t.y_stride;
  for (int64_t o = threadIdx.x; o < p.out; o += blockDim.x) {
    float s = 0.f;
    for (int64_t k = 0; k < p.rank; ++k) s += z[k] * LoadAsF32(p.expand, p.dtype, k * p.out + o);
    yr[o] += p.scale * s;
  }
}

}  // namespace

int LowRankAdd(const float* x, int64_t x_stride, const LowRankPair* const* tables,
               const LowRankItem* items, int64_t num_items, const LowRankTargets& targets,
               void* stream) {
  if (num_items == 0 || targets.num_targets == 0) return 0;
  if (targets.num_targets > kMaxLowRankTargets) return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid(static_cast<unsigned>(num_items), static_cast<unsigned>(targets.num_targets));
  LowRankKernel<<<grid, kThreads, 0, AsStream(stream)>>>(x, x_stride, tables, items, targets);
  return LaunchStatus();
}

}  // namespace preft::kernels::cuda
