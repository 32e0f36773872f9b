#include "common/kernels/cuda/low_rank.cuh"

#include <cuda_runtime.h>

#include <algorithm>

#include "common/kernels/cuda/device_util.cuh"

namespace preft::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVector = 8;                       // elements per 16-byte load of bf16/f16
constexpr int kRowChunk = kThreads * kVector;    // outputs one BGMV block covers per pass

// Eight consecutive elements from element i of a matrix as f32, in one 16-byte load for
// bf16 and f16 (two for f32); the caller checks alignment.
__device__ inline void Load8(const void* base, DType dtype, int64_t i, float v[kVector]) {
  if (dtype == DType::kF32) {
    const float4 a = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    const float4 b = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    return;
  }
  Widen8(*reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + i), dtype, v);
}

// BGMV: one block per (item, target, output chunk). Each warp takes rank rows of the shrink
// (a dot product over `in`, 16-byte loads), then each thread adds 8 consecutive outputs' sums
// over the rank, for outputs chunk * kRowChunk + (thread * 8) and every gridDim.z chunks
// after. Blocks of one item recompute its small shrink (from L2) instead of passing z
// through memory; with y == x the launch has one chunk, so the row is read before written.
__global__ void __launch_bounds__(kThreads)
    LowRankKernel(const float* x, int64_t x_stride, const LowRankPair* const* tables,
                  const LowRankItem* items, LowRankTargets targets) {
  __shared__ float z[kMaxLowRank];
  const LowRankItem item = items[blockIdx.x];
  const LowRankTargets::Target t = targets.target[blockIdx.y];
  const LowRankPair p = tables[item.adapter][t.entry];
  if (p.shrink == nullptr) return;
  const int64_t first = static_cast<int64_t>(blockIdx.z) * kRowChunk;
  if (first >= p.out) return;
  const float* xr = x + item.row * x_stride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = kThreads / 32;
  const bool vec_in = p.in % kVector == 0 && Aligned16(p.shrink) && Aligned16(xr);
  for (int64_t k = warp; k < p.rank; k += warps) {
    float s = 0.f;
    if (vec_in) {
      for (int64_t i = lane * kVector; i < p.in; i += 32 * kVector) {
        float a[kVector], xv[kVector];
        Load8(p.shrink, p.dtype, k * p.in + i, a);
        Load8(xr, DType::kF32, i, xv);
#pragma unroll
        for (int j = 0; j < kVector; ++j) s += a[j] * xv[j];
      }
    } else {
      for (int64_t i = lane; i < p.in; i += 32) s += LoadAsF32(p.shrink, p.dtype, k * p.in + i) * xr[i];
    }
    s = WarpSum(s);
    if (lane == 0) z[k] = s + (p.shrink_bias != nullptr ? p.shrink_bias[k] : 0.f);
  }
  __syncthreads();  // x's row is read in full before y's (perhaps the same) row is written
  float* yr = t.y + item.row * t.y_stride;
  const bool vec_out = p.out % kVector == 0 && Aligned16(p.expand);
  for (int64_t o = first + threadIdx.x * kVector; o < p.out;
       o += static_cast<int64_t>(gridDim.z) * kRowChunk) {
    float acc[kVector] = {};
    if (vec_out) {
      for (int64_t k = 0; k < p.rank; ++k) {
        float e[kVector];
        Load8(p.expand, p.dtype, k * p.out + o, e);
        const float zk = z[k];
#pragma unroll
        for (int j = 0; j < kVector; ++j) acc[j] += zk * e[j];
      }
    } else {
      for (int64_t k = 0; k < p.rank; ++k) {
#pragma unroll
        for (int j = 0; j < kVector; ++j) {
          if (o + j < p.out) acc[j] += z[k] * LoadAsF32(p.expand, p.dtype, k * p.out + o + j);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kVector; ++j) {
      if (o + j < p.out) yr[o + j] += p.scale * acc[j];
    }
  }
}

constexpr int kChunk = 64;     // input columns staged per pass
constexpr int kMicroRows = 4;  // a shrink thread's tile: 4 rows x 2 ranks
constexpr int kMicroRanks = 2;

// One block per (tile, target), for tiles of up to kTileRows rows and rank <= kMaxTileRank.
// Shrink: x rows and the shrink matrix are staged chunk by chunk in shared memory; each
// thread accumulates a 4-row x 2-rank tile of z over its share of the chunk's columns (with
// few ranks, 2 or 4 thread groups split the columns and their sums are added at the end),
// so each shared load feeds more than one FMA. Expand: z is kept transposed in shared memory
// and each thread owns 2 adjacent output columns for every row of the tile (64 f32
// accumulators), reading 4 rows of z per 16-byte shared load and each expand element once
// per tile.
__global__ void __launch_bounds__(kThreads)
    LowRankTileKernel(const float* x, int64_t x_stride, const LowRankPair* const* tables,
                      const LowRankItem* items, const LowRankTile* tiles, LowRankTargets targets) {
  __shared__ float xs[kTileRows][kChunk + 1];  // +1: rows fall in different banks
  __shared__ float ss[kMaxTileRank][kChunk + 1];
  __shared__ __align__(16) float zt[kMaxTileRank][kTileRows];  // z transposed: [k][r]
  __shared__ float part[kThreads * kMicroRows * kMicroRanks];  // [split][r][k], n x rank each
  __shared__ int32_t rows[kTileRows];
  const LowRankTile tile = tiles[blockIdx.x];
  const LowRankTargets::Target t = targets.target[blockIdx.y];
  const LowRankPair p = tables[items[tile.first].adapter][t.entry];
  if (p.shrink == nullptr || p.rank <= 0 || p.rank > kMaxTileRank) return;
  const int n = tile.count, rank = static_cast<int>(p.rank);
  if (threadIdx.x < kTileRows) rows[threadIdx.x] = threadIdx.x < n ? items[tile.first + threadIdx.x].row : -1;

  // Shrink micro tiles: (row group, rank pair); splits of the chunk's columns fill the block.
  const int row_groups = (n + kMicroRows - 1) / kMicroRows;
  const int rank_pairs = (rank + kMicroRanks - 1) / kMicroRanks;
  const int tiles_count = row_groups * rank_pairs;
  const int splits = tiles_count * 4 <= kThreads ? 4 : tiles_count * 2 <= kThreads ? 2 : 1;
  const int mine = threadIdx.x % tiles_count, split = threadIdx.x / tiles_count;
  const bool shrinks = threadIdx.x < tiles_count * splits;
  const int r0 = (mine / rank_pairs) * kMicroRows, k0 = (mine % rank_pairs) * kMicroRanks;
  const int cols = kChunk / splits, c_lo = split * cols;
  __syncthreads();

  float acc[kMicroRows][kMicroRanks] = {};
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
    if (shrinks) {
      for (int i = c_lo; i < c_lo + cols; ++i) {
        float xv[kMicroRows], sv[kMicroRanks];
#pragma unroll
        for (int a = 0; a < kMicroRows; ++a) xv[a] = r0 + a < n ? xs[r0 + a][i] : 0.f;
#pragma unroll
        for (int b = 0; b < kMicroRanks; ++b) sv[b] = k0 + b < rank ? ss[k0 + b][i] : 0.f;
#pragma unroll
        for (int a = 0; a < kMicroRows; ++a) {
#pragma unroll
          for (int b = 0; b < kMicroRanks; ++b) acc[a][b] += xv[a] * sv[b];
        }
      }
    }
    __syncthreads();  // the next chunk overwrites xs and ss
  }
  if (shrinks) {
#pragma unroll
    for (int a = 0; a < kMicroRows; ++a) {
#pragma unroll
      for (int b = 0; b < kMicroRanks; ++b) {
        if (r0 + a < n && k0 + b < rank) part[(split * n + r0 + a) * rank + k0 + b] = acc[a][b];
      }
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kTileRows * kMaxTileRank; e += kThreads) {
    const int r = e % kTileRows, k = e / kTileRows;
    if (k >= rank) break;
    float z = 0.f;
    if (r < n) {
      for (int s = 0; s < splits; ++s) z += part[(s * n + r) * rank + k];
      z += p.shrink_bias != nullptr ? p.shrink_bias[k] : 0.f;
    }
    zt[k][r] = z;  // rows past n are 0: their accumulators stay 0 and are never stored
  }
  __syncthreads();  // every x row was read (staged) before any y row (perhaps x's) is written

  const bool pairs_ok = p.out % 2 == 0 && (reinterpret_cast<uintptr_t>(p.expand) & 3) == 0 &&
                        p.dtype != DType::kF32;
  for (int64_t c = 2 * static_cast<int64_t>(threadIdx.x); c < p.out; c += 2 * kThreads) {
    float y0[kTileRows], y1[kTileRows];
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) y0[r] = y1[r] = 0.f;
    for (int k = 0; k < rank; ++k) {
      float e0, e1;
      if (pairs_ok) {
        const uint32_t word = *reinterpret_cast<const uint32_t*>(
            static_cast<const uint16_t*>(p.expand) + k * p.out + c);
        const float2 f = p.dtype == DType::kBF16
                             ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&word))
                             : __half22float2(*reinterpret_cast<const __half2*>(&word));
        e0 = f.x;
        e1 = f.y;
      } else {
        e0 = LoadAsF32(p.expand, p.dtype, k * p.out + c);
        e1 = c + 1 < p.out ? LoadAsF32(p.expand, p.dtype, k * p.out + c + 1) : 0.f;
      }
      const float4* zk = reinterpret_cast<const float4*>(zt[k]);
#pragma unroll
      for (int r4 = 0; r4 < kTileRows / 4; ++r4) {
        const float4 z = zk[r4];
        y0[4 * r4] += z.x * e0, y1[4 * r4] += z.x * e1;
        y0[4 * r4 + 1] += z.y * e0, y1[4 * r4 + 1] += z.y * e1;
        y0[4 * r4 + 2] += z.z * e0, y1[4 * r4 + 2] += z.z * e1;
        y0[4 * r4 + 3] += z.w * e0, y1[4 * r4 + 3] += z.w * e1;
      }
    }
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) {
      if (r < n) {
        float* yr = t.y + rows[r] * t.y_stride + c;
        yr[0] += p.scale * y0[r];
        if (c + 1 < p.out) yr[1] += p.scale * y1[r];
      }
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
  // Output chunks from the widest y row (a target's stride bounds its width); one when a
  // target updates x in place, so no block writes a row another is still reading.
  int64_t widest = 0;
  bool in_place = false;
  for (int i = 0; i < targets.num_targets; ++i) {
    widest = std::max(widest, targets.target[i].y_stride);
    in_place = in_place || targets.target[i].y == x;
  }
  const int64_t chunks = in_place ? 1 : std::max<int64_t>(1, (widest + kRowChunk - 1) / kRowChunk);
  const dim3 grid(static_cast<unsigned>(num_items), static_cast<unsigned>(targets.num_targets),
                  static_cast<unsigned>(chunks));
  LowRankKernel<<<grid, kThreads, 0, AsStream(stream)>>>(x, x_stride, tables, items, targets);
  return LaunchStatus();
}

}  // namespace preft::kernels::cuda
