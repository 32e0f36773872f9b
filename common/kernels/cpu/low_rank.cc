// The driver of LowRankAdd: work items of up to kRowsPerItem rows of one group, one OpenMP
// region per call, and the kernel (low_rank_kernels.h) for each item by dtype and ISA.

#include "common/kernels/cpu/low_rank.h"

#include <omp.h>

#include <algorithm>
#include <vector>

#include "common/base/check.h"
#include "common/kernels/cpu/isa.h"
#include "common/kernels/cpu/low_rank_kernels.h"

namespace preft::kernels::cpu {
namespace {

using low_rank_internal::Expand;
using low_rank_internal::InLockstep;
using low_rank_internal::kRowsPerItem;
using low_rank_internal::LockstepRows;
using low_rank_internal::RunChunkedDecodeRows;
using low_rank_internal::RunItemDotBf16;
using low_rank_internal::Shrink;

template <DType T>
void RunItem(const float* x, int64_t x_stride, float* y, int64_t y_stride, const LowRankGroup& g,
             int64_t begin, int64_t end, float* z) {
  if constexpr (T == DType::kBF16) {
    // Every row of a bf16 group on these CPUs (chunked matrices only exist there), decode rows
    // included: a row rounds the same way whatever its group's size.
    if (ActiveLinearIsa() >= LinearIsa::kAvx512Bf16) {
      if (g.num_rows == 1 && g.shrink.chunked) {
        const LowRankGroup* one = &g;
        RunChunkedDecodeRows(1, x, x_stride, y, y_stride, &one);
        return;
      }
      RunItemDotBf16(x, x_stride, y, y_stride, g, g.rows + begin, end - begin, z);
      return;
    }
  }
  Shrink<T>(x, x_stride, g.rows + begin, end - begin, g.shrink, g.shrink_bias, z);
  Expand<T>(z, g.rows + begin, end - begin, g.expand, g.scale, g.y != nullptr ? g.y : y,
            g.y != nullptr ? g.y_stride : y_stride);
}

struct Item {
  int32_t group;
  int32_t begin, end;
};

}  // namespace

void LowRankAdd(const float* x, int64_t x_stride, float* y, int64_t y_stride,
                const LowRankGroup* groups, int64_t num_groups) {
  std::vector<Item> items;
  for (int64_t g = 0; g < num_groups; ++g) {
    const LowRankGroup& gr = groups[g];
    PREFT_CHECK(gr.shrink.rows == gr.expand.rows && gr.shrink.rows <= kMaxRank);
    PREFT_CHECK(gr.shrink.dtype == gr.expand.dtype);
    PREFT_CHECK(gr.shrink.chunked == gr.expand.chunked);
    PREFT_CHECK(!gr.shrink.paired && gr.expand.paired == gr.expand.chunked);
    PREFT_CHECK(!gr.shrink.chunked || (LowRankChunkable(gr.shrink) && LowRankChunkable(gr.expand)));
    for (int64_t b = 0; b < gr.num_rows; b += kRowsPerItem) {
      items.push_back({static_cast<int32_t>(g), static_cast<int32_t>(b),
                       static_cast<int32_t>(std::min(gr.num_rows, b + kRowsPerItem))});
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  auto run = [&](int64_t i, float* z) {
    const LowRankGroup& g = groups[items[i].group];
    switch (g.shrink.dtype) {
      case DType::kF32:
        RunItem<DType::kF32>(x, x_stride, y, y_stride, g, items[i].begin, items[i].end, z);
        break;
      case DType::kBF16:
        RunItem<DType::kBF16>(x, x_stride, y, y_stride, g, items[i].begin, items[i].end, z);
        break;
      case DType::kF16:
        RunItem<DType::kF16>(x, x_stride, y, y_stride, g, items[i].begin, items[i].end, z);
        break;
    }
  };
  // Tiny work (one decode row, say) is not worth waking the thread team.
  if (num_items <= 1) {
    alignas(64) float z[kRowsPerItem * kMaxRank];
    for (int64_t i = 0; i < num_items; ++i) run(i, z);
    return;
  }
  // Decode rows only (BGMV, bandwidth-bound): each thread takes one contiguous run of items
  // of about equal bytes, so it streams neighbouring pairs (a caller that orders groups
  // adapter by adapter makes them one adapter's adjacent q, k, v) without a shared counter.
  // Prompt rows (SGMV, compute-bound) are handed out one item at a time.
  const bool decode_only = std::all_of(items.begin(), items.end(),
                                       [](const Item& it) { return it.end - it.begin == 1; });
  if (decode_only) {
    std::vector<int64_t> cost(num_items + 1, 0);  // prefix sums of matrix elements
    for (int64_t i = 0; i < num_items; ++i) {
      const LowRankGroup& g = groups[items[i].group];
      cost[i + 1] = cost[i] + g.shrink.rows * (g.shrink.cols + g.expand.cols);
    }
#pragma omp parallel
    {
      alignas(64) float z[kMaxRank];
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const auto at = [&](int k) {
        return std::lower_bound(cost.begin(), cost.end(), cost.back() * k / nt) - cost.begin();
      };
      const int64_t end = std::min<int64_t>(at(t + 1), num_items);
      for (int64_t i = at(t); i < end;) {
        const LowRankGroup* lock[4] = {&groups[items[i].group]};
        const int64_t width = std::min<int64_t>(LockstepRows(*lock[0]), end - i);
        int n = 1;
        while (n < width && InLockstep(*lock[0], groups[items[i + n].group])) {
          lock[n] = &groups[items[i + n].group];
          ++n;
        }
        if (n == 1) {
          run(i, z);
        } else {
          RunChunkedDecodeRows(n, x, x_stride, y, y_stride, lock);
        }
        i += n;
      }
    }
    return;
  }
#pragma omp parallel
  {
    alignas(64) float z[kRowsPerItem * kMaxRank];
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) run(i, z);
  }
}

}  // namespace preft::kernels::cpu
