#pragma once

// Fixed pool of KV blocks handed out by id, refcounted, with exact accounting and a cache of
// full blocks by content (prefix caching): a cached block whose last user let go keeps its KV in
// an LRU of evictable blocks, reclaimed only when an allocation finds no plain free block. An
// evictable block counts as free, so the cache never makes an allocation fail.

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "common/kv/block_hash.h"

namespace preft::kv {

// Owned by the engine thread; not thread-safe. Freeing a block nobody holds is a broken
// invariant (CHECK), not an error.
class BlockAllocator {
 public:
  // `max_cached`: at most this many blocks keep a content address (0: no prefix cache).
  explicit BlockAllocator(int32_t num_blocks, int32_t max_cached = 0);

  // Appends `n` block ids to `out` (each held once), or returns ResourceExhausted and
  // allocates nothing. Plain free blocks first, then the least recently used evictable ones.
  absl::Status Allocate(int32_t n, std::vector<int32_t>* out);
  // Lets go of one hold; the last one frees the block (evictable if it is cached).
  void Free(int32_t block);
  void Free(const std::vector<int32_t>& blocks);

  // The cached block holding `hash`, or -1. Peek leaves it as it is; Acquire holds it for the
  // caller (taking it out of the evictable LRU), to be let go with Free.
  int32_t Peek(const BlockHash& hash) const;
  int32_t Acquire(const BlockHash& hash);
  // Gives a held block the content address `hash` (its KV is complete). Nothing happens when
  // another block already has that address, or when the cache is full of blocks in use.
  void Publish(int32_t block, const BlockHash& hash);

  int32_t num_blocks() const { return static_cast<int32_t>(refs_.size()); }
  // Plain free and evictable: what an allocation can have.
  int32_t num_free() const { return static_cast<int32_t>(free_.size()) + num_evictable_; }
  int32_t num_used() const { return num_blocks() - num_free(); }
  bool IsAllocated(int32_t block) const { return refs_[block] > 0; }
  int32_t ref_count(int32_t block) const { return refs_[block]; }
  int32_t num_cached() const { return static_cast<int32_t>(by_hash_.size()); }
  int32_t num_evictable() const { return num_evictable_; }
  int64_t evictions() const { return evictions_; }  // cached blocks reclaimed (or dropped at the cap)
  int32_t max_cached() const { return max_cached_; }

 private:
  // The evictable LRU: a doubly linked list through next_/prev_, sentinel num_blocks().
  void LinkAtTail(int32_t block);
  void Unlink(int32_t block);
  // Drops `block`'s content address (it must be evictable); it becomes plain free.
  void Uncache(int32_t block);

  int32_t max_cached_;
  std::vector<int32_t> free_;  // plain free, a stack: last freed is reused first (warm in cache)
  std::vector<int32_t> refs_;
  std::vector<bool> cached_;
  std::vector<BlockHash> hash_of_;
  absl::flat_hash_map<BlockHash, int32_t> by_hash_;
  std::vector<int32_t> next_, prev_;
  int32_t num_evictable_ = 0;
  int64_t evictions_ = 0;
};

}  // namespace preft::kv
