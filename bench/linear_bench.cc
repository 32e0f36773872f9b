// Microbenchmark of cpu::Linear on Qwen2.5-0.5B layer shapes, against references measured in
// the same run: a STREAM-style triad for the bandwidth-bound m = 1 case and OpenBLAS sgemm on
// f32 copies of the weight for batched m. With AVX-512-BF16 the batched table also times the
// dot kernel alone ("dot") and the w-broadcast GEMM alone ("bcast"), against which Linear's
// choice of kernel per m is judged.
// Weights rotate through enough copies to leave the caches, as in a real forward pass.
// PREFT_CPU_ISA=avx2|avx512|avx512bf16|amx caps the level.
//
//   linear_bench [triad_mib [gemv]]   (default 1024 MiB per triad array; "gemv": m = 1 only)

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "common/kernels/cpu/linear.h"
#include "common/kernels/cpu/linear_kernels.h"
#include "common/kernels/dtype.h"
#include "common/kernels/matrix.h"

namespace {

using preft::kernels::DType;
using preft::kernels::MatrixView;
namespace cpu = preft::kernels::cpu;

constexpr size_t kPoolBytes = size_t{384} << 20;  // weight copies per shape, past any L3

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Best time of a few repetitions of fn (each at least min_s long, at least min_calls calls).
template <class Fn>
double SecondsPerCall(Fn&& fn, int min_calls, double min_s = 0.2, int reps = 3) {
  fn(0);  // warm-up: page faults, thread pool, scratch
  double best = 1e30;
  int call = 1;
  for (int r = 0; r < reps; ++r) {
    const double t0 = Now();
    int calls = 0;
    do {
      fn(call++);
      ++calls;
    } while (calls < min_calls || Now() - t0 < min_s);
    best = std::min(best, (Now() - t0) / calls);
  }
  return best;
}

double TriadGBps(size_t mib) {
  const size_t count = (mib << 20) / sizeof(float);
  float* a = static_cast<float*>(std::aligned_alloc(64, count * sizeof(float)));
  float* b = static_cast<float*>(std::aligned_alloc(64, count * sizeof(float)));
  float* c = static_cast<float*>(std::aligned_alloc(64, count * sizeof(float)));
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < count; ++i) {
    a[i] = 0.f;
    b[i] = 1.f;
    c[i] = 2.f;
  }
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    const double t0 = Now();
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < count; ++i) a[i] = b[i] + 3.f * c[i];
    best = std::min(best, Now() - t0);
  }
  std::free(a);
  std::free(b);
  std::free(c);
  return 3.0 * count * sizeof(float) / best / 1e9;
}

struct Shape {
  const char* name;
  int64_t n, k;
};

// Copies of one random weight, in bf16 (and f32 on request), enough to exceed kPoolBytes.
struct WeightPool {
  int copies = 0;
  std::vector<uint16_t> bf16;
  std::vector<float> f32;
};

WeightPool MakePool(int64_t n, int64_t k, bool with_f32) {
  WeightPool p;
  const size_t elems = static_cast<size_t>(n) * k;
  p.copies = static_cast<int>(std::max<size_t>(1, kPoolBytes / (elems * 2) + 1));
  p.bf16.resize(elems * p.copies);
  uint32_t s = 12345;
  for (size_t i = 0; i < elems; ++i) {
    s = s * 1664525u + 1013904223u;
    p.bf16[i] = preft::kernels::F32ToBf16((static_cast<int32_t>(s >> 8) - (1 << 23)) * 1e-8f);
  }
  for (int c = 1; c < p.copies; ++c) std::copy_n(p.bf16.data(), elems, p.bf16.data() + c * elems);
  if (with_f32) {
    const int f32_copies = std::max(1, p.copies / 2);
    p.f32.resize(elems * f32_copies);
    for (size_t i = 0; i < p.f32.size(); ++i) p.f32[i] = preft::kernels::Bf16ToF32(p.bf16[i % elems]);
  }
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const size_t triad_mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 1024;
  const Shape shapes[] = {{"q/o_proj 896x896", 896, 896},      {"k/v_proj 128x896", 128, 896},
                          {"gate/up 4864x896", 4864, 896},     {"down 896x4864", 896, 4864},
                          {"lm_head 151936x896", 151936, 896}};
  std::printf("linear_bench: %d threads, kernel level %s\n", omp_get_max_threads(),
              cpu::LinearIsaName(cpu::ActiveLinearIsa()));
  const double triad = TriadGBps(triad_mib);
  std::printf("triad (3 x %zu MiB): %.1f GB/s\n\n", triad_mib, triad);

  std::printf("m = 1, bf16 weights (GEMV)\n%-22s %10s %9s %9s\n", "shape", "us/call", "GB/s",
              "vs triad");
  for (const Shape& s : shapes) {
    WeightPool pool = MakePool(s.n, s.k, false);
    const size_t elems = static_cast<size_t>(s.n) * s.k;
    std::vector<float> x(s.k, 0.01f), y(s.n);
    const double sec = SecondsPerCall(
        [&](int call) {
          const MatrixView w{pool.bf16.data() + (call % pool.copies) * elems, DType::kBF16, s.n,
                             s.k};
          cpu::Linear(x.data(), 1, w, nullptr, y.data());
        },
        pool.copies);
    const double gbps = elems * 2 / sec / 1e9;
    std::printf("%-22s %10.1f %9.1f %8.0f%%\n", s.name, sec * 1e6, gbps, 100 * gbps / triad);
  }

  if (argc > 2 && std::string_view(argv[2]) == "gemv") return 0;
  // With AVX-512-BF16, the dot kernel alone too: Linear takes the packed GEMM from some m.
  const bool with_dot = cpu::ActiveLinearIsa() >= cpu::LinearIsa::kAvx512Bf16;
  std::printf("\nbatched, bf16 weights vs OpenBLAS sgemm on f32 copies (GFLOP/s)\n");
  std::printf("%-22s %5s %10s %10s %10s %10s %9s\n", "shape", "m", "linear", "dot", "bcast",
              "sgemm", "ratio");
  for (const Shape& s : shapes) {
    WeightPool pool = MakePool(s.n, s.k, true);
    const size_t elems = static_cast<size_t>(s.n) * s.k;
    const int f32_copies = static_cast<int>(pool.f32.size() / elems);
    for (int64_t m : {16, 64, 512}) {
      std::vector<float> x(m * s.k, 0.01f), y(m * s.n);
      const double flops = 2.0 * m * s.n * s.k;
      const double sec = SecondsPerCall(
          [&](int call) {
            const MatrixView w{pool.bf16.data() + (call % pool.copies) * elems, DType::kBF16,
                               s.n, s.k};
            cpu::Linear(x.data(), m, w, nullptr, y.data());
          },
          1, 0.2, 2);
      double sec_dot = 0;
      if (with_dot) {
        sec_dot = SecondsPerCall(
            [&](int call) {
              const uint16_t* w = pool.bf16.data() + (call % pool.copies) * elems;
              cpu::LinearBf16Avx512Bf16(x.data(), m, w, s.n, s.k, nullptr, y.data());
            },
            1, 0.2, 2);
      }
      double sec_bc = 0;
      if (with_dot) {
        sec_bc = SecondsPerCall(
            [&](int call) {
              const uint16_t* w = pool.bf16.data() + (call % pool.copies) * elems;
              cpu::LinearBf16Avx512Broadcast(x.data(), m, w, s.n, s.k, nullptr, y.data());
            },
            1, 0.2, 2);
      }
      const double sec_blas = SecondsPerCall(
          [&](int call) {
            const float* w = pool.f32.data() + (call % f32_copies) * elems;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, s.n, s.k, 1.f, x.data(),
                        s.k, w, s.k, 0.f, y.data(), s.n);
          },
          1, 0.2, 2);
      std::printf("%-22s %5ld %10.1f %10.1f %10.1f %10.1f %8.2fx\n", s.name,
                  static_cast<long>(m), flops / sec / 1e9, with_dot ? flops / sec_dot / 1e9 : 0.0,
                  with_dot ? flops / sec_bc / 1e9 : 0.0, flops / sec_blas / 1e9, sec_blas / sec);
    }
  }
  return 0;
}
