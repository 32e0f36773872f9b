#include "common/backend/tensor_parallel.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"

namespace preft::backend {

ShardSplit SplitOf(model::Projection p) {
  return p == model::Projection::kO || p == model::Projection::kDown ? ShardSplit::kInputs
                                                      : ShardSplit::kOutputs;
}

absl::Status CheckTensorParallel(const model::ModelConfig& c, int ranks) {
  if (ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor parallelism needs at least one rank, got ", ranks));
  }
  const std::pair<const char*, int64_t> split[] = {{"num_attention_heads", c.num_heads},
                                                   {"num_key_value_heads", c.num_kv_heads},
                                                   {"intermediate_size", c.intermediate_size}};
  for (const auto& [field, value] : split) {
    if (value % ranks != 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor parallelism over ", ranks,
                                                     " ranks: the model's ", field, " (", value,
                                                     ") is not a multiple of ", ranks));
    }
  }
  return absl::OkStatus();
}

model::ModelConfig ShardConfig(const model::ModelConfig& c, const TensorShard& s) {
  model::ModelConfig local = c;
  local.num_heads = c.num_heads / s.ranks;
  local.num_kv_heads = c.num_kv_heads / s.ranks;
  local.intermediate_size = c.intermediate_size / s.ranks;
  return local;
}

ShardRange RangeOf(int64_t size, const TensorShard& s) {
  const int64_t part = size / s.ranks;
  return {s.rank * part, (s.rank + 1) * part};
}

void CopySubMatrix(const kernels::MatrixView& m, ShardRange rows, ShardRange cols, void* dst) {
  PREFT_CHECK(!m.chunked);
  PREFT_CHECK(rows.begin >= 0 && rows.end <= m.rows && cols.begin >= 0 && cols.end <= m.cols);
  const size_t es = kernels::DTypeSize(m.dtype);
  const auto* src = static_cast<const uint8_t*>(m.data);
  auto* out = static_cast<uint8_t*>(dst);
  const size_t row_bytes = cols.size() * es;
  for (int64_t r = rows.begin; r < rows.end; ++r) {
    std::memcpy(out, src + (r * m.cols + cols.begin) * es, row_bytes);
    out += row_bytes;
  }
}

WeightSlice SliceOfWeight(const kernels::MatrixView& w, model::Projection p, const TensorShard& s) {
  const ShardRange all_rows{0, w.rows}, all_cols{0, w.cols};
  return SplitOf(p) == ShardSplit::kOutputs ? WeightSlice{RangeOf(w.rows, s), all_cols}
                                            : WeightSlice{all_rows, RangeOf(w.cols, s)};
}

LowRankSlice SliceOfLowRank(const model::LowRank& lr, model::Projection p, const TensorShard& s) {
  const ShardRange shrink_all{0, lr.shrink.cols}, expand_all{0, lr.expand.cols};
  if (SplitOf(p) == ShardSplit::kOutputs) return {shrink_all, RangeOf(lr.expand.cols, s), true};
  return {RangeOf(lr.shrink.cols, s), expand_all, s.rank == 0};
}

std::vector<StridedCopy> KvHeadCopies(const kv::KvCacheShape& full, const TensorShard& s,
                                      const std::vector<int32_t>& blocks) {
  // A block is K [heads][head_dim][tokens] then V [heads][tokens][head_dim]: with `heads`
  // heads, 2 pieces of heads x per_head elements, so piece i of a run (block i / 2, K or V) is
  // at i x heads x per_head from the run's start on either side.
  const int64_t per_head = full.head_dim * full.block_tokens;
  const int64_t local_heads = full.num_kv_heads / s.ranks;
  const int64_t local_half = local_heads * per_head, full_half = full.num_kv_heads * per_head;
  const int64_t head0 = RangeOf(full.num_kv_heads, s).begin;
  std::vector<StridedCopy> copies;
  for (int64_t l = 0; l < full.num_layers; ++l) {
    for (size_t i = 0; i < blocks.size();) {
      size_t j = i + 1;
      while (j < blocks.size() && blocks[j] == blocks[j - 1] + 1) ++j;
      const int64_t first = blocks[i], count = static_cast<int64_t>(j - i);
      copies.push_back({(l * full.num_blocks + first) * 2 * local_half,
                        (l * full.num_blocks + first) * 2 * full_half + head0 * per_head,
                        local_half, 2 * count, local_half, full_half});
      i = j;
    }
  }
  return copies;
}

}  // namespace preft::backend
