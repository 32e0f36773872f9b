#pragma once

// Grouped low-rank updates on the GPU (LoRA and DiReFT in heterogeneous batches): the
// contract of common/kernels/cpu/low_rank.h, shaped like Punica's BGMV/SGMV. Each adapter
// keeps a table of its (layer, projection) matrix pairs in device memory, built once when it
// is uploaded; a call names its rows by (row, adapter) and its outputs by table entry, so a
// forward step copies only those small row lists, whatever the number of layers.
//
//   for each item (row r, adapter a) and target t with pair P = tables[a][t.entry]:
//     t.y[r] += P.scale * ((x[r] P.shrinkᵀ + P.bias) P.expand)

#include <cstdint>

#include "common/kernels/dtype.h"

namespace preft::kernels::cuda {

inline constexpr int64_t kMaxLowRank = 1024;
inline constexpr int kMaxLowRankTargets = 3;

// One matrix pair, in device memory. shrink == nullptr: no update (the projection is not
// adapted in that layer).
struct LowRankPair {
  const void* shrink = nullptr;  // [rank, in]
  const void* expand = nullptr;  // [rank, out]
  DType dtype = DType::kBF16;    // of shrink and expand
  int64_t rank = 0;              // <= kMaxLowRank
  int64_t in = 0;
  int64_t out = 0;
  const float* shrink_bias = nullptr;  // [rank] or null
  float scale = 1.f;
};

struct LowRankItem {
  int32_t row;      // into x and every target's y
  int32_t adapter;  // into the call's tables
};

// Outputs that share the call's input (q, k and v read the same x): each reads its own entry
// of every adapter's table and adds to its own rows.
struct LowRankTargets {
  struct Target {
    int32_t entry = 0;  // index into an adapter's table
    float* y = nullptr;
    int64_t y_stride = 0;
  } target[kMaxLowRankTargets];
  int num_targets = 0;
};

// x: rows of stride x_stride. tables: device array of device pointers, one table per adapter.
// A target's y may be x (DiReFT in place; then it must be the only target): a row is read in
// full before it is written. Rows are distinct across items.
// BGMV: blocks per (item, target, chunk of 2048 outputs), reading its pair for that row
// alone (decode rows), in 16-byte loads where rows are aligned.
int LowRankAdd(const float* x, int64_t x_stride, const LowRankPair* const* tables,
               const LowRankItem* items, int64_t num_items, const LowRankTargets& targets,
               void* stream);

// SGMV for prompt chunks: the same update, but a tile of up to kTileRows items of one adapter
// shares every load of its pair, so a 128-token prompt reads each matrix 4 times, not 128.
// Pairs of rank over kMaxTileRank are skipped: send their rows to LowRankAdd.
inline constexpr int kTileRows = 32;
inline constexpr int64_t kMaxTileRank = 64;
struct LowRankTile {
  int32_t first;  // items[first, first + count) share one adapter
  int32_t count;  // 1..kTileRows
};
int LowRankAddTiles(const float* x, int64_t x_stride, const LowRankPair* const* tables,
                    const LowRankItem* items, const LowRankTile* tiles, int64_t num_tiles,
                    const LowRankTargets& targets, void* stream);

}  // namespace preft::kernels::cuda
