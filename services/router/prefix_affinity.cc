#include "services/router/prefix_affinity.h"

#include <algorithm>
#include <string_view>

#include "common/base/fnv.h"

namespace preft::router {

std::vector<uint64_t> PrefixAffinity::Keys(const std::string& adapter, int64_t version,
                                           const std::vector<int32_t>& tokens,
                                           int64_t block_tokens, size_t max_blocks) {
  std::vector<uint64_t> keys;
  if (block_tokens <= 0) return keys;
  uint64_t h = base::Fnv1a64(adapter, base::Fnv1a64(std::string_view(
                                          reinterpret_cast<const char*>(&version), sizeof(version))));
  const size_t blocks = std::min(tokens.size() / static_cast<size_t>(block_tokens), max_blocks);
  for (size_t b = 0; b < blocks; ++b) {
    h = base::Fnv1a64(std::string_view(reinterpret_cast<const char*>(tokens.data() + b * block_tokens),
                                       block_tokens * sizeof(int32_t)),
                      h);
    keys.push_back(h);
  }
  return keys;
}

absl::flat_hash_map<std::string, int64_t> PrefixAffinity::Match(const std::vector<uint64_t>& keys) {
  absl::flat_hash_map<std::string, int64_t> depth;
  absl::MutexLock lock(&mu_);
  // A key names every block before it too (it chains them): the worker recorded under block i
  // was given blocks 0..i. A key never recorded (or forgotten) ends the walk.
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto it = by_key_.find(keys[i]);
    if (it == by_key_.end()) break;
    depth[it->second->second] = static_cast<int64_t>(i) + 1;
  }
  return depth;
}

void PrefixAffinity::Record(const std::vector<uint64_t>& keys, const std::string& address) {
  absl::MutexLock lock(&mu_);
  // Deepest first, so the first blocks end up most recent and are forgotten last (a walk in
  // Match stops at the first forgotten key).
  for (auto k = keys.rbegin(); k != keys.rend(); ++k) {
    const uint64_t key = *k;
    if (const auto it = by_key_.find(key); it != by_key_.end()) {
      it->second->second = address;
      lru_.splice(lru_.begin(), lru_, it->second);
      continue;
    }
    lru_.emplace_front(key, address);
    by_key_[key] = lru_.begin();
    if (lru_.size() > capacity_) {
      by_key_.erase(lru_.back().first);
      lru_.pop_back();
    }
  }
}

}  // namespace preft::router
