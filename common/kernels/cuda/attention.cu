#include "common/kernels/cuda/attention.cuh"

#include <cuda_runtime.h>

#include "common/kernels/cuda/device_util.cuh"

namespace preft::kernels::cuda {
namespace {

constexpr int kThreads = 128;  // keys per tile; output dims per pass
constexpr int kWarps = kThreads / 32;
constexpr int kDimsPerThread = kMaxHeadDim / kThreads;

// Block-wide reduction through shared scratch (kWarps floats); every thread gets the result.
template <bool kMax>
__device__ float BlockReduce(float v, float* scratch) {
  v = kMax ? WarpMax(v) : WarpSum(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < kWarps; ++w) r = kMax ? fmaxf(r, scratch[w]) : r + scratch[w];
  __syncthreads();
  return r;
}

__global__ void AttentionKernel(const AttentionSeq* seqs, PagedKvLayout kv, int64_t num_heads,
                                float scale, int64_t window) {
  __shared__ float q[kMaxHeadDim];
  __shared__ float p[kThreads];
  __shared__ int64_t key_base[kThreads];  // offset of each tile key's block, K part
  __shared__ float scratch[kWarps];
  const AttentionSeq seq = seqs[blockIdx.x];
  const int64_t head = blockIdx.y, qi = blockIdx.z;
  if (qi >= seq.num_new) return;
  const int64_t hd = kv.head_dim, bt = kv.block_tokens;
  const int64_t kvh = head / (num_heads / kv.num_kv_heads);
  const int64_t pos = seq.context_len - seq.num_new + qi;
  const int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
  const float* qrow = seq.q + (qi * num_heads + head) * hd;
  for (int64_t d = threadIdx.x; d < hd; d += kThreads) q[d] = qrow[d];
  __syncthreads();

  float m = -INFINITY, l = 0.f;
  float acc[kDimsPerThread];
  for (float& a : acc) a = 0.f;
  for (int64_t start = lo; start <= pos; start += kThreads) {
    const int64_t j = start + threadIdx.x;
    float s = -INFINITY;
    if (j <= pos) {
      const int64_t base = seq.block_table[j / bt] * kv.block_stride;
      key_base[threadIdx.x] = base;
      const float* kp = kv.k_base + base + kvh * hd * bt + j % bt;
      float dot = 0.f;
      for (int64_t d = 0; d < hd; ++d) dot += q[d] * kp[d * bt];
      s = dot * scale;
    }
    const float tile_max = BlockReduce<true>(s, scratch);
    const float new_m = fmaxf(m, tile_max);
    const float e = j <= pos ? __expf(s - new_m) : 0.f;
    p[threadIdx.x] = e;
    const float tile_sum = BlockReduce<false>(e, scratch);  // also publishes p and key_base
    const float correction = __expf(m - new_m);  // 0 on the first tile (m = -inf)
    l = l * correction + tile_sum;
    m = new_m;
    const int64_t count = pos - start + 1 < kThreads ? pos - start + 1 : kThreads;
    for (int r = 0; r < kDimsPerThread; ++r) {
      const int64_t d = threadIdx.x + r * kThreads;
      if (d >= hd) break;
      float a = acc[r] * correction;
      for (int64_t t = 0; t < count; ++t) {
        const int64_t jj = start + t;
        a += p[t] * kv.k_base[key_base[t] + kv.v_offset + (kvh * bt + jj % bt) * hd + d];
      }
      acc[r] = a;
    }
    __syncthreads();  // p and key_base are rewritten by the next tile
  }
  float* out = seq.out + (qi * num_heads + head) * hd;
  for (int r = 0; r < kDimsPerThread; ++r) {
    const int64_t d = threadIdx.x + r * kThreads;
    if (d < hd) out[d] = acc[r] / l;
  }
}

// One block per token; thread i of the token's kv_heads * head_dim values stores K (transposed
// tile) and V.
__global__ void WriteKvKernel(const float* k, const float* v, const int64_t* slots, float* base,
                              PagedKvLayout kv) {
  const int64_t t = blockIdx.x, slot = slots[t];
  const int64_t hd = kv.head_dim, bt = kv.block_tokens, width = kv.num_kv_heads * hd;
  float* block = base + (slot / bt) * kv.block_stride;
  const int64_t off = slot % bt;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    const int64_t h = i / hd, d = i % hd;
    block[(h * hd + d) * bt + off] = k[t * width + i];
    block[kv.v_offset + (h * bt + off) * hd + d] = v[t * width + i];
  }
}

}  // namespace

int WriteKv(const float* k, const float* v, const int64_t* slots, int64_t num_tokens,
            float* layer_base, const PagedKvLayout& layout, void* stream) {
  if (num_tokens == 0) return 0;
  WriteKvKernel<<<static_cast<unsigned>(num_tokens), kThreads, 0, AsStream(stream)>>>(
      k, v, slots, layer_base, layout);
  return LaunchStatus();
}

int PagedAttention(const AttentionSeq* seqs, int64_t num_seqs, int64_t max_new,
                   const PagedKvLayout& layout, int64_t num_heads, float scale, int64_t window,
                   void* stream) {
  if (num_seqs == 0 || max_new == 0) return 0;
  if (layout.head_dim > kMaxHeadDim) return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid(static_cast<unsigned>(num_seqs), static_cast<unsigned>(num_heads),
                  static_cast<unsigned>(max_new));
  AttentionKernel<<<grid, kThreads, 0, AsStream(stream)>>>(seqs, layout,
                                                                           num_heads, scale, window);
  return LaunchStatus();
}

}  // namespace preft::kernels::cuda
