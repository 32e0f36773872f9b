#include "common/kernels/cpu/linear_driver.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <memory>

namespace preft::kernels::cpu {
namespace {

// Rows of x per pass over w: 64 bf16 rows of k = 4864 are 622 KB, which stays in L2 while
// the 4-row blocks of w are reused against them.
constexpr int64_t kRowChunk = 64;
// Bytes of w per work item: enough to amortise the hand-out, small enough to balance.
constexpr int64_t kSliceBytes = 128 << 10;
constexpr int kScratchSlots = 5;
// Below both, one thread does the call: a fork/join costs microseconds when the cores are
// free and a scheduler time slice (milliseconds) when another process holds one of them.
constexpr int64_t kMinParallelWeightBytes = 256 << 10;
constexpr int64_t kMinParallelFlops = 8 << 20;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

struct Scratch {
  std::unique_ptr<void, FreeDeleter> data;
  size_t bytes = 0;
};

}  // namespace

bool WorthThreads(int64_t m, int64_t n, int64_t k) {
  return n * k * 2 >= kMinParallelWeightBytes || 2 * m * n * k >= kMinParallelFlops;
}

void* ThreadScratch(int slot, size_t bytes) {
  thread_local Scratch scratch[kScratchSlots];
  Scratch& s = scratch[slot];
  if (s.bytes < bytes) {
    const size_t rounded = (bytes + 4095) & ~size_t{4095};
    s.data.reset(std::aligned_alloc(64, rounded));
    s.bytes = rounded;
  }
  return s.data.get();
}

void RunDotKernel(const DotArgs& args, int64_t m, const DotKernelTable& table) {
  RunDotKernelShared(&args, 1, m, table);
}

void RunDotKernelShared(const DotArgs* outs, int64_t count, int64_t m,
                        const DotKernelTable& table) {
  const int64_t nr = table.nr, max_mr = table.max_mr, k = outs[0].k;
  // Work items are (row chunk, slice of one output's n), handed out dynamically: a thread
  // that loses its core to another process then delays the call by one slice, not by half
  // of it. Slices hold ~kSliceBytes of w (whole nr-blocks), and at least two per thread
  // when n allows.
  int64_t total_n = 0;
  for (int64_t o = 0; o < count; ++o) total_n += outs[o].n;
  const int64_t threads = omp_get_max_threads();
  int64_t slice = std::max<int64_t>(1, kSliceBytes / (k * 2));
  slice = std::min(slice, CeilDiv(total_n, 2 * threads));
  slice = RoundUp(std::max<int64_t>(slice, 1), nr);
  const int64_t slices = CountBlocks(outs, count, slice);
  const int64_t chunks = CeilDiv(m, kRowChunk);
  const bool parallel = WorthThreads(m, total_n, k);
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t item = 0; item < chunks * slices; ++item) {
    const int64_t i_begin = item / slices * kRowChunk;
    const int64_t i_end = std::min(m, i_begin + kRowChunk);
    int64_t s = item % slices;
    const int64_t o = OutputOfBlock(outs, slice, &s);
    const int64_t n = outs[o].n;
    const int64_t j_begin = s * slice;
    const int64_t j_end = std::min(n, j_begin + slice);
    const DotArgs& args = outs[o];
    for (int64_t j = j_begin; j < j_end; j += nr) {
      if (j + nr <= n) {
        for (int64_t i = i_begin; i < i_end; i += max_mr) {
          table.full[std::min(max_mr, i_end - i) - 1](args, i, j);
        }
      } else {
        for (int64_t jj = j; jj < n; ++jj) {
          for (int64_t i = i_begin; i < i_end; i += max_mr) {
            table.single[std::min(max_mr, i_end - i) - 1](args, i, jj);
          }
        }
      }
    }
  }
}

}  // namespace preft::kernels::cpu
