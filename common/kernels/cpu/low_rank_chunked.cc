// The vdpbf16ps low-rank kernel for decode rows of chunked matrices (MatrixView::chunked, the
// multi-LoRA BGMV on a CPU worker's adapters): up to four groups' rows stream their adapters
// in lockstep. Its column-pair shrink serves prompt rows too (low_rank_avx512bf16.cc).

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "common/base/check.h"
#include "common/kernels/cpu/linear_driver.h"
#include "common/kernels/cpu/low_rank_avx512bf16.h"
#include "common/kernels/cpu/low_rank_kernels.h"

// GCC 12's AVX-512 intrinsics build "undefined" vectors by self-initialisation, which -Wall
// reports (as in the Linear kernels).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace preft::kernels::cpu::low_rank_internal {
namespace {

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
      for (int p = 0; p < NP; ++p)
        zb[n][p] = (__m512bh)_mm512_set1_epi32(static_cast<int>(zp[n][p]));
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

}  // namespace

void ShrinkColumnPairs(int n, const uint16_t* const* xb, const uint16_t* const* s,
                       const float* const* bias, int64_t rank, int64_t in, float* const* z) {
  WithRows(n, [&](auto rows) {
    ShrinkColumnPairs<decltype(rows)::value>(xb, s, bias, rank, in, z);
  });
}

void RunChunkedDecodeRows(int n, const float* x, int64_t x_stride, float* y, int64_t y_stride,
                          const LowRankGroup* const* g) {
  WithRows(n, [&](auto rows) {
    RunChunkedDecodeRows<decltype(rows)::value>(x, x_stride, y, y_stride, g);
  });
}

}  // namespace preft::kernels::cpu::low_rank_internal
