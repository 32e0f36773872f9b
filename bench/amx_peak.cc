#include "bench/amx_peak.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "common/kernels/cpu/cpu_features.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

#include "common/kernels/cpu/amx_tiles.h"

namespace preft::bench {
namespace {

// Seconds for `iters` rounds of 4 tile dots (16 x 16 x 32 each) on this thread.
double RunDots(int64_t iters) {
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
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  _tile_release();
  return s;
}

}  // namespace

double AmxPeakTflops() {
  // The feature probe also asks the kernel for permission to use the tile registers.
  if (!kernels::cpu::GetCpuFeatures().amx_bf16) return 0;
  constexpr int64_t kIters = 1 << 21;  // ~0.1-0.3 s per thread
  constexpr double kFlopPerIter = 4.0 * 16 * 16 * 32 * 2;
  double best = 0;
  for (int round = 0; round < 3; ++round) {
    double slowest = 0;
#pragma omp parallel reduction(max : slowest)
    slowest = RunDots(kIters);
    best = std::max(best, kIters * kFlopPerIter * omp_get_max_threads() / slowest / 1e12);
  }
  return best;
}

}  // namespace preft::bench

#pragma GCC pop_options
