#pragma once

// Hashes stable across processes, builds and machines (std::hash and absl::Hash are neither:
// absl seeds per process): FNV-1a 64 for names, layouts and fingerprints that two processes must
// agree on, SplitMix64 for seeds. Never for hash tables.

#include <cstdint>
#include <string_view>

namespace preft::base {

inline constexpr uint64_t kFnv1a64Offset = 0xcbf29ce484222325ull;

// Continues the hash `h` over `bytes` (start from kFnv1a64Offset).
inline uint64_t Fnv1a64(std::string_view bytes, uint64_t h = kFnv1a64Offset) {
  for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// SplitMix64's finaliser: a well-mixed 64-bit value of `x` (seeds from seeds and counters).
inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace preft::base
