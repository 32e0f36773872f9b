#include "common/kernels/cpu/low_rank.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <vector>

#include "common/base/check.h"
#include "common/kernels/cpu/cpu_features.h"
#include "common/kernels/cpu/simd_avx2.h"

// GCC 12's AVX-512 intrinsics build "undefined" vectors by self-initialisation, which -Wall
// reports (as in the Linear kernels).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace preft::kernels::cpu {
namespace {

// Rows handled by one work item: enough to reuse each loaded shrink/expand row a few times,
// few enough that a 64-row prompt chunk still spreads over the threads.
constexpr int64_t kRowsPerItem = 8;
constexpr int64_t kMaxRank = 1024;
// Widest output a decode row's expand sums on the stack (Llama 3.1 70B's MLP is 28672).
constexpr int64_t kMaxExpandOut = 32768;
// Elements ahead at which a decode row's shrink and expand prefetch S and E (64 rows on 64
// adapters: 1.56-2.08 x the byte bound without, 1.26-1.37 with).
constexpr int64_t kPrefetchElems = 1024;

// ---- A decode row on bf16 weights with AVX-512 (the multi-LoRA BGMV) ----
// 64 bytes of bf16 read as 16 pairs widen to f32 in one instruction per half: the even
// elements by a shift, the odd ones by a mask. Working on x and on the expand sum in that
// even/odd order (deinterleaved once per row) costs a quarter of the AVX2 path's
// instructions per weight, which made it instruction-bound below the memory bandwidth.
#define PREFT_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

PREFT_AVX512 inline __m512 EvenBf16(__m512i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
PREFT_AVX512 inline __m512 OddBf16(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// yr[0 .. 32) += scale * the 32 outputs whose even elements are `even` and odd ones `odd`:
// output p is lane p / 2 of one or the other.
PREFT_AVX512 inline void AddInterleaved(__m512 even, __m512 odd, __m512 scale, float* yr) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  _mm512_storeu_ps(yr, _mm512_fmadd_ps(scale, _mm512_permutex2var_ps(even, lo, odd),
                                       _mm512_loadu_ps(yr)));
  _mm512_storeu_ps(yr + 16, _mm512_fmadd_ps(scale, _mm512_permutex2var_ps(even, hi, odd),
                                            _mm512_loadu_ps(yr + 16)));
}

// yr[o] += scale * z E[:, o] for the outputs [begin, out) past a vector loop.
inline void ExpandTailBf16(const float* z, const uint16_t* e, int64_t rank, int64_t out,
                           int64_t begin, float scale, float* yr) {
  for (int64_t o = begin; o < out; ++o) {
    float sum = 0;
    for (int64_t k = 0; k < rank; ++k) sum += z[k] * Bf16ToF32(e[k * out + o]);
    yr[o] += scale * sum;
  }
}

// Rank rows handled per pass: four streams of S or E, each loaded vector of x (or of the
// expand sum) reused four times.
constexpr int64_t kRowsPerPass = 4;

// z[k] = xr . S[k] (+ b[k]) for one row of x.
PREFT_AVX512 void ShrinkRowBf16Avx512(const float* xr, const uint16_t* s, int64_t rank,
                                      int64_t in, const float* bias, float* z) {
  const int64_t vec_end = in & ~int64_t{31};
  // xs[32 c .. 32 c + 15] = even elements of x's chunk c, [32 c + 16 ..] = odd ones.
  alignas(64) float xs[kMaxExpandOut];
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t c = 0; c < vec_end; c += 32) {
    const __m512 a = _mm512_loadu_ps(xr + c), b = _mm512_loadu_ps(xr + c + 16);
    _mm512_store_ps(xs + c, _mm512_permutex2var_ps(a, even, b));
    _mm512_store_ps(xs + c + 16, _mm512_permutex2var_ps(a, odd, b));
  }
  for (int64_t k = 0; k < rank; k += kRowsPerPass) {
    const int64_t kn = std::min(kRowsPerPass, rank - k);
    const uint16_t* row[kRowsPerPass];
    for (int64_t j = 0; j < kRowsPerPass; ++j) row[j] = s + (k + std::min(j, kn - 1)) * in;
    __m512 acc[kRowsPerPass];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int64_t c = 0; c < vec_end; c += 32) {
      const __m512 xe = _mm512_load_ps(xs + c), xo = _mm512_load_ps(xs + c + 16);
#pragma GCC unroll 4
      for (int64_t j = 0; j < kRowsPerPass; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(row[j] + c + kPrefetchElems), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(row[j] + c);
        acc[j] = _mm512_fmadd_ps(EvenBf16(v), xe, acc[j]);
        acc[j] = _mm512_fmadd_ps(OddBf16(v), xo, acc[j]);
      }
    }
    for (int64_t j = 0; j < kn; ++j) {
      float sum = _mm512_reduce_add_ps(acc[j]);
      for (int64_t i = vec_end; i < in; ++i) sum += Bf16ToF32(row[j][i]) * xr[i];
      z[k + j] = sum + (bias != nullptr ? bias[k + j] : 0.0f);
    }
  }
}

// yr += scale * z E for one row, E streamed in memory order into an L1-resident sum kept in
// the even/odd order and interleaved once at the end.
PREFT_AVX512 void ExpandRowBf16Avx512(const float* z, const uint16_t* e, int64_t rank,
                                      int64_t out, float scale, float* yr) {
  const int64_t vec_end = out & ~int64_t{31};
  alignas(64) float t[kMaxExpandOut];
  for (int64_t c = 0; c < vec_end; c += 16) _mm512_store_ps(t + c, _mm512_setzero_ps());
  for (int64_t k = 0; k < rank; k += kRowsPerPass) {
    const int64_t kn = std::min(kRowsPerPass, rank - k);
    const uint16_t* row[kRowsPerPass];
    __m512 zk[kRowsPerPass];
    for (int64_t j = 0; j < kRowsPerPass; ++j) {
      row[j] = e + (k + std::min(j, kn - 1)) * out;
      zk[j] = _mm512_set1_ps(j < kn ? z[k + j] : 0.0f);
    }
    for (int64_t c = 0; c < vec_end; c += 32) {
      __m512 te = _mm512_load_ps(t + c), to = _mm512_load_ps(t + c + 16);
#pragma GCC unroll 4
      for (int64_t j = 0; j < kRowsPerPass; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(row[j] + c + kPrefetchElems), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(row[j] + c);
        te = _mm512_fmadd_ps(zk[j], EvenBf16(v), te);
        to = _mm512_fmadd_ps(zk[j], OddBf16(v), to);
      }
      _mm512_store_ps(t + c, te);
      _mm512_store_ps(t + c + 16, to);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t c = 0; c < vec_end; c += 32) {
    AddInterleaved(_mm512_load_ps(t + c), _mm512_load_ps(t + c + 16), sc, yr + c);
  }
  ExpandTailBf16(z, e, rank, out, vec_end, scale, yr);
}

// ---- Prompt rows on bf16 weights with AVX-512 (SGMV): compute-bound, each loaded weight
// vector feeds four rows ----

PREFT_AVX512 inline __m512 Widen16Bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// z[r][k] = x[rows[r]] . S[k] (+ b[k]): two rank rows x four rows of x per pass.
PREFT_AVX512 void ShrinkRowsBf16Avx512(const float* x, int64_t x_stride, const int32_t* rows,
                                       int64_t n, const uint16_t* s, int64_t rank, int64_t in,
                                       const float* bias, float* z) {
  const int64_t vec_end = in & ~int64_t{15};
  for (int64_t k = 0; k < rank; k += 2) {
    const int64_t kn = std::min<int64_t>(2, rank - k);
    const uint16_t* srow[2] = {s + k * in, s + (k + kn - 1) * in};
    for (int64_t r0 = 0; r0 < n; r0 += 4) {
      const int64_t m = std::min<int64_t>(4, n - r0);
      const float* xr[4];
      for (int64_t j = 0; j < 4; ++j) xr[j] = x + rows[r0 + std::min(j, m - 1)] * x_stride;
      __m512 acc[4][2];
      for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
      for (int64_t i = 0; i < vec_end; i += 16) {
        const __m512 w0 = Widen16Bf16(srow[0] + i), w1 = Widen16Bf16(srow[1] + i);
#pragma GCC unroll 4
        for (int64_t j = 0; j < 4; ++j) {
          const __m512 xv = _mm512_loadu_ps(xr[j] + i);
          acc[j][0] = _mm512_fmadd_ps(w0, xv, acc[j][0]);
          acc[j][1] = _mm512_fmadd_ps(w1, xv, acc[j][1]);
        }
      }
      for (int64_t j = 0; j < m; ++j) {
        for (int64_t q = 0; q < kn; ++q) {
          float sum = _mm512_reduce_add_ps(acc[j][q]);
          for (int64_t i = vec_end; i < in; ++i) sum += Bf16ToF32(srow[q][i]) * xr[j][i];
          z[(r0 + j) * rank + k + q] = sum + (bias != nullptr ? bias[k + q] : 0.0f);
        }
      }
    }
  }
}

// y[rows[r]] += scale * z[r] E: 32 outputs (one 64-byte load of E, widened even/odd) x four
// rows per pass, with the rank loop inside.
PREFT_AVX512 void ExpandRowsBf16Avx512(const float* z, const int32_t* rows, int64_t n,
                                       const uint16_t* e, int64_t rank, int64_t out,
                                       float scale, float* y, int64_t y_stride) {
  const int64_t vec_end = out & ~int64_t{31};
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < n; r0 += 4) {
    const int64_t m = std::min<int64_t>(4, n - r0);
    const float* zr[4];
    for (int64_t j = 0; j < 4; ++j) zr[j] = z + (r0 + std::min(j, m - 1)) * rank;
    for (int64_t o = 0; o < vec_end; o += 32) {
      __m512 even[4], odd[4];
      for (int64_t j = 0; j < 4; ++j) even[j] = odd[j] = _mm512_setzero_ps();
      for (int64_t k = 0; k < rank; ++k) {
        const __m512i v = _mm512_loadu_si512(e + k * out + o);
        const __m512 we = EvenBf16(v), wo = OddBf16(v);
#pragma GCC unroll 4
        for (int64_t j = 0; j < 4; ++j) {
          const __m512 zk = _mm512_set1_ps(zr[j][k]);
          even[j] = _mm512_fmadd_ps(zk, we, even[j]);
          odd[j] = _mm512_fmadd_ps(zk, wo, odd[j]);
        }
      }
      for (int64_t j = 0; j < m; ++j) {
        AddInterleaved(even[j], odd[j], sc, y + rows[r0 + j] * y_stride + o);
      }
    }
    for (int64_t j = 0; j < m; ++j) {
      ExpandTailBf16(zr[j], e, rank, out, vec_end, scale, y + rows[r0 + j] * y_stride);
    }
  }
}

#undef PREFT_AVX512

// z[r][k] = x[rows[r]] . S[k] (+ b[k]) for up to kRowsPerItem rows, four rows per pass over S.
template <DType T>
void Shrink(const float* x, int64_t x_stride, const int32_t* rows, int64_t n, const MatrixView& s,
            const float* bias, float* z) {
  const int64_t rank = s.rows, in = s.cols, vec_end = in & ~int64_t{7};
  if (n == 1) {  // a decode row (BGMV): bandwidth-bound on S, two chains for latency
    const float* xr = x + rows[0] * x_stride;
    if constexpr (T == DType::kBF16) {
      if (GetCpuFeatures().avx512 && in <= kMaxExpandOut) {
        ShrinkRowBf16Avx512(xr, static_cast<const uint16_t*>(s.data), rank, in, bias, z);
        return;
      }
    }
    const int64_t vec2_end = in & ~int64_t{15};
    for (int64_t k = 0; k < rank; ++k) {
      const void* srow = static_cast<const uint8_t*>(s.data) + k * in * DTypeSize(T);
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i < vec2_end; i += 16) {
        _mm_prefetch(static_cast<const char*>(srow) + (i + kPrefetchElems) * DTypeSize(T),
                     _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(Load8<T>(srow, i), _mm256_loadu_ps(xr + i), a0);
        a1 = _mm256_fmadd_ps(Load8<T>(srow, i + 8), _mm256_loadu_ps(xr + i + 8), a1);
      }
      for (; i < vec_end; i += 8)
        a0 = _mm256_fmadd_ps(Load8<T>(srow, i), _mm256_loadu_ps(xr + i), a0);
      float sum = Reduce1(_mm256_add_ps(a0, a1));
      for (; i < in; ++i) sum += LoadAsF32(srow, T, i) * xr[i];
      z[k] = sum + (bias != nullptr ? bias[k] : 0.0f);
    }
    return;
  }
  if constexpr (T == DType::kBF16) {
    if (GetCpuFeatures().avx512) {
      ShrinkRowsBf16Avx512(x, x_stride, rows, n, static_cast<const uint16_t*>(s.data), rank, in,
                           bias, z);
      return;
    }
  }
  // Two rank rows x four activation rows per pass: each loaded x vector feeds two rank rows,
  // each loaded S vector four activation rows (8 FMAs per 6 loads).
  const size_t srow_bytes = in * DTypeSize(T);
  for (int64_t k = 0; k < rank; k += 2) {
    const int64_t kn = std::min<int64_t>(2, rank - k);
    const void* srow[2] = {static_cast<const uint8_t*>(s.data) + k * srow_bytes,
                           static_cast<const uint8_t*>(s.data) + (k + kn - 1) * srow_bytes};
    for (int64_t r0 = 0; r0 < n; r0 += 4) {
      const int64_t m = std::min<int64_t>(4, n - r0);
      const float* xr[4];
      for (int64_t j = 0; j < 4; ++j) xr[j] = x + rows[r0 + std::min(j, m - 1)] * x_stride;
      __m256 acc[4][2];
      for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
      for (int64_t i = 0; i < vec_end; i += 8) {
        const __m256 w0 = Load8<T>(srow[0], i), w1 = Load8<T>(srow[1], i);
        for (int64_t j = 0; j < 4; ++j) {
          const __m256 xv = _mm256_loadu_ps(xr[j] + i);
          acc[j][0] = _mm256_fmadd_ps(w0, xv, acc[j][0]);
          acc[j][1] = _mm256_fmadd_ps(w1, xv, acc[j][1]);
        }
      }
      for (int64_t j = 0; j < m; ++j) {
        for (int64_t q = 0; q < kn; ++q) {
          float sum = Reduce1(acc[j][q]);
          for (int64_t i = vec_end; i < in; ++i) sum += LoadAsF32(srow[q], T, i) * xr[j][i];
          z[(r0 + j) * rank + k + q] = sum + (bias != nullptr ? bias[k + q] : 0.0f);
        }
      }
    }
  }
}

// y[rows[r]] += scale * z[r] E, four rows per pass over E (each loaded E vector feeds four
// rows' accumulators), 16 outputs at a time with the rank loop inside.
template <DType T>
void Expand(const float* z, const int32_t* rows, int64_t n, const MatrixView& e, float scale,
            float* y, int64_t y_stride) {
  const int64_t rank = e.rows, out = e.cols, vec_end = out & ~int64_t{15};
  const size_t row_bytes = out * DTypeSize(T);
  const uint8_t* base = static_cast<const uint8_t*>(e.data);
  const __m256 sc = _mm256_set1_ps(scale);
  if constexpr (T == DType::kBF16) {
    if (GetCpuFeatures().avx512) {
      const auto* ew = static_cast<const uint16_t*>(e.data);
      if (n == 1 && out <= kMaxExpandOut) {
        ExpandRowBf16Avx512(z, ew, rank, out, scale, y + rows[0] * y_stride);
      } else {
        ExpandRowsBf16Avx512(z, rows, n, ew, rank, out, scale, y, y_stride);
      }
      return;
    }
  }
  if (n == 1 && out <= kMaxExpandOut) {
    // A decode row (BGMV): E streamed once in memory order, row by row, into an L1-resident
    // sum (strips of 16 outputs across all rank rows made 2 x rank concurrent streams, which
    // the prefetchers did not keep up with).
    alignas(64) float t[kMaxExpandOut];
    const int64_t vec8_end = out & ~int64_t{7};
    std::fill(t, t + out, 0.f);
    for (int64_t k = 0; k < rank; ++k) {
      const void* erow = base + k * row_bytes;
      const __m256 zk = _mm256_set1_ps(z[k]);
      int64_t o = 0;
      for (; o < vec8_end; o += 8) {
        if (o % 32 == 0) {
          _mm_prefetch(static_cast<const char*>(erow) + (o + kPrefetchElems) * DTypeSize(T),
                       _MM_HINT_T0);
        }
        _mm256_store_ps(t + o, _mm256_fmadd_ps(zk, Load8<T>(erow, o), _mm256_load_ps(t + o)));
      }
      for (; o < out; ++o) t[o] += z[k] * LoadAsF32(erow, T, o);
    }
    float* yr = y + rows[0] * y_stride;
    int64_t o = 0;
    for (; o < vec8_end; o += 8) {
      _mm256_storeu_ps(yr + o, _mm256_fmadd_ps(sc, _mm256_load_ps(t + o), _mm256_loadu_ps(yr + o)));
    }
    for (; o < out; ++o) yr[o] += scale * t[o];
    return;
  }
  for (int64_t r0 = 0; r0 < n; r0 += 4) {
    const int64_t m = std::min<int64_t>(4, n - r0);
    const float* zr[4];
    for (int64_t j = 0; j < 4; ++j) zr[j] = z + (r0 + std::min(j, m - 1)) * rank;
    for (int64_t o = 0; o < vec_end; o += 16) {
      __m256 acc[4][2];
      for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
      for (int64_t k = 0; k < rank; ++k) {
        const void* erow = base + k * row_bytes;
        const __m256 e0 = Load8<T>(erow, o), e1 = Load8<T>(erow, o + 8);
        for (int64_t j = 0; j < 4; ++j) {
          const __m256 zk = _mm256_broadcast_ss(zr[j] + k);
          acc[j][0] = _mm256_fmadd_ps(zk, e0, acc[j][0]);
          acc[j][1] = _mm256_fmadd_ps(zk, e1, acc[j][1]);
        }
      }
      for (int64_t j = 0; j < m; ++j) {
        float* yr = y + rows[r0 + j] * y_stride + o;
        _mm256_storeu_ps(yr, _mm256_fmadd_ps(sc, acc[j][0], _mm256_loadu_ps(yr)));
        _mm256_storeu_ps(yr + 8, _mm256_fmadd_ps(sc, acc[j][1], _mm256_loadu_ps(yr + 8)));
      }
    }
    for (int64_t j = 0; j < m; ++j) {
      float* yr = y + rows[r0 + j] * y_stride;
      for (int64_t o = vec_end; o < out; ++o) {
        float sum = 0;
        for (int64_t k = 0; k < rank; ++k) sum += zr[j][k] * LoadAsF32(base + k * row_bytes, T, o);
        yr[o] += scale * sum;
      }
    }
  }
}

template <DType T>
void RunItem(const float* x, int64_t x_stride, float* y, int64_t y_stride, const LowRankGroup& g,
             int64_t begin, int64_t end, float* z) {
  Shrink<T>(x, x_stride, g.rows + begin, end - begin, g.shrink, g.shrink_bias, z);
  Expand<T>(z, g.rows + begin, end - begin, g.expand, g.scale, g.y != nullptr ? g.y : y,
            g.y != nullptr ? g.y_stride : y_stride);
}

struct Item {
  int32_t group;
  int32_t begin, end;
};

}  // namespace

void LowRankAdd(const float* x, int64_t x_stride, float* y, int64_t y_stride,
                const LowRankGroup* groups, int64_t num_groups) {
  std::vector<Item> items;
  for (int64_t g = 0; g < num_groups; ++g) {
    const LowRankGroup& gr = groups[g];
    PREFT_CHECK(gr.shrink.rows == gr.expand.rows && gr.shrink.rows <= kMaxRank);
    PREFT_CHECK(gr.shrink.dtype == gr.expand.dtype);
    for (int64_t b = 0; b < gr.num_rows; b += kRowsPerItem) {
      items.push_back({static_cast<int32_t>(g), static_cast<int32_t>(b),
                       static_cast<int32_t>(std::min(gr.num_rows, b + kRowsPerItem))});
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  auto run = [&](int64_t i, float* z) {
    const LowRankGroup& g = groups[items[i].group];
    switch (g.shrink.dtype) {
      case DType::kF32:
        RunItem<DType::kF32>(x, x_stride, y, y_stride, g, items[i].begin, items[i].end, z);
        break;
      case DType::kBF16:
        RunItem<DType::kBF16>(x, x_stride, y, y_stride, g, items[i].begin, items[i].end, z);
        break;
      case DType::kF16:
        RunItem<DType::kF16>(x, x_stride, y, y_stride, g, items[i].begin, items[i].end, z);
        break;
    }
  };
  // Tiny work (one decode row, say) is not worth waking the thread team.
  if (num_items <= 1) {
    alignas(64) float z[kRowsPerItem * kMaxRank];
    for (int64_t i = 0; i < num_items; ++i) run(i, z);
    return;
  }
  // Decode rows only (BGMV, bandwidth-bound): each thread takes one contiguous run of items
  // of about equal bytes, so it streams neighbouring pairs (a caller that orders groups
  // adapter by adapter makes them one adapter's adjacent q, k, v) without a shared counter.
  // Prompt rows (SGMV, compute-bound) are handed out one item at a time.
  const bool decode_only = std::all_of(items.begin(), items.end(),
                                       [](const Item& it) { return it.end - it.begin == 1; });
  if (decode_only) {
    std::vector<int64_t> cost(num_items + 1, 0);  // prefix sums of matrix elements
    for (int64_t i = 0; i < num_items; ++i) {
      const LowRankGroup& g = groups[items[i].group];
      cost[i + 1] = cost[i] + g.shrink.rows * (g.shrink.cols + g.expand.cols);
    }
#pragma omp parallel
    {
      alignas(64) float z[kMaxRank];
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const auto at = [&](int k) {
        return std::lower_bound(cost.begin(), cost.end(), cost.back() * k / nt) - cost.begin();
      };
      for (int64_t i = at(t); i < std::min<int64_t>(at(t + 1), num_items); ++i) run(i, z);
    }
    return;
  }
#pragma omp parallel
  {
    alignas(64) float z[kRowsPerItem * kMaxRank];
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) run(i, z);
  }
}

}  // namespace preft::kernels::cpu
