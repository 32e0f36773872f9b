// The CUDA kernels against the device's own ceilings, measured in the same run: device-to-
// device copy bandwidth, and the bf16 GEMM rate of cuBLAS on a large square product. Then
// Linear at decode shapes of llama3.1-8b (batch 1: weight bytes / step time against the copy
// bandwidth, the issue's >= 70% target) and of qwen2.5-0.5b, and the low-rank kernel on 64
// decode rows over 64 adapters against its byte bound.
//
//   cuda_bench            (prints one markdown table; exit 2 without a CUDA device)

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "common/kernels/cuda/linear.cuh"
#include "common/kernels/cuda/low_rank.cuh"
#include "common/kernels/cuda/runtime.cuh"

namespace {

namespace cuda = preft::kernels::cuda;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Check(int e, const char* what) {
  if (e != 0) {
    std::fprintf(stderr, "cuda_bench: %s: %s\n", what, cuda::ErrorString(e));
    std::exit(1);
  }
}

// Mean seconds per call of fn over `calls` after 3 warm-ups, synchronised at both ends.
template <class Fn>
double Time(Fn&& fn, int calls) {
  for (int i = 0; i < 3; ++i) fn(i);
  Check(cuda::StreamSynchronize(nullptr), "sync");
  const double t0 = Now();
  for (int i = 0; i < calls; ++i) fn(i);
  Check(cuda::StreamSynchronize(nullptr), "sync");
  return (Now() - t0) / calls;
}

void* Alloc(size_t bytes) {
  void* p = nullptr;
  Check(cuda::Malloc(&p, bytes), "cudaMalloc");
  Check(cuda::Memset(p, 0, bytes, nullptr), "cudaMemset");
  return p;
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (cuda::DeviceCount() == 0) {
    std::fprintf(stderr, "cuda_bench: no CUDA device\n");
    return 2;
  }
  size_t free_b = 0, total_b = 0;
  Check(cuda::MemoryInfo(&free_b, &total_b), "cudaMemGetInfo");
  std::printf("device memory: %.1f GiB free of %.1f\n\n", free_b / 1073741824.0,
              total_b / 1073741824.0);

  // Copy bandwidth: 2 GiB device to device, bytes read + written (the DRAM rate a stream of
  // weight reads can approach).
  const size_t copy_bytes = size_t{2} << 30;
  void* a = Alloc(copy_bytes);
  void* b = Alloc(copy_bytes);
  const double copy_s = Time([&](int) { cuda::CopyOnDevice(b, a, copy_bytes, nullptr); }, 10);
  const double bw = 2.0 * copy_bytes / copy_s / 1e9;
  cuda::Free(a);
  cuda::Free(b);

  cuda::Blas* raw = nullptr;
  Check(cuda::Blas::Create(nullptr, &raw), "cublasCreate");
  std::unique_ptr<cuda::Blas> blas(raw);

  // bf16 GEMM rate: 8192^3.
  const int64_t big = 8192;
  auto* x = static_cast<float*>(Alloc(big * big * 4));
  auto* w = static_cast<uint16_t*>(Alloc(big * big * 2));
  auto* y = static_cast<float*>(Alloc(big * big * 4));
  const double gemm_s =
      Time([&](int) { Check(blas->Linear(x, big, w, big, big, nullptr, y), "Linear"); }, 10);
  const double tflops = 2.0 * big * big * big / gemm_s / 1e12;
  cuda::Free(x);
  cuda::Free(w);
  cuda::Free(y);

  std::printf("| figure | value | reference (same run) | ratio | target |\n|---|---|---|---|---|\n");
  std::printf("| copy bandwidth | %.0f GB/s (read + write) | - | - | - |\n", bw);
  std::printf("| bf16 GEMM 8192^3 (x rounded on device) | %.0f TFLOP/s | - | - | - |\n", tflops);

  // Decode GEMV: a whole llama3.1-8b layer stack's projections at m = 1 (weights rotate
  // through 32 layers' worth of copies, 7 shapes each), bytes / time against the copy rate.
  struct Shape {
    int64_t n, k;
  };
  const Shape llama[] = {{4096, 4096}, {1024, 4096}, {1024, 4096}, {4096, 4096},
                         {14336, 4096}, {14336, 4096}, {4096, 14336}};
  size_t layer_elems = 0;
  for (const Shape& s : llama) layer_elems += s.n * s.k;
  const int layers = 32;
  auto* wl = static_cast<uint16_t*>(Alloc(layer_elems * layers * 2));
  auto* xl = static_cast<float*>(Alloc(256 * 14336 * 4));
  auto* yl = static_cast<float*>(Alloc(256 * 14336 * 4));
  for (const int64_t m : {int64_t{1}, int64_t{64}, int64_t{256}}) {
    const double step_s = Time(
        [&](int) {
          size_t off = 0;
          for (int l = 0; l < layers; ++l) {
            for (const Shape& s : llama) {
              Check(blas->Linear(xl, m, wl + off, s.n, s.k, nullptr, yl), "Linear");
              off += s.n * s.k;
            }
          }
        },
        5);
    const double gbps = layer_elems * layers * 2.0 / step_s / 1e9;
    if (m == 1) {
      std::printf("| llama3.1-8b projections, batch 1 | %.2f ms/step = %.0f GB/s of weights | copy %.0f GB/s | %.2f | >= 0.70 |\n",
                  step_s * 1e3, gbps, bw, gbps / bw);
    } else {
      std::printf("| llama3.1-8b projections, %ld rows | %.2f ms/step = %.0f tok/s (projections only) | - | - | - |\n",
                  static_cast<long>(m), step_s * 1e3, m / step_s);
    }
  }
  cuda::Free(wl);
  cuda::Free(xl);
  cuda::Free(yl);

  // Low-rank: 64 decode rows on 64 rank-16 adapters, llama3.1-8b gate_proj shape per call.
  const int64_t adapters = 64, rank = 16, in = 4096, out = 14336;
  const size_t per = rank * (in + out);
  auto* lw = static_cast<uint16_t*>(Alloc(per * adapters * 2));
  auto* lx = static_cast<float*>(Alloc(adapters * in * 4));
  auto* ly = static_cast<float*>(Alloc(adapters * out * 4));
  // One table of one pair per adapter; items (row g, adapter g).
  std::vector<cuda::LowRankPair> pairs(adapters);
  std::vector<const cuda::LowRankPair*> tables(adapters);
  std::vector<cuda::LowRankItem> items(adapters);
  auto* dp = static_cast<cuda::LowRankPair*>(Alloc(pairs.size() * sizeof(pairs[0])));
  for (int64_t g = 0; g < adapters; ++g) {
    pairs[g] = {lw + g * per, lw + g * per + rank * in, preft::kernels::DType::kBF16, rank, in, out,
                nullptr, 1.f};
    tables[g] = dp + g;
    items[g] = {static_cast<int32_t>(g), static_cast<int32_t>(g)};
  }
  void* dt = Alloc(tables.size() * sizeof(tables[0]));
  void* di = Alloc(items.size() * sizeof(items[0]));
  Check(cuda::CopyToDevice(dp, pairs.data(), pairs.size() * sizeof(pairs[0]), nullptr), "copy");
  Check(cuda::CopyToDevice(dt, tables.data(), tables.size() * sizeof(tables[0]), nullptr), "copy");
  Check(cuda::CopyToDevice(di, items.data(), items.size() * sizeof(items[0]), nullptr), "copy");
  cuda::LowRankTargets targets;
  targets.target[0] = {0, ly, out};
  targets.num_targets = 1;
  const double lr_s = Time(
      [&](int) {
        Check(cuda::LowRankAdd(lx, in, static_cast<const cuda::LowRankPair* const*>(dt),
                               static_cast<cuda::LowRankItem*>(di), adapters, targets, nullptr),
              "LowRankAdd");
      },
      50);
  const double bound_s = per * adapters * 2.0 / (bw * 1e9);
  std::printf("| low-rank, 64 decode rows x 64 adapters (r16, 4096->14336) | %.1f us | byte bound %.1f us | %.2f | <= 1.5 |\n",
              lr_s * 1e6, bound_s * 1e6, lr_s / bound_s);

  // SGMV: 64 prompts of 128 rows, one adapter each (tiles of kTileRows), same shape: against
  // the time the base gate GEMM of those 8192 rows takes at the GEMM rate measured above.
  const int64_t prompt_rows = 128, rows_all = adapters * prompt_rows;
  auto* px = static_cast<float*>(Alloc(rows_all * in * 4));
  auto* py = static_cast<float*>(Alloc(rows_all * out * 4));
  std::vector<cuda::LowRankItem> prompt_items;
  std::vector<cuda::LowRankTile> tiles;
  for (int64_t g = 0; g < adapters; ++g) {
    for (int64_t r = 0; r < prompt_rows; r += cuda::kTileRows) {
      tiles.push_back({static_cast<int32_t>(prompt_items.size()), cuda::kTileRows});
      for (int64_t i = r; i < r + cuda::kTileRows; ++i) {
        prompt_items.push_back({static_cast<int32_t>(g * prompt_rows + i), static_cast<int32_t>(g)});
      }
    }
  }
  void* dpi = Alloc(prompt_items.size() * sizeof(prompt_items[0]));
  void* dti = Alloc(tiles.size() * sizeof(tiles[0]));
  Check(cuda::CopyToDevice(dpi, prompt_items.data(), prompt_items.size() * sizeof(prompt_items[0]), nullptr), "copy");
  Check(cuda::CopyToDevice(dti, tiles.data(), tiles.size() * sizeof(tiles[0]), nullptr), "copy");
  cuda::LowRankTargets prompt_targets;
  prompt_targets.target[0] = {0, py, out};
  prompt_targets.num_targets = 1;
  const double sgmv_s = Time(
      [&](int) {
        Check(cuda::LowRankAddTiles(px, in, static_cast<const cuda::LowRankPair* const*>(dt),
                                    static_cast<cuda::LowRankItem*>(dpi),
                                    static_cast<cuda::LowRankTile*>(dti),
                                    static_cast<int64_t>(tiles.size()), prompt_targets, nullptr),
              "LowRankAddTiles");
      },
      20);
  const double gemm_equiv_s = 2.0 * rows_all * in * out / (tflops * 1e12);
  std::printf("| low-rank tiles, 64 prompts x 128 rows (r16, 4096->14336) | %.1f us = %.1f TFLOP/s | base GEMM of the rows %.1f us | %.3f | - |\n",
              sgmv_s * 1e6, 2.0 * rows_all * rank * (in + out) / sgmv_s / 1e12,
              gemm_equiv_s * 1e6, sgmv_s / gemm_equiv_s);
  return 0;
}
