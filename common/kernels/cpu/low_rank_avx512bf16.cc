// The vdpbf16ps low-rank kernel for a work item of up to kRowsPerItem rows of one group: prompt
// rows (SGMV) in four-row passes, and decode rows of row-major matrices (BGMV). Chunked decode
// rows take low_rank_chunked.cc's kernel, which sums in the same order.

#include <immintrin.h>

#include <algorithm>
#include <array>

#include "common/kernels/cpu/linear_driver.h"
#include "common/kernels/cpu/low_rank_avx512bf16.h"
#include "common/kernels/cpu/low_rank_kernels.h"

// GCC 12's AVX-512 intrinsics build "undefined" vectors by self-initialisation, which -Wall
// reports (as in the Linear kernels).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace preft::kernels::cpu::low_rank_internal {
namespace {

// Where row k, columns [c, c + 32) of a matrix start (c a multiple of 32): data + k RowStep +
// c ColScale, in either layout.
int64_t RowStep(const MatrixView& m) { return m.chunked ? kChunkCols : m.cols; }
int64_t ColScale(const MatrixView& m) { return m.chunked ? m.rows : 1; }

// Rank pairs applied per pass of the expand: 16 rank rows of E, interleaved, stay in registers.
constexpr int64_t kExpandPairs = 8;

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

}  // namespace

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
      ShrinkColumnPairs(m, xs, ss, bs, rank, in, zs);
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
        kExpandPasses[g.expand.paired][n > 1][np](
            zp + r0 * pairs, pairs, rows + r0, rn, e, RowStep(g.expand), ColScale(g.expand), rank,
            out, o, 2 * p0, p0 == 0, p0 + kExpandPairs >= pairs, g.scale, yy, ys, t);
      }
    }
  }
}

}  // namespace preft::kernels::cpu::low_rank_internal
