// LowRankAdd alone (the multi-LoRA decode cost): 64 decode rows on 64 distinct rank-16 bf16
// adapters over qwen2.5-0.5b's seven projection shapes, against the bytes those adapters hold
// and the triad bandwidth of the same run. Each adapter is one mapping in 2 MiB pages, as the
// engine's compute slots are (AdapterWeights::ConvertTo); the same step runs on a copy in the
// row-major layout and one in the CPU kernels' chunked layout (LowRankChunkable; a CPU
// worker's store loads adapters so), alternately, so the layouts are compared within one run.
// Then the chunked step again as the engine runs it: each call after the base linears of its
// layer (bf16 weights of the model's shapes), so the adapters are read right after the GEMMs
// streamed theirs; the calls' own time, and the step's time less the linears' alone.
//   low_rank_bench [adapters 64] [rows per adapter 1]

#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "bench/bench_util.h"
#include "common/kernels/cpu/linear.h"
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
  // groups[layout][layer][proj]: one group per adapter; shrink then expand, bf16.
  std::vector<std::vector<std::vector<std::vector<LowRankGroup>>>> groups(
      2, std::vector<std::vector<std::vector<LowRankGroup>>>(
             layers, std::vector<std::vector<LowRankGroup>>(7)));
  std::vector<std::vector<int32_t>> rows(adapters);
  for (int a = 0; a < adapters; ++a)
    for (int r = 0; r < rows_per_adapter; ++r) rows[a].push_back(a * rows_per_adapter + r);
  size_t per_adapter = 0;  // bytes of one adapter, all layers
  for (const Proj& p : projs) per_adapter += 2 * rank * (p.in + p.out) * layers;
  const size_t bytes = per_adapter * adapters;
  std::vector<preft::bench::ByteSpan> spans;  // the chunked copy's, for the plain read below
  const bool chunkable =
      preft::kernels::cpu::LowRankChunkable(MatrixView{nullptr, DType::kBF16, rank, 896});
  for (int chunked = 0; chunked < 2; ++chunked) {
    for (int a = 0; a < adapters; ++a) {
      void* region =
          mmap(nullptr, per_adapter, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (region == MAP_FAILED) return 1;
      if (chunked) spans.push_back({region, per_adapter});
      madvise(region, per_adapter, MADV_HUGEPAGE);
      auto* w = static_cast<uint16_t*>(region);
      std::fill(w, w + per_adapter / 2, preft::kernels::F32ToBf16(0.01f));
      for (int64_t l = 0; l < layers; ++l) {
        for (int p = 0; p < 7; ++p) {
          MatrixView s{w, DType::kBF16, rank, projs[p].in};
          MatrixView e{w + rank * projs[p].in, DType::kBF16, rank, projs[p].out};
          s.chunked = e.chunked = e.paired = chunked && chunkable;  // equal values: no reordering
          groups[chunked][l][p].push_back({rows[a].data(), rows_per_adapter, s, e, nullptr, 2.0f});
          w += rank * (projs[p].in + projs[p].out);
        }
      }
    }
  }
  const int64_t m = int64_t{adapters} * rows_per_adapter;
  std::vector<float> x(m * 4864, 0.5f);
  // As Model::ApplyLora calls it: four calls per layer (q/k/v, o, gate/up, down, grouped by
  // their shared input), groups adapter by adapter, each with its own output rows.
  const std::vector<std::vector<int>> calls = {{0, 1, 2}, {3}, {4, 5}, {6}};
  std::vector<std::vector<float>> ys(7);
  for (int p = 0; p < 7; ++p) ys[p].assign(m * projs[p].out, 0.f);
  std::vector<LowRankGroup> call_groups;
  // call_groups = layer l's groups for `call`, writing into y[p] per projection.
  auto set_call_groups = [&](int chunked, int64_t l, const std::vector<int>& call,
                             std::vector<std::vector<float>>& y) {
    call_groups.clear();
    for (int a = 0; a < adapters; ++a) {
      for (int p : call) {
        LowRankGroup g = groups[chunked][l][p][a];
        g.y = y[p].data();
        g.y_stride = projs[p].out;
        call_groups.push_back(g);
      }
    }
  };
  auto step = [&](int chunked) {
    for (int64_t l = 0; l < layers; ++l) {
      for (const std::vector<int>& call : calls) {
        set_call_groups(chunked, l, call, ys);
        preft::kernels::cpu::LowRankAdd(x.data(), projs[call[0]].in, nullptr, 0, call_groups.data(),
                                        static_cast<int64_t>(call_groups.size()));
      }
    }
  };
  step(0);
  step(1);
  // The same bytes read plainly, each thread a contiguous half of the adapters.
  uint64_t fold = 0;
  auto plain_read = [&] { fold ^= preft::bench::PlainRead(spans); };
  double best[3] = {1e9, 1e9, 1e9};
  for (int rep = 0; rep < 5; ++rep) {
    for (int v = 0; v < 3; ++v) {
      const auto t0 = preft::bench::Clock::now();
      if (v < 2) {
        step(v);
      } else {
        plain_read();
      }
      best[v] = std::min(best[v], preft::bench::Seconds(t0, preft::bench::Clock::now()));
    }
  }
  const double triad = preft::bench::TriadGBps();
  for (int chunked = 0; chunked < 2; ++chunked) {
    std::printf(
        "%d threads, %d adapters x %d rows, %s: %.1f MB of adapters per step in %.2f ms "
        "= %.1f GB/s; triad %.1f GB/s; time / byte bound = %.2f\n",
        omp_get_max_threads(), adapters, rows_per_adapter,
        !chunked    ? "row-major"
        : chunkable ? "chunked"
                    : "chunked (not on this CPU: row-major)",
        bytes / 1e6, best[chunked] * 1e3, bytes / best[chunked] / 1e9, triad,
        best[chunked] / (bytes / (triad * 1e9)));
  }
  // The step with the base linears: q/k/v, o, gate/up, down per layer, each followed by its
  // adapters' call (as Model::Forward; the attention, norms and MLP activation left out).
  const size_t base_elems = [&] {
    size_t n = 0;
    for (const Proj& p : projs) n += static_cast<size_t>(p.in) * p.out;
    return n * layers;
  }();
  auto* base = static_cast<uint16_t*>(
      mmap(nullptr, base_elems * 2, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) return 1;
  madvise(base, base_elems * 2, MADV_HUGEPAGE);
  std::fill(base, base + base_elems, preft::kernels::F32ToBf16(0.02f));
  std::vector<std::vector<MatrixView>> weights(layers);
  for (int64_t l = 0, at = 0; l < layers; ++l) {
    for (const Proj& p : projs) {
      weights[l].push_back(MatrixView{base + at, DType::kBF16, p.out, p.in});
      at += p.in * p.out;
    }
  }
  std::vector<std::vector<float>> outs(7);
  for (int p = 0; p < 7; ++p) outs[p].assign(m * projs[p].out, 0.f);
  double in_calls = 0;  // seconds inside LowRankAdd this step
  auto base_step = [&](bool with_adapters) {
    for (int64_t l = 0; l < layers; ++l) {
      for (size_t c = 0; c < calls.size(); ++c) {
        const std::vector<int>& call = calls[c];
        if (call.size() == 1) {
          preft::kernels::cpu::Linear(x.data(), m, weights[l][call[0]], nullptr,
                                      outs[call[0]].data());
        } else if (call.size() == 2) {
          preft::kernels::cpu::LinearShared(
              x.data(), m,
              {{weights[l][4], nullptr, outs[4].data()}, {weights[l][5], nullptr, outs[5].data()}});
        } else {
          preft::kernels::cpu::LinearShared(x.data(), m,
                                            {{weights[l][0], nullptr, outs[0].data()},
                                             {weights[l][1], nullptr, outs[1].data()},
                                             {weights[l][2], nullptr, outs[2].data()}});
        }
        if (!with_adapters) continue;
        set_call_groups(1, l, call, outs);
        const auto t0 = preft::bench::Clock::now();
        preft::kernels::cpu::LowRankAdd(x.data(), projs[call[0]].in, nullptr, 0, call_groups.data(),
                                        static_cast<int64_t>(call_groups.size()));
        in_calls += preft::bench::Seconds(t0, preft::bench::Clock::now());
      }
    }
  };
  base_step(true);
  std::vector<double> alone, with, calls_time;
  for (int rep = 0; rep < 7; ++rep) {
    for (bool with_adapters : {false, true}) {
      in_calls = 0;
      const auto t0 = preft::bench::Clock::now();
      base_step(with_adapters);
      const double seconds = preft::bench::Seconds(t0, preft::bench::Clock::now());
      (with_adapters ? with : alone).push_back(seconds);
      if (with_adapters) calls_time.push_back(in_calls);
    }
  }
  const double bound = bytes / (triad * 1e9);
  const double step_alone = preft::bench::Median(alone), step_with = preft::bench::Median(with);
  const double call_med = preft::bench::Median(calls_time);
  std::printf(
      "chunked in a step of %d rows (medians of 7): linears alone %.1f ms, with the "
      "adapters %.1f ms; the calls %.2f ms = %.2f x the bound; step overhead %.2f ms = "
      "%.2f x the bound\n",
      static_cast<int>(m), step_alone * 1e3, step_with * 1e3, call_med * 1e3, call_med / bound,
      (step_with - step_alone) * 1e3, (step_with - step_alone) / bound);
  std::printf("plain read of the same bytes: %.2f ms = %.1f GB/s (fold %llx)\n", best[2] * 1e3,
              bytes / best[2] / 1e9, static_cast<unsigned long long>(fold & 0xff));
  std::printf("chunked / row-major time: %.2f; each / the plain read: %.2f, %.2f\n",
              best[1] / best[0], best[0] / best[2], best[1] / best[2]);
  return 0;
}
