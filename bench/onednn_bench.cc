// The AMX GEMM against oneDNN's (issue 2: "hand-written kernels, or oneDNN where it wins").
// Both multiply the same bf16 weights by the same activations, alternating call by call so
// the host's drift cancels; oneDNN gets its weights prepacked once (its best case) and only
// converts x per call, as cpu::Linear does internally. Weights rotate through copies past L3.
// Built only when CMake finds oneDNN (Debian: apt-get install libdnnl-dev); oneDNN 2.x needs
// ONEDNN_MAX_CPU_ISA=AVX512_CORE_AMX to use the tiles.
//
//   onednn_bench [m n k ...]   (default: Qwen2.5-0.5B layer shapes at m = 64 and 512)

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <dnnl.hpp>
#include <vector>

#include "bench/bench_util.h"
#include "common/base/aligned_vector.h"
#include "common/kernels/cpu/cpu_features.h"
#include "common/kernels/cpu/linear.h"
#include "common/kernels/cpu/linear_kernels.h"
#include "common/kernels/cpu/threads.h"

namespace {

namespace cpu = preft::kernels::cpu;
using preft::bench::Clock;
using preft::bench::Seconds;

void Compare(int64_t m, int64_t n, int64_t k) {
  using dnnl::memory;
  const int copies = static_cast<int>(std::max<int64_t>(2, (int64_t{160} << 20) / (n * k * 2)));
  std::vector<uint16_t> w(static_cast<size_t>(copies) * n * k);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint16_t>(0x3f80 + (i * 7919 % 64) - 32);
  preft::base::AlignedVector<float> x(m * k), y(m * n), y_dnnl(m * n);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 13) * 0.01f - 0.06f;

  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream s(eng);
  const memory::desc x_f32({m, k}, memory::data_type::f32, memory::format_tag::ab);
  const memory::desc x_bf16({m, k}, memory::data_type::bf16, memory::format_tag::ab);
  const memory::desc w_any({k, n}, memory::data_type::bf16, memory::format_tag::any);
  const memory::desc w_rows({k, n}, memory::data_type::bf16, memory::format_tag::ba);  // W [n, k]
  const memory::desc y_f32({m, n}, memory::data_type::f32, memory::format_tag::ab);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(x_bf16, w_any, y_f32), eng);
  const dnnl::matmul mm(pd);
  std::vector<memory> packed;
  for (int c = 0; c < copies; ++c) {
    memory raw(w_rows, eng, w.data() + static_cast<size_t>(c) * n * k);
    packed.emplace_back(pd.weights_desc(), eng);
    dnnl::reorder(raw, packed.back()).execute(s, raw, packed.back());
  }
  memory xs(x_f32, eng, x.data()), xb(x_bf16, eng), ym(y_f32, eng, y_dnnl.data());
  const dnnl::reorder convert(xs, xb);

  double total[2] = {0, 0};
  int64_t calls = 0, copy = 0;
  const auto start = Clock::now();
  while (Seconds(start, Clock::now()) < 3.0) {
    for (int turn = 0; turn < 2; ++turn) {
      const int which = (calls % 2) ? 1 - turn : turn;
      const int c = static_cast<int>(copy++ % copies);
      const auto t0 = Clock::now();
      if (which == 0) {
        cpu::Linear(x.data(), m,
                    {w.data() + static_cast<size_t>(c) * n * k, preft::kernels::DType::kBF16, n, k},
                    nullptr, y.data());
      } else {
        convert.execute(s, xs, xb);
        mm.execute(s, {{DNNL_ARG_SRC, xb}, {DNNL_ARG_WEIGHTS, packed[c]}, {DNNL_ARG_DST, ym}});
        s.wait();
      }
      total[which] += Seconds(t0, Clock::now());
    }
    ++calls;
  }
  double max_diff = 0;
  for (size_t i = 0; i < y.size(); ++i)
    max_diff = std::max<double>(max_diff, std::abs(y[i] - y_dnnl[i]));
  const double flop = 2.0 * m * n * k * calls;
  std::printf("| %ld x %ld x %ld | %.0f | %.0f | %.2f | %s | %.1e |\n", static_cast<long>(m),
              static_cast<long>(n), static_cast<long>(k), flop / total[0] / 1e9,
              flop / total[1] / 1e9, total[0] / total[1], pd.impl_info_str(), max_diff);
}

}  // namespace

int main(int argc, char** argv) {
  cpu::InitThreads();
  (void)cpu::GetCpuFeatures();
  std::printf("threads: %d, preft kernel level %s\n", omp_get_max_threads(),
              cpu::LinearIsaName(cpu::ActiveLinearIsa()));
  std::printf(
      "| m x n x k | preft GFLOP/s | oneDNN GFLOP/s | oneDNN / preft | oneDNN kernel | max |diff| "
      "|\n|---|---|---|---|---|---|\n");
  if (argc > 3) {
    for (int i = 1; i + 2 < argc; i += 3)
      Compare(std::atol(argv[i]), std::atol(argv[i + 1]), std::atol(argv[i + 2]));
    return 0;
  }
  for (int64_t m : {64, 512}) {
    Compare(m, 896, 896);   // q/o_proj
    Compare(m, 4864, 896);  // gate/up
    Compare(m, 896, 4864);  // down
  }
  return 0;
}
