#include "bench/bf16_peak.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "common/kernels/cpu/cpu_features.h"

// GCC 12 builds "undefined" vectors by self-initialisation inside the reductions.
#pragma GCC diagnostic ignored "-Wuninitialized"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,amx-tile,amx-bf16")

#include "common/kernels/cpu/amx_tiles.h"

namespace preft::bench {
namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Seconds for `iters` rounds of 4 tile dots (16 x 16 x 32 each) on this thread.
double RunTileDots(int64_t iters) {
  kernels::cpu::ConfigureFullTiles();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  const double s = Seconds(t0);
  _tile_release();
  return s;
}

// Seconds for `iters` rounds of kChains independent vdpbf16ps: enough chains to cover the
// instruction's latency on every pipe, named one by one so that they stay in registers.
constexpr int kChains = 12;
double RunVectorDots(int64_t iters) {
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // (1, 1)
  const __m512bh b = (__m512bh)_mm512_set1_epi32(0x0d800d80);  // (2^-100, 2^-100): normal
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0,
         c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    c0 = _mm512_dpbf16_ps(c0, a, b);
    c1 = _mm512_dpbf16_ps(c1, a, b);
    c2 = _mm512_dpbf16_ps(c2, a, b);
    c3 = _mm512_dpbf16_ps(c3, a, b);
    c4 = _mm512_dpbf16_ps(c4, a, b);
    c5 = _mm512_dpbf16_ps(c5, a, b);
    c6 = _mm512_dpbf16_ps(c6, a, b);
    c7 = _mm512_dpbf16_ps(c7, a, b);
    c8 = _mm512_dpbf16_ps(c8, a, b);
    c9 = _mm512_dpbf16_ps(c9, a, b);
    c10 = _mm512_dpbf16_ps(c10, a, b);
    c11 = _mm512_dpbf16_ps(c11, a, b);
  }
  const double s = Seconds(t0);
  const __m512 sum = _mm512_add_ps(
      _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                    _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7))),
      _mm512_add_ps(_mm512_add_ps(c8, c9), _mm512_add_ps(c10, c11)));
  volatile float sink = _mm512_reduce_add_ps(sum);
  (void)sink;
  return s;
}

template <class Run>
double BestTflops(Run run, int64_t iters, double flop_per_iter) {
  double best = 0;
  for (int round = 0; round < 3; ++round) {
    double slowest = 0;
#pragma omp parallel reduction(max : slowest)
    slowest = run(iters);
    best = std::max(best, iters * flop_per_iter * omp_get_max_threads() / slowest / 1e12);
  }
  return best;
}

}  // namespace

Bf16Peak MeasureBf16Peak() {
  // The feature probe also asks the kernel for permission to use the tile registers.
  const kernels::cpu::CpuFeatures& f = kernels::cpu::GetCpuFeatures();
  if (f.amx_bf16) {
    return {"AMX tiles", BestTflops(RunTileDots, 1 << 21, 4.0 * 16 * 16 * 32 * 2)};
  }
  if (f.avx512_bf16) {
    return {"vdpbf16ps", BestTflops(RunVectorDots, 1 << 23, kChains * 16 * 2 * 2.0)};
  }
  return {};
}

}  // namespace preft::bench

#pragma GCC pop_options
