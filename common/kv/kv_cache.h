#pragma once

// The paged KV cache memory of one model: every layer's K and V blocks in one allocation.

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "common/base/check.h"
#include "common/kernels/attention_types.h"  // header-only: KvDtype

namespace preft::kv {

using kernels::KvDtype;
using kernels::KvDtypeBytes;
using kernels::KvDtypeName;

struct KvCacheShape {
  int64_t num_layers = 0;
  int64_t num_blocks = 0;
  int64_t block_tokens = 16;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  // Last, so the positional initialisers {layers, blocks, bt, heads, hd} stay f32.
  KvDtype dtype = KvDtype::kF32;

  int64_t element_bytes() const { return KvDtypeBytes(dtype); }
  // Elements in one block of one layer: K [kv_head][head_dim][block_tokens] (transposed, so a
  // query's scores over a block's tokens are one vector loop), then V
  // [kv_head][block_tokens][head_dim].
  int64_t block_elements() const { return 2 * num_kv_heads * block_tokens * head_dim; }
  int64_t block_bytes() const { return block_elements() * element_bytes(); }
  int64_t bytes_per_block_all_layers() const { return num_layers * block_bytes(); }
};

// A cache of the same layout in a GPU's memory (one allocation, layer 0 at `base`), as a
// transport that moves device blocks sees it; `base` is null where the cache is in host memory.
struct DeviceKvView {
  void* base = nullptr;
  KvCacheShape shape;
};

// Layout [layer][block][K|V][kv_head][...] in shape().dtype (see KvCacheShape::block_elements).
// Owned by the engine thread. Transports move blocks as bytes (block_data, block_bytes); the
// float accessors are for the f32 kernels and tests, and check the cache is f32.
class KvCache {
 public:
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const KvCacheShape& shape);

  const KvCacheShape& shape() const { return shape_; }
  std::byte* layer_data(int64_t layer) { return data_.get() + layer * layer_bytes(); }
  const std::byte* layer_data(int64_t layer) const { return data_.get() + layer * layer_bytes(); }
  int64_t layer_bytes() const { return shape_.num_blocks * shape_.block_bytes(); }
  std::byte* block_data(int64_t layer, int64_t block) {
    return layer_data(layer) + block * shape_.block_bytes();
  }
  const std::byte* block_data(int64_t layer, int64_t block) const {
    return layer_data(layer) + block * shape_.block_bytes();
  }
  // Elements from a block's K to its V.
  int64_t v_offset() const { return shape_.num_kv_heads * shape_.block_tokens * shape_.head_dim; }

  // f32 caches only.
  float* layer_base(int64_t layer) {
    PREFT_CHECK(shape_.dtype == KvDtype::kF32);
    return reinterpret_cast<float*>(layer_data(layer));
  }
  const float* layer_base(int64_t layer) const {
    PREFT_CHECK(shape_.dtype == KvDtype::kF32);
    return reinterpret_cast<const float*>(layer_data(layer));
  }
  // K tile of head `h` in `block` of `layer`: [head_dim][block_tokens].
  float* key_tile(int64_t layer, int64_t block, int64_t h) {
    return layer_base(layer) + block * shape_.block_elements() +
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
    void operator()(std::byte* p) const;
  };
  KvCache(const KvCacheShape& shape, std::byte* data, size_t bytes)
      : shape_(shape), data_(data, Unmapper{bytes}) {}

  KvCacheShape shape_;
  std::unique_ptr<std::byte, Unmapper> data_;
};

}  // namespace preft::kv
