#include "common/kv/block_allocator.h"

#include "absl/strings/str_cat.h"
#include "common/base/check.h"

namespace preft::kv {

BlockAllocator::BlockAllocator(int32_t num_blocks) : allocated_(num_blocks, false) {
  free_.reserve(num_blocks);
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

absl::Status BlockAllocator::Allocate(int32_t n, std::vector<int32_t>* out) {
  if (n < 0 || n > num_free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache: need ", n, " blocks, ", num_free(), " free"));
  }
  for (int32_t i = 0; i < n; ++i) {
    int32_t b = free_.back();
    free_.pop_back();
    allocated_[b] = true;
    out->push_back(b);
  }
  return absl::OkStatus();
}

void BlockAllocator::Free(int32_t block) {
  PREFT_CHECK(block >= 0 && block < num_blocks());
  PREFT_CHECK(allocated_[block]);  // double free
  allocated_[block] = false;
  free_.push_back(block);
}

void BlockAllocator::Free(const std::vector<int32_t>& blocks) {
  // Last block first: the next allocation of as many blocks pops them back in their original
  // (often consecutive) order, so KV transfers keep moving runs of blocks, not single ones.
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) Free(*it);
}

}  // namespace preft::kv
