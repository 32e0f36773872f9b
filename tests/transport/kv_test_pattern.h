#pragma once

// Deterministic KV block contents for transport tests: every bit pattern (NaNs included), so
// a transfer is checked byte for byte, and a receiver in another process can recompute them.
// Blocks are filled as 32-bit words over their bytes, whatever the cache's dtype.

#include <cstdint>
#include <cstring>

#include "common/kv/kv_cache.h"

namespace preft::transport::testing {

inline uint32_t PatternWord(uint64_t seed, int64_t layer, int64_t tag, int64_t k) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(layer) * 0xbf58476d1ce4e5b9ull ^
               static_cast<uint64_t>(tag) * 0x94d049bb133111ebull ^ static_cast<uint64_t>(k);
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return static_cast<uint32_t>(x);
}

// Writes the pattern (seed, tag) into `block` of every layer.
inline void FillPattern(kv::KvCache& cache, int32_t block, uint64_t seed, int64_t tag) {
  const int64_t n = cache.shape().block_bytes() / 4;
  for (int64_t layer = 0; layer < cache.shape().num_layers; ++layer) {
    std::byte* p = cache.block_data(layer, block);
    for (int64_t k = 0; k < n; ++k) {
      const uint32_t w = PatternWord(seed, layer, tag, k);
      std::memcpy(p + 4 * k, &w, sizeof(w));
    }
  }
}

inline bool HasPattern(kv::KvCache& cache, int32_t block, uint64_t seed, int64_t tag) {
  const int64_t n = cache.shape().block_bytes() / 4;
  for (int64_t layer = 0; layer < cache.shape().num_layers; ++layer) {
    const std::byte* p = cache.block_data(layer, block);
    for (int64_t k = 0; k < n; ++k) {
      uint32_t w;
      std::memcpy(&w, p + 4 * k, sizeof(w));
      if (w != PatternWord(seed, layer, tag, k)) return false;
    }
  }
  return true;
}

inline bool IsZero(kv::KvCache& cache, int32_t block) {
  const int64_t n = cache.shape().block_bytes() / 4;
  for (int64_t layer = 0; layer < cache.shape().num_layers; ++layer) {
    const std::byte* p = cache.block_data(layer, block);
    for (int64_t k = 0; k < n; ++k) {
      uint32_t w;
      std::memcpy(&w, p + 4 * k, sizeof(w));
      if (w != 0) return false;
    }
  }
  return true;
}

}  // namespace preft::transport::testing
