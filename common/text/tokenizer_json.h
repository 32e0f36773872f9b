#pragma once

// Parsing of tokenizer.json (internal to preft_model). The BPE vocab and merges (hundreds of
// thousands of entries) are streamed straight into flat vectors by a SAX handler; only the
// small rest of the file becomes a JSON DOM. A DOM of the whole file costs seconds.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace preft::text::tokenizer_internal {

// model.vocab and model.merges as written in the file (byte-level surface strings).
struct RawBpe {
  bool has_vocab = false;                                   // model.vocab was an object
  bool has_merges = false;                                  // model.merges was a list
  std::vector<std::pair<std::string, int64_t>> vocab;       // file order
  std::vector<std::pair<std::string, std::string>> merges;  // by rank
};

struct ParsedTokenizerJson {
  nlohmann::json root;  // with model.vocab and model.merges replaced by null when captured
  RawBpe bpe;
};

// Parses tokenizer.json text; malformed JSON or malformed vocab/merges entries give
// InvalidArgument. Never throws.
absl::StatusOr<ParsedTokenizerJson> ParseTokenizerJson(std::string_view text);

}  // namespace preft::text::tokenizer_internal
