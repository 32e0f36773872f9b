#include "common/kernels/cpu/attention.h"

#include "common/kernels/cpu/ops.h"

#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "common/base/check.h"
#include "common/base/math.h"
#include "common/kernels/cpu/cpu_features.h"
#include "common/kernels/dtype.h"

namespace preft::kernels::cpu {
namespace {

// Queries stream the K/V blocks directly (AttendDirect, or its AVX-512 form, which beats
// OpenBLAS at every chunk length: 1.1-1.4x on prompts). Without AVX-512, long query chunks
// (prefill) use two single-threaded GEMMs per query head over a gathered copy of the head's
// K and V instead. OpenMP spreads the work over sequences, heads and runs of query rows.
constexpr int64_t kGemmMinQueries = 8;
// Query rows per work item of the direct paths.
constexpr int64_t kDirectRows = 64;

// The cache's elements: float (f32 KV), the bits of a bf16 (bf16 KV) or of an fp8 e4m3 (fp8
// KV, times its KV head's scale). Every kernel reads them through Widen (or its vector form,
// Load16), which rounds at most once (fp8: the exact value times the scale), and then runs the
// f32 code unchanged: attention over a bf16 or fp8 cache equals, bit for bit, attention over an
// f32 cache holding the same values, so batch invariance carries over from f32 as it is.
using Bf16Bits = uint16_t;
using Fp8Bits = uint8_t;

// `scale` is the KV head's fp8 scale; f32 and bf16 elements ignore it.
inline float Widen(float v, float /*scale*/) { return v; }
inline float Widen(Bf16Bits v, float /*scale*/) {
  // The shift in integers, then a bit cast: a loop of these vectorises (Bf16ToF32's memcpy
  // through a local does too, but less reliably).
  return std::bit_cast<float>(static_cast<uint32_t>(v) << 16);
}

// Every fp8 e4m3 code's exact value (0x7f and 0xff: NaN; the writer stores NaN only for NaN).
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) value[b] = Fp8E4M3ToF32(static_cast<uint8_t>(b));
  }
};
const Fp8Table kFp8;

inline float Widen(Fp8Bits v, float scale) { return kFp8.value[v] * scale; }

// The fp8 scales of KV head h (1 where the layout has none: f32 and bf16 caches).
float KeyScale(const PagedKvLayout& l, int64_t h) {
  return l.k_scales != nullptr ? l.k_scales[h] : 1.f;
}
float ValueScale(const PagedKvLayout& l, int64_t h) {
  return l.v_scales != nullptr ? l.v_scales[h] : 1.f;
}

// Where K tile of KV head h in the b-th block of a sequence starts; V is l.v_offset further.
template <class T>
const T* KeyBlock(const PagedKvLayout& l, const int32_t* table, int64_t b, int64_t h) {
  return static_cast<const T*>(l.k_base) + table[b] * l.block_stride +
         h * l.block_tokens * l.head_dim;
}

// First key position a query sees when it sees `visible` positions in all.
int64_t FirstVisible(int64_t visible, int64_t window) {
  return window > 0 && visible > window ? visible - window : 0;
}

// Softmax of s[0..n) in place, scaled; returns nothing, s becomes probabilities.
void Softmax(float* s, int64_t n) {
  // The max in 8 lanes (AVX2 is the build's baseline): GCC keeps a plain max loop a scalar
  // chain (even under `omp simd reduction(max)`), which took ~60% of the softmax.
  __m256 lanes = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i0 = 0;
  for (; i0 + 8 <= n; i0 += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(s + i0));
  alignas(32) float lane_max[8];
  _mm256_store_ps(lane_max, lanes);
  float mx = *std::max_element(lane_max, lane_max + 8);
  for (; i0 < n; ++i0) mx = std::max(mx, s[i0]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    s[i] = FastExp(s[i] - mx);
    sum += s[i];
  }
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}

// Asks for `bytes` from p on into L1 ahead of use: a sequence's blocks lie anywhere in the
// pool, each K tile or V slab a few KiB, too short for the hardware prefetcher to ramp up, so
// without this a decode step waits on memory latency at every block, not on bandwidth.
inline void Prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// Local accumulators of AttendDirect: a block's scores, and a slice of a head's output.
constexpr int64_t kMaxBlockTokens = 64;
constexpr int64_t kOutChunk = 64;

// Queries of one KV head's group for a few new tokens, straight over the blocks: each K tile
// ([d][bt], transposed) is loaded once for all the group's heads, and a head's scores over
// the tile's tokens are one vector loop (no horizontal sums).
template <class T>
void AttendDirect(const AttentionSeq& seq, const PagedKvLayout& l, int64_t h, int64_t t_begin,
                  int64_t t_end, int64_t num_heads, float scale, int64_t window,
                  std::vector<float>& scores) {
  const int64_t d = l.head_dim, bt = l.block_tokens;
  const int64_t group = num_heads / l.num_kv_heads;
  const int64_t ctx = seq.context_len;
  const int64_t stride = base::RoundUp(ctx, bt);  // scores of one head, whole blocks
  const float ks = KeyScale(l, h), vs = ValueScale(l, h);
  scores.resize(group * stride);
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t visible = ctx - seq.num_new + t + 1;
    const int64_t first = FirstVisible(visible, window);
    const float* q = seq.q + (t * num_heads + h * group) * d;  // the group's heads, contiguous
    // Scores and outputs accumulate in local arrays (registers once vectorised): through the
    // scores or output pointers, which may alias K and V for all the compiler knows, every
    // step was a load and a store.
    for (int64_t b = first / bt; b * bt < visible; ++b) {
      const T* kt = KeyBlock<T>(l, seq.block_table, b, h);
      if ((b + 1) * bt < visible) {
        Prefetch(KeyBlock<T>(l, seq.block_table, b + 1, h), d * bt * int64_t{sizeof(T)});
      }
      for (int64_t j = 0; j < group; ++j) {
        const float* qj = q + j * d;
        for (int64_t tok0 = 0; tok0 < bt; tok0 += kMaxBlockTokens) {
          const int64_t n = std::min(kMaxBlockTokens, bt - tok0);
          float acc[kMaxBlockTokens] = {};
          for (int64_t i = 0; i < d; ++i) {
            const float qi = qj[i] * scale;
            const T* row = kt + i * bt + tok0;
#pragma omp simd
            for (int64_t tok = 0; tok < n; ++tok) acc[tok] += qi * Widen(row[tok], ks);
          }
          std::copy(acc, acc + n, scores.data() + j * stride + b * bt + tok0);
        }
      }
    }
    for (int64_t j = 0; j < group; ++j) {
      const float* w = scores.data() + j * stride;
      Softmax(scores.data() + j * stride + first, visible - first);
      for (int64_t i0 = 0; i0 < d; i0 += kOutChunk) {
        const int64_t n = std::min(kOutChunk, d - i0);
        float acc[kOutChunk] = {};
        for (int64_t p = first; p < visible; ++p) {
          const T* v =
              KeyBlock<T>(l, seq.block_table, p / bt, h) + l.v_offset + (p % bt) * d + i0;
          const float wp = w[p];
          if (n == kOutChunk) {
#pragma omp simd
            for (int64_t i = 0; i < kOutChunk; ++i) acc[i] += wp * Widen(v[i], vs);
          } else {
            for (int64_t i = 0; i < n; ++i) acc[i] += wp * Widen(v[i], vs);
          }
        }
        std::copy(acc, acc + n, seq.out + (t * num_heads + h * group + j) * d + i0);
      }
    }
  }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")

// The largest head the AVX-512 path keeps its scaled queries for on the stack.
constexpr int64_t kMaxDirectHeadDim = 256;

// 16 consecutive elements widened to f32; masked-off lanes read nothing and are +0.0.
// `scale256` is 256 times the KV head's fp8 scale (f32 and bf16 ignore it).
inline __m512 Load16(__mmask16 m, const float* p, __m512 /*scale256*/) {
  return _mm512_maskz_loadu_ps(m, p);
}
inline __m512 Load16(__mmask16 m, const Bf16Bits* p, __m512 /*scale256*/) {
  // The maskz forms (all lanes) rather than the plain ones: GCC 12 warns that the plain ones'
  // undefined pass-through source "may be used uninitialized".
  const __m512i wide = _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, wide, 16));
}
inline __m512 Load16(__mmask16 m, const Fp8Bits* p, __m512 scale256) {
  // An e4m3 code moved into an f16's bit positions, sign | exponent and mantissa << 7, is an
  // f16 of 1/256 of its value (normals and subnormals alike: the exponent biases differ by 8),
  // which vcvtph2ps widens exactly; the one multiply by 256 * scale rounds as Widen does.
  const __m256i b = _mm256_maskz_cvtepu8_epi16(0xffff, _mm_maskz_loadu_epi8(m, p));
  const __m256i h = _mm256_or_si256(
      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), scale256);
}

// AttendDirect with AVX-512 and all G query heads of the KV head at once: each 16-token row
// of a K tile and each 32-wide slice of a V row is loaded once for the G heads (G
// accumulators each), where the portable loop reloads them per head from L1.
template <int G, class T>
void AttendGroupAvx512(const AttentionSeq& seq, const PagedKvLayout& l, int64_t h,
                       int64_t t_begin, int64_t t_end, int64_t num_heads, float scale,
                       int64_t window, std::vector<float>& scores) {
  const int64_t d = l.head_dim, bt = l.block_tokens;
  const int64_t ctx = seq.context_len;
  const int64_t stride = base::RoundUp(ctx, bt);
  scores.resize(G * stride);
  float qs[G * kMaxDirectHeadDim];
  const __m512 ks = _mm512_set1_ps(256.f * KeyScale(l, h));
  const __m512 vs = _mm512_set1_ps(256.f * ValueScale(l, h));
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t visible = ctx - seq.num_new + t + 1;
    const int64_t first = FirstVisible(visible, window);
    const float* q = seq.q + (t * num_heads + h * G) * d;
    for (int64_t i = 0; i < G * d; ++i) qs[i] = q[i] * scale;
    for (int64_t b = first / bt; b * bt < visible; ++b) {
      const T* kt = KeyBlock<T>(l, seq.block_table, b, h);
      if ((b + 1) * bt < visible) {
        Prefetch(KeyBlock<T>(l, seq.block_table, b + 1, h), d * bt * int64_t{sizeof(T)});
      }
      for (int64_t tok0 = 0; tok0 < bt; tok0 += 16) {
        const __mmask16 mask = bt - tok0 >= 16 ? 0xffff : (1u << (bt - tok0)) - 1;
        __m512 acc[G];
        for (int j = 0; j < G; ++j) acc[j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; ++i) {
          const __m512 k = Load16(mask, kt + i * bt + tok0, ks);
          for (int j = 0; j < G; ++j)
            acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(qs[j * d + i]), k, acc[j]);
        }
        for (int j = 0; j < G; ++j)
          _mm512_mask_storeu_ps(scores.data() + j * stride + b * bt + tok0, mask, acc[j]);
      }
    }
    for (int j = 0; j < G; ++j) Softmax(scores.data() + j * stride + first, visible - first);
    for (int64_t i0 = 0; i0 < d; i0 += 32) {
      const int64_t left = d - i0;
      const __mmask16 m0 = left >= 16 ? 0xffff : (1u << left) - 1;
      const __mmask16 m1 = left >= 32 ? 0xffff : left > 16 ? (1u << (left - 16)) - 1 : 0;
      __m512 o0[G], o1[G];
      for (int j = 0; j < G; ++j) o0[j] = o1[j] = _mm512_setzero_ps();
      for (int64_t p0 = first; p0 < visible;) {
        const int64_t block_end = std::min(visible, (p0 / bt + 1) * bt);
        const T* vb = KeyBlock<T>(l, seq.block_table, p0 / bt, h) + l.v_offset + i0;
        if (block_end < visible) {
          Prefetch(KeyBlock<T>(l, seq.block_table, p0 / bt + 1, h) + l.v_offset + i0,
                   bt * d * int64_t{sizeof(T)});
        }
        for (int64_t p = p0; p < block_end; ++p) {
          const T* v = vb + (p % bt) * d;
          const __m512 v0 = Load16(m0, v, vs), v1 = Load16(m1, v + 16, vs);
          for (int j = 0; j < G; ++j) {
            const __m512 w = _mm512_set1_ps(scores[j * stride + p]);
            o0[j] = _mm512_fmadd_ps(w, v0, o0[j]);
            o1[j] = _mm512_fmadd_ps(w, v1, o1[j]);
          }
        }
        p0 = block_end;
      }
      float* out = seq.out + (t * num_heads + h * G) * d + i0;
      for (int j = 0; j < G; ++j) {
        _mm512_mask_storeu_ps(out + j * d, m0, o0[j]);
        _mm512_mask_storeu_ps(out + j * d + 16, m1, o1[j]);
      }
    }
  }
}

#pragma GCC pop_options

// Attends query rows [t_begin, t_end) of seq for the query heads of KV head h.
using AttendFn = void (*)(const AttentionSeq& seq, const PagedKvLayout& l, int64_t h,
                          int64_t t_begin, int64_t t_end, int64_t num_heads, float scale,
                          int64_t window, std::vector<float>& scores);

// The AVX-512 direct path for this shape, or null (then AttendDirect).
template <class T>
AttendFn PickAttendAvx512(int64_t group, int64_t head_dim) {
  if (!GetCpuFeatures().avx512 || head_dim > kMaxDirectHeadDim) return nullptr;
  switch (group) {
    case 1: return AttendGroupAvx512<1, T>;
    case 2: return AttendGroupAvx512<2, T>;
    case 3: return AttendGroupAvx512<3, T>;
    case 4: return AttendGroupAvx512<4, T>;
    case 5: return AttendGroupAvx512<5, T>;
    case 6: return AttendGroupAvx512<6, T>;
    case 7: return AttendGroupAvx512<7, T>;
    case 8: return AttendGroupAvx512<8, T>;
    default: return nullptr;
  }
}

// Gathers one KV head's keys (as Kᵀ, [d, ctx]) and values ([ctx, d]) for positions [0, ctx),
// widened to f32.
template <class T>
void GatherHead(const AttentionSeq& seq, const PagedKvLayout& l, int64_t h, float* keys_t,
                float* values) {
  const int64_t d = l.head_dim, bt = l.block_tokens, ctx = seq.context_len;
  const float ks = KeyScale(l, h), vs = ValueScale(l, h);
  for (int64_t p0 = 0; p0 < ctx; p0 += bt) {
    const int64_t len = std::min(bt, ctx - p0);
    const T* kb = KeyBlock<T>(l, seq.block_table, p0 / bt, h);
    for (int64_t i = 0; i < d; ++i) {
      std::transform(kb + i * bt, kb + i * bt + len, keys_t + i * ctx + p0,
                     [ks](T v) { return Widen(v, ks); });
    }
    std::transform(kb + l.v_offset, kb + l.v_offset + len * d, values + p0 * d,
                   [vs](T v) { return Widen(v, vs); });
  }
}

// Query rows per pair of SGEMMs in AttendGemm: each block of rows sees keys only up to its
// last row's position, so a fresh prompt computes about half of the causal square.
constexpr int64_t kGemmRowBlock = 64;

// Same result as AttendDirect for one query head via the gathered K/V and two SGEMMs per
// block of query rows: S = Q Kᵀ over the keys the block sees, causal softmax, O = P V.
void AttendGemm(const AttentionSeq& seq, const PagedKvLayout& l, int64_t head, int64_t num_heads,
                float scale, int64_t window, const float* keys_t, const float* values,
                std::vector<float>& s) {
  const int64_t d = l.head_dim, ctx = seq.context_len, n = seq.num_new;
  const int64_t ld = num_heads * d;
  s.resize(std::min(n, kGemmRowBlock) * ctx);
  for (int64_t r0 = 0; r0 < n; r0 += kGemmRowBlock) {
    const int64_t rows = std::min(kGemmRowBlock, n - r0);
    // Keys [lo, hi) cover every position a row of the block sees.
    const int64_t lo = FirstVisible(ctx - n + r0 + 1, window);
    const int64_t hi = ctx - n + r0 + rows;
    const int64_t width = hi - lo;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, width, d, scale,
                seq.q + r0 * ld + head * d, ld, keys_t + lo, ctx, 0.f, s.data(), width);
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t visible = ctx - n + r0 + t + 1;
      const int64_t first = FirstVisible(visible, window);
      float* row = s.data() + t * width - lo;  // indexed by key position
      std::fill(row + lo, row + first, 0.f);
      Softmax(row + first, visible - first);
      std::fill(row + visible, row + hi, 0.f);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d, width, 1.f, s.data(), width,
                values + lo * d, d, 0.f, seq.out + r0 * ld + head * d, ld);
  }
}

template <class T>
void PagedAttentionOf(const AttentionSeq* seqs, int64_t num_seqs, const PagedKvLayout& layout,
                      int64_t num_heads, float scale, int64_t window) {
  const int64_t group = num_heads / layout.num_kv_heads, d = layout.head_dim;
  const AttendFn attend = PickAttendAvx512<T>(group, d);
  struct DirectItem {
    int64_t seq, kv_head, t_begin, t_end;
  };
  std::vector<DirectItem> direct;
  std::vector<std::pair<int64_t, int64_t>> gemm;  // (seq, query head)
  int64_t work = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t n = seqs[i].num_new;
    if (attend == nullptr && n >= kGemmMinQueries) {
      for (int64_t h = 0; h < num_heads; ++h) gemm.emplace_back(i, h);
    } else {
      for (int64_t h = 0; h < layout.num_kv_heads; ++h)
        for (int64_t t = 0; t < n; t += kDirectRows)
          direct.push_back({i, h, t, std::min(n, t + kDirectRows)});
    }
    work += n * seqs[i].context_len;
  }
  // Gathered K/V per (long sequence, kv head), shared by the query heads of its group.
  std::vector<std::vector<float>> gathered(gemm.size() / std::max<int64_t>(group, 1));
#pragma omp parallel if (work * num_heads * d > (1 << 18))
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (size_t g = 0; g < gathered.size(); ++g) {
      const auto [i, head] = gemm[g * group];
      const int64_t ctx = seqs[i].context_len;
      gathered[g].resize(2 * ctx * d);
      GatherHead<T>(seqs[i], layout, head / group, gathered[g].data(),
                    gathered[g].data() + ctx * d);
    }
#pragma omp for schedule(dynamic, 1) nowait
    for (size_t w = 0; w < gemm.size(); ++w) {
      const auto [i, head] = gemm[w];
      const std::vector<float>& kv = gathered[w / group];
      AttendGemm(seqs[i], layout, head, num_heads, scale, window, kv.data(),
                 kv.data() + seqs[i].context_len * d, scratch);
    }
#pragma omp for schedule(dynamic, 1)
    for (size_t w = 0; w < direct.size(); ++w) {
      const DirectItem& it = direct[w];
      (attend != nullptr ? attend : AttendDirect<T>)(seqs[it.seq], layout, it.kv_head,
                                                     it.t_begin, it.t_end, num_heads, scale,
                                                     window, scratch);
    }
  }
}

}  // namespace

void PagedAttention(const AttentionSeq* seqs, int64_t num_seqs, const PagedKvLayout& layout,
                    int64_t num_heads, float scale, int64_t window) {
  switch (layout.dtype) {
    case KvDtype::kF32:
      return PagedAttentionOf<float>(seqs, num_seqs, layout, num_heads, scale, window);
    case KvDtype::kBF16:
      return PagedAttentionOf<Bf16Bits>(seqs, num_seqs, layout, num_heads, scale, window);
    case KvDtype::kFp8E4M3:
      return PagedAttentionOf<Fp8Bits>(seqs, num_seqs, layout, num_heads, scale, window);
  }
  PREFT_CHECK(false && "unknown KV dtype");
}

}  // namespace preft::kernels::cpu
