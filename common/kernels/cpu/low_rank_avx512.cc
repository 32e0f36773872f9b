// The bf16 low-rank kernels for AVX-512 CPUs without AVX-512-BF16: weights widened to f32 and
// f32 FMA, like the AVX2 path (low_rank_avx2.cc, which calls them after its run-time check)
// but 16 lanes wide, for a decode row (BGMV) and for prompt rows (SGMV).

#include <immintrin.h>

#include <algorithm>

#include "common/kernels/cpu/low_rank_kernels.h"
#include "common/kernels/dtype.h"

// GCC 12's AVX-512 intrinsics build "undefined" vectors by self-initialisation, which -Wall
// reports (as in the Linear kernels).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace preft::kernels::cpu::low_rank_internal {

// ---- A decode row on bf16 weights with AVX-512 (the multi-LoRA BGMV) ----
// 64 bytes of bf16 read as 16 pairs widen to f32 in one instruction per half: the even
// elements by a shift, the odd ones by a mask. Working on x and on the expand sum in that
// even/odd order (deinterleaved once per row) costs a quarter of the AVX2 path's
// instructions per weight, which made it instruction-bound below the memory bandwidth.
#define PREFT_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

namespace {

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

// xs[c .. c + 15] = the even elements of x's 32-element chunk at c, xs[c + 16 ..] the odd ones,
// for c < n (a multiple of 32): the order in which a loaded vector of bf16 pairs widens.
PREFT_AVX512 void DeinterleaveEvenOdd(const float* x, int64_t n, float* xs) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t c = 0; c < n; c += 32) {
    const __m512 a = _mm512_loadu_ps(x + c), b = _mm512_loadu_ps(x + c + 16);
    _mm512_store_ps(xs + c, _mm512_permutex2var_ps(a, even, b));
    _mm512_store_ps(xs + c + 16, _mm512_permutex2var_ps(a, odd, b));
  }
}

// Rank rows handled per pass: four streams of S or E, each loaded vector of x (or of the
// expand sum) reused four times.
constexpr int64_t kRowsPerPass = 4;

}  // namespace

// z[k] = xr . S[k] (+ b[k]) for one row of x.
PREFT_AVX512 void ShrinkRowBf16Avx512(const float* xr, const uint16_t* s, int64_t rank,
                                      int64_t in, const float* bias, float* z) {
  const int64_t vec_end = in & ~int64_t{31};
  alignas(64) float xs[kMaxExpandOut];
  DeinterleaveEvenOdd(xr, vec_end, xs);
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

// z[r][k] = x[rows[r]] . S[k] (+ b[k]): two rank rows x four rows of x per pass, in
// ShrinkRowBf16Avx512's order (per 32 inputs the even elements, then the odd ones, into one
// 16-lane sum), so a row's bits do not depend on how many rows its group has.
PREFT_AVX512 void ShrinkRowsBf16Avx512(const float* x, int64_t x_stride, const int32_t* rows,
                                       int64_t n, const uint16_t* s, int64_t rank, int64_t in,
                                       const float* bias, float* z) {
  const int64_t vec_end = in & ~int64_t{31};
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t k = 0; k < rank; k += 2) {
    const int64_t kn = std::min<int64_t>(2, rank - k);
    const uint16_t* srow[2] = {s + k * in, s + (k + kn - 1) * in};
    for (int64_t r0 = 0; r0 < n; r0 += 4) {
      const int64_t m = std::min<int64_t>(4, n - r0);
      const float* xr[4];
      for (int64_t j = 0; j < 4; ++j) xr[j] = x + rows[r0 + std::min(j, m - 1)] * x_stride;
      __m512 acc[4][2];
      for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
      for (int64_t i = 0; i < vec_end; i += 32) {
        const __m512i v0 = _mm512_loadu_si512(srow[0] + i), v1 = _mm512_loadu_si512(srow[1] + i);
        const __m512 e0 = EvenBf16(v0), o0 = OddBf16(v0), e1 = EvenBf16(v1), o1 = OddBf16(v1);
#pragma GCC unroll 4
        for (int64_t j = 0; j < 4; ++j) {
          const __m512 a = _mm512_loadu_ps(xr[j] + i), b = _mm512_loadu_ps(xr[j] + i + 16);
          const __m512 xe = _mm512_permutex2var_ps(a, even, b);
          const __m512 xo = _mm512_permutex2var_ps(a, odd, b);
          acc[j][0] = _mm512_fmadd_ps(o0, xo, _mm512_fmadd_ps(e0, xe, acc[j][0]));
          acc[j][1] = _mm512_fmadd_ps(o1, xo, _mm512_fmadd_ps(e1, xe, acc[j][1]));
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

}  // namespace preft::kernels::cpu::low_rank_internal
