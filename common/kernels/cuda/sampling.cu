#include "common/kernels/cuda/sampling.cuh"

#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_sort.cuh>

#include "common/kernels/cuda/device_util.cuh"

namespace preft::kernels::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

// The better of two (value, id) candidates: higher value, then lower id.
__device__ void Better(float& v, int32_t& id, float ov, int32_t oid) {
  if (ov > v || (ov == v && oid < id)) {
    v = ov;
    id = oid;
  }
}

// The block's argmax of row[0, n) (the lowest id on ties); every thread gets it.
__device__ void BlockArgmax(const float* row, int64_t n, float* value, int32_t* index) {
  __shared__ float best_v[kWarps];
  __shared__ int32_t best_id[kWarps];
  float v = -INFINITY;
  int32_t id = INT32_MAX;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) Better(v, id, row[i], static_cast<int32_t>(i));
  for (int o = 16; o > 0; o >>= 1) {
    Better(v, id, __shfl_down_sync(0xffffffffu, v, o), __shfl_down_sync(0xffffffffu, id, o));
  }
  if (threadIdx.x % 32 == 0) {
    best_v[threadIdx.x / 32] = v;
    best_id[threadIdx.x / 32] = id;
  }
  __syncthreads();
  v = best_v[0];
  id = best_id[0];
  for (int w = 1; w < kWarps; ++w) Better(v, id, best_v[w], best_id[w]);
  *value = v;
  *index = id;
}

// One block per row: argmax, then the sum of exp(l - max) in double.
__global__ void __launch_bounds__(kThreads) GreedyKernel(const float* logits, int64_t vocab, int32_t* token, float* logprob) {
  __shared__ double sums[kWarps];
  const float* row = logits + blockIdx.x * vocab;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float v;
  int32_t id;
  BlockArgmax(row, vocab, &v, &id);
  const double max_logit = v;
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) s += exp(row[i] - max_logit);
  for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  if (lane == 0) sums[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int w = 0; w < kWarps; ++w) total += sums[w];
    token[blockIdx.x] = id;
    logprob[blockIdx.x] = static_cast<float>(-log(total));  // l[id] = max: logprob = -log Z'
  }
}

constexpr float kGreedyEpsilon = 1e-5f;  // as the CPU sampler

__device__ uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// engine::UniformFromCounter, bit for bit.
__device__ double UniformFromCounter(uint64_t seed, uint64_t step) {
  const uint64_t bits = SplitMix64(SplitMix64(seed) ^ SplitMix64(step + 0x632be59bd9b4e019ull));
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

__device__ bool NeedsOrder(const SampleSpec& s) {
  return s.temperature > kGreedyEpsilon && (s.top_k > 0 || s.top_p < 1.f);
}

// Scaled logits and ids for every sampled row; sort segments only for rows that need order.
__global__ void __launch_bounds__(kThreads) PrepareKernel(const float* logits, int64_t vocab, const SampleSpec* specs,
                              float* keys, int32_t* ids, int* begin, int* end) {
  const int64_t r = blockIdx.x;
  const SampleSpec s = specs[r];
  if (threadIdx.x == 0) {
    begin[r] = static_cast<int>(r * vocab);
    end[r] = static_cast<int>(NeedsOrder(s) ? (r + 1) * vocab : r * vocab);
  }
  if (s.temperature <= kGreedyEpsilon) return;
  const float inv_t = 1.f / s.temperature;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    keys[r * vocab + i] = logits[r * vocab + i] * inv_t;
    ids[r * vocab + i] = static_cast<int32_t>(i);
  }
}

using BlockScan = cub::BlockScan<double, kThreads>;
using BlockReduceD = cub::BlockReduce<double, kThreads>;

// The first index i in [0, n) whose inclusive prefix sum of w(i) exceeds `threshold` (or
// reaches it, with `reach`); n when none. All threads get the answer.
template <class W>
__device__ int64_t FirstPrefixOver(int64_t n, W w, double threshold, bool reach,
                                   BlockScan::TempStorage& scan, int64_t* found) {
  if (threadIdx.x == 0) *found = n;
  __syncthreads();
  double carry = 0.0;
  for (int64_t start = 0; start < n; start += kThreads) {
    const int64_t i = start + threadIdx.x;
    const double v = i < n ? w(i) : 0.0;
    double prefix, total;
    BlockScan(scan).InclusiveSum(v, prefix, total);
    prefix += carry;
    if (i < n && (reach ? prefix >= threshold : prefix > threshold)) atomicMin(reinterpret_cast<unsigned long long*>(found), static_cast<unsigned long long>(i));
    carry += total;
    __syncthreads();
    if (*found < n) break;
  }
  return *found;
}

// One block per row: SampleToken's choice over the sorted (or id-ordered) candidates.
__global__ void __launch_bounds__(kThreads) SampleKernel(const float* logits, int64_t vocab, const SampleSpec* specs,
                             const float* keys_in, const float* keys_sorted,
                             const int32_t* ids_sorted, int32_t* token) {
  __shared__ BlockScan::TempStorage scan;
  __shared__ BlockReduceD::TempStorage reduce;
  __shared__ double shared_sum;
  __shared__ int64_t found;
  const int64_t r = blockIdx.x;
  const SampleSpec s = specs[r];
  const bool ordered = NeedsOrder(s);
  const float* c = (ordered ? keys_sorted : keys_in) + r * vocab;
  if (s.temperature <= kGreedyEpsilon) c = logits + r * vocab;

  // The best candidate (ordered: the first; else the argmax, lowest id on ties).
  float v = -INFINITY;
  int32_t id = INT32_MAX;
  if (ordered) {
    v = c[0];
    id = 0;
  } else {
    BlockArgmax(c, vocab, &v, &id);
  }
  if (s.temperature <= kGreedyEpsilon) {
    if (threadIdx.x == 0) token[r] = id;
    return;
  }
  const float max_logit = v;
  const int64_t k = s.top_k > 0 && s.top_k < vocab ? s.top_k : vocab;
  auto weight = [&](int64_t i) { return exp(static_cast<double>(c[i] - max_logit)); };
  double part = 0.0;
  for (int64_t i = threadIdx.x; i < k; i += kThreads) part += weight(i);
  const double sum = BlockReduceD(reduce).Sum(part);
  if (threadIdx.x == 0) shared_sum = sum;
  __syncthreads();
  int64_t keep = k;
  if (s.top_p < 1.f) {  // the smallest prefix whose mass reaches top_p
    const double total = shared_sum;
    const int64_t at = FirstPrefixOver(k, [&](int64_t i) { return weight(i) / total; },
                                       static_cast<double>(s.top_p), true, scan, &found);
    if (at < k) keep = at + 1;
  }
  const double min_weight = s.min_p;
  auto kept = [&](int64_t i) {
    const double w = weight(i);
    return w < min_weight ? 0.0 : w;
  };
  part = 0.0;
  for (int64_t i = threadIdx.x; i < keep; i += kThreads) part += kept(i);
  __syncthreads();
  const double kept_sum = BlockReduceD(reduce).Sum(part);
  if (threadIdx.x == 0) shared_sum = kept_sum;
  __syncthreads();
  const double target = UniformFromCounter(s.seed, s.step) * shared_sum;
  int64_t pick = FirstPrefixOver(keep, kept, target, false, scan, &found);
  if (pick == keep) {  // rounding left a sliver: the last non-zero candidate
    if (threadIdx.x == 0) {
      pick = 0;
      for (int64_t i = keep; i-- > 0;) {
        if (kept(i) > 0.0) {
          pick = i;
          break;
        }
      }
      found = pick;
    }
    __syncthreads();
    pick = found;
  }
  if (threadIdx.x == 0) token[r] = ordered ? ids_sorted[r * vocab + pick] : static_cast<int32_t>(pick);
}

// The workspace: scaled keys, sorted keys, ids, sorted ids, segment offsets, then cub's.
struct Workspace {
  float *keys, *keys_sorted;
  int32_t *ids, *ids_sorted;
  int *begin, *end;
  void* temp;
  size_t temp_bytes;
  size_t total;
};

Workspace Carve(void* base, int64_t rows, int64_t vocab) {
  auto align = [](size_t n) { return (n + 255) / 256 * 256; };
  const size_t n = static_cast<size_t>(rows * vocab);
  Workspace w{};
  size_t at = 0;
  auto take = [&](size_t bytes) {
    void* p = base != nullptr ? static_cast<char*>(base) + at : nullptr;
    at += align(bytes);
    return p;
  };
  w.keys = static_cast<float*>(take(n * 4));
  w.keys_sorted = static_cast<float*>(take(n * 4));
  w.ids = static_cast<int32_t*>(take(n * 4));
  w.ids_sorted = static_cast<int32_t*>(take(n * 4));
  w.begin = static_cast<int*>(take(rows * sizeof(int)));
  w.end = static_cast<int*>(take(rows * sizeof(int)));
  cub::DeviceSegmentedSort::StableSortPairsDescending(
      nullptr, w.temp_bytes, w.keys, w.keys_sorted, w.ids, w.ids_sorted, static_cast<int>(n),
      static_cast<int>(rows), w.begin, w.end);
  w.temp = take(w.temp_bytes);
  w.total = at;
  return w;
}

}  // namespace

size_t SampleWorkspaceBytes(int64_t rows, int64_t vocab) {
  return Carve(nullptr, rows, vocab).total;
}

int SampleRows(const float* logits, int64_t rows, int64_t vocab, const SampleSpec* specs,
               int32_t* token, void* workspace, size_t workspace_bytes, void* stream) {
  if (rows == 0) return 0;
  if (rows * vocab > INT32_MAX) return static_cast<int>(cudaErrorInvalidValue);
  Workspace w = Carve(workspace, rows, vocab);
  if (workspace_bytes < w.total) return static_cast<int>(cudaErrorInvalidValue);
  const cudaStream_t st = AsStream(stream);
  PrepareKernel<<<static_cast<unsigned>(rows), kThreads, 0, st>>>(logits, vocab, specs, w.keys,
                                                                   w.ids, w.begin, w.end);
  if (const int e = LaunchStatus(); e != 0) return e;
  if (const cudaError_t e = cub::DeviceSegmentedSort::StableSortPairsDescending(
          w.temp, w.temp_bytes, w.keys, w.keys_sorted, w.ids, w.ids_sorted,
          static_cast<int>(rows * vocab), static_cast<int>(rows), w.begin, w.end, st);
      e != cudaSuccess) {
    return static_cast<int>(e);
  }
  SampleKernel<<<static_cast<unsigned>(rows), kThreads, 0, st>>>(
      logits, vocab, specs, w.keys, w.keys_sorted, w.ids_sorted, token);
  return LaunchStatus();
}

int GreedyLogprob(const float* logits, int64_t rows, int64_t vocab, int32_t* token,
                  float* logprob, void* stream) {
  if (rows == 0) return 0;
  GreedyKernel<<<static_cast<unsigned>(rows), kThreads, 0, AsStream(stream)>>>(logits, vocab,
                                                                               token, logprob);
  return LaunchStatus();
}

}  // namespace preft::kernels::cuda
