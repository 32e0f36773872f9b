#pragma once

// The paged KV cache memory of one model: every layer's K and V blocks in one allocation.

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace preft::kv {

struct KvCacheShape {
  int64_t num_layers = 0;
  int64_t num_blocks = 0;
  int64_t block_tokens = 16;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;

  // Floats in one block of one layer: K then V, each [kv_head][block_tokens][head_dim].
  int64_t block_floats() const { return 2 * num_kv_heads * block_tokens * head_dim; }
  int64_t bytes_per_block_all_layers() const {
    return num_layers * block_floats() * static_cast<int64_t>(sizeof(float));
  }
};

// Layout [layer][block][K|V][kv_head][token][dim], f32. Owned by the engine thread.
class KvCache {
 public:
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const KvCacheShape& shape);

  const KvCacheShape& shape() const { return shape_; }
  float* layer_base(int64_t layer) { return data_.get() + layer * layer_stride(); }
  int64_t layer_stride() const { return shape_.num_blocks * shape_.block_floats(); }
  int64_t v_offset() const { return shape_.num_kv_heads * shape_.block_tokens * shape_.head_dim; }
  // K of token slot `slot` (0..block_tokens) of `block`, head `h`, in `layer`.
  float* key(int64_t layer, int64_t block, int64_t h, int64_t slot) {
    return layer_base(layer) + block * shape_.block_floats() +
           (h * shape_.block_tokens + slot) * shape_.head_dim;
  }
  float* value(int64_t layer, int64_t block, int64_t h, int64_t slot) {
    return key(layer, block, h, slot) + v_offset();
  }
  size_t bytes() const;

 private:
  struct FreeDeleter {
    void operator()(float* p) const;
  };
  KvCache(const KvCacheShape& shape, float* data) : shape_(shape), data_(data) {}

  KvCacheShape shape_;
  std::unique_ptr<float, FreeDeleter> data_;
};

}  // namespace preft::kv
