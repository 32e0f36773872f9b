#include "common/kv/kv_cache.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace preft::kv {

void KvCache::FreeDeleter::operator()(float* p) const { std::free(p); }

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const KvCacheShape& shape) {
  if (shape.num_layers <= 0 || shape.num_blocks <= 0 || shape.block_tokens <= 0 ||
      shape.num_kv_heads <= 0 || shape.head_dim <= 0) {
    return absl::InvalidArgumentError("KV cache: every dimension must be positive");
  }
  const size_t bytes = static_cast<size_t>(shape.num_blocks) * shape.bytes_per_block_all_layers();
  // Page-aligned and untouched: pages become resident only as blocks are first written.
  void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("KV cache: cannot allocate ", bytes, " bytes"));
  }
  return std::unique_ptr<KvCache>(new KvCache(shape, static_cast<float*>(p)));
}

size_t KvCache::bytes() const {
  return static_cast<size_t>(shape_.num_blocks) * shape_.bytes_per_block_all_layers();
}

}  // namespace preft::kv
