#include "common/text/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <utf8proc.h>
#include <string>
#include <thread>
#include <vector>

namespace preft::text {
namespace {

// Options for WriteSyntheticTokenizer (no chat template).
SyntheticTokenizerOptions Synthetic(int32_t vocab_size, std::string style = "llama3") {
  SyntheticTokenizerOptions o;
  o.vocab_size = vocab_size;
  o.style = std::move(style);
  return o;
}

using json = nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr char kLlama3Regex[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr char kQwen2Regex[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::mutex temp_dirs_mu;
std::vector<std::string>* temp_dirs = new std::vector<std::string>();

std::string MakeTempDir() {
  std::string templ = (std::filesystem::temp_directory_path() / "preft_tok_XXXXXX").string();
  EXPECT_NE(mkdtemp(templ.data()), nullptr);
  std::lock_guard<std::mutex> lock(temp_dirs_mu);
  temp_dirs->push_back(templ);
  return templ;
}

// Removes the directories MakeTempDir created once all tests have run.
class TempDirCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    std::lock_guard<std::mutex> lock(temp_dirs_mu);
    for (const std::string& dir : *temp_dirs) {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
    temp_dirs->clear();
  }
};
[[maybe_unused]] ::testing::Environment* const cleanup =
    ::testing::AddGlobalTestEnvironment(new TempDirCleanup);

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << contents;
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// GPT-2's byte -> printable code point table, written independently of the library.
std::string ByteSurface(int b) {
  int cp = b;
  if (!((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF))) {
    int n = 0;
    for (int x = 0; x < b; ++x) {
      if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF))) ++n;
    }
    cp = 256 + n;
  }
  std::string out;
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return out;
}

json SplitPreTokenizer(const char* regex) {
  return {{"type", "Sequence"},
          {"pretokenizers",
           {{{"type", "Split"},
             {"pattern", {{"Regex", regex}}},
             {"behavior", "Isolated"},
             {"invert", false}},
            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
}

// A hand-made tokenizer whose ids can be worked out by hand: ids 0..255 are the bytes, then
// one id per merge below (256 + rank), then added tokens 267..270.
//   256 th  257 the  258 " the"  259 "  "  260 12  261 123  262 't  263 on  264 "\n\n"
//   265 bc  266 ab   267 <|begin_of_text|>  268 <|end_of_text|>  269 <x>  270 <x><y>
const std::vector<std::pair<std::string, std::string>> kMerges = {
    {"t", "h"}, {"th", "e"}, {"Ġ", "the"}, {"Ġ", "Ġ"}, {"1", "2"}, {"12", "3"},
    {"'", "t"}, {"o", "n"},  {"Ċ", "Ċ"},   {"b", "c"}, {"a", "b"}};

json HandTokenizer(const json& pre_tokenizer, bool merges_as_pairs = false) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[ByteSurface(b)] = b;
  json merges = json::array();
  for (size_t i = 0; i < kMerges.size(); ++i) {
    const auto& [a, b] = kMerges[i];
    vocab[a + b] = 256 + static_cast<int>(i);
    if (merges_as_pairs) {
      merges.push_back({a, b});
    } else {
      merges.push_back(a + " " + b);
    }
  }
  json added = json::array();
  const std::vector<std::pair<std::string, bool>> added_tokens = {
      {"<|begin_of_text|>", true}, {"<|end_of_text|>", true}, {"<x>", false}, {"<x><y>", false}};
  for (size_t i = 0; i < added_tokens.size(); ++i) {
    added.push_back({{"id", 267 + static_cast<int>(i)},
                     {"content", added_tokens[i].first},
                     {"special", added_tokens[i].second},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"single_word", false},
                     {"normalized", false}});
  }
  return {{"version", "1.0"},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre_tokenizer},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"byte_fallback", false},
            {"vocab", vocab},
            {"merges", merges}}}};
}

// Writes tokenizer.json (and tokenizer_config.json when `config` is not null) into a fresh
// directory and loads it.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadJson(const json& tokenizer,
                                                    const json& config = nullptr) {
  const std::string dir = MakeTempDir();
  WriteFile(dir + "/tokenizer.json", tokenizer.dump());
  if (!config.is_null()) WriteFile(dir + "/tokenizer_config.json", config.dump());
  return Tokenizer::LoadFromModelDir(dir);
}

std::unique_ptr<Tokenizer> MustLoad(const json& tokenizer, const json& config = nullptr) {
  auto tok = LoadJson(tokenizer, config);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? std::move(*tok) : nullptr;
}

std::vector<int32_t> Ids(const Tokenizer& tok, std::string_view text, bool special = false) {
  auto ids = tok.Encode(text, special);
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? *ids : std::vector<int32_t>{-1};
}

TEST(TokenizerTest, Llama3SplitAndMerges) {
  auto tok = MustLoad(HandTokenizer(SplitPreTokenizer(kLlama3Regex)));
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 271);
  EXPECT_THAT(Ids(*tok, "the the"), ElementsAre(257, 258));
  EXPECT_THAT(Ids(*tok, "a   b"), ElementsAre(97, 259, 32, 98));  // "a", "  ", " b"
  EXPECT_THAT(Ids(*tok, "a  "), ElementsAre(97, 259));            // trailing run kept whole
  EXPECT_THAT(Ids(*tok, "12345"), ElementsAre(261, 52, 53));      // "123", "45"
  EXPECT_THAT(Ids(*tok, "1234567"), ElementsAre(261, 52, 53, 54, 55));
  EXPECT_THAT(Ids(*tok, "don't"), ElementsAre(100, 263, 262));  // "don", "'t"
  EXPECT_THAT(Ids(*tok, "a\n\nb"), ElementsAre(97, 264, 98));
  EXPECT_THAT(Ids(*tok, "abc"), ElementsAre(97, 265));  // "b c" outranks "a b"
  EXPECT_THAT(Ids(*tok, "abd"), ElementsAre(266, 100));
  EXPECT_THAT(Ids(*tok, ""), IsEmpty());
}

TEST(TokenizerTest, Qwen2SplitsDigitsOneByOne) {
  auto tok = MustLoad(HandTokenizer(SplitPreTokenizer(kQwen2Regex)));
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Ids(*tok, "12345"), ElementsAre(49, 50, 51, 52, 53));
  EXPECT_THAT(Ids(*tok, "the the"), ElementsAre(257, 258));
}

TEST(TokenizerTest, MergesAsPairsMatchMergesAsStrings) {
  auto tok = MustLoad(HandTokenizer(SplitPreTokenizer(kLlama3Regex), /*merges_as_pairs=*/true));
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Ids(*tok, "the the 12345 abc"), ElementsAre(257, 258, 32, 261, 52, 53, 32, 97, 265));
}

TEST(TokenizerTest, ByteLevelWithRegexAndPrefixSpace) {
  json pre = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  auto tok = MustLoad(HandTokenizer(pre));
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Ids(*tok, "the"), ElementsAre(258));                // " the"
  EXPECT_THAT(Ids(*tok, "12345"), ElementsAre(32, 261, 52, 53));  // " 12345" is one piece
  EXPECT_THAT(Ids(*tok, "a<|end_of_text|>the"), ElementsAre(32, 97, 268, 258));
}

TEST(TokenizerTest, SplitBehaviors) {
  json removed = {{"type", "Sequence"},
                  {"pretokenizers",
                   {{{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Removed"}},
                    {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  auto tok = MustLoad(HandTokenizer(removed));
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Ids(*tok, "the the"), ElementsAre(257, 257));

  json merged = removed;
  merged["pretokenizers"][0] = {
      {"type", "Split"}, {"pattern", {{"String", "e"}}}, {"behavior", "MergedWithPrevious"}};
  tok = MustLoad(HandTokenizer(merged));
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Ids(*tok, "thethe"), ElementsAre(257, 257));
  merged["pretokenizers"][0]["behavior"] = "Isolated";
  tok = MustLoad(HandTokenizer(merged));
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Ids(*tok, "thethe"), ElementsAre(256, 101, 256, 101));
}

TEST(TokenizerTest, AddedTokensMatchWholeAndLongestFirst) {
  auto tok = MustLoad(HandTokenizer(SplitPreTokenizer(kLlama3Regex)));
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Ids(*tok, "hi<|end_of_text|>the"), ElementsAre(104, 105, 268, 257));
  EXPECT_THAT(Ids(*tok, "a<x><y>b"), ElementsAre(97, 270, 98));
  EXPECT_THAT(Ids(*tok, "a<x>b"), ElementsAre(97, 269, 98));
  EXPECT_THAT(Ids(*tok, "<|end_of_text|><|end_of_text|>"), ElementsAre(268, 268));
  // Looks like a special token but is not one: ordinary pieces "<|", "end", "_of", "_text", "|".
  EXPECT_THAT(Ids(*tok, "<|end_of_text|"),
              ElementsAre(60, 124, 101, 110, 100, 95, 111, 102, 95, 116, 101, 120, 116, 124));
  EXPECT_EQ(tok->TokenToId("<x><y>"), 270);
  EXPECT_EQ(tok->TokenToId("Ġthe"), 258);
  EXPECT_EQ(tok->TokenToId("the"), 257);
  EXPECT_EQ(tok->TokenToId("nope"), -1);
  EXPECT_TRUE(tok->IsSpecial(268));
  EXPECT_FALSE(tok->IsSpecial(269));
  EXPECT_FALSE(tok->IsSpecial(257));
  EXPECT_EQ(tok->TokenBytes(258), " the");
  EXPECT_EQ(tok->TokenBytes(268), "<|end_of_text|>");
}

TEST(TokenizerTest, BosFromConfig) {
  json config = {{"add_bos_token", true},
                 {"bos_token", "<|begin_of_text|>"},
                 {"eos_token", {{"content", "<|end_of_text|>"}, {"special", true}}}};
  auto tok = MustLoad(HandTokenizer(SplitPreTokenizer(kLlama3Regex)), config);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->bos_token_id(), 267);
  EXPECT_EQ(tok->eos_token_id(), 268);
  EXPECT_THAT(Ids(*tok, "the", true), ElementsAre(267, 257));
  EXPECT_THAT(Ids(*tok, "the", false), ElementsAre(257));
  EXPECT_THAT(Ids(*tok, "", true), ElementsAre(267));
  auto text = tok->Decode({267, 257, 268}, /*skip_special_tokens=*/true);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "the");
  text = tok->Decode({267, 257, 269});
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "<|begin_of_text|>the<x>");
}

TEST(TokenizerTest, BosFromTemplateProcessing) {
  json tokenizer = HandTokenizer(SplitPreTokenizer(kLlama3Regex));
  tokenizer["post_processor"] = {
      {"type", "Sequence"},
      {"processors",
       {{{"type", "ByteLevel"}, {"trim_offsets", false}},
        {{"type", "TemplateProcessing"},
         {"single",
          {{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
           {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
         {"special_tokens",
          {{"<|begin_of_text|>",
            {{"id", "<|begin_of_text|>"}, {"ids", {267}}, {"tokens", {"<|begin_of_text|>"}}}}}}}}}};
  auto tok = MustLoad(tokenizer);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->bos_token_id(), 267);
  EXPECT_THAT(Ids(*tok, "the", true), ElementsAre(267, 257));
  // An explicit add_bos_token: false in tokenizer_config.json wins over the template.
  tok = MustLoad(tokenizer, {{"add_bos_token", false}, {"bos_token", "<|begin_of_text|>"}});
  ASSERT_NE(tok, nullptr);
  EXPECT_THAT(Ids(*tok, "the", true), ElementsAre(257));
}

TEST(TokenizerTest, InvalidUtf8NamesOffset) {
  auto tok = MustLoad(HandTokenizer(SplitPreTokenizer(kLlama3Regex)));
  ASSERT_NE(tok, nullptr);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"ab\xFF"
       "cd",
       "offset 2"},
      {"\xE4\xB8", "offset 0"},          // truncated
      {"ok \xC0\xAF", "offset 3"},       // overlong
      {"x\xED\xA0\x80", "offset 1"},     // surrogate
      {"\xF4\x90\x80\x80", "offset 0"},  // above U+10FFFF
      {"\xE4\xB8\xAD\x80", "offset 3"},  // stray continuation byte
  };
  for (const auto& [text, offset] : cases) {
    auto ids = tok->Encode(text);
    ASSERT_FALSE(ids.ok());
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(ids.status().message()), HasSubstr(offset));
  }
}

TEST(TokenizerTest, DecodeRejectsOutOfRangeAndReplacesBrokenUtf8) {
  auto tok = MustLoad(HandTokenizer(SplitPreTokenizer(kLlama3Regex)));
  ASSERT_NE(tok, nullptr);
  EXPECT_FALSE(tok->Decode({271}).ok());
  EXPECT_FALSE(tok->Decode({-1}).ok());
  auto text = tok->Decode({0xE4, 0xB8, 'a', 0xFF});
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text,
            "\xEF\xBF\xBD"
            "a"
            "\xEF\xBF\xBD");
}

// Mixed text that every tokenizer must round-trip.
std::vector<std::string> HostileTexts() {
  std::vector<std::string> texts = {
      "",
      " ",
      "Hello, world! I'm here; they'll go. We've DONE it, it's OK.",
      "a   b\n\n\nc \t d\r\n  ",
      "你好，世界！这是一个测试。",
      "مرحبا بالعالم",
      "नमस्ते दुनिया",
      "👨‍👩‍👧‍👦 family 🏳️‍🌈 flag 👍🏽 e\xCC\x81 café",
      "prices: $19.99, 1,250 pts, 3.14159265358979",
      "x<|begin_of_text|>y<|end_of_text|><|end_of_text",
      "<|im_start|>user\nhi<|im_end|>",
      "<|begin_of_text",
  };
  texts.push_back(std::string(100000, ' '));
  texts.push_back(std::string(100000, ' ') + "x");
  texts.push_back(std::string(100000, '7'));
  texts.push_back(std::string(100000, '\n'));
  texts.push_back(std::string(100000, 'a'));
  std::string chinese;
  while (chinese.size() < 100000) chinese += "中文字符";  // one 100 KB \p{L}+ pre-token
  texts.push_back(chinese);
  std::string mixed;
  while (mixed.size() < 100000) mixed += "word 123 ☃ 🎉\n ";
  texts.push_back(mixed);
  return texts;
}

// Unicode NFC of valid UTF-8 (utf8proc, the library the tokenizer uses: these tests pin where
// normalization applies; tests/tokenizer_js checks the forms against Hugging Face's).
std::string Nfc(const std::string& text) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   static_cast<utf8proc_ssize_t>(text.size()), &out,
                   utf8proc_option_t(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  std::string s(reinterpret_cast<const char*>(out), static_cast<size_t>(std::max<utf8proc_ssize_t>(n, 0)));
  std::free(out);
  return s;
}

// decode(encode(text)) is the text, normalized when the tokenizer normalizes (`nfc`).
void ExpectRoundTrip(const Tokenizer& tok, bool nfc = false) {
  for (const std::string& text : HostileTexts()) {
    const auto start = std::chrono::steady_clock::now();
    auto ids = tok.Encode(text, /*add_special_tokens=*/false);
    ASSERT_TRUE(ids.ok()) << ids.status();
    auto decoded = tok.Decode(*ids);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(*decoded, nfc ? Nfc(text) : text) << text.substr(0, 60);
    EXPECT_LT(SecondsSince(start), 5.0) << "slow on " << text.substr(0, 20);
  }
}

TEST(TokenizerTest, HandTokenizerRoundTrips) {
  auto tok = MustLoad(HandTokenizer(SplitPreTokenizer(kLlama3Regex)));
  ASSERT_NE(tok, nullptr);
  ExpectRoundTrip(*tok);
  auto ids = tok->Encode(std::string(100000, '7'), false);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->size(), 100000u);  // no "77" merge
  ids = tok->Encode(std::string(100000, ' '), false);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->size(), 50000u);  // all "  "
}

TEST(TokenizerTest, ReferenceFixture) {
  auto tok = Tokenizer::Load(std::string(PREFT_SHARED_DIR) + "/fixtures/tiny-llama/tokenizer.json");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 300);
  EXPECT_EQ((*tok)->bos_token_id(), 298);
  EXPECT_EQ((*tok)->eos_token_id(), 299);
  // add_bos_token is false there. "the" is 258; " there" = Ġ t h e r e -> er, th -> Ġ th er e.
  EXPECT_THAT(Ids(**tok, "the there", true), ElementsAre(258, 32, 257, 256, 101));
  EXPECT_EQ((*tok)->TokenToId("Ġt"), 259);
  ExpectRoundTrip(**tok);
}

TEST(TokenizerTest, StreamDecoderNeverSplitsCodePoints) {
  auto tok = MustLoad(HandTokenizer(SplitPreTokenizer(kLlama3Regex)));
  ASSERT_NE(tok, nullptr);
  const std::string text = "héllo 你好 👨‍👩‍👧 the end ☃";
  auto ids = tok->Encode(text, false);
  ASSERT_TRUE(ids.ok());
  StreamDecoder stream(tok.get());
  std::string joined;
  for (int32_t id : *ids) {
    const std::string piece = stream.Push(id);
    auto check = tok->Encode(piece);  // Encode validates UTF-8
    EXPECT_TRUE(check.ok()) << "broken piece after id " << id;
    joined += piece;
  }
  joined += stream.Flush();
  EXPECT_EQ(joined, text);

  StreamDecoder broken(tok.get());
  EXPECT_EQ(broken.Push(0xE4), "");
  EXPECT_EQ(broken.Push(0xB8), "");
  EXPECT_EQ(broken.Push('a'),
            "\xEF\xBF\xBD"
            "a");  // invalid once the next byte arrives
  EXPECT_EQ(broken.Push(0xF0), "");
  EXPECT_EQ(broken.Flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(broken.Flush(), "");

  StreamDecoder skipping(tok.get(), /*skip_special_tokens=*/true);
  EXPECT_EQ(skipping.Push(267), "");
  EXPECT_EQ(skipping.Push(257), "the");
  EXPECT_EQ(skipping.Push(269), "<x>");
}

TEST(TokenizerTest, ConcurrentEncode) {
  auto tok = MustLoad(HandTokenizer(SplitPreTokenizer(kLlama3Regex)));
  ASSERT_NE(tok, nullptr);
  const std::string text = "the the theory of 12345 don't abc abd\n\n";
  const std::vector<int32_t> expected = Ids(*tok, text);
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        auto ids = tok->Encode(text, false);
        if (!ids.ok() || *ids != expected) ++mismatches[t];
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_THAT(mismatches, ElementsAre(0, 0, 0, 0));
}

TEST(SyntheticTokenizerTest, SmallLlama3) {
  const std::string dir = MakeTempDir();
  int32_t bos = 0, eos = 0;
  ASSERT_TRUE(
      WriteSyntheticTokenizer(dir, Synthetic(300, "llama3"), &bos, &eos).ok());
  EXPECT_EQ(bos, 298);
  EXPECT_EQ(eos, 299);
  auto tok = Tokenizer::LoadFromModelDir(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 300);
  EXPECT_EQ((*tok)->bos_token_id(), 298);
  EXPECT_EQ((*tok)->eos_token_id(), 299);
  EXPECT_EQ((*tok)->TokenToId("<|begin_of_text|>"), 298);
  auto ids = (*tok)->Encode("hello");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->front(), 298);
  ExpectRoundTrip(**tok);

  // Deterministic: a second write is byte-identical.
  const std::string dir2 = MakeTempDir();
  ASSERT_TRUE(
      WriteSyntheticTokenizer(dir2, Synthetic(300, "llama3"), &bos, &eos).ok());
  std::ifstream a(dir + "/tokenizer.json"), b(dir2 + "/tokenizer.json");
  std::string sa((std::istreambuf_iterator<char>(a)), {}),
      sb((std::istreambuf_iterator<char>(b)), {});
  EXPECT_EQ(sa, sb);
}

TEST(SyntheticTokenizerTest, SmallQwen2) {
  const std::string dir = MakeTempDir();
  int32_t bos = 0, eos = 0;
  ASSERT_TRUE(WriteSyntheticTokenizer(dir, Synthetic(300, "qwen2"), &bos, &eos).ok());
  EXPECT_EQ(bos, -1);
  EXPECT_EQ(eos, 297);
  auto tok = Tokenizer::LoadFromModelDir(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->bos_token_id(), -1);
  EXPECT_EQ((*tok)->eos_token_id(), 297);
  auto ids = (*tok)->Encode("<|im_start|>user\nhi<|im_end|>");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->front(), 298);
  EXPECT_EQ(ids->back(), 299);
  ids = (*tok)->Encode("12345");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->size(), 5u);
  ExpectRoundTrip(**tok, /*nfc=*/true);  // Qwen2 normalizes to NFC
}

TEST(SyntheticTokenizerTest, RejectsBadOptions) {
  int32_t bos = 0, eos = 0;
  EXPECT_FALSE(WriteSyntheticTokenizer(MakeTempDir(), Synthetic(100), &bos, &eos).ok());
  EXPECT_FALSE(
      WriteSyntheticTokenizer(MakeTempDir(), Synthetic(300, "gpt9"), &bos, &eos)
          .ok());
}

void CheckLargeSynthetic(const std::string& style, int32_t vocab_size, int32_t want_bos,
                         int32_t want_eos) {
  const std::string dir = MakeTempDir();
  int32_t bos = 0, eos = 0;
  auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(
      WriteSyntheticTokenizer(dir, Synthetic(vocab_size, style), &bos, &eos).ok());
  const double write_s = SecondsSince(start);
  start = std::chrono::steady_clock::now();
  auto tok = Tokenizer::LoadFromModelDir(dir);
  const double load_s = SecondsSince(start);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ(bos, want_bos);
  EXPECT_EQ(eos, want_eos);
  EXPECT_EQ((*tok)->vocab_size(), vocab_size);
  EXPECT_EQ((*tok)->bos_token_id(), want_bos);
  EXPECT_EQ((*tok)->eos_token_id(), want_eos);
  start = std::chrono::steady_clock::now();
  ExpectRoundTrip(**tok, /*nfc=*/style == "qwen2");
  const double round_trip_s = SecondsSince(start);
  std::string english;
  while (english.size() < 1000000) english += "The quick brown fox jumps over the lazy dog 2024. ";
  start = std::chrono::steady_clock::now();
  auto ids = (*tok)->Encode(english, false);
  const double encode_s = SecondsSince(start);
  ASSERT_TRUE(ids.ok());
  std::printf(
      "%s %d: write %.3f s, load %.3f s, hostile round trips %.3f s, "
      "encode 1 MB %.3f s (%zu tokens)\n",
      style.c_str(), vocab_size, write_s, load_s, round_trip_s, encode_s, ids->size());
  EXPECT_LT(write_s, 4.0);  // target well under 2 s; slack for loaded CI machines
  EXPECT_LT(load_s, 4.0);
}

TEST(SyntheticTokenizerTest, Qwen25Size) { CheckLargeSynthetic("qwen2", 151936, -1, 151933); }

TEST(SyntheticTokenizerTest, Llama3Size) {
  CheckLargeSynthetic("llama3", 128256, 128000, 128001);
  // 256 Llama 3.1 special tokens at the top; digits grouped in threes.
  const std::string dir = MakeTempDir();
  int32_t bos = 0, eos = 0;
  ASSERT_TRUE(WriteSyntheticTokenizer(dir, Synthetic(128256), &bos, &eos).ok());
  auto tok = Tokenizer::LoadFromModelDir(dir);
  ASSERT_TRUE(tok.ok());
  EXPECT_EQ((*tok)->TokenToId("<|eot_id|>"), 128009);
  EXPECT_EQ((*tok)->TokenToId("<|reserved_special_token_247|>"), 128255);
  auto ids = (*tok)->Encode("123456", false);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->size(), 2u);
}

// Hostile tokenizer.json files: every one must give an error status, never a crash.
TEST(TokenizerTest, HostileFilesAreRefused) {
  const json good = HandTokenizer(SplitPreTokenizer(kLlama3Regex));
  ASSERT_NE(MustLoad(good), nullptr);
  struct Case {
    std::string name;
    std::string text;
    std::string message;  // expected in the error, may be empty
  };
  auto with = [&](const std::function<void(json&)>& edit) {
    json copy = good;
    edit(copy);
    return copy.dump();
  };
  std::vector<Case> cases = {
      {"not json", "this is not json", ""},
      {"truncated", good.dump().substr(0, 2000), ""},
      {"array", "[]", ""},
      {"no model", "{}", "model"},
      {"model number", with([](json& j) { j["model"] = 5; }), "model"},
      {"wordpiece", with([](json& j) { j["model"]["type"] = "WordPiece"; }), "WordPiece"},
      {"unigram", with([](json& j) { j["model"]["type"] = "Unigram"; }), "Unigram"},
      {"byte fallback", with([](json& j) { j["model"]["byte_fallback"] = true; }), "byte_fallback"},
      {"vocab array", with([](json& j) { j["model"]["vocab"] = json::array(); }), "vocab"},
      {"vocab id string", with([](json& j) { j["model"]["vocab"]["th"] = "x"; }), "th"},
      {"vocab id negative", with([](json& j) { j["model"]["vocab"]["th"] = -1; }), ""},
      {"vocab id huge", with([](json& j) { j["model"]["vocab"]["th"] = 1000000000000LL; }), ""},
      {"duplicate id", with([](json& j) { j["model"]["vocab"]["zzz"] = 5; }), "id 5"},
      {"missing byte", with([](json& j) { j["model"]["vocab"].erase("a"); }), "byte 0x61"},
      {"merge unknown", with([](json& j) { j["model"]["merges"].push_back("qq zz"); }), "qq"},
      {"merge result unknown", with([](json& j) { j["model"]["merges"].push_back("x y"); }), "xy"},
      {"merge no space", with([](json& j) { j["model"]["merges"].push_back("xy"); }), ""},
      {"merge number", with([](json& j) { j["model"]["merges"].push_back(5); }), ""},
      {"merge short pair", with([](json& j) { j["model"]["merges"].push_back({"x"}); }), ""},
      {"merges object", with([](json& j) { j["model"]["merges"] = json::object(); }), "merges"},
      {"normalizer", with([](json& j) {
         j["normalizer"] = {{"type", "BertNormalizer"}};
       }),
       "BertNormalizer"},
      {"nested normalizer", with([](json& j) {
         j["normalizer"] = {{"type", "Sequence"},
                            {"normalizers", {{{"type", "NFC"}}, {{"type", "Precompiled"}}}}};
       }),
       "Precompiled"},
      {"replace without pattern", with([](json& j) {
         j["normalizer"] = {{"type", "Replace"}, {"content", "x"}};
       }),
       "Replace"},
      {"metaspace", with([](json& j) {
         j["pre_tokenizer"] = {{"type", "Metaspace"}};
       }),
       "Metaspace"},
      {"no pre_tokenizer", with([](json& j) { j["pre_tokenizer"] = nullptr; }), "pre_tokenizer"},
      {"bad regex",
       with([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(a"; }),
       "regex"},
      {"pattern number",
       with([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = 3; }), ""},
      {"decoder", with([](json& j) {
         j["decoder"] = {{"type", "Metaspace"}};
       }),
       "Metaspace"},
      {"post_processor", with([](json& j) {
         j["post_processor"] = {{"type", "RobertaProcessing"}};
       }),
       "RobertaProcessing"},
      {"added not list", with([](json& j) { j["added_tokens"] = 5; }), "added_tokens"},
      {"added bad id", with([](json& j) { j["added_tokens"][0]["id"] = "x"; }), "added_tokens"},
      {"added empty", with([](json& j) { j["added_tokens"][0]["content"] = ""; }), ""},
      {"deep nesting", std::string(100000, '[') + std::string(100000, ']'), ""},
      {"deep sequence", with([](json& j) {
         json pre = j["pre_tokenizer"];
         for (int i = 0; i < 50; ++i) pre = {{"type", "Sequence"}, {"pretokenizers", {pre}}};
         j["pre_tokenizer"] = pre;
       }),
       "deep"},
  };
  for (const Case& c : cases) {
    const std::string dir = MakeTempDir();
    WriteFile(dir + "/tokenizer.json", c.text);
    auto tok = Tokenizer::LoadFromModelDir(dir);
    EXPECT_FALSE(tok.ok()) << c.name;
    if (!tok.ok() && !c.message.empty()) {
      EXPECT_THAT(std::string(tok.status().message()), HasSubstr(c.message)) << c.name;
    }
  }
  EXPECT_EQ(Tokenizer::LoadFromModelDir("/nonexistent/preft").status().code(),
            absl::StatusCode::kNotFound);
  // A broken tokenizer_config.json, and one naming an unknown BOS, are errors too.
  const std::string dir = MakeTempDir();
  WriteFile(dir + "/tokenizer.json", good.dump());
  WriteFile(dir + "/tokenizer_config.json", "{not json");
  EXPECT_FALSE(Tokenizer::LoadFromModelDir(dir).ok());
  WriteFile(dir + "/tokenizer_config.json", R"({"bos_token": "<s>", "add_bos_token": true})");
  auto tok = Tokenizer::LoadFromModelDir(dir);
  ASSERT_FALSE(tok.ok());
  EXPECT_THAT(std::string(tok.status().message()), HasSubstr("<s>"));
  WriteFile(dir + "/tokenizer_config.json", R"({"bos_token": 7})");
  EXPECT_FALSE(Tokenizer::LoadFromModelDir(dir).ok());
}

}  // namespace
}  // namespace preft::text
