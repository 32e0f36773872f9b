#pragma once

// Tensor parallelism (Megatron-LM's split, as vLLM runs it): each of `ranks` devices holds a
// slice of every layer. Column-parallel projections (q, k, v, gate, up) keep whole rows of
// their outputs: a rank computes the outputs of its own heads (its KV heads, its share of the
// MLP's intermediate width). Row-parallel projections (o, down) take the matching slice of
// their inputs and produce a partial sum of the whole output, which an all-reduce completes:
// two all-reduces per layer, after attention's o and after the MLP's down. Embedding, norms,
// LM head and DiReFT (on the whole residual stream) are replicated.
//
// LoRA follows its base projection: column-parallel keeps A whole and slices B by outputs (z
// is computed on every rank); row-parallel slices A by inputs and keeps B whole, so a rank's
// z is partial and z B adds into the partial output before the same all-reduce (the sum is
// linear). A shrink bias (none for LoRA) is added by rank 0 alone there.
//
// A rank's KV cache holds its KV heads only. For the KV transport the ranks meet in one host
// cache of every head (the layout a worker without tensor parallelism has), each copying its
// heads in or out (KvHeadCopies), so tiers of different splits hand KV to each other.
//
// This file is host-only: what each rank holds. The GPU forward (DeviceModel) runs it.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "common/kernels/matrix.h"
#include "common/kv/kv_cache.h"
#include "common/model/adapter_weights.h"
#include "common/model/config.h"

namespace preft::backend {

struct TensorShard {
  int rank = 0;
  int ranks = 1;
  bool whole() const { return ranks == 1; }
};

enum class ShardSplit { kOutputs, kInputs };  // column-parallel, row-parallel
ShardSplit SplitOf(model::Projection p);

// InvalidArgument unless `ranks` >= 1 divides the attention heads, the KV heads and the
// intermediate size of `c` (the message names the field and its value).
absl::Status CheckTensorParallel(const model::ModelConfig& c, int ranks);

// The config of one rank's slice: its heads, KV heads and intermediate width; the rest as `c`.
// DimsOf(ShardConfig(c, s), p) is then the shape of the rank's slice of projection p.
model::ModelConfig ShardConfig(const model::ModelConfig& c, const TensorShard& s);

// The rank's equal part [begin, end) of a dimension of `size` (a multiple of s.ranks).
struct ShardRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};
ShardRange RangeOf(int64_t size, const TensorShard& s);

// Copies rows [r.begin, r.end) x columns [c.begin, c.end) of row-major `m` into `dst`,
// densely and in m's dtype. `m` must not be chunked.
void CopySubMatrix(const kernels::MatrixView& m, ShardRange rows, ShardRange cols, void* dst);

// The part of base weight `w` ([out, in], nn.Linear) of projection p that rank s holds.
struct WeightSlice {
  ShardRange rows, cols;
};
WeightSlice SliceOfWeight(const kernels::MatrixView& w, model::Projection p, const TensorShard& s);

// The parts of a LoRA pair (shrink [rank, in], expand [rank, out]) that rank s holds for
// projection p, and whether it adds the shrink bias.
struct LowRankSlice {
  ShardRange shrink_cols, expand_cols;
  bool bias = true;
};
LowRankSlice SliceOfLowRank(const model::LowRank& lr, model::Projection p, const TensorShard& s);

// `rows` rows of `width` elements (of the cache's dtype), rows `src_pitch` and `dst_pitch`
// elements apart; offsets in elements from each cache's layer 0, block 0.
struct StridedCopy {
  int64_t src_offset = 0, dst_offset = 0;
  int64_t width = 0, rows = 0;
  int64_t src_pitch = 0, dst_pitch = 0;
};
// The copies that move rank s's KV heads of `blocks` (every layer) from its own cache (`full`
// with full.num_kv_heads / s.ranks heads) into a cache of `full`'s shape; swap source and
// destination (offsets and pitches) to move them back. One copy per layer and run of
// consecutive blocks: a block's K heads, then its V heads, are each one piece on both sides.
std::vector<StridedCopy> KvHeadCopies(const kv::KvCacheShape& full, const TensorShard& s,
                                      const std::vector<int32_t>& blocks);

}  // namespace preft::backend
