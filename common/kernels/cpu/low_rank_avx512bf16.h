#pragma once

// The vdpbf16ps (AVX-512-BF16) pieces that the low-rank kernels of low_rank_avx512bf16.cc
// (prompt rows, row-major decode rows) and low_rank_chunked.cc (chunked decode rows) share, so
// that a row sums and rounds alike in either. Everything here needs AVX-512-BF16.

#include <immintrin.h>

#include <cstdint>

#include "common/kernels/cpu/linear_driver.h"
#include "common/kernels/dtype.h"

// Like the bf16 GEMMs (and PEFT running a bf16 model), the rows of x and the shrink results z
// are rounded to bf16 (RNE) and the products accumulate in f32: half the multiply
// instructions of widening the weights to f32, the same rounding as the base linears. The
// kernels of both files are compiled for AVX-512-BF16 with this attribute.
#define PREFT_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

namespace preft::kernels::cpu::low_rank_internal {

// Elements per vdpbf16ps: 16 pairs.
inline constexpr int64_t kDotElems = 32;

// Elements of `in` per block of the shrink: the block's rows of x (kRowsPerItem) and of S
// (rank 16) stay in L1 across the passes over them.
inline constexpr int64_t kShrinkBlock = 512;

// xb[r] = x[rows[r]] in bf16, zero from `in` up to ld (a multiple of kDotElems). In
// low_rank_avx512bf16.cc.
PREFT_AVX512BF16 void PackRowsBf16(const float* x, int64_t x_stride, const int32_t* rows, int64_t n,
                                   int64_t in, int64_t ld, uint16_t* xb);

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

// zp[p] = z[2p] (low half) and z[2p + 1] (high) in bf16, the latter zero past the rank.
inline void PackPairsBf16(const float* z, int64_t rank, uint32_t* zp) {
  for (int64_t p = 0; p < CeilDiv(rank, 2); ++p) {
    const uint32_t lo = F32ToBf16(z[2 * p]);
    const uint32_t hi = 2 * p + 1 < rank ? F32ToBf16(z[2 * p + 1]) : 0;
    zp[p] = lo | hi << 16;
  }
}

}  // namespace preft::kernels::cpu::low_rank_internal
