// AVX-512 kernels of Linear: vdpbf16ps dot products for bf16 weights, and f32 FMA on
// widened bf16/f16 weights. Every function here is compiled for AVX-512 and only reached
// after the run-time check in linear.cc.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <type_traits>

#include "common/kernels/cpu/cpu_features.h"
#include "common/kernels/cpu/linear_driver.h"
#include "common/kernels/cpu/linear_kernels.h"

// GCC 12's intrinsics headers build "undefined" vectors by self-initialisation, which -Wall
// reports inside every masked load and reduction.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")

namespace preft::kernels::cpu {
namespace {

// Sums of a, b, c, d as one vector [Σa, Σb, Σc, Σd].
inline __m128 Reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Reduces the accumulators of an MR x NR tile and writes it to y with bias.
template <int MR, int NR>
inline void StoreTile(const __m512 (&acc)[MR][NR], const DotArgs& a, int64_t i0, int64_t j0) {
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    float* y = a.y + (i0 + i) * a.n + j0;
    if constexpr (NR % 4 == 0) {
#pragma GCC unroll 4
      for (int j = 0; j < NR; j += 4) {
        __m128 s = Reduce4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]);
        if (a.bias != nullptr) s = _mm_add_ps(s, _mm_loadu_ps(a.bias + j0 + j));
        _mm_storeu_ps(y + j, s);
      }
    } else {
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        float s = _mm512_reduce_add_ps(acc[i][j]);
        if (a.bias != nullptr) s += a.bias[j0 + j];
        y[j] = s;
      }
    }
  }
}

// 16 elements of w from p as f32 (the first `mask` ones, zero past them).
template <DType kW>
inline __m512 Load16(const void* p, __mmask16 mask = 0xffff) {
  if constexpr (kW == DType::kF32) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else {
    const __m256i v = _mm256_maskz_loadu_epi16(mask, p);
    if constexpr (kW == DType::kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    } else {
      return _mm512_cvtph_ps(v);
    }
  }
}

// f32 FMA tile on w (f32, or widened bf16/f16); x is the caller's f32 rows (ldx = k). Each
// output sums 16 lanes over k in order, then the lanes in a fixed tree, whatever the tile:
// so its bits do not depend on m.
template <DType kW, int MR, int NR>
void FmaTile(const DotArgs& a, int64_t i0, int64_t j0) {
  using Elem = std::conditional_t<kW == DType::kF32, float, uint16_t>;
  const float* x = static_cast<const float*>(a.x) + i0 * a.ldx;
  const Elem* w = static_cast<const Elem*>(a.w) + j0 * a.k;
  const int64_t k = a.k, ldx = a.ldx;
  __m512 acc[MR][NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= k; c += 16) {
    __m512 xv[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) xv[i] = _mm512_loadu_ps(x + i * ldx + c);
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      const __m512 wv = Load16<kW>(w + j * k + c);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  if (c < k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (k - c)) - 1);
    __m512 xv[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) xv[i] = _mm512_maskz_loadu_ps(mask, x + i * ldx + c);
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      const __m512 wv = Load16<kW>(w + j * k + c, mask);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  StoreTile<MR, NR>(acc, a, i0, j0);
}

template <DType kW>
constexpr DotKernelTable FmaTable() {
  DotKernelTable t;
  t.max_mr = 4;
  t.nr = 4;
  t.full[0] = FmaTile<kW, 1, 4>;
  t.full[1] = FmaTile<kW, 2, 4>;
  t.full[2] = FmaTile<kW, 3, 4>;
  t.full[3] = FmaTile<kW, 4, 4>;
  t.single[0] = FmaTile<kW, 1, 1>;
  t.single[1] = FmaTile<kW, 2, 1>;
  t.single[2] = FmaTile<kW, 3, 1>;
  t.single[3] = FmaTile<kW, 4, 1>;
  return t;
}

}  // namespace

void LinearFmaAvx512(const float* x, int64_t m, const void* w, DType w_dtype, int64_t n,
                    int64_t k, const float* bias, float* y) {
  static const DotKernelTable kF32 = FmaTable<DType::kF32>();
  static const DotKernelTable kBf16 = FmaTable<DType::kBF16>();
  static const DotKernelTable kF16 = FmaTable<DType::kF16>();
  DotArgs args{x, k, w, w_dtype, n, k, bias, y};
  RunDotKernel(args, m, w_dtype == DType::kF32 ? kF32 : w_dtype == DType::kBF16 ? kBf16 : kF16);
}

}  // namespace preft::kernels::cpu

#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace preft::kernels::cpu {
namespace {

// vdpbf16ps tile: x is bf16, rows padded with zeros to a multiple of 32 (ldx), so only w's
// tail needs a masked load (it may end the mapping, and its bytes past k are not ours).
// With kPrefetch each row's line is fetched ahead (one per 64-byte load, so every line
// once): short rows fetch the same column of the next tile, long ones 2 KB ahead in the row.
template <int MR, int NR, bool kPrefetch>
void Bf16Tile(const DotArgs& a, int64_t i0, int64_t j0) {
  const uint16_t* x = static_cast<const uint16_t*>(a.x) + i0 * a.ldx;
  const uint16_t* w = static_cast<const uint16_t*>(a.w) + j0 * a.k;
  const int64_t k = a.k, ldx = a.ldx;
  const int64_t prefetch = NR * k <= 4096 ? NR * k : 1024;
  __m512 acc[MR][NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= k; c += 32) {
    __m512bh xv[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x + i * ldx + c);
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      if constexpr (kPrefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(w + j * k + c + prefetch), _MM_HINT_T0);
      }
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * k + c);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
    }
  }
  if (c < k) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (k - c)) - 1);
    __m512bh xv[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x + i * ldx + c);
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * k + c);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
    }
  }
  StoreTile<MR, NR>(acc, a, i0, j0);
}

// The GEMV's shape differs by microarchitecture (measured, 2 threads, weights from DRAM):
// - Sapphire Rapids: 4 rows of w per tile with software prefetch; its hardware prefetcher
//   alone left GEMVs at 12-14 GB/s (prefetch: lm_head 1.31x, gate/up 1.16x, k/v 1.24x).
// - Zen 5: 8 rows per tile (more lines in flight) and no software prefetch, which only
//   competes with a strong hardware prefetcher: 1.03-1.13x over the Intel shape on every
//   projection (alternating calls, weights from DRAM).
// Eight rows leave registers for three rows of x (24 accumulators).
template <int NR, bool kPrefetch, int kMaxMr>
constexpr DotKernelTable Bf16Table() {
  DotKernelTable t;
  t.max_mr = kMaxMr;
  t.nr = NR;
  t.full[0] = Bf16Tile<1, NR, kPrefetch>;
  t.full[1] = Bf16Tile<2, NR, kPrefetch>;
  t.full[2] = Bf16Tile<3, NR, kPrefetch>;
  t.single[0] = Bf16Tile<1, 1, kPrefetch>;
  t.single[1] = Bf16Tile<2, 1, kPrefetch>;
  t.single[2] = Bf16Tile<3, 1, kPrefetch>;
  if constexpr (kMaxMr == 4) {
    t.full[3] = Bf16Tile<4, NR, kPrefetch>;
    t.single[3] = Bf16Tile<4, 1, kPrefetch>;
  }
  return t;
}

const DotKernelTable& GemvTable() {
  static const DotKernelTable table = GetCpuFeatures().vendor == CpuFeatures::Vendor::kIntel
                                          ? Bf16Table<4, true, 4>()
                                          : Bf16Table<8, false, 3>();
  return table;
}

}  // namespace

void ConvertRowsToBf16(const float* x, int64_t m, int64_t k, int64_t ldx, uint16_t* xb) {
#pragma omp parallel for schedule(static) if (m * k >= (1 << 16))
  for (int64_t i = 0; i < m; ++i) {
    const float* src = x + i * k;
    uint16_t* dst = xb + i * ldx;
    for (int64_t c = 0; c < ldx; c += 32) {
      const int64_t left = k - c;
      const __mmask16 lo = left >= 16 ? 0xffff : left > 0 ? (1u << left) - 1 : 0;
      const __mmask16 hi = left >= 32 ? 0xffff : left > 16 ? (1u << (left - 16)) - 1 : 0;
      const __m512 vlo = _mm512_maskz_loadu_ps(lo, src + c);
      const __m512 vhi = _mm512_maskz_loadu_ps(hi, src + c + 16);
      _mm512_storeu_si512(dst + c, (__m512i)_mm512_cvtne2ps_pbh(vhi, vlo));
    }
  }
}

void RunBf16DotShared(const float* x, int64_t m, int64_t k, const Bf16Output* outs,
                      int64_t count, const DotKernelTable& table) {
  const int64_t ldx = RoundUp(k, 32);
  auto* xb = static_cast<uint16_t*>(ThreadScratch(0, m * ldx * sizeof(uint16_t)));
  ConvertRowsToBf16(x, m, k, ldx, xb);
  // One parallel region per group of outputs (q, k, v and gate, up are one group each).
  constexpr int64_t kGroup = 4;
  for (int64_t first = 0; first < count; first += kGroup) {
    const int64_t n = std::min(kGroup, count - first);
    DotArgs args[kGroup];
    for (int64_t o = 0; o < n; ++o) {
      const Bf16Output& out = outs[first + o];
      args[o] = {xb, ldx, out.w, DType::kBF16, out.n, k, out.bias, out.y};
    }
    RunDotKernelShared(args, n, m, table);
  }
}

void LinearBf16Avx512Bf16(const float* x, int64_t m, const uint16_t* w, int64_t n, int64_t k,
                          const float* bias, float* y) {
  const Bf16Output out{w, n, bias, y};
  RunBf16DotShared(x, m, k, &out, 1, GemvTable());
}

void LinearBf16Avx512Bf16Shared(const float* x, int64_t m, int64_t k, const Bf16Output* outs,
                                int64_t count) {
  RunBf16DotShared(x, m, k, outs, count, GemvTable());
}

}  // namespace preft::kernels::cpu

#pragma GCC pop_options
