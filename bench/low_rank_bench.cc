// LowRankAdd alone (the multi-LoRA decode cost): 64 decode rows on 64 distinct rank-16 bf16
// adapters over qwen2.5-0.5b's seven projection shapes, against the bytes those adapters hold
// and the triad bandwidth of the same run.

#include <omp.h>

#include <cstdio>
#include <random>
#include <vector>

#include "bench/bench_util.h"
#include "common/kernels/cpu/low_rank.h"
#include "common/kernels/cpu/threads.h"
#include "common/kernels/dtype.h"

namespace {

using preft::kernels::DType;
using preft::kernels::MatrixView;
using preft::kernels::cpu::LowRankGroup;

struct Proj {
  int64_t in, out;
};

}  // namespace

int main(int argc, char** argv) {
  preft::kernels::cpu::InitThreads();  // as the engine: BLAS single-threaded inside OpenMP
  const int adapters = argc > 1 ? std::atoi(argv[1]) : 64;
  const int rows_per_adapter = argc > 2 ? std::atoi(argv[2]) : 1;
  const int64_t rank = 16, layers = 24;
  const Proj projs[] = {{896, 896},  {896, 128},  {896, 128}, {896, 896},
                        {896, 4864}, {896, 4864}, {4864, 896}};
  std::mt19937 rng(1);
  // weights[layer][proj][adapter]: shrink then expand, bf16.
  std::vector<std::vector<uint16_t>> store;
  std::vector<std::vector<std::vector<LowRankGroup>>> groups(
      layers, std::vector<std::vector<LowRankGroup>>(7));
  std::vector<std::vector<int32_t>> rows(adapters);
  for (int a = 0; a < adapters; ++a)
    for (int r = 0; r < rows_per_adapter; ++r) rows[a].push_back(a * rows_per_adapter + r);
  size_t bytes = 0;
  for (int64_t l = 0; l < layers; ++l)
    for (int p = 0; p < 7; ++p)
      for (int a = 0; a < adapters; ++a) {
        store.emplace_back(rank * projs[p].in, preft::kernels::F32ToBf16(0.01f));
        const void* s = store.back().data();
        store.emplace_back(rank * projs[p].out, preft::kernels::F32ToBf16(0.01f));
        const void* e = store.back().data();
        bytes += 2 * rank * (projs[p].in + projs[p].out);
        groups[l][p].push_back({rows[a].data(), rows_per_adapter,
                                MatrixView{s, DType::kBF16, rank, projs[p].in},
                                MatrixView{e, DType::kBF16, rank, projs[p].out}, nullptr, 2.0f});
      }
  const int64_t m = int64_t{adapters} * rows_per_adapter;
  std::vector<float> x(m * 4864, 0.5f), y(m * 4864, 0.f);
  auto step = [&] {
    for (int64_t l = 0; l < layers; ++l)
      for (int p = 0; p < 7; ++p)
        preft::kernels::cpu::LowRankAdd(x.data(), projs[p].in, y.data(), projs[p].out,
                                        groups[l][p].data(), adapters);
  };
  step();
  double best = 1e9;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = preft::bench::Clock::now();
    step();
    best = std::min(best, preft::bench::Seconds(t0, preft::bench::Clock::now()));
  }
  const double triad = preft::bench::TriadGBps();
  std::printf(
      "%d threads, %d adapters x %d rows: %.1f MB of adapters per step in %.2f ms = %.1f GB/s; "
      "triad %.1f GB/s; time / byte bound = %.2f\n",
      omp_get_max_threads(), adapters, rows_per_adapter, bytes / 1e6, best * 1e3,
      bytes / best / 1e9, triad, best / (bytes / (triad * 1e9)));
  return 0;
}
