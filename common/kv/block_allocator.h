#pragma once

// Fixed pool of KV blocks handed out by id, with exact accounting.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace preft::kv {

// Owned by the engine thread; not thread-safe. Freeing a block that is not allocated is a
// broken invariant (CHECK), not an error.
class BlockAllocator {
 public:
  explicit BlockAllocator(int32_t num_blocks);

  // Appends `n` block ids to `out`, or returns ResourceExhausted and allocates nothing.
  absl::Status Allocate(int32_t n, std::vector<int32_t>* out);
  void Free(int32_t block);
  void Free(const std::vector<int32_t>& blocks);

  int32_t num_blocks() const { return static_cast<int32_t>(allocated_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t num_used() const { return num_blocks() - num_free(); }
  bool IsAllocated(int32_t block) const { return allocated_[block]; }

 private:
  std::vector<int32_t> free_;     // stack: last freed is reused first (warm in cache)
  std::vector<bool> allocated_;
};

}  // namespace preft::kv
