#pragma once

// Prefix-affinity routing (llm-d's prefix-cache scorer, kept from the router's own decisions):
// which worker was last given a prompt that starts with the same blocks under the same adapter
// version, so the next such prompt goes where that KV is probably still cached. The keys are a
// routing hint only (a stale or colliding key costs a cache miss, never a wrong answer: workers
// check their own SHA-256 block hashes), so they are 64-bit and cheap.

#include <cstdint>
#include <list>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace preft::router {

class PrefixAffinity {
 public:
  // Remembers at most `capacity` block keys, least recently used forgotten first.
  explicit PrefixAffinity(size_t capacity = size_t{1} << 16) : capacity_(capacity) {}

  // The chained keys of the first full blocks of `tokens` (at most `max_blocks`), salted with
  // the adapter and its version ("" and 0 for the base model).
  static std::vector<uint64_t> Keys(const std::string& adapter, int64_t version,
                                    const std::vector<int32_t>& tokens, int64_t block_tokens,
                                    size_t max_blocks = 256);

  // For each worker given a prompt that starts like `keys`: how many of its leading blocks.
  absl::flat_hash_map<std::string, int64_t> Match(const std::vector<uint64_t>& keys)
      ABSL_LOCKS_EXCLUDED(mu_);
  // `address` was given a prompt with these keys.
  void Record(const std::vector<uint64_t>& keys, const std::string& address)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Lru = std::list<std::pair<uint64_t, std::string>>;  // most recent first
  const size_t capacity_;
  absl::Mutex mu_;
  Lru lru_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Lru::iterator> by_key_ ABSL_GUARDED_BY(mu_);
};

}  // namespace preft::router
