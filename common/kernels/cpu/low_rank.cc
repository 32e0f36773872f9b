#include "common/kernels/cpu/low_rank.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/base/check.h"
#include "common/kernels/cpu/cpu_features.h"
#include "common/kernels/cpu/linear_driver.h"
#include "common/kernels/cpu/linear_kernels.h"
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
// Elements ahead at which a decode row's shrink and expand prefetch S and E (64 rows on 64
// adapters: 1.56-2.08 x the byte bound without, 1.26-1.37 with).
constexpr int64_t kPrefetchElems = 1024;

// Where row k, columns [c, c + 32) of a matrix start (c a multiple of 32): data + k RowStep +
// c ColScale, in either layout.
int64_t RowStep(const MatrixView& m) { return m.chunked ? kChunkCols : m.cols; }
int64_t ColScale(const MatrixView& m) { return m.chunked ? m.rows : 1; }

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

// ---- Prompt rows on bf16 weights with AVX-512-BF16 (SGMV through vdpbf16ps) ----
// Like the bf16 GEMMs (and PEFT running a bf16 model), the rows of x and the shrink results z
// are rounded to bf16 (RNE) and the products accumulate in f32: half the multiply
// instructions of widening the weights to f32, the same rounding as the base linears.
#define PREFT_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

// Elements per vdpbf16ps: 16 pairs.
constexpr int64_t kDotElems = 32;
// Rank pairs applied per pass of the expand: 16 rank rows of E, interleaved, stay in registers.
constexpr int64_t kExpandPairs = 8;

// xb[r] = x[rows[r]] in bf16, zero from `in` up to ld (a multiple of kDotElems).
PREFT_AVX512BF16 void PackRowsBf16(const float* x, int64_t x_stride, const int32_t* rows,
                                   int64_t n, int64_t in, int64_t ld, uint16_t* xb) {
  for (int64_t r = 0; r < n; ++r) {
    const float* src = x + rows[r] * x_stride;
    for (int64_t c = 0; c < ld; c += kDotElems) {
      const int64_t left = in - c;
      const __mmask16 lo = left >= 16 ? 0xffff : left > 0 ? (1u << left) - 1 : 0;
      const __mmask16 hi = left >= 32 ? 0xffff : left > 16 ? (1u << (left - 16)) - 1 : 0;
      const __m512 a = _mm512_maskz_loadu_ps(lo, src + c);
      const __m512 b = _mm512_maskz_loadu_ps(hi, src + c + 16);
      _mm512_storeu_si512(xb + r * ld + c, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

// Elements of `in` per block of the shrink: the block's rows of x (kRowsPerItem) and of S
// (rank 16) stay in L1 across the passes over them.
constexpr int64_t kShrinkBlock = 512;

// The 16 sums of acc[f] (f = 4 i + j) in lanes 0 .. 15, by a transposing tree (45 shuffles and
// adds instead of 16 full reductions).
PREFT_AVX512BF16 inline __m512 Sum16(const __m512 (&acc)[16]) {
  __m512 s[8], u[4], v[2];
  // s[q]: blocks 0-1 a partial of acc[2q], blocks 2-3 of acc[2q + 1].
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) {
    s[q] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * q], acc[2 * q + 1], 0x44),
                         _mm512_shuffle_f32x4(acc[2 * q], acc[2 * q + 1], 0xee));
  }
  // u[q]: block b a partial of acc[4 q + b].
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    u[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0xdd));
  }
  // v[q], block b: lanes 0, 2 partials of acc[8 q + b], lanes 1, 3 of acc[8 q + 4 + b].
#pragma GCC unroll 2
  for (int q = 0; q < 2; ++q) {
    v[q] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * q], u[2 * q + 1]),
                         _mm512_unpackhi_ps(u[2 * q], u[2 * q + 1]));
  }
  // w, block b: acc[b], acc[8 + b], acc[4 + b], acc[12 + b].
  const __m512 w = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, w);
}

// z[r][k] = xb[r] . S[k] (+ b[k]): R rows of x (4, or 1 for a lone row) x four rank rows per
// pass (up to 16 accumulators, 8 loads per 16 vdpbf16ps), over blocks of `in`.
// S[k][c .. c + 32) is at s + k row_step + c col_scale: (in, 1) row-major, (32, rank) chunked.
template <int R>
PREFT_AVX512BF16 void ShrinkRowsDotBf16(const uint16_t* xb, int64_t ld, int64_t n,
                                        const uint16_t* s, int64_t row_step, int64_t col_scale,
                                        int64_t rank, int64_t in, const float* bias, float* z) {
  const int64_t vec_end = in & ~(kDotElems - 1);
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (in - vec_end)) - 1);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t k = 0; k < rank; ++k) z[r * rank + k] = bias != nullptr ? bias[k] : 0.0f;
  }
  for (int64_t c0 = 0; c0 < in; c0 += kShrinkBlock) {
    const int64_t c1 = std::min(in, c0 + kShrinkBlock);
    for (int64_t k0 = 0; k0 < rank; k0 += 4) {
      const int64_t kn = std::min<int64_t>(4, rank - k0);
      const uint16_t* srow[4];
      for (int64_t j = 0; j < 4; ++j) srow[j] = s + (k0 + std::min(j, kn - 1)) * row_step;
      for (int64_t r0 = 0; r0 < n; r0 += R) {
        const int64_t m = std::min<int64_t>(R, n - r0);
        const uint16_t* xr[R];
        for (int64_t i = 0; i < R; ++i) xr[i] = xb + (r0 + std::min(i, m - 1)) * ld;
        __m512 acc[16];
        for (__m512& a : acc) a = _mm512_setzero_ps();
        // xb is zero past `in`; S is read only up to it.
        for (int64_t c = c0; c < c1; c += kDotElems) {
          const __mmask32 valid = c < vec_end ? ~__mmask32{0} : tail;
          __m512bh sv[4];
#pragma GCC unroll 4
          for (int64_t j = 0; j < 4; ++j) {
            // A lone row streams four rank rows at a row's stride: prefetch them ahead.
            if (R == 1 && col_scale == 1) {
              _mm_prefetch(reinterpret_cast<const char*>(srow[j] + c + kPrefetchElems),
                           _MM_HINT_T0);
            }
            sv[j] = (__m512bh)_mm512_maskz_loadu_epi16(valid, srow[j] + c * col_scale);
          }
#pragma GCC unroll 4
          for (int64_t i = 0; i < R; ++i) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr[i] + c);
#pragma GCC unroll 4
            for (int64_t j = 0; j < 4; ++j)
              acc[4 * i + j] = _mm512_dpbf16_ps(acc[4 * i + j], xv, sv[j]);
          }
        }
        alignas(64) float sums[16];
        _mm512_store_ps(sums, Sum16(acc));
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < kn; ++j) z[(r0 + i) * rank + k0 + j] += sums[4 * i + j];
        }
      }
    }
  }
}

// y[0 .. 32) += sc * [v0, v1] for the outputs `mask` keeps.
PREFT_AVX512BF16 inline void AddSums(__m512 v0, __m512 v1, __m512 sc, float* y, __mmask32 mask) {
  if (mask == ~__mmask32{0}) {  // masked stores are slow on Zen
    _mm512_storeu_ps(y, _mm512_fmadd_ps(sc, v0, _mm512_loadu_ps(y)));
    _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(sc, v1, _mm512_loadu_ps(y + 16)));
    return;
  }
  const __mmask16 m0 = static_cast<__mmask16>(mask), m1 = static_cast<__mmask16>(mask >> 16);
  _mm512_mask_storeu_ps(y, m0, _mm512_fmadd_ps(sc, v0, _mm512_maskz_loadu_ps(m0, y)));
  _mm512_mask_storeu_ps(y + 16, m1, _mm512_fmadd_ps(sc, v1, _mm512_maskz_loadu_ps(m1, y + 16)));
}

// y[0 .. 32) += sc * the 32 sums of an expand over unpacked rank pairs, for the outputs `mask`
// keeps: lane d of lo is output 8 (d / 4) + d % 4, of hi that plus 4.
PREFT_AVX512BF16 inline void AddPairSums(__m512 lo, __m512 hi, __m512 sc, float* y,
                                         __mmask32 mask) {
  const __m512i idx0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i idx1 =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  AddSums(_mm512_permutex2var_ps(lo, idx0, hi), _mm512_permutex2var_ps(lo, idx1, hi), sc, y,
          mask);
}

// One pass of the expand over 32 outputs and NP rank pairs (2 NP rank rows of E, interleaved
// into vdpbf16ps pairs once and applied to all n rows). acc lane d of the unpacked "lo" half
// is output 8 (d / 4) + d % 4, of the "hi" half that plus 4. With `last`, y[rows] (masked to
// the valid outputs) gets scale times the sum; otherwise the sums carry over in t [n][32].
// E[k][o .. o + 32) is at e + k row_step + o col_scale (as S in ShrinkRowsDotBf16). kPaired:
// E is chunked with paired rows, so rank rows k, k + 1 of those 32 outputs are the 128 bytes
// there, already in vdpbf16ps pairs: lo lane d is output d, hi lane d output 16 + d (the same
// sums in other lanes, so the same bits).
template <int NP, int R, bool kPaired>
PREFT_AVX512BF16 void ExpandPass(const uint32_t* zp, int64_t zld, const int32_t* rows, int64_t n,
                                 const uint16_t* e, int64_t row_step, int64_t col_scale,
                                 int64_t rank, int64_t out, int64_t o, int64_t k0, bool first,
                                 bool last, float scale, float* y, int64_t y_stride, float* t) {
  const int64_t left = out - o;
  const __mmask32 mask = left >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << left) - 1);
  __m512bh lo[NP], hi[NP];
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) {
    const int64_t k = k0 + 2 * p;
    const uint16_t* at = e + k * row_step + o * col_scale;
    if constexpr (kPaired) {  // out % 32 == 0 and rank % 4 == 0 (chunkable): nothing masked
      lo[p] = (__m512bh)_mm512_loadu_si512(at);
      hi[p] = (__m512bh)_mm512_loadu_si512(at + kChunkCols);
      continue;
    }
    const __m512i a = _mm512_maskz_loadu_epi16(mask, at);
    const __m512i b =
        k + 1 < rank ? _mm512_maskz_loadu_epi16(mask, at + row_step) : _mm512_setzero_si512();
    lo[p] = (__m512bh)_mm512_unpacklo_epi16(a, b);
    hi[p] = (__m512bh)_mm512_unpackhi_epi16(a, b);
  }
  const __m512 sc = _mm512_set1_ps(scale);
  const uint32_t* zk = zp + k0 / 2;
  // Four rows at a time (R = 4): eight independent accumulator chains hide vdpbf16ps's latency.
  constexpr int64_t kRows = R;
  for (int64_t r0 = 0; r0 < n; r0 += kRows) {
    const int64_t rn = std::min(kRows, n - r0);
    __m512 a0[kRows], a1[kRows];
#pragma GCC unroll 4
    for (int64_t i = 0; i < kRows; ++i) {
      const int64_t r = r0 + std::min(i, rn - 1);
      a0[i] = first ? _mm512_setzero_ps() : _mm512_load_ps(t + r * 32);
      a1[i] = first ? _mm512_setzero_ps() : _mm512_load_ps(t + r * 32 + 16);
    }
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
#pragma GCC unroll 4
      for (int64_t i = 0; i < kRows; ++i) {
        const int64_t r = r0 + std::min(i, rn - 1);
        const __m512bh zb = (__m512bh)_mm512_set1_epi32(static_cast<int>(zk[r * zld + p]));
        a0[i] = _mm512_dpbf16_ps(a0[i], lo[p], zb);
        a1[i] = _mm512_dpbf16_ps(a1[i], hi[p], zb);
      }
    }
    // Rows past rn repeat the last one: only the first rn are kept.
    alignas(64) float keep[kRows][32];
#pragma GCC unroll 4
    for (int64_t i = 0; i < kRows; ++i) {
      _mm512_store_ps(keep[i], a0[i]);
      _mm512_store_ps(keep[i] + 16, a1[i]);
    }
    for (int64_t i = 0; i < rn; ++i) {
      const int64_t r = r0 + i;
      const __m512 b0 = _mm512_load_ps(keep[i]), b1 = _mm512_load_ps(keep[i] + 16);
      if (!last) {
        _mm512_store_ps(t + r * 32, b0);
        _mm512_store_ps(t + r * 32 + 16, b1);
        continue;
      }
      if constexpr (kPaired) {
        AddSums(b0, b1, sc, y + rows[r] * y_stride + o, mask);
      } else {
        AddPairSums(b0, b1, sc, y + rows[r] * y_stride + o, mask);
      }
    }
  }
}

using ExpandPassFn = void (*)(const uint32_t*, int64_t, const int32_t*, int64_t, const uint16_t*,
                              int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool,
                              float, float*, int64_t, float*);
template <int R, bool kPaired>
constexpr std::array<ExpandPassFn, kExpandPairs + 1> ExpandPasses() {
  return {nullptr,
          ExpandPass<1, R, kPaired>,
          ExpandPass<2, R, kPaired>,
          ExpandPass<3, R, kPaired>,
          ExpandPass<4, R, kPaired>,
          ExpandPass<5, R, kPaired>,
          ExpandPass<6, R, kPaired>,
          ExpandPass<7, R, kPaired>,
          ExpandPass<8, R, kPaired>};
}
// [E paired][rows per pass is 4][rank pairs]
constexpr std::array<ExpandPassFn, kExpandPairs + 1> kExpandPasses[2][2] = {
    {ExpandPasses<1, false>(), ExpandPasses<4, false>()},
    {ExpandPasses<1, true>(), ExpandPasses<4, true>()}};

// zp[p] = z[2p] (low half) and z[2p + 1] (high) in bf16, the latter zero past the rank.
inline void PackPairsBf16(const float* z, int64_t rank, uint32_t* zp) {
  for (int64_t p = 0; p < CeilDiv(rank, 2); ++p) {
    const uint32_t lo = F32ToBf16(z[2 * p]);
    const uint32_t hi = 2 * p + 1 < rank ? F32ToBf16(z[2 * p + 1]) : 0;
    zp[p] = lo | hi << 16;
  }
}

// ---- Decode rows through vdpbf16ps (the multi-LoRA BGMV) ----
// The sums of ShrinkRowsDotBf16 and ExpandPass, term for term and in the same order, so a row's
// result does not depend on how many rows its group has; without their four-row passes. On
// chunked matrices of rank <= 16 one pass over S takes all rank rows (a 1 KB run of S per 32
// inputs: one sequential stream), and rows of neighbouring groups can run in lockstep (two,
// or four on shrinks stored by column pairs): more streams of adapter bytes per thread keep
// more of the memory's bandwidth busy than one (NOTES steps 18, 23).

// acc[n][j] += xb[n] . S_n[k0 + j] over [c0, c1) for j < K and N rows of chunked S (the other
// accumulators stay zero); each 32 inputs' K rank rows are K consecutive 64-byte lines.
template <int K, int N>
PREFT_AVX512BF16 inline void ShrinkChunkedDot(const uint16_t* const* xb, const uint16_t* const* s,
                                              int64_t rank, int64_t k0, int64_t c0, int64_t c1,
                                              __m512 (*acc)[16]) {
  for (int64_t c = c0; c < c1; c += kDotElems) {
#pragma GCC unroll 2
    for (int n = 0; n < N; ++n) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb[n] + c);
      const uint16_t* p = s[n] + c * rank + k0 * kChunkCols;
#pragma GCC unroll 16
      for (int j = 0; j < K; ++j) {
        acc[n][j] =
            _mm512_dpbf16_ps(acc[n][j], xv, (__m512bh)_mm512_loadu_si512(p + j * kChunkCols));
      }
    }
  }
}

// z[n][k] = xb[n] . S_n[k] (+ b_n[k]) for N rows of chunked S_n [rank, in], rank % 4 == 0.
template <int N>
PREFT_AVX512BF16 void ShrinkChunkedRows(const uint16_t* const* xb, const uint16_t* const* s,
                                        const float* const* bias, int64_t rank, int64_t in,
                                        float* const* z) {
  for (int n = 0; n < N; ++n) {
    for (int64_t k = 0; k < rank; ++k) z[n][k] = bias[n] != nullptr ? bias[n][k] : 0.0f;
  }
  for (int64_t c0 = 0; c0 < in; c0 += kShrinkBlock) {
    const int64_t c1 = std::min(in, c0 + kShrinkBlock);
    for (int64_t k0 = 0; k0 < rank; k0 += 16) {
      const int64_t kn = std::min<int64_t>(16, rank - k0);
      __m512 acc[N][16];
      for (auto& row : acc)
        for (__m512& a : row) a = _mm512_setzero_ps();
      switch (kn) {
        case 16: ShrinkChunkedDot<16, N>(xb, s, rank, k0, c0, c1, acc); break;
        case 12: ShrinkChunkedDot<12, N>(xb, s, rank, k0, c0, c1, acc); break;
        case 8: ShrinkChunkedDot<8, N>(xb, s, rank, k0, c0, c1, acc); break;
        default: ShrinkChunkedDot<4, N>(xb, s, rank, k0, c0, c1, acc); break;
      }
      for (int n = 0; n < N; ++n) {
        alignas(64) float sums[16];
        _mm512_store_ps(sums, Sum16(acc[n]));
        for (int64_t j = 0; j < kn; ++j) z[n][k0 + j] += sums[j];
      }
    }
  }
}

// Shrinks stored by column pairs (chunked, rank a multiple of 16: [in / 2][rank][2]): the rank
// runs along the lanes, so a line of S is 16 rank rows' products with one broadcast pair of x,
// and a row needs four accumulators per 16 ranks, not one per rank row (then Sum16). So up to
// four decode rows stream their adapters in lockstep (NOTES step 23). z[k] sums the input
// pairs p = j (mod 4) into accumulator j in increasing p, then (a0 + a1) + (a2 + a3), then the
// bias: the same for any number of rows per pass, decode rows and prompt rows alike (not the
// row-major layout's order: the two layouts' bits differ in the last places).

// z_n[16 v0 .. 16 (v0 + VB)) = xb_n . S_n[k] (+ b_n[k]) for N rows (S_n of one rank and width).
template <int N, int VB>
PREFT_AVX512BF16 void ShrinkColumnPairsPass(const uint16_t* const* xb, const uint16_t* const* s,
                                            const float* const* bias, int64_t rank, int64_t in,
                                            int64_t v0, float* const* z) {
  __m512 acc[N][VB][4];
  for (auto& row : acc)
    for (auto& v : row)
      for (__m512& a : v) a = _mm512_setzero_ps();
  for (int64_t p = 0; p < in / 2; p += 4) {  // in is a multiple of 32 (LowRankChunkable)
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) {
      const uint16_t* line = s[n] + (p * rank + 16 * v0) * 2;
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        int32_t pair;
        std::memcpy(&pair, xb[n] + 2 * (p + j), sizeof(pair));
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
        for (int v = 0; v < VB; ++v) {
          acc[n][v][j] = _mm512_dpbf16_ps(
              acc[n][v][j], (__m512bh)_mm512_loadu_si512(line + j * rank * 2 + 32 * v), xv);
        }
      }
    }
  }
  for (int n = 0; n < N; ++n) {
    for (int v = 0; v < VB; ++v) {
      __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[n][v][0], acc[n][v][1]),
                                 _mm512_add_ps(acc[n][v][2], acc[n][v][3]));
      const int64_t k = 16 * (v0 + v);
      if (bias[n] != nullptr) sum = _mm512_add_ps(sum, _mm512_loadu_ps(bias[n] + k));
      _mm512_storeu_ps(z[n] + k, sum);
    }
  }
}

// Rows in lockstep through a shrink by column pairs of this rank: four accumulators per 16
// ranks and row, at most 16 in all.
int64_t ColumnPairRows(int64_t rank) { return std::max<int64_t>(1, 4 / (rank / 16)); }

// ShrinkColumnPairsPass over every rank for N <= ColumnPairRows(rank) rows.
template <int N>
PREFT_AVX512BF16 void ShrinkColumnPairs(const uint16_t* const* xb, const uint16_t* const* s,
                                        const float* const* bias, int64_t rank, int64_t in,
                                        float* const* z) {
  const int64_t vecs = rank / 16;
  int64_t v0 = 0;
  if constexpr (N == 1) {
    for (; v0 + 4 <= vecs; v0 += 4) ShrinkColumnPairsPass<1, 4>(xb, s, bias, rank, in, v0, z);
    for (; v0 + 2 <= vecs; v0 += 2) ShrinkColumnPairsPass<1, 2>(xb, s, bias, rank, in, v0, z);
  }
  if constexpr (N == 2) {
    for (; v0 + 2 <= vecs; v0 += 2) ShrinkColumnPairsPass<2, 2>(xb, s, bias, rank, in, v0, z);
  }
  for (; v0 < vecs; ++v0) ShrinkColumnPairsPass<N, 1>(xb, s, bias, rank, in, v0, z);
}

// f(std::integral_constant<int, n>()) for a runtime count n of 1 .. 4: the kernels take the
// rows they run in lockstep as a template argument.
template <typename F>
void WithRows(int n, F&& f) {
  switch (n) {
    case 4: f(std::integral_constant<int, 4>()); return;
    case 3: f(std::integral_constant<int, 3>()); return;
    case 2: f(std::integral_constant<int, 2>()); return;
    default: f(std::integral_constant<int, 1>()); return;
  }
}

// y_n[o0 .. o1) += scale_n * z_n E_n for N rows of chunked, paired E_n, rank 2 NP (at most
// 16); the rank pairs' broadcasts of z held in registers for up to two rows, loaded as used
// beyond (four rows' would crowd out the sums).
template <int NP, int N>
PREFT_AVX512BF16 void ExpandChunkedRows(const uint32_t* const* zp, const uint16_t* const* e,
                                        const float* scale, float* const* y, int64_t o0,
                                        int64_t o1) {
  constexpr bool kHoist = N <= 2;
  __m512bh zb[N][NP];
  __m512 sc[N];
  for (int n = 0; n < N; ++n) {
    sc[n] = _mm512_set1_ps(scale[n]);
    if constexpr (kHoist) {
      for (int p = 0; p < NP; ++p) zb[n][p] = (__m512bh)_mm512_set1_epi32(static_cast<int>(zp[n][p]));
    }
  }
  for (int64_t o = o0; o < o1; o += kChunkCols) {
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) {
      const uint16_t* at = e[n] + o * (2 * NP);
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        const uint16_t* pair = at + 2 * p * kChunkCols;
        const __m512bh zv =
            kHoist ? zb[n][p] : (__m512bh)_mm512_set1_epi32(static_cast<int>(zp[n][p]));
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(pair), zv);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(pair + kChunkCols), zv);
      }
      AddSums(a0, a1, sc[n], y[n] + o, ~__mmask32{0});
    }
  }
}

// As ExpandChunkedRows for one row of any rank (a multiple of 4): z's pairs broadcast as used.
PREFT_AVX512BF16 void ExpandChunkedRowWide(int64_t rank, const uint32_t* zp, const uint16_t* e,
                                           float scale, float* y, int64_t o0, int64_t o1) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t o = o0; o < o1; o += kChunkCols) {
    const uint16_t* at = e + o * rank;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int64_t p = 0; p < rank / 2; ++p) {
      const uint16_t* pair = at + 2 * p * kChunkCols;
      const __m512bh zb = (__m512bh)_mm512_set1_epi32(static_cast<int>(zp[p]));
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(pair), zb);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(pair + kChunkCols), zb);
    }
    AddSums(a0, a1, sc, y + o, ~__mmask32{0});
  }
}

template <int N>
PREFT_AVX512BF16 void ExpandChunkedRowsAnyRank(int64_t rank, const uint32_t* const* zp,
                                               const uint16_t* const* e, const float* scale,
                                               float* const* y, int64_t o0, int64_t o1) {
  switch (rank) {
    case 16: ExpandChunkedRows<8, N>(zp, e, scale, y, o0, o1); return;
    case 12: ExpandChunkedRows<6, N>(zp, e, scale, y, o0, o1); return;
    case 8: ExpandChunkedRows<4, N>(zp, e, scale, y, o0, o1); return;
    case 4: ExpandChunkedRows<2, N>(zp, e, scale, y, o0, o1); return;
    default:  // wider: one row at a time
      for (int n = 0; n < N; ++n) ExpandChunkedRowWide(rank, zp[n], e[n], scale[n], y[n], o0, o1);
      return;
  }
}

// Decode rows (one row per group) that run in lockstep with g's: two for chunked shrinks of
// rank <= 16 (the pair's shrink accumulators fill the registers), ColumnPairRows for those
// stored by column pairs, else one.
int64_t LockstepRows(const LowRankGroup& g) {
  if (!g.shrink.chunked || g.num_rows != 1) return 1;
  if (ColumnPaired(g.shrink.rows, false)) return ColumnPairRows(g.shrink.rows);
  return g.shrink.rows <= 16 ? 2 : 1;
}

// Whether b's decode row can join a's lockstep: both chunked, of one rank and input width.
bool InLockstep(const LowRankGroup& a, const LowRankGroup& b) {
  return b.num_rows == 1 && b.shrink.chunked && b.shrink.rows == a.shrink.rows &&
         b.shrink.cols == a.shrink.cols;
}

// One decode row of each of N chunked groups (N <= LockstepRows, InLockstep).
template <int N>
PREFT_AVX512BF16 void RunChunkedDecodeRows(const float* x, int64_t x_stride, float* y,
                                           int64_t y_stride, const LowRankGroup* const* g) {
  PREFT_CHECK(N <= LockstepRows(*g[0]));  // the shrink's sums of N rows fit in the registers
  const int64_t rank = g[0]->shrink.rows, in = g[0]->shrink.cols;
  auto* packed =
      static_cast<uint16_t*>(ThreadScratch(kLowRankScratchSlot, N * in * sizeof(uint16_t)));
  const uint16_t *xb[N], *s[N], *e[N];
  const float* bias[N];
  float scale[N], *yr[N], *zr[N];
  alignas(64) float z[N][kMaxRank];
  alignas(64) uint32_t zp[N][kMaxRank / 2];
  // Every row is read in full before any is written (x may be y: DiReFT in place).
  for (int n = 0; n < N; ++n) {
    const LowRankGroup& gn = *g[n];
    PackRowsBf16(x, x_stride, gn.rows, 1, in, in, packed + n * in);
    xb[n] = packed + n * in;
    s[n] = static_cast<const uint16_t*>(gn.shrink.data);
    e[n] = static_cast<const uint16_t*>(gn.expand.data);
    bias[n] = gn.shrink_bias;
    scale[n] = gn.scale;
    yr[n] = (gn.y != nullptr ? gn.y : y) + gn.rows[0] * (gn.y != nullptr ? gn.y_stride : y_stride);
    zr[n] = z[n];
  }
  if (ColumnPaired(rank, false)) {
    ShrinkColumnPairs<N>(xb, s, bias, rank, in, zr);
  } else if constexpr (N <= 2) {  // other shrinks hold two rows' sums at most
    ShrinkChunkedRows<N>(xb, s, bias, rank, in, zr);
  }
  for (int n = 0; n < N; ++n) PackPairsBf16(z[n], rank, zp[n]);
  // In lockstep over the outputs every row still has, dropping each row at its width (q, k
  // and v side by side: 128 outputs four wide, then q's rest two wide).
  int live[N], m = N;
  for (int n = 0; n < N; ++n) live[n] = n;
  for (int64_t o0 = 0; m > 0;) {
    int64_t o1 = g[live[0]]->expand.cols;
    for (int i = 1; i < m; ++i) o1 = std::min(o1, g[live[i]]->expand.cols);
    const uint32_t* lz[N];
    const uint16_t* le[N];
    float ls[N], *ly[N];
    for (int i = 0; i < m; ++i) {
      lz[i] = zp[live[i]];
      le[i] = e[live[i]];
      ls[i] = scale[live[i]];
      ly[i] = yr[live[i]];
    }
    WithRows(m, [&](auto rows) {
      ExpandChunkedRowsAnyRank<decltype(rows)::value>(rank, lz, le, ls, ly, o0, o1);
    });
    int kept = 0;
    for (int i = 0; i < m; ++i)
      if (g[live[i]]->expand.cols > o1) live[kept++] = live[i];
    m = kept;
    o0 = o1;
  }
}

// yr += scale * z E for one row of a row-major E: E streamed in memory order, two rank rows
// at a time, into per-output sums kept in L1 in ExpandPass's lane order. Each output sums the
// same pairs in the same order as in ExpandPass, so the bits are its bits; ExpandPass itself,
// run on one row, reads 2 NP rows of E at a row's stride per 32 outputs, streams the
// prefetchers lose (~2x the time).
PREFT_AVX512BF16 void ExpandRowStreamedDot(const uint32_t* zp, const uint16_t* e, int64_t rank,
                                           int64_t out, float scale, float* yr) {
  alignas(64) float t[kMaxExpandOut + 32];  // [chunk][lo 16, hi 16]
  const int64_t chunks = CeilDiv(out, 32);
  std::fill(t, t + chunks * 32, 0.0f);
  const int64_t vec_end = out & ~int64_t{31};
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (out - vec_end)) - 1);
  for (int64_t k = 0; k < rank; k += 2) {
    const __m512bh zb = (__m512bh)_mm512_set1_epi32(static_cast<int>(zp[k / 2]));
    const uint16_t* ra = e + k * out;
    const uint16_t* rb = k + 1 < rank ? ra + out : nullptr;
    for (int64_t o = 0; o < out; o += 32) {
      const __mmask32 mask = o < vec_end ? ~__mmask32{0} : tail;
      const __m512i a = _mm512_maskz_loadu_epi16(mask, ra + o);
      const __m512i b =
          rb != nullptr ? _mm512_maskz_loadu_epi16(mask, rb + o) : _mm512_setzero_si512();
      float* tc = t + o;
      _mm512_store_ps(tc, _mm512_dpbf16_ps(_mm512_load_ps(tc),
                                           (__m512bh)_mm512_unpacklo_epi16(a, b), zb));
      _mm512_store_ps(tc + 16, _mm512_dpbf16_ps(_mm512_load_ps(tc + 16),
                                                (__m512bh)_mm512_unpackhi_epi16(a, b), zb));
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t o = 0; o < out; o += 32) {
    AddPairSums(_mm512_load_ps(t + o), _mm512_load_ps(t + o + 16), sc, yr + o,
                o < vec_end ? ~__mmask32{0} : tail);
  }
}

// One work item of a prompt group: rows [0, n) of `rows`, at most kRowsPerItem.
PREFT_AVX512BF16 void RunItemDotBf16(const float* x, int64_t x_stride, float* y,
                                     int64_t y_stride, const LowRankGroup& g,
                                     const int32_t* rows, int64_t n, float* z) {
  const int64_t rank = g.shrink.rows, in = g.shrink.cols, out = g.expand.cols;
  const int64_t ld = RoundUp(in, kDotElems);
  auto* xb = static_cast<uint16_t*>(ThreadScratch(kLowRankScratchSlot, n * ld * sizeof(uint16_t)));
  PackRowsBf16(x, x_stride, rows, n, in, ld, xb);
  if (g.shrink.chunked && ColumnPaired(rank, false)) {
    // The decode rows' kernel, as many rows per pass as it takes.
    const auto* s = static_cast<const uint16_t*>(g.shrink.data);
    const uint16_t* ss[4] = {s, s, s, s};
    const float* bs[4] = {g.shrink_bias, g.shrink_bias, g.shrink_bias, g.shrink_bias};
    const int64_t width = ColumnPairRows(rank);
    for (int64_t r0 = 0; r0 < n; r0 += width) {
      const int m = static_cast<int>(std::min(width, n - r0));
      const uint16_t* xs[4];
      float* zs[4];
      for (int i = 0; i < m; ++i) {
        xs[i] = xb + (r0 + i) * ld;
        zs[i] = z + (r0 + i) * rank;
      }
      WithRows(m, [&](auto rows) {
        ShrinkColumnPairs<decltype(rows)::value>(xs, ss, bs, rank, in, zs);
      });
    }
  } else {
    // A lone row (a decode row of a row-major matrix) in passes of one row, not four copies.
    (n == 1 ? ShrinkRowsDotBf16<1> : ShrinkRowsDotBf16<4>)(
        xb, ld, n, static_cast<const uint16_t*>(g.shrink.data), RowStep(g.shrink),
        ColScale(g.shrink), rank, in, g.shrink_bias, z);
  }
  // z in bf16 pairs, zero past the rank.
  const int64_t pairs = CeilDiv(rank, 2);
  alignas(64) uint32_t zp[kRowsPerItem * (kMaxRank / 2)];
  for (int64_t r = 0; r < n; ++r) PackPairsBf16(z + r * rank, rank, zp + r * pairs);
  alignas(64) float t[kRowsPerItem * 32];
  const auto* e = static_cast<const uint16_t*>(g.expand.data);
  float* yy = g.y != nullptr ? g.y : y;
  const int64_t ys = g.y != nullptr ? g.y_stride : y_stride;
  if (n == 1 && !g.expand.chunked && out <= kMaxExpandOut) {
    ExpandRowStreamedDot(zp, e, rank, out, g.scale, yy + rows[0] * ys);
    return;
  }
  for (int64_t r0 = 0; r0 < n; r0 += 4) {
    const int64_t rn = std::min<int64_t>(4, n - r0);
    for (int64_t o = 0; o < out; o += 32) {
      for (int64_t p0 = 0; p0 < pairs; p0 += kExpandPairs) {
        const int64_t np = std::min(kExpandPairs, pairs - p0);
        kExpandPasses[g.expand.paired][n > 1][np](zp + r0 * pairs, pairs, rows + r0, rn, e, RowStep(g.expand),
                                 ColScale(g.expand), rank, out, o, 2 * p0, p0 == 0,
                                 p0 + kExpandPairs >= pairs, g.scale, yy, ys, t);
      }
    }
  }
}

#undef PREFT_AVX512BF16

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
    // One chain per rank row, the sums of the four-row pass below lane for lane (a row's bits
    // may not depend on its group's size); S streams from memory, so latency is hidden.
    for (int64_t k = 0; k < rank; ++k) {
      const void* srow = static_cast<const uint8_t*>(s.data) + k * in * DTypeSize(T);
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < vec_end; i += 8) {
        if (i % 16 == 0) {
          _mm_prefetch(static_cast<const char*>(srow) + (i + kPrefetchElems) * DTypeSize(T),
                       _MM_HINT_T0);
        }
        acc = _mm256_fmadd_ps(Load8<T>(srow, i), _mm256_loadu_ps(xr + i), acc);
      }
      float sum = Reduce1(acc);
      for (int64_t i = vec_end; i < in; ++i) sum += LoadAsF32(srow, T, i) * xr[i];
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
      for (; o < out; ++o) t[o] = std::fma(z[k], LoadAsF32(erow, T, o), t[o]);
    }
    float* yr = y + rows[0] * y_stride;
    int64_t o = 0;
    for (; o < vec8_end; o += 8) {
      _mm256_storeu_ps(yr + o, _mm256_fmadd_ps(sc, _mm256_load_ps(t + o), _mm256_loadu_ps(yr + o)));
    }
    for (; o < out; ++o) yr[o] = std::fma(scale, t[o], yr[o]);
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
      // Scalar FMAs: the same operations as a vector lane, so an output's bits do not
      // depend on whether a decode row's vector loop (8 wide) or this one (16) reached it.
      for (int64_t o = vec_end; o < out; ++o) {
        float sum = 0;
        for (int64_t k = 0; k < rank; ++k) {
          sum = std::fma(zr[j][k], LoadAsF32(base + k * row_bytes, T, o), sum);
        }
        yr[o] = std::fma(scale, sum, yr[o]);
      }
    }
  }
}

template <DType T>
void RunItem(const float* x, int64_t x_stride, float* y, int64_t y_stride, const LowRankGroup& g,
             int64_t begin, int64_t end, float* z) {
  if constexpr (T == DType::kBF16) {
    // Every row of a bf16 group on these CPUs (chunked matrices only exist there), decode rows
    // included: a row rounds the same way whatever its group's size.
    if (ActiveLinearIsa() >= LinearIsa::kAvx512Bf16) {
      if (g.num_rows == 1 && g.shrink.chunked) {
        const LowRankGroup* one = &g;
        RunChunkedDecodeRows<1>(x, x_stride, y, y_stride, &one);
        return;
      }
      RunItemDotBf16(x, x_stride, y, y_stride, g, g.rows + begin, end - begin, z);
      return;
    }
  }
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
    PREFT_CHECK(gr.shrink.chunked == gr.expand.chunked);
    PREFT_CHECK(!gr.shrink.paired && gr.expand.paired == gr.expand.chunked);
    PREFT_CHECK(!gr.shrink.chunked || (LowRankChunkable(gr.shrink) && LowRankChunkable(gr.expand)));
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
      const int64_t end = std::min<int64_t>(at(t + 1), num_items);
      for (int64_t i = at(t); i < end;) {
        const LowRankGroup* lock[4] = {&groups[items[i].group]};
        const int64_t width = std::min<int64_t>(LockstepRows(*lock[0]), end - i);
        int n = 1;
        while (n < width && InLockstep(*lock[0], groups[items[i + n].group])) {
          lock[n] = &groups[items[i + n].group];
          ++n;
        }
        if (n == 1) {
          run(i, z);
        } else {
          WithRows(n, [&](auto rows) {
            RunChunkedDecodeRows<decltype(rows)::value>(x, x_stride, y, y_stride, lock);
          });
        }
        i += n;
      }
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
