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

  // Floats in one block of one layer: K [kv_head][head_dim][block_tokens] (transposed, so a
  // query's scores over a block's tokens are one vector loop), then V
  // [kv_head][block_tokens][head_dim].
  int64_t block_floats() const { return 2 * num_kv_heads * block_tokens * head_dim; }
  int64_t bytes_per_block_all_layers() const {
    return num_layers * block_floats() * static_cast<int64_t>(sizeof(float));
  }
};

// A cache of the same layout in a GPU's memory (one allocation, layer 0 at `base`), as a
// transport that moves device blocks sees it; `base` is null where the cache is in host memory.
struct DeviceKvView {
  void* base = nullptr;
  KvCacheShape shape;
};

// Layout [layer][block][K|V][kv_head][...], f32 (see KvCacheShape::block_floats). Owned by the
// engine thread.
class KvCache {
 public:
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const KvCacheShape& shape);

  const KvCacheShape& shape() const { return shape_; }
  float* layer_base(int64_t layer) { return data_.get() + layer * layer_stride(); }
  const float* layer_base(int64_t layer) const { return data_.get() + layer * layer_stride(); }
  int64_t layer_stride() const { return shape_.num_blocks * shape_.block_floats(); }
  int64_t v_offset() const { return shape_.num_kv_heads * shape_.block_tokens * shape_.head_dim; }
  // K tile of head `h` in `block` of `layer`: [head_dim][block_tokens].
  float* key_tile(int64_t layer, int64_t block, int64_t h) {
    return layer_base(layer) + block * shape_.block_floats() +
           h * shape_.block_tokens * shape_.head_dim;
  }
  // V of token slot `slot` (0..block_tokens) of `block`, head `h`: [head_dim].
  float* value(int64_t layer, int64_t block, int64_t h, int64_t slot) {
    return key_tile(layer, block, h) + v_offset() + slot * shape_.head_dim;
  }
  size_t bytes() const;

 private:
  struct Unmapper {
    size_t bytes;
    void operator()(float* p) const;
  };
  KvCache(const KvCacheShape& shape, float* data, size_t bytes)
      : shape_(shape), data_(data, Unmapper{bytes}) {}

  KvCacheShape shape_;
  std::unique_ptr<float, Unmapper> data_;
};

}  // namespace preft::kv
