#pragma once

// tokenizer.json's "normalizer", applied as Hugging Face tokenizers applies it: to the text
// between added tokens, before pre-tokenization (decode never normalizes). Implemented: NFC,
// NFD, NFKC, NFKD (utf8proc), Lowercase (full Unicode lowercase, final sigma included), Strip,
// Replace (a string or a regex), Prepend and Sequence; the families preft serves ship NFC
// (Qwen2/2.5) or none (Llama 3, Mistral's tekken). Any other type is refused at load, naming it.

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace preft::text::tokenizer_internal {

// Immutable after Parse; thread-safe.
class Normalizer {
 public:
  virtual ~Normalizer() = default;
  // `config` is the "normalizer" value: null gives nullptr (no normalization). Unimplemented
  // for a type preft lacks, InvalidArgument for a malformed one; both name the type.
  static absl::StatusOr<std::unique_ptr<Normalizer>> Parse(const nlohmann::json& config,
                                                           int depth = 0);
  // `text` is valid UTF-8; so is the result.
  virtual std::string Apply(std::string_view text) const = 0;
};

}  // namespace preft::text::tokenizer_internal
