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

constexpr int kChunk = 64;  // input columns staged per pass
constexpr int kOutputsPerThread = kTileRows * kMaxTileRank / kThreads;

// One block per (tile, target). Shrink: the tile's x rows and the shrink matrix are staged
// chunk by chunk in shared memory, and each thread accumulates up to kOutputsPerThread of the
// tile's rows x rank dot products. Expand: each thread owns output columns and adds every
// row's sum over the rank, reading each expand element once for the whole tile.
__global__ void LowRankTileKernel(const float* x, int64_t x_stride,
                                  const LowRankPair* const* tables, const LowRankItem* items,
                                  const LowRankTile* tiles, LowRankTargets targets) {
  __shared__ float xs[kTileRows][kChunk + 1];  // +1: rows fall in different banks
  __shared__ float ss[kMaxTileRank][kChunk + 1];
  __shared__ float z[kTileRows][kMaxTileRank];
  __shared__ int32_t rows[kTileRows];
  const LowRankTile tile = tiles[blockIdx.x];
  const LowRankTargets::Target t = targets.target[blockIdx.y];
  const LowRankPair p = tables[items[tile.first].adapter][t.entry];
  if (p.shrink == nullptr || p.rank > kMaxTileRank) return;
  const int n = tile.count, rank = static_cast<int>(p.rank), outputs = n * rank;
  if (threadIdx.x < n) rows[threadIdx.x] = items[tile.first + threadIdx.x].row;
  __syncthreads();

  float acc[kOutputsPerThread];
#pragma unroll
  for (int j = 0; j < kOutputsPerThread; ++j) acc[j] = 0.f;
  for (int64_t i0 = 0; i0 < p.in; i0 += kChunk) {
    for (int e = threadIdx.x; e < n * kChunk; e += kThreads) {
      const int r = e / kChunk, i = e % kChunk;
      xs[r][i] = i0 + i < p.in ? x[rows[r] * x_stride + i0 + i] : 0.f;
    }
    for (int e = threadIdx.x; e < rank * kChunk; e += kThreads) {
      const int k = e / kChunk, i = e % kChunk;
      ss[k][i] = i0 + i < p.in ? LoadAsF32(p.shrink, p.dtype, k * p.in + i0 + i) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kOutputsPerThread; ++j) {
      const int o = threadIdx.x + j * kThreads;
      if (o < outputs) {
        const int r = o / rank, k = o % rank;
        float s = 0.f;
        for (int i = 0; i < kChunk; ++i) s += xs[r][i] * ss[k][i];
        acc[j] += s;
      }
    }
    __syncthreads();  // the next chunk overwrites xs and ss
  }
#pragma unroll
  for (int j = 0; j < kOutputsPerThread; ++j) {
    const int o = threadIdx.x + j * kThreads;
    if (o < outputs) {
      const int r = o / rank, k = o % rank;
      z[r][k] = acc[j] + (p.shrink_bias != nullptr ? p.shrink_bias[k] : 0.f);
    }
  }
  __syncthreads();  // every x row was read (staged) before any y row (perhaps x's) is written
  for (int64_t c = threadIdx.x; c < p.out; c += kThreads) {
    float y[kTileRows];
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) y[r] = 0.f;
    for (int k = 0; k < rank; ++k) {
      const float e = LoadAsF32(p.expand, p.dtype, k * p.out + c);
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
        if (r < n) y[r] += z[r][k] * e;
      }
    }
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) {
      if (r < n) t.y[rows[r] * t.y_stride + c] += p.scale * y[r];
    }
  }
}

}  // namespace

int LowRankAddTiles(const float* x, int64_t x_stride, const LowRankPair* const* tables,
                    const LowRankItem* items, const LowRankTile* tiles, int64_t num_tiles,
                    const LowRankTargets& targets, void* stream) {
  if (num_tiles == 0 || targets.num_targets == 0) return 0;
  if (targets.num_targets > kMaxLowRankTargets) return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid(static_cast<unsigned>(num_tiles), static_cast<unsigned>(targets.num_targets));
  LowRankTileKernel<<<grid, kThreads, 0, AsStream(stream)>>>(x, x_stride, tables, items, tiles,
                                                             targets);
  return LaunchStatus();
}

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
