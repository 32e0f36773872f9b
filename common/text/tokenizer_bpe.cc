#include "common/text/tokenizer_bpe.h"

#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <queue>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/text/tokenizer_unicode.h"

namespace preft::text::tokenizer_internal {
namespace {

using json = nlohmann::json;

// Options byte-level BPE does not implement are accepted only when absent, null, false, 0 or "".
absl::Status RefuseUnlessUnset(const json& model, const char* key) {
  const auto it = model.find(key);
  if (it == model.end() || it->is_null()) return absl::OkStatus();
  if (it->is_boolean() && !it->get<bool>()) return absl::OkStatus();
  if (it->is_string() && it->get_ref<const std::string&>().empty()) return absl::OkStatus();
  if (it->is_number() && it->get<double>() == 0.0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("model: \"", key, "\" = ", it->dump(), " is not supported by byte-level BPE"));
}

}  // namespace

void TokenIndex::Reserve(size_t count) {
  size_t capacity = 16;
  while (capacity < 2 * count) capacity *= 2;
  slots_.assign(capacity, 0);
  size_ = 0;
}

bool TokenIndex::Insert(int32_t id, const std::vector<std::string>& keys) {
  if (2 * (size_ + 1) > slots_.size()) {
    std::vector<uint64_t> old = std::move(slots_);
    Reserve(std::max<size_t>(16, old.size()));
    for (uint64_t slot : old) {
      if (slot != 0) Insert(static_cast<int32_t>((slot & 0xFFFFFFFF) - 1), keys);
    }
  }
  const std::string_view key = keys[id];
  const uint64_t hash = Hash(key);
  const size_t mask = slots_.size() - 1;
  for (size_t i = hash & mask;; i = (i + 1) & mask) {
    const uint64_t slot = slots_[i];
    if (slot == 0) {
      slots_[i] = ((hash >> 32) << 32) | static_cast<uint32_t>(id + 1);
      ++size_;
      return true;
    }
    if ((slot >> 32) == (hash >> 32) && keys[(slot & 0xFFFFFFFF) - 1] == key) return false;
  }
}

int32_t TokenIndex::Find(std::string_view key, const std::vector<std::string>& keys) const {
  if (slots_.empty()) return -1;
  const uint64_t hash = Hash(key);
  const size_t mask = slots_.size() - 1;
  for (size_t i = hash & mask;; i = (i + 1) & mask) {
    const uint64_t slot = slots_[i];
    if (slot == 0) return -1;
    const auto id = static_cast<int32_t>((slot & 0xFFFFFFFF) - 1);
    if ((slot >> 32) == (hash >> 32) && keys[id] == key) return id;
  }
}

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::FromParts(const json& model, RawBpe raw) {
  if (!model.is_object()) return absl::InvalidArgumentError("\"model\" must be an object");
  const auto type_it = model.find("type");
  if (type_it != model.end() && !type_it->is_null()) {
    if (!type_it->is_string())
      return absl::InvalidArgumentError("model: \"type\" must be a string");
    const std::string& type = type_it->get_ref<const std::string&>();
    if (type != "BPE") {
      return absl::InvalidArgumentError(
          absl::StrCat("model type \"", type, "\" is not supported (only byte-level BPE)"));
    }
  }
  for (const char* key :
       {"dropout", "byte_fallback", "continuing_subword_prefix", "end_of_word_suffix"}) {
    if (absl::Status s = RefuseUnlessUnset(model, key); !s.ok()) return s;
  }
  if (!raw.has_vocab) {
    return absl::InvalidArgumentError("model: \"vocab\" must be an object of token -> id");
  }
  if (!raw.has_merges) return absl::InvalidArgumentError("model: \"merges\" must be a list");

  std::unique_ptr<BpeModel> bpe(new BpeModel());
  const auto ignore_it = model.find("ignore_merges");
  bpe->ignore_merges_ =
      ignore_it != model.end() && ignore_it->is_boolean() && ignore_it->get<bool>();

  int64_t max_id = -1;
  for (const auto& [surface, id] : raw.vocab) {
    if (id < 0 || id > kMaxTokenId) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "model.vocab: id of \"%s\" must be in [0, %d], got %d", surface, kMaxTokenId, id));
    }
    max_id = std::max(max_id, id);
  }
  bpe->id_to_bytes_.resize(max_id + 1);
  bpe->has_id_.assign(max_id + 1, false);
  bpe->bytes_to_id_.Reserve(raw.vocab.size());
  for (auto& [surface, id64] : raw.vocab) {
    const auto id = static_cast<int32_t>(id64);
    if (bpe->has_id_[id]) {
      return absl::InvalidArgumentError(
          absl::StrFormat("model.vocab: id %d is used by two tokens (one is \"%s\")", id, surface));
    }
    bpe->has_id_[id] = true;
    if (std::optional<std::string> bytes = SurfaceToBytes(surface); bytes.has_value()) {
      bpe->id_to_bytes_[id] = std::move(*bytes);
      if (!bpe->bytes_to_id_.Insert(id, bpe->id_to_bytes_)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("model.vocab: token \"%s\" is listed twice", surface));
      }
    } else {
      bpe->odd_surface_to_id_.emplace(surface, id);
      bpe->id_to_bytes_[id] = std::move(surface);
    }
  }
  for (int b = 0; b < 256; ++b) {
    const int32_t id =
        bpe->bytes_to_id_.Find(std::string(1, static_cast<char>(b)), bpe->id_to_bytes_);
    if (id < 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "model.vocab has no token for byte 0x%02x (\"%s\"): not a byte-level BPE vocab", b,
          ByteToSurface()[b]));
    }
    bpe->byte_ids_[b] = id;
  }

  bpe->merges_.reserve(raw.merges.size());
  std::string joined;
  for (size_t rank = 0; rank < raw.merges.size(); ++rank) {
    const auto& [left, right] = raw.merges[rank];
    const int32_t l = bpe->SurfaceToId(left), r = bpe->SurfaceToId(right);
    if (l < 0 || r < 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "model.merges[%d]: token \"%s\" is not in the vocab", rank, l < 0 ? left : right));
    }
    joined.assign(left);
    joined.append(right);
    const int32_t result = bpe->SurfaceToId(joined);
    if (result < 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "model.merges[%d]: merged token \"%s\" is not in the vocab", rank, joined));
    }
    // The first (lowest-ranked) occurrence of a duplicated pair wins.
    bpe->merges_.emplace(PairKey(l, r), Merge{static_cast<int32_t>(rank), result});
  }
  return bpe;
}

int32_t BpeModel::SurfaceToId(std::string_view surface) const {
  if (std::optional<std::string> bytes = SurfaceToBytes(surface); bytes.has_value()) {
    return bytes_to_id_.Find(*bytes, id_to_bytes_);
  }
  const auto it = odd_surface_to_id_.find(std::string(surface));
  return it == odd_surface_to_id_.end() ? -1 : it->second;
}

void BpeModel::EncodeWord(std::string_view word, std::vector<int32_t>* ids) const {
  if (word.size() == 1) {
    ids->push_back(byte_ids_[static_cast<unsigned char>(word[0])]);
    return;
  }
  if (ignore_merges_) {
    if (const int32_t id = bytes_to_id_.Find(word, id_to_bytes_); id >= 0) {
      ids->push_back(id);
      return;
    }
  }
  if (word.size() > kMaxCachedWordBytes) {
    MergeWord(word, ids);
    return;
  }
  std::string key(word);
  {
    std::lock_guard<std::mutex> lock(cache_mu_);
    const auto it = cache_.find(key);
    if (it != cache_.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = ids->size();
  MergeWord(word, ids);
  std::lock_guard<std::mutex> lock(cache_mu_);
  if (cache_.size() >= kMaxCacheEntries) cache_.clear();
  cache_.emplace(std::move(key), std::vector<int32_t>(ids->begin() + start, ids->end()));
}

void BpeModel::MergeWord(std::string_view word, std::vector<int32_t>* ids) const {
  // Symbols form a doubly linked list over the word's bytes; a min-heap holds candidate pairs
  // by (rank, position), so each merge costs O(log n) and long runs stay O(n log n).
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
  };
  const int32_t n = static_cast<int32_t>(word.size());
  std::vector<Symbol> symbols(n);
  for (int32_t i = 0; i < n; ++i) {
    symbols[i] = {byte_ids_[static_cast<unsigned char>(word[i])], i - 1, i + 1 < n ? i + 1 : -1};
  }
  using Candidate = std::pair<int32_t, int32_t>;  // (rank, left position)
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto push = [&](int32_t left) {
    if (left < 0 || symbols[left].next < 0) return;
    if (const Merge* m = FindMerge(symbols[left].id, symbols[symbols[left].next].id)) {
      heap.emplace(m->rank, left);
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const auto [rank, left] = heap.top();
    heap.pop();
    Symbol& l = symbols[left];
    if (l.id < 0 || l.next < 0) continue;
    const Merge* m = FindMerge(l.id, symbols[l.next].id);
    if (m == nullptr || m->rank != rank) continue;  // stale: a neighbour changed
    Symbol& r = symbols[l.next];
    l.id = m->id;
    r.id = -1;
    l.next = r.next;
    if (l.next >= 0) symbols[l.next].prev = left;
    push(l.prev);
    push(left);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) ids->push_back(symbols[i].id);
}

}  // namespace preft::text::tokenizer_internal
