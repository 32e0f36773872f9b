#pragma once

// Pre-tokenization for byte-level BPE (internal to preft_model): the Hugging Face `Split`,
// `ByteLevel` and `Sequence` pre-tokenizers over PCRE2 (UTF + UCP) regexes.

#include <deque>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace preft::text::tokenizer_internal {

// GPT-2's split regex, applied by ByteLevel when use_regex is true.
inline constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// A compiled PCRE2 pattern (JIT when available). Immutable; Split is thread-safe.
class Regex {
 public:
  // `literal` compiles `pattern` as a plain string.
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(std::string_view pattern, bool literal);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  struct Span {
    size_t begin;
    size_t end;
    bool match;
  };
  // Cuts `subject` (valid UTF-8) into the matches of the pattern and the gaps between them,
  // in order, covering all of it. Empty matches are dropped.
  absl::Status Spans(std::string_view subject, std::vector<Span>* spans) const;

 private:
  explicit Regex(void* code) : code_(code) {}
  void* code_;  // pcre2_code_8*
};

// HF SplitDelimiterBehavior.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// The pre-tokenizer chain: zero or more Splits, then ByteLevel (required, last).
// Immutable after Parse; thread-safe.
class PreTokenizer {
 public:
  // `config` is tokenizer.json's "pre_tokenizer" value.
  static absl::StatusOr<std::unique_ptr<PreTokenizer>> Parse(const nlohmann::json& config);
  // Builds the chain used by Llama 3 / Qwen2: Split(pattern, Isolated) then ByteLevel without
  // prefix space or regex.
  static absl::StatusOr<std::unique_ptr<PreTokenizer>> ForSplitPattern(std::string_view pattern);

  // Appends the pre-tokens of `text` (valid UTF-8) to `pieces`; pieces point into `text` or
  // into `storage` (for prefix spaces). Never appends empty pieces.
  absl::Status Run(std::string_view text, std::vector<std::string_view>* pieces,
                   std::deque<std::string>* storage) const;

 private:
  struct Step {
    std::unique_ptr<Regex> regex;
    SplitBehavior behavior = SplitBehavior::kIsolated;
    bool invert = false;
  };
  PreTokenizer() = default;
  absl::Status AddFromJson(const nlohmann::json& config, int depth, bool* saw_byte_level);
  absl::Status SplitAll(const Regex& regex, SplitBehavior behavior, bool invert,
                        std::vector<std::string_view>* pieces) const;

  std::vector<Step> splits_;
  bool add_prefix_space_ = false;
  std::unique_ptr<Regex> byte_level_regex_;  // set when ByteLevel has use_regex
};

}  // namespace preft::text::tokenizer_internal
