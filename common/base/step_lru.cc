#include "common/base/step_lru.h"

#include "common/base/check.h"

namespace preft::base {

void StepLru::Touch(uint64_t key) {
  auto it = entries_.find(key);
  PREFT_CHECK(it != entries_.end());
  order_.splice(order_.begin(), order_, it->second.at);
  it->second.step = step_;
}

void StepLru::Insert(uint64_t key, size_t bytes) {
  order_.push_front(key);
  const bool added = entries_.emplace(key, Entry{bytes, step_, order_.begin()}).second;
  PREFT_CHECK(added);
  bytes_ += bytes;
}

void StepLru::Erase(uint64_t key) {
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  bytes_ -= it->second.bytes;
  order_.erase(it->second.at);
  entries_.erase(it);
}

std::vector<uint64_t> StepLru::MakeRoom(size_t incoming) {
  return ShrinkTo(incoming <= budget_ ? budget_ - incoming : 0);
}

std::vector<uint64_t> StepLru::ShrinkTo(size_t target) {
  std::vector<uint64_t> dropped;
  while (bytes_ > target && !order_.empty()) {
    const uint64_t oldest = order_.back();
    // Least recently used last: once the oldest is in this step, every other one is too.
    if (entries_.at(oldest).step == step_) break;
    Erase(oldest);
    dropped.push_back(oldest);
  }
  return dropped;
}

}  // namespace preft::base
