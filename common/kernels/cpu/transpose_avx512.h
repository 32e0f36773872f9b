#pragma once

// AVX-512 register transpose shared by the bf16 GEMM kernels. Include it only inside a
// `#pragma GCC target("avx512f,...")` region (the kernels' .cc files open one).

#include <immintrin.h>

namespace preft::kernels::cpu {

// Transposes 16 x 16 32-bit elements: out[c] lane r = in[r] lane c.
inline void Transpose16x16(const __m512i (&in)[16], __m512i (&out)[16]) {
  __m512i t[16], u[16];
#pragma GCC unroll 8
  for (int r = 0; r < 16; r += 2) {
    t[r] = _mm512_unpacklo_epi32(in[r], in[r + 1]);
    t[r + 1] = _mm512_unpackhi_epi32(in[r], in[r + 1]);
  }
  // u[4g + q], 128-bit lane L: rows 4g .. 4g+3 of column 4L + q.
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    const __m512i a_lo = _mm512_shuffle_i32x4(u[q], u[4 + q], 0x88);  // lanes 0, 2
    const __m512i a_hi = _mm512_shuffle_i32x4(u[q], u[4 + q], 0xdd);  // lanes 1, 3
    const __m512i b_lo = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0x88);
    const __m512i b_hi = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0xdd);
    out[q] = _mm512_shuffle_i32x4(a_lo, b_lo, 0x88);
    out[8 + q] = _mm512_shuffle_i32x4(a_lo, b_lo, 0xdd);
    out[4 + q] = _mm512_shuffle_i32x4(a_hi, b_hi, 0x88);
    out[12 + q] = _mm512_shuffle_i32x4(a_hi, b_hi, 0xdd);
  }
}

}  // namespace preft::kernels::cpu
