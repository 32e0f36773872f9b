#pragma once

// The GPU forward's KV cache in device memory, with copies of blocks to and from a host cache
// (the KV transport's mirror).

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/backend/device_memory.h"
#include "common/backend/tensor_parallel.h"
#include "common/kernels/attention_types.h"
#include "common/kv/kv_cache.h"

namespace preft::backend {

// A paged KV cache in device memory: kv::KvCache's layout ([layer][block][K|V]...), in the
// shape's dtype (f32 or bf16).
class DeviceKvCache {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceKvCache>> Create(const kv::KvCacheShape& shape);
  // The number of blocks of `shape` (its num_blocks ignored) that fit in `fraction` of the
  // device's free memory now, less `reserve_bytes` kept for other uses (adapter slots): how a
  // serving process sizes its pool after loading weights.
  static absl::StatusOr<int64_t> BlocksThatFit(const kv::KvCacheShape& shape, double fraction,
                                               size_t reserve_bytes = 0);

  const kv::KvCacheShape& shape() const { return shape_; }
  // Layer `layer`'s blocks, addressed in bytes (the kernels read them as shape().dtype).
  char* layer_data(int64_t layer) const {
    return data_.as<char>() + layer * shape_.num_blocks * shape_.block_bytes();
  }
  // Elements from a block's K to its V.
  int64_t v_offset() const { return shape_.num_kv_heads * shape_.block_tokens * shape_.head_dim; }
  // Copies the whole cache of an f32 shape to `host` (resized): tests compare it with the CPU
  // cache.
  absl::Status CopyToHost(std::vector<float>* host) const;
  // Copies `blocks` (every layer) to or from a host cache of the same shape (a host mirror the
  // KV transport reads and writes); for tensor-parallel rank `shard`, whose cache holds its KV
  // heads only, into or out of its heads' place in a host cache of every head.
  // InvalidArgument for another shape or a block out of range.
  absl::Status CopyBlocksToHost(const std::vector<int32_t>& blocks, kv::KvCache* host,
                                const TensorShard& shard = {}) const;
  absl::Status CopyBlocksFromHost(const kv::KvCache& host, const std::vector<int32_t>& blocks,
                                  const TensorShard& shard = {});
  // Sets every byte to 0xff (NaN), so a test sees any value the forward should have written.
  absl::Status PoisonForTesting();

 private:
  DeviceKvCache(const kv::KvCacheShape& shape, DeviceBuffer data)
      : shape_(shape), data_(std::move(data)) {}
  kv::KvCacheShape shape_;
  DeviceBuffer data_;
};

}  // namespace preft::backend
