#pragma once

// The BPE model of a byte-level tokenizer.json (internal to preft_model): vocab, merge ranks
// and the merge loop.

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "common/text/tokenizer_json.h"

namespace preft::text::tokenizer_internal {

// Largest token id accepted from a file (real vocabularies stay under 2^18); bounds the
// memory a hostile file can make us allocate.
inline constexpr int32_t kMaxTokenId = (1 << 22) - 1;

// Open-addressing hash index from token bytes to id. The keys are not stored: slots hold ids
// into the caller's id -> bytes table, so a lookup touches two cache lines, not a node chain.
class TokenIndex {
 public:
  void Reserve(size_t count);
  // Inserts `id` (whose bytes are keys[id]); false when those bytes are already present.
  bool Insert(int32_t id, const std::vector<std::string>& keys);
  int32_t Find(std::string_view key, const std::vector<std::string>& keys) const;

 private:
  static uint64_t Hash(std::string_view key) { return std::hash<std::string_view>()(key); }
  std::vector<uint64_t> slots_;  // (hash >> 32) << 32 | (id + 1); 0 when empty
  size_t size_ = 0;
};

// Immutable after FromParts apart from an internal word cache; all methods are thread-safe.
class BpeModel {
 public:
  // `model` is tokenizer.json's "model" value (for its options) and `raw` its vocab and
  // merges. Only byte-level BPE without byte_fallback, dropout or subword prefixes/suffixes;
  // every one of the 256 bytes must have a token.
  static absl::StatusOr<std::unique_ptr<BpeModel>> FromParts(const nlohmann::json& model,
                                                             RawBpe raw);

  // Appends the ids of one pre-token (raw bytes, non-empty).
  void EncodeWord(std::string_view word, std::vector<int32_t>* ids) const;

  // Raw bytes of `id`, or nullptr when the vocab has no such id.
  const std::string* TokenBytes(int32_t id) const {
    return id >= 0 && id < static_cast<int32_t>(id_to_bytes_.size()) && has_id_[id]
               ? &id_to_bytes_[id]
               : nullptr;
  }
  // Id of a token given in its byte-level surface form ("Ġthe"), or -1.
  int32_t SurfaceToId(std::string_view surface) const;
  int32_t id_end() const { return static_cast<int32_t>(id_to_bytes_.size()); }

 private:
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  static uint64_t PairKey(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  const Merge* FindMerge(int32_t a, int32_t b) const {
    const auto it = merges_.find(PairKey(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  }
  void MergeWord(std::string_view word, std::vector<int32_t>* ids) const;

  std::array<int32_t, 256> byte_ids_{};
  std::vector<std::string> id_to_bytes_;
  std::vector<bool> has_id_;
  TokenIndex bytes_to_id_;  // over id_to_bytes_, byte-level tokens only
  // Tokens whose surface is not byte-level text (outside GPT-2's table); decoded as UTF-8.
  std::unordered_map<std::string, int32_t> odd_surface_to_id_;
  std::unordered_map<uint64_t, Merge> merges_;
  bool ignore_merges_ = false;

  static constexpr size_t kMaxCachedWordBytes = 64;
  static constexpr size_t kMaxCacheEntries = 1 << 16;
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;  // guarded by cache_mu_
};

}  // namespace preft::text::tokenizer_internal
