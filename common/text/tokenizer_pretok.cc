#include "common/text/tokenizer_pretok.h"

#include <algorithm>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/status_macros.h"

namespace preft::text::tokenizer_internal {
namespace {

using json = nlohmann::json;

constexpr int kMaxSequenceDepth = 8;

// Per-thread PCRE2 match state, shared by all patterns: a one-pair match data block (only the
// whole match is read) and a JIT stack big enough for long whitespace or digit runs.
struct MatchScratch {
  MatchScratch() {
    match_data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    if (context != nullptr && jit_stack != nullptr) {
      pcre2_jit_stack_assign(context, nullptr, jit_stack);
    }
  }
  ~MatchScratch() {
    pcre2_match_data_free(match_data);
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(jit_stack);
  }
  pcre2_match_data* match_data;
  pcre2_match_context* context;
  pcre2_jit_stack* jit_stack;
};

std::string Pcre2Message(int code) {
  PCRE2_UCHAR buffer[256];
  if (pcre2_get_error_message(code, buffer, sizeof(buffer)) < 0) return absl::StrCat(code);
  return reinterpret_cast<const char*>(buffer);
}

size_t Utf8Length(unsigned char b) {
  if (b < 0x80) return 1;
  if (b >= 0xF0) return 4;
  if (b >= 0xE0) return 3;
  return 2;
}

absl::StatusOr<SplitBehavior> ParseBehavior(const json& value) {
  if (!value.is_string()) {
    return absl::InvalidArgumentError("pre_tokenizer Split: \"behavior\" must be a string");
  }
  const std::string& s = value.get_ref<const std::string&>();
  if (s == "Removed") return SplitBehavior::kRemoved;
  if (s == "Isolated") return SplitBehavior::kIsolated;
  if (s == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (s == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (s == "Contiguous") return SplitBehavior::kContiguous;
  return absl::InvalidArgumentError(
      absl::StrCat("pre_tokenizer Split: unsupported behavior \"", s, "\""));
}

bool GetBool(const json& config, const char* key, bool default_value) {
  const auto it = config.find(key);
  if (it == config.end() || !it->is_boolean()) return default_value;
  return it->get<bool>();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Regex>> Regex::Compile(std::string_view pattern, bool literal) {
  // PCRE2_LITERAL accepts only a few options; UCP is not one of them (nor needed).
  const uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  int error = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   options, &error, &error_offset, nullptr);
  if (code == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "pre_tokenizer regex \"%s\" does not compile at offset %d: %s", std::string(pattern),
        static_cast<int64_t>(error_offset), Pcre2Message(error)));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // The interpreter is the fallback.
  return std::unique_ptr<Regex>(new Regex(code));
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

absl::Status Regex::Spans(std::string_view subject, std::vector<Span>* spans) const {
  thread_local MatchScratch scratch;
  if (scratch.match_data == nullptr || scratch.context == nullptr) {
    return absl::ResourceExhaustedError("pcre2: out of memory for match data");
  }
  auto* code = static_cast<const pcre2_code*>(code_);
  const auto* data = reinterpret_cast<PCRE2_SPTR>(subject.data());
  const size_t n = subject.size();
  size_t offset = 0;
  size_t prev = 0;
  while (offset < n) {
    // The caller validated the UTF-8 once; without NO_UTF_CHECK every call would rescan the
    // whole subject, which is quadratic.
    const int rc =
        pcre2_match(code, data, n, offset, PCRE2_NO_UTF_CHECK, scratch.match_data, scratch.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("pre_tokenizer regex match failed: ", Pcre2Message(rc)));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(scratch.match_data);
    const size_t begin = ovector[0], end = ovector[1];
    if (end <= begin || begin < offset) {
      // An empty (or \K-shifted) match: retry one character further on.
      const size_t at = std::max(offset, begin);
      if (at >= n) break;
      offset = at + Utf8Length(static_cast<unsigned char>(subject[at]));
      continue;
    }
    if (begin > prev) spans->push_back({prev, begin, false});
    spans->push_back({begin, end, true});
    prev = offset = end;
  }
  if (prev < n) spans->push_back({prev, n, false});
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PreTokenizer>> PreTokenizer::Parse(const json& config) {
  if (config.is_null()) {
    return absl::InvalidArgumentError(
        "pre_tokenizer is null: only byte-level BPE (with a ByteLevel pre-tokenizer) is "
        "supported");
  }
  std::unique_ptr<PreTokenizer> pre(new PreTokenizer());
  bool saw_byte_level = false;
  PREFT_RETURN_IF_ERROR(pre->AddFromJson(config, 0, &saw_byte_level));
  if (!saw_byte_level) {
    return absl::InvalidArgumentError(
        "pre_tokenizer has no ByteLevel step: only byte-level BPE is supported");
  }
  return pre;
}

absl::StatusOr<std::unique_ptr<PreTokenizer>> PreTokenizer::ForSplitPattern(
    std::string_view pattern) {
  std::unique_ptr<PreTokenizer> pre(new PreTokenizer());
  Step step;
  PREFT_ASSIGN_OR_RETURN(step.regex, Regex::Compile(pattern, /*literal=*/false));
  pre->splits_.push_back(std::move(step));
  return pre;
}

absl::Status PreTokenizer::AddFromJson(const json& config, int depth, bool* saw_byte_level) {
  if (depth > kMaxSequenceDepth) {
    return absl::InvalidArgumentError("pre_tokenizer: Sequence nested too deeply");
  }
  if (!config.is_object()) {
    return absl::InvalidArgumentError("pre_tokenizer: each pre-tokenizer must be an object");
  }
  const auto type_it = config.find("type");
  if (type_it == config.end() || !type_it->is_string()) {
    return absl::InvalidArgumentError("pre_tokenizer: missing string \"type\"");
  }
  const std::string& type = type_it->get_ref<const std::string&>();
  if (*saw_byte_level && type != "Sequence") {
    return absl::InvalidArgumentError(absl::StrCat(
        "pre_tokenizer: \"", type, "\" after ByteLevel is not supported (ByteLevel must be last)"));
  }
  if (type == "Sequence") {
    const auto it = config.find("pretokenizers");
    if (it == config.end() || !it->is_array()) {
      return absl::InvalidArgumentError("pre_tokenizer Sequence: \"pretokenizers\" must be a list");
    }
    for (const json& child : *it) {
      PREFT_RETURN_IF_ERROR(AddFromJson(child, depth + 1, saw_byte_level));
    }
    return absl::OkStatus();
  }
  if (type == "Split") {
    const auto pattern_it = config.find("pattern");
    if (pattern_it == config.end() || !pattern_it->is_object()) {
      return absl::InvalidArgumentError("pre_tokenizer Split: \"pattern\" must be an object");
    }
    Step step;
    const auto regex_it = pattern_it->find("Regex");
    const auto string_it = pattern_it->find("String");
    if (regex_it != pattern_it->end() && regex_it->is_string()) {
      PREFT_ASSIGN_OR_RETURN(step.regex, Regex::Compile(regex_it->get_ref<const std::string&>(),
                                                        /*literal=*/false));
    } else if (string_it != pattern_it->end() && string_it->is_string()) {
      const std::string& literal = string_it->get_ref<const std::string&>();
      if (literal.empty()) {
        return absl::InvalidArgumentError("pre_tokenizer Split: empty \"String\" pattern");
      }
      PREFT_ASSIGN_OR_RETURN(step.regex, Regex::Compile(literal, /*literal=*/true));
    } else {
      return absl::InvalidArgumentError(
          "pre_tokenizer Split: \"pattern\" needs a string \"Regex\" or \"String\"");
    }
    const auto behavior_it = config.find("behavior");
    if (behavior_it != config.end()) {
      PREFT_ASSIGN_OR_RETURN(step.behavior, ParseBehavior(*behavior_it));
    }
    step.invert = GetBool(config, "invert", false);
    splits_.push_back(std::move(step));
    return absl::OkStatus();
  }
  if (type == "ByteLevel") {
    *saw_byte_level = true;
    // Hugging Face's defaults are add_prefix_space = true, use_regex = true.
    add_prefix_space_ = GetBool(config, "add_prefix_space", true);
    if (GetBool(config, "use_regex", true)) {
      PREFT_ASSIGN_OR_RETURN(byte_level_regex_, Regex::Compile(kGpt2Pattern, /*literal=*/false));
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "pre_tokenizer type \"", type,
      "\" is not supported (supported: Sequence, Split, ByteLevel for byte-level BPE)"));
}

absl::Status PreTokenizer::SplitAll(const Regex& regex, SplitBehavior behavior, bool invert,
                                    std::vector<std::string_view>* pieces) const {
  std::vector<std::string_view> out;
  out.reserve(pieces->size());
  std::vector<Regex::Span> spans;
  for (std::string_view piece : *pieces) {
    spans.clear();
    PREFT_RETURN_IF_ERROR(regex.Spans(piece, &spans));
    if (invert) {
      for (Regex::Span& span : spans) span.match = !span.match;
    }
    // Merge per Hugging Face's SplitDelimiterBehavior, on [begin, end) offsets into `piece`.
    std::vector<Regex::Span> merged;
    merged.reserve(spans.size());
    switch (behavior) {
      case SplitBehavior::kIsolated:
        merged = spans;
        break;
      case SplitBehavior::kRemoved:
        for (const Regex::Span& s : spans) {
          if (!s.match) merged.push_back(s);
        }
        break;
      case SplitBehavior::kMergedWithPrevious: {
        bool previous_match = false;
        for (const Regex::Span& s : spans) {
          if (s.match && !previous_match && !merged.empty()) {
            merged.back().end = s.end;
          } else {
            merged.push_back(s);
          }
          previous_match = s.match;
        }
        break;
      }
      case SplitBehavior::kMergedWithNext: {
        bool previous_match = false;
        for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
          if (it->match && !previous_match && !merged.empty()) {
            merged.back().begin = it->begin;
          } else {
            merged.push_back(*it);
          }
          previous_match = it->match;
        }
        std::reverse(merged.begin(), merged.end());
        break;
      }
      case SplitBehavior::kContiguous: {
        bool previous_match = false;
        for (const Regex::Span& s : spans) {
          if (s.match == previous_match && !merged.empty()) {
            merged.back().end = s.end;
          } else {
            merged.push_back(s);
          }
          previous_match = s.match;
        }
        break;
      }
    }
    for (const Regex::Span& s : merged) {
      if (s.end > s.begin) out.push_back(piece.substr(s.begin, s.end - s.begin));
    }
  }
  *pieces = std::move(out);
  return absl::OkStatus();
}

absl::Status PreTokenizer::Run(std::string_view text, std::vector<std::string_view>* pieces,
                               std::deque<std::string>* storage) const {
  if (text.empty()) return absl::OkStatus();
  std::vector<std::string_view> local = {text};
  for (const Step& step : splits_) {
    PREFT_RETURN_IF_ERROR(SplitAll(*step.regex, step.behavior, step.invert, &local));
  }
  if (add_prefix_space_) {
    for (std::string_view& piece : local) {
      if (piece.front() != ' ') {
        storage->push_back(std::string(" ").append(piece));
        piece = storage->back();
      }
    }
  }
  if (byte_level_regex_ != nullptr) {
    PREFT_RETURN_IF_ERROR(
        SplitAll(*byte_level_regex_, SplitBehavior::kIsolated, /*invert=*/false, &local));
  }
  pieces->insert(pieces->end(), local.begin(), local.end());
  return absl::OkStatus();
}

}  // namespace preft::text::tokenizer_internal
