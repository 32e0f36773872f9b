#include "common/text/tokenizer.h"

#include <algorithm>
#include <deque>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"
#include "common/text/tokenizer_added.h"
#include "common/text/tokenizer_bpe.h"
#include "common/text/tokenizer_json.h"
#include "common/text/tokenizer_normalizer.h"
#include "common/text/tokenizer_pretok.h"
#include "common/text/tokenizer_unicode.h"

namespace preft::text {
namespace {

using json = nlohmann::json;
using tokenizer_internal::AddedToken;
using tokenizer_internal::AddedTokenMatcher;
using tokenizer_internal::BpeModel;
using tokenizer_internal::Normalizer;
using tokenizer_internal::PreTokenizer;

constexpr int kMaxNestingDepth = 8;

// The parts of tokenizer_config.json we use.
struct TokenizerConfig {
  std::optional<bool> add_bos_token;
  std::optional<bool> add_eos_token;
  std::optional<std::string> bos_token;
  std::optional<std::string> eos_token;
};

class BpeTokenizer final : public Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> FromJson(
      tokenizer_internal::ParsedTokenizerJson parsed, const std::optional<TokenizerConfig>& config);

  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              bool add_special_tokens) const override;
  absl::StatusOr<std::string> Decode(const std::vector<int32_t>& ids,
                                     bool skip_special_tokens) const override;
  std::string TokenBytes(int32_t id) const override;
  bool IsSpecial(int32_t id) const override { return id >= 0 && id < vocab_size_ && special_[id]; }
  int32_t vocab_size() const override { return vocab_size_; }
  int32_t bos_token_id() const override { return bos_id_; }
  int32_t eos_token_id() const override { return eos_id_; }
  int32_t TokenToId(std::string_view token) const override;

 private:
  BpeTokenizer() = default;
  absl::Status ParseAddedTokens(const json& root);
  absl::Status ParsePostProcessor(const json& config, int depth);
  absl::Status ApplyConfig(const std::optional<TokenizerConfig>& config);

  std::unique_ptr<BpeModel> model_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<Normalizer> normalizer_;  // null: none
  std::vector<AddedToken> added_;
  // Without a normalizer, every added token in one pass. With one, as Hugging Face: first the
  // tokens with normalized=false in the raw text, then, in each normalized piece between them,
  // those with normalized=true (by their normalized content).
  AddedTokenMatcher matcher_;
  AddedTokenMatcher normalized_matcher_;
  std::unordered_map<int32_t, int32_t> added_by_id_;  // id -> index in added_
  std::unordered_map<std::string, int32_t> added_by_content_;
  std::vector<bool> special_;
  int32_t vocab_size_ = 0;
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  std::vector<int32_t> prefix_ids_;  // prepended when add_special_tokens
  std::vector<int32_t> suffix_ids_;  // appended when add_special_tokens
};

absl::Status CheckDecoder(const json& decoder, int depth) {
  if (decoder.is_null()) return absl::OkStatus();
  if (depth > kMaxNestingDepth || !decoder.is_object() || !decoder.contains("type") ||
      !decoder["type"].is_string()) {
    return absl::InvalidArgumentError("decoder: must be null or an object with a \"type\"");
  }
  const std::string& type = decoder["type"].get_ref<const std::string&>();
  if (type == "ByteLevel") return absl::OkStatus();
  if (type == "Sequence" && decoder.contains("decoders") && decoder["decoders"].is_array()) {
    for (const json& child : decoder["decoders"]) {
      PREFT_RETURN_IF_ERROR(CheckDecoder(child, depth + 1));
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "decoder type \"", type, "\" is not supported (only ByteLevel for byte-level BPE)"));
}

bool OptionalBool(const json& object, const char* key, bool default_value) {
  const auto it = object.find(key);
  return it != object.end() && it->is_boolean() ? it->get<bool>() : default_value;
}

// A bos_token/eos_token entry: a string, {"content": string}, or null/absent.
absl::StatusOr<std::optional<std::string>> TokenName(const json& object, const char* key) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::optional<std::string>();
  if (it->is_string()) return std::optional<std::string>(it->get<std::string>());
  if (it->is_object()) {
    const auto content = it->find("content");
    if (content != it->end() && content->is_string()) {
      return std::optional<std::string>(content->get<std::string>());
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("tokenizer_config.json: \"", key,
                                                 "\" must be a string or {\"content\": string}"));
}

absl::StatusOr<std::optional<TokenizerConfig>> ReadConfig(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return std::optional<TokenizerConfig>();
  PREFT_ASSIGN_OR_RETURN(std::string text, base::ReadFileToString(path));
  json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  }
  TokenizerConfig config;
  if (root.contains("add_bos_token") && root["add_bos_token"].is_boolean()) {
    config.add_bos_token = root["add_bos_token"].get<bool>();
  }
  if (root.contains("add_eos_token") && root["add_eos_token"].is_boolean()) {
    config.add_eos_token = root["add_eos_token"].get<bool>();
  }
  PREFT_ASSIGN_OR_RETURN(config.bos_token, TokenName(root, "bos_token"));
  PREFT_ASSIGN_OR_RETURN(config.eos_token, TokenName(root, "eos_token"));
  return std::optional<TokenizerConfig>(std::move(config));
}

absl::StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::FromJson(
    tokenizer_internal::ParsedTokenizerJson parsed, const std::optional<TokenizerConfig>& config) {
  const json& root = parsed.root;
  if (!root.is_object()) return absl::InvalidArgumentError("top level must be a JSON object");
  std::unique_ptr<BpeTokenizer> tok(new BpeTokenizer());
  if (!root.contains("model")) return absl::InvalidArgumentError("missing \"model\"");
  PREFT_ASSIGN_OR_RETURN(tok->model_, BpeModel::FromParts(root["model"], std::move(parsed.bpe)));
  PREFT_ASSIGN_OR_RETURN(tok->normalizer_, Normalizer::Parse(root.value("normalizer", json())));
  PREFT_ASSIGN_OR_RETURN(tok->pre_tokenizer_,
                         PreTokenizer::Parse(root.value("pre_tokenizer", json())));
  PREFT_RETURN_IF_ERROR(CheckDecoder(root.value("decoder", json()), 0));
  PREFT_RETURN_IF_ERROR(tok->ParseAddedTokens(root));
  PREFT_RETURN_IF_ERROR(tok->ParsePostProcessor(root.value("post_processor", json()), 0));
  PREFT_RETURN_IF_ERROR(tok->ApplyConfig(config));
  return tok;
}

absl::Status BpeTokenizer::ParseAddedTokens(const json& root) {
  vocab_size_ = model_->id_end();
  special_.assign(vocab_size_, false);
  const json added = root.value("added_tokens", json());
  if (added.is_null()) return absl::OkStatus();
  if (!added.is_array()) return absl::InvalidArgumentError("\"added_tokens\" must be a list");
  for (const json& entry : added) {
    if (!entry.is_object() || !entry.contains("id") || !entry["id"].is_number_integer() ||
        !entry.contains("content") || !entry["content"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "added_tokens: each entry needs an integer \"id\" and a string \"content\", got ",
          entry.dump()));
    }
    AddedToken token;
    const int64_t id = entry["id"].get<int64_t>();
    token.content = entry["content"].get<std::string>();
    if (id < 0 || id > tokenizer_internal::kMaxTokenId || token.content.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("added_tokens: bad id or empty content in ", entry.dump()));
    }
    token.id = static_cast<int32_t>(id);
    token.special = OptionalBool(entry, "special", false);
    token.lstrip = OptionalBool(entry, "lstrip", false);
    token.rstrip = OptionalBool(entry, "rstrip", false);
    token.single_word = OptionalBool(entry, "single_word", false);
    token.normalized = OptionalBool(entry, "normalized", !token.special);
    const auto index = static_cast<int32_t>(added_.size());
    if (normalizer_ != nullptr && token.normalized) {
      const std::string normalized = normalizer_->Apply(token.content);
      if (!normalized.empty()) normalized_matcher_.Add(normalized, index);
    } else {
      matcher_.Add(token.content, index);
    }
    added_by_id_[token.id] = index;
    added_by_content_[token.content] = token.id;
    vocab_size_ = std::max(vocab_size_, token.id + 1);
    added_.push_back(std::move(token));
  }
  special_.assign(vocab_size_, false);
  for (const AddedToken& token : added_) {
    if (token.special) special_[token.id] = true;
  }
  return absl::OkStatus();
}

absl::Status BpeTokenizer::ParsePostProcessor(const json& config, int depth) {
  if (config.is_null()) return absl::OkStatus();
  if (depth > kMaxNestingDepth || !config.is_object() || !config.contains("type") ||
      !config["type"].is_string()) {
    return absl::InvalidArgumentError("post_processor: must be null or an object with a \"type\"");
  }
  const std::string& type = config["type"].get_ref<const std::string&>();
  if (type == "ByteLevel") return absl::OkStatus();  // only adjusts offsets
  if (type == "Sequence") {
    if (!config.contains("processors") || !config["processors"].is_array()) {
      return absl::InvalidArgumentError("post_processor Sequence: \"processors\" must be a list");
    }
    for (const json& child : config["processors"]) {
      PREFT_RETURN_IF_ERROR(ParsePostProcessor(child, depth + 1));
    }
    return absl::OkStatus();
  }
  if (type != "TemplateProcessing") {
    return absl::InvalidArgumentError(
        absl::StrCat("post_processor type \"", type,
                     "\" is not supported (supported: TemplateProcessing, ByteLevel, Sequence)"));
  }
  if (!config.contains("single") || !config["single"].is_array()) {
    return absl::InvalidArgumentError(
        "post_processor TemplateProcessing: \"single\" must be a list");
  }
  const json specials = config.value("special_tokens", json::object());
  bool seen_sequence = false;
  for (const json& piece : config["single"]) {
    if (piece.is_object() && piece.contains("Sequence")) {
      seen_sequence = true;
      continue;
    }
    if (!piece.is_object() || !piece.contains("SpecialToken") ||
        !piece["SpecialToken"].is_object() || !piece["SpecialToken"].contains("id") ||
        !piece["SpecialToken"]["id"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "post_processor TemplateProcessing: unsupported template piece ", piece.dump()));
    }
    const std::string& name = piece["SpecialToken"]["id"].get_ref<const std::string&>();
    std::vector<int32_t> ids;
    if (specials.is_object() && specials.contains(name) && specials[name].is_object() &&
        specials[name].contains("ids") && specials[name]["ids"].is_array()) {
      for (const json& id : specials[name]["ids"]) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab_size_) {
          return absl::InvalidArgumentError(absl::StrCat(
              "post_processor TemplateProcessing: bad id ", id.dump(), " for \"", name, "\""));
        }
        ids.push_back(id.get<int32_t>());
      }
    } else {
      const int32_t id = TokenToId(name);
      if (id < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "post_processor TemplateProcessing: special token \"", name, "\" is unknown"));
      }
      ids.push_back(id);
    }
    std::vector<int32_t>& target = seen_sequence ? suffix_ids_ : prefix_ids_;
    target.insert(target.end(), ids.begin(), ids.end());
  }
  return absl::OkStatus();
}

absl::Status BpeTokenizer::ApplyConfig(const std::optional<TokenizerConfig>& config) {
  auto resolve = [&](const std::optional<std::string>& name, const char* key,
                     int32_t* id) -> absl::Status {
    if (!name.has_value()) return absl::OkStatus();
    *id = TokenToId(*name);
    if (*id < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer_config.json: ", key, " \"", *name, "\" is not a token"));
    }
    return absl::OkStatus();
  };
  // Without a config, BOS is whatever the post-processor template prepends.
  if (prefix_ids_.size() == 1) bos_id_ = prefix_ids_[0];
  if (!config.has_value()) return absl::OkStatus();
  if (config->bos_token.has_value()) bos_id_ = -1;
  PREFT_RETURN_IF_ERROR(resolve(config->bos_token, "bos_token", &bos_id_));
  PREFT_RETURN_IF_ERROR(resolve(config->eos_token, "eos_token", &eos_id_));
  // An explicit add_bos_token/add_eos_token overrides the template, as transformers does when
  // it rebuilds the post-processor from them.
  if (config->add_bos_token.has_value()) {
    std::erase(prefix_ids_, bos_id_);
    if (*config->add_bos_token) {
      if (bos_id_ < 0) {
        return absl::InvalidArgumentError(
            "tokenizer_config.json: add_bos_token is true but there is no bos_token");
      }
      prefix_ids_.insert(prefix_ids_.begin(), bos_id_);
    }
  }
  if (config->add_eos_token.has_value()) {
    std::erase(suffix_ids_, eos_id_);
    if (*config->add_eos_token) {
      if (eos_id_ < 0) {
        return absl::InvalidArgumentError(
            "tokenizer_config.json: add_eos_token is true but there is no eos_token");
      }
      suffix_ids_.push_back(eos_id_);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> BpeTokenizer::Encode(std::string_view text,
                                                          bool add_special_tokens) const {
  if (const auto bad = tokenizer_internal::FirstInvalidUtf8(text); bad.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("text is not valid UTF-8 at byte offset %d", static_cast<int64_t>(*bad)));
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + prefix_ids_.size() + suffix_ids_.size() + 1);
  if (add_special_tokens) ids = prefix_ids_;
  std::vector<std::string_view> pieces;
  std::deque<std::string> storage;
  auto encode_segment = [&](std::string_view segment) -> absl::Status {
    pieces.clear();
    storage.clear();
    PREFT_RETURN_IF_ERROR(pre_tokenizer_->Run(segment, &pieces, &storage));
    for (std::string_view piece : pieces) model_->EncodeWord(piece, &ids);
    return absl::OkStatus();
  };
  // Splits `piece` on `matcher`'s added tokens, handing the text between them to `between`.
  auto split = [&](std::string_view piece, const AddedTokenMatcher& matcher,
                   const auto& between) -> absl::Status {
    size_t start = 0;
    while (start < piece.size()) {
      const AddedTokenMatcher::Match match = matcher.Find(piece, start, start, added_);
      PREFT_RETURN_IF_ERROR(between(piece.substr(start, match.begin - start)));
      if (match.index < 0) break;
      ids.push_back(added_[match.index].id);
      start = match.end;
    }
    return absl::OkStatus();
  };
  if (normalizer_ == nullptr) {
    PREFT_RETURN_IF_ERROR(split(text, matcher_, encode_segment));
  } else {
    PREFT_RETURN_IF_ERROR(split(text, matcher_, [&](std::string_view raw) -> absl::Status {
      if (raw.empty()) return absl::OkStatus();
      const std::string normalized = normalizer_->Apply(raw);
      return split(normalized, normalized_matcher_, encode_segment);
    }));
  }
  if (add_special_tokens) ids.insert(ids.end(), suffix_ids_.begin(), suffix_ids_.end());
  return ids;
}

absl::StatusOr<std::string> BpeTokenizer::Decode(const std::vector<int32_t>& ids,
                                                 bool skip_special_tokens) const {
  std::string bytes;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= vocab_size_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "token id %d at position %d is out of range [0, %d)", id, i, vocab_size_));
    }
    if (skip_special_tokens && special_[id]) continue;
    bytes += TokenBytes(id);
  }
  std::string text;
  text.reserve(bytes.size());
  tokenizer_internal::AppendUtf8Lossy(bytes, /*hold_incomplete_tail=*/false, &text);
  return text;
}

std::string BpeTokenizer::TokenBytes(int32_t id) const {
  if (const auto it = added_by_id_.find(id); it != added_by_id_.end()) {
    return added_[it->second].content;
  }
  const std::string* bytes = model_->TokenBytes(id);
  return bytes == nullptr ? std::string() : *bytes;
}

int32_t BpeTokenizer::TokenToId(std::string_view token) const {
  if (const auto it = added_by_content_.find(std::string(token)); it != added_by_content_.end()) {
    return it->second;
  }
  return model_->SurfaceToId(token);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& tokenizer_json_path) {
  PREFT_ASSIGN_OR_RETURN(std::string text, base::ReadFileToString(tokenizer_json_path));
  const std::string config_path =
      (std::filesystem::path(tokenizer_json_path).parent_path() / "tokenizer_config.json").string();
  try {
    absl::StatusOr<std::unique_ptr<BpeTokenizer>> tok;
    absl::StatusOr<tokenizer_internal::ParsedTokenizerJson> parsed =
        tokenizer_internal::ParseTokenizerJson(text);
    text.clear();
    text.shrink_to_fit();
    if (parsed.ok()) {
      PREFT_ASSIGN_OR_RETURN(std::optional<TokenizerConfig> config, ReadConfig(config_path));
      tok = BpeTokenizer::FromJson(std::move(*parsed), config);
    } else {
      tok = parsed.status();
    }
    if (!tok.ok()) {
      return absl::Status(tok.status().code(),
                          absl::StrCat(tokenizer_json_path, ": ", tok.status().message()));
    }
    return std::unique_ptr<Tokenizer>(std::move(*tok));
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(tokenizer_json_path, ": ", e.what()));
  }
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::LoadFromModelDir(const std::string& dir) {
  return Load((std::filesystem::path(dir) / "tokenizer.json").string());
}

std::string StreamDecoder::Push(int32_t id) {
  if (skip_special_tokens_ && tokenizer_->IsSpecial(id)) return std::string();
  pending_ += tokenizer_->TokenBytes(id);
  std::string text;
  const size_t used =
      tokenizer_internal::AppendUtf8Lossy(pending_, /*hold_incomplete_tail=*/true, &text);
  pending_.erase(0, used);
  return text;
}

std::string StreamDecoder::Flush() {
  std::string text;
  tokenizer_internal::AppendUtf8Lossy(pending_, /*hold_incomplete_tail=*/false, &text);
  pending_.clear();
  return text;
}

}  // namespace preft::text
