#include "common/kernels/cuda/attention.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "common/kernels/cuda/device_util.cuh"

namespace preft::kernels::cuda {
namespace {

constexpr int kThreads = 128;  // keys per tile; output dims per pass
constexpr int kWarps = kThreads / 32;
constexpr int kDimsPerThread = kMaxHeadDim / kThreads;

// The cache's element types: every kernel reads through Load (exact widening to f32; fp8
// then times its KV head's scale, one rounding as the CPU's) and writes through Store (f32 as
// is; bf16 rounded to nearest even, as the CPU's F32ToBf16; fp8 divided by the scale, then
// rounded to nearest even and saturated, as the CPU's F32ToFp8E4M3), so either device leaves
// the same bytes for the same values. f32 and bf16 ignore the scale.
__device__ __forceinline__ float Load(const float* p, float) { return *p; }
__device__ __forceinline__ float Load(const __nv_bfloat16* p, float) { return __bfloat162float(*p); }
__device__ __forceinline__ float Load(const __nv_fp8_e4m3* p, float scale) {
  return __fmul_rn(static_cast<float>(*p), scale);
}
__device__ __forceinline__ void Store(float* p, float v, float) { *p = v; }
__device__ __forceinline__ void Store(__nv_bfloat16* p, float v, float) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void Store(__nv_fp8_e4m3* p, float v, float scale) {
  *p = __nv_fp8_e4m3(__fdiv_rn(v, scale));  // __NV_SATFINITE, round to nearest even
}
// KV head h's fp8 scale (PagedKvLayout::k_scales / v_scales; 1 without them).
__device__ __forceinline__ float HeadScale(const float* scales, int64_t h) {
  return scales != nullptr ? scales[h] : 1.f;
}

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

template <class T>
__global__ void AttentionKernel(const AttentionSeq* seqs, PagedKvLayout kv, int64_t num_heads,
                                float scale, int64_t window) {
  __shared__ float q[kMaxHeadDim];
  __shared__ float p[kThreads];
  __shared__ int64_t key_base[kThreads];  // offset of each tile key's block, K part
  __shared__ float scratch[kWarps];
  const AttentionSeq seq = seqs[blockIdx.x];
  const T* k_base = static_cast<const T*>(kv.k_base);  // the launchers pick T by kv.dtype
  const int64_t head = blockIdx.y, qi = blockIdx.z;
  if (qi >= seq.num_new) return;
  const int64_t hd = kv.head_dim, bt = kv.block_tokens;
  const int64_t kvh = head / (num_heads / kv.num_kv_heads);
  const float ks = HeadScale(kv.k_scales, kvh), vs = HeadScale(kv.v_scales, kvh);
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
      const T* kp = k_base + base + kvh * hd * bt + j % bt;
      float dot = 0.f;
      for (int64_t d = 0; d < hd; ++d) dot += q[d] * Load(kp + d * bt, ks);
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
        a += p[t] * Load(k_base + key_base[t] + kv.v_offset + (kvh * bt + jj % bt) * hd + d, vs);
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
template <class T>
__global__ void WriteKvKernel(const float* k, const float* v, const int64_t* slots, T* base,
                              PagedKvLayout kv) {
  const int64_t t = blockIdx.x, slot = slots[t];
  const int64_t hd = kv.head_dim, bt = kv.block_tokens, width = kv.num_kv_heads * hd;
  T* block = base + (slot / bt) * kv.block_stride;
  const int64_t off = slot % bt;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    const int64_t h = i / hd, d = i % hd;
    Store(block + (h * hd + d) * bt + off, k[t * width + i], HeadScale(kv.k_scales, h));
    Store(block + kv.v_offset + (h * bt + off) * hd + d, v[t * width + i],
          HeadScale(kv.v_scales, h));
  }
}

// One block per token: q's pairs rotated in place, then each K pair rotated on its way into
// the block's transposed tile and V copied, as RopeKernel then WriteKvKernel.
template <class T>
__global__ void RopeWriteKvKernel(const int32_t* positions, const float* inv_freq, float* q,
                                  int64_t num_heads, const float* k, const float* v,
                                  const int64_t* slots, T* base, PagedKvLayout kv) {
  const int64_t t = blockIdx.x, slot = slots[t];
  const int64_t hd = kv.head_dim, half = hd / 2, bt = kv.block_tokens;
  const int64_t width = kv.num_kv_heads * hd;
  const int32_t pos = positions[t];
  for (int64_t p = threadIdx.x; p < num_heads * half; p += blockDim.x) {
    float* qh = q + (t * num_heads + p / half) * hd;
    const int64_t i = p % half;
    const float2 r = RotateHalfPair(qh[i], qh[i + half], pos, inv_freq[i]);
    qh[i] = r.x;
    qh[i + half] = r.y;
  }
  T* block = base + (slot / bt) * kv.block_stride;
  const int64_t off = slot % bt;
  for (int64_t p = threadIdx.x; p < kv.num_kv_heads * half; p += blockDim.x) {
    const int64_t h = p / half, i = p % half;
    const float* kh = k + t * width + h * hd;
    const float2 r = RotateHalfPair(kh[i], kh[i + half], pos, inv_freq[i]);
    const float ks = HeadScale(kv.k_scales, h);
    Store(block + (h * hd + i) * bt + off, r.x, ks);
    Store(block + (h * hd + i + half) * bt + off, r.y, ks);
  }
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    const int64_t h = i / hd, d = i % hd;
    Store(block + kv.v_offset + (h * bt + off) * hd + d, v[t * width + i],
          HeadScale(kv.v_scales, h));
  }
}

// ---- Decode (flash-decoding): one query per sequence ----
// One block per (sequence, KV head, split): the block scores the whole GQA group of query
// heads against each cache block of keys it owns, so every K and V element is read once per
// group, not once per query head. A long context is shared by `splits` blocks (cache block
// b goes to split b % splits, so any context is covered whatever the split count, which a
// replayed CUDA graph fixes); each leaves an unnormalised partial (o, m, l) that
// CombineKernel merges. With one split the block writes the output itself.
constexpr int kDecodeThreads = 128;
constexpr int kMaxGroup = 8;
constexpr int kDecodeDims = kMaxHeadDim / kDecodeThreads;

template <class T>
__global__ void __launch_bounds__(kDecodeThreads)
    DecodeAttentionKernel(const AttentionSeq* seqs, PagedKvLayout kv, int group, float scale,
                          int64_t window, float* parts, bool per_query) {
  __shared__ float q[kMaxGroup][kMaxHeadDim];
  __shared__ float partial[kMaxGroup][kDecodeThreads];  // per-thread slices of each dot
  __shared__ float p[kMaxGroup][kDecodeThreads];        // [g][t]: this cache block's weights
  __shared__ float corr[kMaxGroup];
  __shared__ float final_m[kMaxGroup], final_l[kMaxGroup];
  const AttentionSeq seq = seqs[blockIdx.x];
  // Decode: the sequence's one new token, blockIdx.z its split. Prompts (per_query): new
  // token blockIdx.z, whole context in one split.
  const int64_t qi = per_query ? static_cast<int64_t>(blockIdx.z) : seq.num_new - 1;
  if (qi < 0 || qi >= seq.num_new) return;
  const int kvh = blockIdx.y;
  const float ks = HeadScale(kv.k_scales, kvh), vs = HeadScale(kv.v_scales, kvh);
  const T* k_base = static_cast<const T*>(kv.k_base);  // the launchers pick T by kv.dtype
  const int split = per_query ? 0 : blockIdx.z, splits = per_query ? 1 : gridDim.z;
  const int hd = static_cast<int>(kv.head_dim), bt = static_cast<int>(kv.block_tokens);
  const int num_heads = group * static_cast<int>(kv.num_kv_heads);
  const int64_t pos = seq.context_len - seq.num_new + qi;
  const int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
  const float* q_row = seq.q + qi * num_heads * hd;
  for (int i = threadIdx.x; i < group * hd; i += kDecodeThreads) {
    q[i / hd][i % hd] = q_row[(kvh * group + i / hd) * hd + i % hd];
  }
  __syncthreads();

  // Scores: thread (slice, t) sums dims slice, slice + slices, ... of token t for every head
  // of the group (consecutive threads read consecutive tokens of the transposed K tile).
  const int t_mine = threadIdx.x % bt, slice = threadIdx.x / bt, slices = kDecodeThreads / bt;
  // Softmax: thread (g, t) of the first group * bt owns score (g, t); a segment of bt lanes
  // (within one warp: bt divides 32) holds one head's running max m and sum l.
  const int g_own = threadIdx.x / bt;
  const bool owner = g_own < group;
  float m = -INFINITY, l = 0.f;
  float o[kMaxGroup][kDecodeDims];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
    for (int r = 0; r < kDecodeDims; ++r) o[g][r] = 0.f;
  }
  for (int64_t b = lo / bt + split; b <= pos / bt; b += splits) {
    const int64_t block = static_cast<int64_t>(seq.block_table[b]) * kv.block_stride;
    const T* kt = k_base + block + static_cast<int64_t>(kvh) * hd * bt;
    const T* vt = k_base + block + kv.v_offset + static_cast<int64_t>(kvh) * bt * hd;
    const int t_lo = lo > b * bt ? static_cast<int>(lo - b * bt) : 0;
    const int t_hi = pos < (b + 1) * bt - 1 ? static_cast<int>(pos - b * bt) : bt - 1;
    float dot[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) dot[g] = 0.f;
    for (int d = slice; d < hd; d += slices) {
      const float k = Load(kt + d * bt + t_mine, ks);
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g < group) dot[g] += q[g][d] * k;
      }
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g < group) partial[g][threadIdx.x] = dot[g];
    }
    __syncthreads();
    // Every lane takes part in the shuffles (a segment never mixes with another: bt divides
    // 32 and the xor offsets stay below bt); only owners keep the results.
    float s = -INFINITY;
    if (owner && t_mine >= t_lo && t_mine <= t_hi) {
      float sum = 0.f;
      for (int sl = 0; sl < slices; ++sl) sum += partial[g_own][sl * bt + t_mine];
      s = sum * scale;
    }
    float tile_max = s;
    for (int off = bt / 2; off > 0; off >>= 1) {
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
    }
    const float new_m = fmaxf(m, tile_max);  // an owner's is finite: the block has a key in range
    const float e = owner ? __expf(s - new_m) : 0.f;
    float tile_sum = e;
    for (int off = bt / 2; off > 0; off >>= 1) {
      tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, off);
    }
    if (owner) {
      const float c = __expf(m - new_m);  // 0 on the first block (m = -inf)
      l = l * c + tile_sum;
      m = new_m;
      p[g_own][t_mine] = e;
      if (t_mine == 0) corr[g_own] = c;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kDecodeDims; ++r) {
      const int d = threadIdx.x + r * kDecodeThreads;
      if (d >= hd) break;
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g < group) o[g][r] *= corr[g];
      }
      for (int t = t_lo; t <= t_hi; ++t) {  // keys out of range may hold anything, even NaN
        const float v = Load(vt + t * hd + d, vs);
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g < group) o[g][r] += p[g][t] * v;
        }
      }
    }
    __syncthreads();  // partial, p and corr are rewritten by the next cache block
  }
  if (owner && t_mine == 0) {
    final_m[g_own] = m;
    final_l[g_own] = l;
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= group) break;
    const int head = kvh * group + g;
    float* dst = splits == 1
                     ? seq.out + (qi * num_heads + head) * hd
                     : parts + ((static_cast<int64_t>(blockIdx.x) * num_heads + head) * splits + split) * (hd + 2);
#pragma unroll
    for (int r = 0; r < kDecodeDims; ++r) {
      const int d = threadIdx.x + r * kDecodeThreads;
      if (d < hd) dst[d] = splits == 1 ? o[g][r] / final_l[g] : o[g][r];
    }
    if (splits > 1 && threadIdx.x == 0) {
      dst[hd] = final_m[g];  // -inf and 0 when this split had no cache block
      dst[hd + 1] = final_l[g];
    }
  }
}

// One block per (sequence, head): merges the splits' partial softmaxes.
__global__ void __launch_bounds__(kDecodeThreads)
    CombineKernel(const AttentionSeq* seqs, int num_heads, int hd, int splits,
                  const float* parts) {
  const AttentionSeq seq = seqs[blockIdx.x];
  if (seq.num_new == 0) return;
  const int head = blockIdx.y;
  const float* base = parts + (static_cast<int64_t>(blockIdx.x) * num_heads + head) * splits * (hd + 2);
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) m = fmaxf(m, base[s * (hd + 2) + hd]);
  float l = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float* part = base + s * (hd + 2);
    if (part[hd + 1] > 0.f) l += part[hd + 1] * __expf(part[hd] - m);
  }
  for (int d = threadIdx.x; d < hd; d += kDecodeThreads) {
    float acc = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float* part = base + s * (hd + 2);
      if (part[hd + 1] > 0.f) acc += part[d] * __expf(part[hd] - m);
    }
    seq.out[static_cast<int64_t>(head) * hd + d] = acc / l;
  }
}

// The decode kernel's limits: a GQA group of at most kMaxGroup heads whose scores fit one
// pass of the block, and cache blocks of a power of two tokens up to a warp.
bool DecodeKernelFits(const PagedKvLayout& kv, int64_t num_heads) {
  const int64_t bt = kv.block_tokens, group = num_heads / kv.num_kv_heads;
  return bt >= 1 && bt <= 32 && (bt & (bt - 1)) == 0 && group <= kMaxGroup &&
         group * bt <= kDecodeThreads && kv.head_dim <= kMaxHeadDim;
}

int DecodeSplits(int64_t num_seqs, int64_t num_kv_heads) {
  static const int sms = [] {
    int device = 0, n = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    return n > 0 ? n : 100;
  }();
  const int64_t ctas = num_seqs * num_kv_heads, want = 2 * static_cast<int64_t>(sms);
  const int64_t splits = (want + ctas - 1) / ctas;
  return static_cast<int>(splits < 1 ? 1 : splits > kMaxDecodeSplits ? kMaxDecodeSplits : splits);
}

// Calls fn with a null pointer of the cache's element type; false for an unknown dtype.
template <class Fn>
bool WithElementType(KvDtype dtype, Fn&& fn) {
  switch (dtype) {
    case KvDtype::kF32: fn(static_cast<float*>(nullptr)); return true;
    case KvDtype::kBF16: fn(static_cast<__nv_bfloat16*>(nullptr)); return true;
    case KvDtype::kFp8E4M3: fn(static_cast<__nv_fp8_e4m3*>(nullptr)); return true;
  }
  return false;
}

}  // namespace

int WriteKv(const float* k, const float* v, const int64_t* slots, int64_t num_tokens,
            void* layer_base, const PagedKvLayout& layout, void* stream) {
  if (num_tokens == 0) return 0;
  const bool known = WithElementType(layout.dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    WriteKvKernel<T><<<static_cast<unsigned>(num_tokens), kThreads, 0, AsStream(stream)>>>(
        k, v, slots, static_cast<T*>(layer_base), layout);
  });
  return known ? LaunchStatus() : static_cast<int>(cudaErrorInvalidValue);
}

int RopeWriteKv(const int32_t* positions, const float* inv_freq, float* q, int64_t num_heads,
                const float* k, const float* v, const int64_t* slots, int64_t num_tokens,
                void* layer_base, const PagedKvLayout& layout, void* stream) {
  if (num_tokens == 0) return 0;
  const bool known = WithElementType(layout.dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    RopeWriteKvKernel<T><<<static_cast<unsigned>(num_tokens), kThreads, 0, AsStream(stream)>>>(
        positions, inv_freq, q, num_heads, k, v, slots, static_cast<T*>(layer_base), layout);
  });
  return known ? LaunchStatus() : static_cast<int>(cudaErrorInvalidValue);
}

int64_t AttentionWorkspaceFloats(int64_t num_seqs, int64_t max_new, const PagedKvLayout& layout,
                                 int64_t num_heads) {
  if (max_new != 1 || !DecodeKernelFits(layout, num_heads)) return 0;
  const int64_t splits = DecodeSplits(num_seqs, layout.num_kv_heads);
  return splits == 1 ? 0 : num_seqs * num_heads * splits * (layout.head_dim + 2);
}

int PagedAttention(const AttentionSeq* seqs, int64_t num_seqs, int64_t max_new,
                   const PagedKvLayout& layout, int64_t num_heads, float scale, int64_t window,
                   float* workspace, void* stream) {
  if (num_seqs == 0 || max_new == 0) return 0;
  if (layout.head_dim > kMaxHeadDim) return static_cast<int>(cudaErrorInvalidValue);
  const bool decode = max_new == 1 && DecodeKernelFits(layout, num_heads);
  const int splits = decode ? DecodeSplits(num_seqs, layout.num_kv_heads) : 1;
  if (splits > 1 && workspace == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  const int group = static_cast<int>(num_heads / layout.num_kv_heads);
  const bool known = WithElementType(layout.dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    if (decode) {
      const dim3 grid(static_cast<unsigned>(num_seqs), static_cast<unsigned>(layout.num_kv_heads),
                      static_cast<unsigned>(splits));
      DecodeAttentionKernel<T><<<grid, kDecodeThreads, 0, AsStream(stream)>>>(
          seqs, layout, group, scale, window, workspace, false);
      if (splits > 1) {
        const dim3 heads(static_cast<unsigned>(num_seqs), static_cast<unsigned>(num_heads));
        CombineKernel<<<heads, kDecodeThreads, 0, AsStream(stream)>>>(
            seqs, static_cast<int>(num_heads), static_cast<int>(layout.head_dim), splits,
            workspace);
      }
    } else if (DecodeKernelFits(layout, num_heads)) {  // prompts: a block per query, unsplit
      const dim3 grid(static_cast<unsigned>(num_seqs), static_cast<unsigned>(layout.num_kv_heads),
                      static_cast<unsigned>(max_new));
      DecodeAttentionKernel<T><<<grid, kDecodeThreads, 0, AsStream(stream)>>>(
          seqs, layout, group, scale, window, nullptr, true);
    } else {
      const dim3 grid(static_cast<unsigned>(num_seqs), static_cast<unsigned>(num_heads),
                      static_cast<unsigned>(max_new));
      AttentionKernel<T><<<grid, kThreads, 0, AsStream(stream)>>>(seqs, layout, num_heads, scale,
                                                                  window);
    }
  });
  return known ? LaunchStatus() : static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace preft::kernels::cuda
