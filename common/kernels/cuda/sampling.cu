#include "common/kernels/cuda/sampling.cuh"

#include <cuda_runtime.h>

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

// One block per row: argmax, then the sum of exp(l - max) in double.
__global__ void GreedyKernel(const float* logits, int64_t vocab, int32_t* token, float* logprob) {
  __shared__ float best_v[kWarps];
  __shared__ int32_t best_id[kWarps];
  __shared__ double sums[kWarps];
  const float* row = logits + blockIdx.x * vocab;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float v = -INFINITY;
  int32_t id = INT32_MAX;
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) Better(v, id, row[i], static_cast<int32_t>(i));
  for (int o = 16; o > 0; o >>= 1) {
    Better(v, id, __shfl_down_sync(0xffffffffu, v, o), __shfl_down_sync(0xffffffffu, id, o));
  }
  if (lane == 0) {
    best_v[warp] = v;
    best_id[warp] = id;
  }
  __syncthreads();
  v = best_v[0];
  id = best_id[0];
  for (int w = 1; w < kWarps; ++w) Better(v, id, best_v[w], best_id[w]);
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

}  // namespace

int GreedyLogprob(const float* logits, int64_t rows, int64_t vocab, int32_t* token,
                  float* logprob, void* stream) {
  if (rows == 0) return 0;
  GreedyKernel<<<static_cast<unsigned>(rows), kThreads, 0, AsStream(stream)>>>(logits, vocab,
                                                                               token, logprob);
  return LaunchStatus();
}

}  // namespace preft::kernels::cuda
