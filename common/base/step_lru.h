#pragma once

// Byte-budget LRU bookkeeping for a cache whose entries a step pins: what the device adapter
// slots (common/backend/device_model.h) keep. The cache owns the values; this decides which keys
// to drop. Entries used in the current step are never chosen, so a step's adapters stay valid
// until it ends even when together they exceed the budget (the budget then holds again from
// the next step on, as room is made).

#include <cstddef>
#include <cstdint>
#include <list>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace preft::base {

class StepLru {
 public:
  static constexpr size_t kNoBudget = ~size_t{0};
  explicit StepLru(size_t budget_bytes) : budget_(budget_bytes) {}

  // Starts a new step: entries used before it become candidates for eviction.
  void BeginStep() { ++step_; }
  bool Contains(uint64_t key) const { return entries_.contains(key); }
  // Marks `key` (present) used in the current step and most recently used.
  void Touch(uint64_t key);
  // Adds `key` (absent) of `bytes`, used in the current step.
  void Insert(uint64_t key, size_t bytes);
  // Removes `key` if present (the cache dropped it for its own reasons).
  void Erase(uint64_t key);
  // Chooses and removes least recently used keys, none used in the current step, until
  // `incoming` more bytes fit the budget or no candidate is left; returns them oldest first.
  std::vector<uint64_t> MakeRoom(size_t incoming);
  // The same until at most `target` bytes are held (0: all but the current step's).
  std::vector<uint64_t> ShrinkTo(size_t target);

  size_t bytes() const { return bytes_; }
  size_t budget() const { return budget_; }
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    size_t bytes;
    uint64_t step;                     // the last step that used it
    std::list<uint64_t>::iterator at;  // in order_
  };
  size_t budget_;
  size_t bytes_ = 0;
  uint64_t step_ = 0;
  std::list<uint64_t> order_;  // most recently used first
  absl::flat_hash_map<uint64_t, Entry> entries_;
};

}  // namespace preft::base
