#pragma once

// FNV-1a, 64 bit: a hash stable across processes, builds and machines (std::hash and
// absl::Hash are neither: absl seeds per process). For names, layouts and fingerprints that
// two processes must agree on, never for hash tables.

#include <cstdint>
#include <string_view>

namespace preft::base {

inline constexpr uint64_t kFnv1a64Offset = 0xcbf29ce484222325ull;

// Continues the hash `h` over `bytes` (start from kFnv1a64Offset).
inline uint64_t Fnv1a64(std::string_view bytes, uint64_t h = kFnv1a64Offset) {
  for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

}  // namespace preft::base
