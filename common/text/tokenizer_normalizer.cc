#include "common/text/tokenizer_normalizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/base/status_macros.h"

namespace preft::text::tokenizer_internal {
namespace {

using json = nlohmann::json;
constexpr int kMaxDepth = 16;

// The code points of valid UTF-8 text.
std::vector<utf8proc_int32_t> CodePoints(std::string_view text) {
  std::vector<utf8proc_int32_t> out;
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(text.data());
  utf8proc_ssize_t left = static_cast<utf8proc_ssize_t>(text.size());
  while (left > 0) {
    utf8proc_int32_t c;
    const utf8proc_ssize_t n = utf8proc_iterate(p, left, &c);
    if (n <= 0) break;  // not reached: callers pass valid UTF-8
    out.push_back(c);
    p += n;
    left -= n;
  }
  return out;
}

void Append(std::string* out, utf8proc_int32_t c) {
  utf8proc_uint8_t buf[4];
  const utf8proc_ssize_t n = utf8proc_encode_char(c, buf);
  out->append(reinterpret_cast<const char*>(buf), static_cast<size_t>(n));
}

class UnicodeForm final : public Normalizer {
 public:
  explicit UnicodeForm(utf8proc_option_t options) : options_(options) {}
  std::string Apply(std::string_view text) const override {
    // ASCII is its own NFC/NFD/NFKC/NFKD: most prompts skip the mapping.
    if (std::all_of(text.begin(), text.end(),
                    [](char c) { return static_cast<unsigned char>(c) < 0x80; })) {
      return std::string(text);
    }
    utf8proc_uint8_t* mapped = nullptr;
    const utf8proc_ssize_t n =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                     static_cast<utf8proc_ssize_t>(text.size()), &mapped, options_);
    if (n < 0) return std::string(text);  // not reached for valid UTF-8
    std::string out(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n));
    std::free(mapped);
    return out;
  }

 private:
  utf8proc_option_t options_;
};

bool Cased(utf8proc_int32_t c) {
  const utf8proc_category_t cat = utf8proc_category(c);
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL ||
         cat == UTF8PROC_CATEGORY_LT || utf8proc_tolower(c) != c || utf8proc_toupper(c) != c;
}

bool CaseIgnorable(utf8proc_int32_t c) {
  const utf8proc_category_t cat = utf8proc_category(c);
  return cat == UTF8PROC_CATEGORY_MN || cat == UTF8PROC_CATEGORY_ME ||
         cat == UTF8PROC_CATEGORY_CF || cat == UTF8PROC_CATEGORY_LM ||
         cat == UTF8PROC_CATEGORY_SK || c == '\'' || c == '.' || c == ':' || c == 0x00B7 ||
         c == 0x2019;
}

// Rust's str::to_lowercase (what Hugging Face's Lowercase calls): the simple mapping, plus
// the two unconditional special cases that are not one-to-one: U+0130 -> "i\u0307", and a
// capital sigma at the end of a word -> final sigma.
class Lowercase final : public Normalizer {
 public:
  std::string Apply(std::string_view text) const override {
    const std::vector<utf8proc_int32_t> cps = CodePoints(text);
    std::string out;
    out.reserve(text.size());
    for (size_t i = 0; i < cps.size(); ++i) {
      const utf8proc_int32_t c = cps[i];
      if (c == 0x0130) {
        Append(&out, 'i');
        Append(&out, 0x0307);
      } else if (c == 0x03A3) {
        Append(&out, FinalSigma(cps, i) ? 0x03C2 : 0x03C3);
      } else {
        Append(&out, utf8proc_tolower(c));
      }
    }
    return out;
  }

 private:
  // Unicode's Final_Sigma: a cased letter before (skipping case-ignorables), none after.
  static bool FinalSigma(const std::vector<utf8proc_int32_t>& cps, size_t i) {
    size_t j = i;
    bool before = false;
    while (j > 0) {
      --j;
      if (CaseIgnorable(cps[j])) continue;
      before = Cased(cps[j]);
      break;
    }
    if (!before) return false;
    for (size_t k = i + 1; k < cps.size(); ++k) {
      if (CaseIgnorable(cps[k])) continue;
      return !Cased(cps[k]);
    }
    return true;
  }
};

// Unicode White_Space, as Rust's char::is_whitespace.
bool WhiteSpace(utf8proc_int32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

class Strip final : public Normalizer {
 public:
  Strip(bool left, bool right) : left_(left), right_(right) {}
  std::string Apply(std::string_view text) const override {
    const std::vector<utf8proc_int32_t> cps = CodePoints(text);
    size_t begin = 0, end = cps.size();
    if (left_) while (begin < end && WhiteSpace(cps[begin])) ++begin;
    if (right_) while (end > begin && WhiteSpace(cps[end - 1])) --end;
    std::string out;
    for (size_t i = begin; i < end; ++i) Append(&out, cps[i]);
    return out;
  }

 private:
  bool left_, right_;
};

class Prepend final : public Normalizer {
 public:
  explicit Prepend(std::string prefix) : prefix_(std::move(prefix)) {}
  std::string Apply(std::string_view text) const override {
    if (text.empty()) return "";  // as Hugging Face: nothing to prepend to
    return prefix_ + std::string(text);
  }

 private:
  std::string prefix_;
};

class ReplaceString final : public Normalizer {
 public:
  ReplaceString(std::string pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  std::string Apply(std::string_view text) const override {
    return absl::StrReplaceAll(absl::string_view(text.data(), text.size()),
                               {{pattern_, content_}});
  }

 private:
  std::string pattern_, content_;
};

class ReplaceRegex final : public Normalizer {
 public:
  static absl::StatusOr<std::unique_ptr<Normalizer>> Create(const std::string& pattern,
                                                            std::string content) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
    if (code == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "normalizer Replace: regex \"", pattern, "\" does not compile at offset ", offset));
    }
    return std::unique_ptr<Normalizer>(new ReplaceRegex(code, std::move(content)));
  }
  ~ReplaceRegex() override { pcre2_code_free(code_); }
  std::string Apply(std::string_view text) const override {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    std::string out;
    size_t pos = 0;
    while (pos <= text.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(),
                                 pos, 0, md, nullptr);
      if (rc < 0) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      out.append(text.substr(pos, ov[0] - pos));
      out.append(content_);
      if (ov[1] == ov[0]) {  // an empty match: keep one code point and move past it
        if (ov[1] >= text.size()) {
          pos = text.size() + 1;
          break;
        }
        size_t next = ov[1] + 1;
        while (next < text.size() && (static_cast<unsigned char>(text[next]) & 0xC0) == 0x80) ++next;
        out.append(text.substr(ov[1], next - ov[1]));
        pos = next;
      } else {
        pos = ov[1];
      }
    }
    if (pos < text.size()) out.append(text.substr(pos));
    pcre2_match_data_free(md);
    return out;
  }

 private:
  ReplaceRegex(pcre2_code* code, std::string content) : code_(code), content_(std::move(content)) {}
  pcre2_code* code_;
  std::string content_;
};

class Sequence final : public Normalizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}
  std::string Apply(std::string_view text) const override {
    std::string s(text);
    for (const auto& step : steps_) s = step->Apply(s);
    return s;
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

absl::StatusOr<std::string> StringField(const json& config, const char* key,
                                        const std::string& type) {
  if (!config.contains(key) || !config[key].is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat("normalizer ", type, ": \"", key, "\" must be a string"));
  }
  return config[key].get<std::string>();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Normalizer>> Normalizer::Parse(const json& config, int depth) {
  if (config.is_null()) return std::unique_ptr<Normalizer>();
  if (depth > kMaxDepth || !config.is_object() || !config.contains("type") ||
      !config["type"].is_string()) {
    return absl::InvalidArgumentError("normalizer: must be null or an object with a \"type\"");
  }
  const std::string type = config["type"].get<std::string>();
  const auto make = [](Normalizer* n) -> absl::StatusOr<std::unique_ptr<Normalizer>> {
    return std::unique_ptr<Normalizer>(n);
  };
  constexpr auto kStable = UTF8PROC_STABLE;
  if (type == "NFC") return make(new UnicodeForm(utf8proc_option_t(kStable | UTF8PROC_COMPOSE)));
  if (type == "NFD") return make(new UnicodeForm(utf8proc_option_t(kStable | UTF8PROC_DECOMPOSE)));
  if (type == "NFKC") {
    return make(new UnicodeForm(utf8proc_option_t(kStable | UTF8PROC_COMPOSE | UTF8PROC_COMPAT)));
  }
  if (type == "NFKD") {
    return make(new UnicodeForm(utf8proc_option_t(kStable | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT)));
  }
  if (type == "Lowercase") return make(new Lowercase());
  if (type == "Strip") {
    auto flag = [&](const char* key) {
      return config.contains(key) && config[key].is_boolean() ? config[key].get<bool>() : true;
    };
    return make(new Strip(flag("strip_left"), flag("strip_right")));
  }
  if (type == "Prepend") {
    PREFT_ASSIGN_OR_RETURN(std::string prefix, StringField(config, "prepend", type));
    return make(new Prepend(std::move(prefix)));
  }
  if (type == "Replace") {
    PREFT_ASSIGN_OR_RETURN(std::string content, StringField(config, "content", type));
    const json pattern = config.value("pattern", json());
    if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string()) {
      const std::string s = pattern["String"].get<std::string>();
      if (s.empty()) return absl::InvalidArgumentError("normalizer Replace: empty pattern");
      return make(new ReplaceString(s, std::move(content)));
    }
    if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
      return ReplaceRegex::Create(pattern["Regex"].get<std::string>(), std::move(content));
    }
    return absl::InvalidArgumentError(
        "normalizer Replace: \"pattern\" must be {\"String\": ...} or {\"Regex\": ...}");
  }
  if (type == "Sequence") {
    if (!config.contains("normalizers") || !config["normalizers"].is_array()) {
      return absl::InvalidArgumentError("normalizer Sequence: \"normalizers\" must be a list");
    }
    std::vector<std::unique_ptr<Normalizer>> steps;
    for (const json& child : config["normalizers"]) {
      PREFT_ASSIGN_OR_RETURN(std::unique_ptr<Normalizer> step, Parse(child, depth + 1));
      if (step != nullptr) steps.push_back(std::move(step));
    }
    return make(new Sequence(std::move(steps)));
  }
  return absl::UnimplementedError(absl::StrCat(
      "normalizer type \"", type,
      "\" is not implemented (preft has NFC, NFD, NFKC, NFKD, Lowercase, Strip, Replace, "
      "Prepend and Sequence)"));
}

}  // namespace preft::text::tokenizer_internal
