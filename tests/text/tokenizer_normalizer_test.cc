// tokenizer.json's normalizer, applied where Hugging Face applies it. The ids themselves are
// checked against Hugging Face's JavaScript tokenizers in tests/tokenizer_js; these tests pin
// the rules around them: added tokens raw vs normalized, decode untouched, refusals.

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "common/base/mapped_file.h"
#include "common/text/tokenizer.h"
#include "nlohmann/json.hpp"

namespace preft::text {
namespace {

using json = nlohmann::json;

// make-model's qwen2 tokenizer (normalizer NFC) in a fresh folder; `edit` changes its JSON.
std::unique_ptr<Tokenizer> Qwen2Tokenizer(const std::string& name,
                                          const std::function<void(json&)>& edit = nullptr,
                                          absl::Status* error = nullptr) {
  const std::string dir = (std::filesystem::path(::testing::TempDir()) /
                           ("preft_normalizer_" + std::to_string(getpid())) / name)
                              .string();
  std::filesystem::create_directories(dir);
  SyntheticTokenizerOptions o;
  o.vocab_size = 400;
  o.style = "qwen2";
  int32_t bos, eos;
  EXPECT_TRUE(WriteSyntheticTokenizer(dir, o, &bos, &eos).ok());
  if (edit) {
    json j = json::parse(*base::ReadFileToString(dir + "/tokenizer.json"));
    edit(j);
    std::ofstream(dir + "/tokenizer.json") << j.dump();
  }
  auto tok = Tokenizer::LoadFromModelDir(dir);
  if (error != nullptr) *error = tok.status();
  if (!tok.ok()) return nullptr;
  return std::move(tok).value();
}

std::vector<int32_t> Ids(const Tokenizer& t, std::string_view text) {
  auto ids = t.Encode(text, false);
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? *ids : std::vector<int32_t>{};
}

TEST(TokenizerNormalizerTest, Qwen2NormalizesToNfcAndDecodeDoesNot) {
  auto nfc = Qwen2Tokenizer("nfc");
  auto none = Qwen2Tokenizer("none", [](json& j) { j["normalizer"] = nullptr; });
  ASSERT_NE(nfc, nullptr);
  ASSERT_NE(none, nullptr);
  EXPECT_EQ(Ids(*nfc, "cafe\u0301"), Ids(*nfc, "caf\u00e9"));
  EXPECT_EQ(Ids(*nfc, "\u212B"), Ids(*nfc, "\u00C5"));              // Angstrom sign
  EXPECT_EQ(Ids(*nfc, "a\u0302\u0323"), Ids(*nfc, "\u1EAD"));       // reordered, composed
  EXPECT_EQ(Ids(*nfc, "\u1100\u1161\u11A8"), Ids(*nfc, "\uAC01"));  // Hangul jamo
  EXPECT_EQ(Ids(*nfc, "\uFB01"), Ids(*none, "\uFB01"));  // NFC keeps compatibility characters
  EXPECT_NE(Ids(*none, "cafe\u0301"), Ids(*none, "caf\u00e9"));
  // Decoding gives back what the ids say, unnormalized.
  auto text = nfc->Decode(Ids(*none, "cafe\u0301"));
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "cafe\u0301");
}

TEST(TokenizerNormalizerTest, AddedTokensMatchRawOrNormalizedAsHuggingFace) {
  // Lowercase, with the special <|im_start|> (normalized: false) and an added "<Tag>"
  // (normalized: true).
  int32_t tag_id = -1;
  auto tok = Qwen2Tokenizer("added", [&](json& j) {
    j["normalizer"] = {{"type", "Lowercase"}};
    tag_id = j["added_tokens"].back()["id"].get<int32_t>() + 1;
    j["added_tokens"].push_back({{"id", tag_id}, {"content", "<Tag>"}, {"special", false},
                                 {"lstrip", false}, {"rstrip", false}, {"single_word", false},
                                 {"normalized", true}});
  });
  ASSERT_NE(tok, nullptr);
  const int32_t im_start = Ids(*tok, "<|im_start|>").at(0);
  EXPECT_EQ(Ids(*tok, "<|im_start|>").size(), 1u);
  // Raw tokens are matched before normalization: the upper-case spelling is plain text.
  EXPECT_GT(Ids(*tok, "<|IM_START|>").size(), 1u);
  // Normalized tokens are matched in the normalized text, by their normalized content.
  EXPECT_EQ(Ids(*tok, "<TAG>"), std::vector<int32_t>{tag_id});
  EXPECT_EQ(Ids(*tok, "<tag>"), std::vector<int32_t>{tag_id});
  const std::vector<int32_t> mixed = Ids(*tok, "<|im_start|>A<TAG>");
  ASSERT_EQ(mixed.front(), im_start);
  EXPECT_EQ(mixed.back(), tag_id);
}

TEST(TokenizerNormalizerTest, UnimplementedTypesAreRefusedByName) {
  for (const char* type : {"BertNormalizer", "Precompiled", "StripAccents", "Nmt", "ByteLevel"}) {
    absl::Status error;
    auto tok = Qwen2Tokenizer(std::string("refused-") + type,
                              [&](json& j) { j["normalizer"] = {{"type", type}}; }, &error);
    EXPECT_EQ(tok, nullptr) << type;
    EXPECT_EQ(error.code(), absl::StatusCode::kUnimplemented) << type;
    EXPECT_NE(error.message().find(type), absl::string_view::npos) << error;
  }
}

TEST(TokenizerNormalizerTest, PrependLeavesEmptyTextEmpty) {
  auto tok = Qwen2Tokenizer("prepend", [](json& j) {
    j["normalizer"] = {{"type", "Prepend"}, {"prepend", "x"}};
  });
  ASSERT_NE(tok, nullptr);
  auto none = Qwen2Tokenizer("prepend-none", [](json& j) { j["normalizer"] = nullptr; });
  ASSERT_NE(none, nullptr);
  EXPECT_TRUE(Ids(*tok, "").empty());
  EXPECT_EQ(Ids(*tok, "y"), Ids(*none, "xy"));
}

}  // namespace
}  // namespace preft::text
