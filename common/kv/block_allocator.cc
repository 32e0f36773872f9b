#include "common/kv/block_allocator.h"

#include "absl/strings/str_cat.h"
#include "common/base/check.h"

namespace preft::kv {

BlockAllocator::BlockAllocator(int32_t num_blocks, int32_t max_cached)
    : max_cached_(max_cached),
      refs_(num_blocks, 0),
      cached_(num_blocks, false),
      hash_of_(num_blocks),
      next_(num_blocks + 1),
      prev_(num_blocks + 1) {
  free_.reserve(num_blocks);
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
  next_[num_blocks] = prev_[num_blocks] = num_blocks;  // empty LRU
}

void BlockAllocator::LinkAtTail(int32_t block) {
  const int32_t sentinel = num_blocks(), last = prev_[sentinel];
  next_[last] = block;
  prev_[block] = last;
  next_[block] = sentinel;
  prev_[sentinel] = block;
  ++num_evictable_;
}

void BlockAllocator::Unlink(int32_t block) {
  next_[prev_[block]] = next_[block];
  prev_[next_[block]] = prev_[block];
  --num_evictable_;
}

void BlockAllocator::Uncache(int32_t block) {
  Unlink(block);
  by_hash_.erase(hash_of_[block]);
  cached_[block] = false;
  ++evictions_;
}

absl::Status BlockAllocator::Allocate(int32_t n, std::vector<int32_t>* out) {
  if (n < 0 || n > num_free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache: need ", n, " blocks, ", num_free(), " free"));
  }
  for (int32_t i = 0; i < n; ++i) {
    int32_t b;
    if (!free_.empty()) {
      b = free_.back();
      free_.pop_back();
    } else {  // the least recently used cached block gives up its content
      b = next_[num_blocks()];
      Uncache(b);
    }
    refs_[b] = 1;
    out->push_back(b);
  }
  return absl::OkStatus();
}

void BlockAllocator::Free(int32_t block) {
  PREFT_CHECK(block >= 0 && block < num_blocks());
  PREFT_CHECK(refs_[block] > 0);  // double free
  if (--refs_[block] > 0) return;
  if (cached_[block]) {
    LinkAtTail(block);
  } else {
    free_.push_back(block);
  }
}

void BlockAllocator::Free(const std::vector<int32_t>& blocks) {
  // Last block first: the next allocation of as many blocks pops them back in their original
  // (often consecutive) order, so KV transfers keep moving runs of blocks, not single ones; and
  // a sequence's cached blocks enter the LRU tail-first, so its prefix is evicted last.
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) Free(*it);
}

int32_t BlockAllocator::Peek(const BlockHash& hash) const {
  const auto it = by_hash_.find(hash);
  return it == by_hash_.end() ? -1 : it->second;
}

int32_t BlockAllocator::Acquire(const BlockHash& hash) {
  const int32_t b = Peek(hash);
  if (b < 0) return -1;
  if (refs_[b]++ == 0) Unlink(b);
  return b;
}

void BlockAllocator::Publish(int32_t block, const BlockHash& hash) {
  PREFT_CHECK(block >= 0 && block < num_blocks() && refs_[block] > 0);
  if (cached_[block] || by_hash_.contains(hash)) return;
  if (num_cached() >= max_cached_) {
    if (num_evictable_ == 0) return;  // every cached block is in use: keep this one private
    const int32_t oldest = next_[num_blocks()];
    Uncache(oldest);
    free_.push_back(oldest);
  }
  cached_[block] = true;
  hash_of_[block] = hash;
  by_hash_.emplace(hash, block);
}

}  // namespace preft::kv
