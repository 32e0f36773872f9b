// The GEMV twin of the w-broadcast GEMM (linear_broadcast.cc) for a few rows of x: per output
// the same vdpbf16ps steps in the same order (the pairs of each BroadcastKBlock block in
// order, the blocks added into y in order), so a row of y has the same bits whether its row
// of x came alone or among hundreds (batch invariance), at the speed of a GEMV. The GEMM
// holds rows of x in lanes and broadcasts pairs of w; here outputs sit in lanes: each 16 x 16
// block of w's pairs (16 rows, 16 pairs of each) is transposed in registers, and each of its
// pair vectors meets a broadcast pair of x. Compiled for AVX-512-BF16 and only reached after
// the run-time check in linear.cc.

#include <immintrin.h>

#include <algorithm>
#include <utility>

#include "common/kernels/cpu/linear_driver.h"
#include "common/kernels/cpu/linear_kernels.h"

// GCC 12's intrinsics headers build "undefined" vectors by self-initialisation.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

#include "common/kernels/cpu/transpose_avx512.h"

namespace preft::kernels::cpu {
namespace {

// Groups of 16 rows of w per tile: each row of x then runs two independent accumulator
// chains, since an output's own sum is one chain by construction.
constexpr int kGroups = 2;
// Elements ahead in each row of w at which its lines are prefetched. A tile reads 32 rows at
// once, more streams than the hardware prefetcher follows; measured on Zen 5 (2 threads,
// weights from DRAM, 64 .. 4096): 128 (four lines) took the GEMV from 0.6-0.7x the dot
// kernel's bandwidth (no prefetch) to 1.0-1.1x; 512 and more lost again.
constexpr int64_t kPrefetchElems = 128;

// in[r] lane p = pair p0 + p of row r of w, for np pairs (zero past them and past `rows`
// rows). half_last: the last of them holds only its first element (k odd), read alone so
// that nothing past the end of w is touched.
inline void LoadPairs(const uint16_t* w, int64_t k, int rows, int64_t p0, int np, bool half_last,
                      __m512i (&in)[16]) {
  if (rows == 16 && np == 16 && !half_last) {
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * k + 2 * p0 + kPrefetchElems),
                   _MM_HINT_T0);
      in[r] = _mm512_loadu_si512(w + r * k + 2 * p0);
    }
    return;
  }
  const int elems = 2 * np - (half_last ? 1 : 0);
  const __mmask32 mask = elems >= 32 ? ~__mmask32{0} : (__mmask32{1} << elems) - 1;
  for (int r = 0; r < 16; ++r) {
    in[r] = r < rows ? _mm512_maskz_loadu_epi16(mask, w + r * k + 2 * p0) : _mm512_setzero_si512();
  }
}

// y[i0 .. i0+MR, j0 .. j0+rows] over the whole of k, bias included; G groups of 16 rows of w
// (rows <= 16 G). xp: x rounded to bf16, as pairs [row][ldp].
template <int MR, int G>
void LanesTile(const uint32_t* xp, int64_t ldp, const uint16_t* w, int64_t k, int rows,
               const float* bias, float* y, int64_t ldy) {
  const int64_t kc = BroadcastKBlock(k);
  __m512 sum[MR][G];
  for (int64_t c0 = 0; c0 < k; c0 += kc) {
    const int64_t len = std::min(kc, k - c0), np = CeilDiv(len, 2), pb = c0 / 2;
    const bool half_last = (len & 1) != 0;
    __m512 acc[MR][G];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) acc[i][g] = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p += 16) {
      const int step = static_cast<int>(std::min<int64_t>(16, np - p));
      const bool half = half_last && p + step == np;
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const int grows = std::min(16, rows - 16 * g);
        if (grows <= 0) break;
        __m512i in[16], t[16];
        LoadPairs(w + 16 * g * k, k, grows, pb + p, step, half, in);
        Transpose16x16(in, t);
        const uint32_t* xq = xp + pb + p;
        auto apply = [&](int q) __attribute__((always_inline)) {  // pair q to every row
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xq[i * ldp + q]));
            acc[i][g] = _mm512_dpbf16_ps(acc[i][g], (__m512bh)t[q], xv);
          }
        };
        if (step == 16) {
#pragma GCC unroll 16
          for (int q = 0; q < 16; ++q) apply(q);
        } else {
          for (int q = 0; q < step; ++q) apply(q);
        }
      }
    }
    // The GEMM's epilogue: the first block's sums plus the bias (or zero), later ones plus y.
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const int grows = std::min(16, rows - 16 * g);
      if (grows <= 0) break;
      const __mmask16 mask = static_cast<__mmask16>((1u << grows) - 1);
      const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + 16 * g)
                                       : _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        sum[i][g] = _mm512_add_ps(acc[i][g], c0 == 0 ? b : sum[i][g]);
      }
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    const int grows = std::min(16, rows - 16 * g);
    if (grows <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << grows) - 1);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + i * ldy + 16 * g, mask, sum[i][g]);
  }
}

// DotKernelTable entries: full tiles cover 16 kGroups rows of w, single ones the n tail.
template <int MR, int G, int kRows>
void LanesDotTile(const DotArgs& a, int64_t i0, int64_t j0) {
  const int64_t ldp = a.ldx / 2;
  LanesTile<MR, G>(static_cast<const uint32_t*>(a.x) + i0 * ldp, ldp,
                   static_cast<const uint16_t*>(a.w) + j0 * a.k, a.k, kRows,
                   a.bias != nullptr ? a.bias + j0 : nullptr, a.y + i0 * a.n + j0, a.n);
}

// Up to seven rows of x in one pass over w (Linear sends fewer than 8 here): 14 accumulators.
template <int... MR>
constexpr DotKernelTable LanesTable(std::integer_sequence<int, MR...>) {
  DotKernelTable t;
  t.max_mr = sizeof...(MR);
  t.nr = 16 * kGroups;
  ((t.full[MR - 1] = LanesDotTile<MR, kGroups, 16 * kGroups>), ...);
  ((t.single[MR - 1] = LanesDotTile<MR, 1, 1>), ...);
  return t;
}

constexpr DotKernelTable kLanesTable =
    LanesTable(std::integer_sequence<int, 1, 2, 3, 4, 5, 6, 7>{});

}  // namespace

void LinearBf16Avx512Lanes(const float* x, int64_t m, const uint16_t* w, int64_t n, int64_t k,
                           const float* bias, float* y) {
  const Bf16Output out{w, n, bias, y};
  RunBf16DotShared(x, m, k, &out, 1, kLanesTable);
}

void LinearBf16Avx512LanesShared(const float* x, int64_t m, int64_t k, const Bf16Output* outs,
                                 int64_t count) {
  RunBf16DotShared(x, m, k, outs, count, kLanesTable);
}

}  // namespace preft::kernels::cpu

#pragma GCC pop_options
