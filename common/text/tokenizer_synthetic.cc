// WriteSyntheticTokenizer: a deterministic byte-level BPE tokenizer.json of an exact size.

#include <algorithm>
#include <deque>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"
#include "common/text/tokenizer.h"
#include "common/text/tokenizer_bpe.h"
#include "common/text/tokenizer_pretok.h"
#include "common/text/tokenizer_unicode.h"

namespace preft::text {
namespace {

using ordered_json = nlohmann::ordered_json;
using tokenizer_internal::BytesToSurface;

constexpr std::string_view kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// The text the first merges are learned from; any English-like text with code and numbers.
constexpr std::string_view kCorpus = R"(The quick brown fox jumps over the lazy dog. The dog was
not amused, and the fox ran into the forest where the other animals were waiting for him.
In the beginning there was nothing but the sound of the wind in the trees, and then the rain
came down on the roof of the house. She said that they would have been there if the train had
not been late; we're sure it's the last time they'll take that line. I don't think you've seen
this before, but I'm going to show you how it works: first you read the input, then you write
the output, and finally you check that the result is what you expected.
The model reads tokens and predicts the next token. Each layer computes attention over the
previous tokens, then a feed-forward network transforms the hidden state. The server batches
requests from many users, schedules them on the device, and streams the generated text back.
def forward(self, input_ids, positions):
    hidden = self.embed(input_ids)
    for layer in self.layers:
        hidden = layer(hidden, positions)
    return self.norm(hidden)
for (int i = 0; i < n; ++i) { sum += values[i] * weights[i]; }
In 2024 there were 365 days, 12 months and 52 weeks; the price was $19.99 or 1,250 points.
Call 555-0100 between 9:00 and 17:30. Version 3.1.4 was released on 2023-10-15.
The people of the city went to the market every morning to buy bread, milk, fruit and fish.
When the children came home from school they played in the garden until it was dark outside.
)";

struct Vocab {
  std::vector<std::string> tokens;                  // raw bytes, by id
  std::unordered_map<std::string, int32_t> ids;     // raw bytes -> id
  std::vector<std::pair<int32_t, int32_t>> merges;  // by rank
  size_t capacity = 0;                              // regular tokens wanted

  bool full() const { return tokens.size() >= capacity; }
  // Adds the merge (a, b) if its result is new and there is room; returns the new id or -1.
  int32_t AddMerge(int32_t a, int32_t b) {
    if (full()) return -1;
    std::string joined = tokens[a] + tokens[b];
    if (ids.count(joined) != 0) return -1;
    const auto id = static_cast<int32_t>(tokens.size());
    ids.emplace(joined, id);
    tokens.push_back(std::move(joined));
    merges.emplace_back(a, b);
    return id;
  }
};

// Classic BPE training on the pre-tokenized corpus: repeatedly merge the most frequent pair
// (ties to the smallest ids) until no pair occurs twice.
absl::Status LearnMerges(std::string_view pattern, Vocab* vocab) {
  PREFT_ASSIGN_OR_RETURN(auto pre, tokenizer_internal::PreTokenizer::ForSplitPattern(pattern));
  std::vector<std::string_view> pieces;
  std::deque<std::string> storage;
  PREFT_RETURN_IF_ERROR(pre->Run(kCorpus, &pieces, &storage));
  std::map<std::string_view, int64_t> counts;
  for (std::string_view piece : pieces) ++counts[piece];
  std::vector<std::vector<int32_t>> words;
  std::vector<int64_t> freqs;
  for (const auto& [piece, count] : counts) {
    std::vector<int32_t> word;
    for (unsigned char b : piece) word.push_back(b);
    words.push_back(std::move(word));
    freqs.push_back(count);
  }
  auto key = [](int32_t a, int32_t b) {
    return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b);
  };
  std::unordered_set<uint64_t> used;
  while (!vocab->full()) {
    std::unordered_map<uint64_t, int64_t> pair_counts;
    for (size_t w = 0; w < words.size(); ++w) {
      for (size_t i = 0; i + 1 < words[w].size(); ++i) {
        pair_counts[key(words[w][i], words[w][i + 1])] += freqs[w];
      }
    }
    uint64_t best = 0;
    int64_t best_count = 1;
    for (const auto& [pair, count] : pair_counts) {
      if (used.count(pair) != 0) continue;
      if (count > best_count || (count == best_count && count > 1 && pair < best)) {
        best = pair;
        best_count = count;
      }
    }
    if (best_count < 2) break;
    used.insert(best);
    const auto a = static_cast<int32_t>(best >> 32), b = static_cast<int32_t>(best & 0xFFFFFFFF);
    int32_t merged = vocab->AddMerge(a, b);
    if (merged < 0) {
      // The result already exists under another split: keep the merge, no new id.
      merged = vocab->ids.at(vocab->tokens[a] + vocab->tokens[b]);
      vocab->merges.emplace_back(a, b);
    }
    for (std::vector<int32_t>& word : words) {
      std::vector<int32_t> out;
      for (size_t i = 0; i < word.size(); ++i) {
        if (i + 1 < word.size() && word[i] == a && word[i + 1] == b) {
          out.push_back(merged);
          ++i;
        } else {
          out.push_back(word[i]);
        }
      }
      word = std::move(out);
    }
  }
  return absl::OkStatus();
}

// Fills the rest of the budget systematically: digit groups (llama3), whitespace runs, then
// words grown breadth-first from letters and space+letter by common letters.
void ExtendMerges(bool digit_groups, Vocab* vocab) {
  // Tokens missing here were not added because the budget ran out; ids 0..255 always exist.
  auto id_of = [&](std::string_view s) {
    const auto it = vocab->ids.find(std::string(s));
    return it == vocab->ids.end() ? -1 : it->second;
  };
  auto add = [&](int32_t a, int32_t b) { return a < 0 ? -1 : vocab->AddMerge(a, b); };
  if (digit_groups) {
    for (char d1 = '0'; d1 <= '9'; ++d1) {
      for (char d2 = '0'; d2 <= '9'; ++d2) vocab->AddMerge(d1, d2);
    }
    for (char d1 = '0'; d1 <= '9'; ++d1) {
      for (char d2 = '0'; d2 <= '9'; ++d2) {
        for (char d3 = '0'; d3 <= '9'; ++d3) {
          add(id_of(std::string{d1, d2}), d3);
        }
      }
    }
  }
  for (const auto& [c, max_run] : {std::pair<char, int>{' ', 16}, {'\t', 8}, {'\n', 4}}) {
    for (int run = 2; run <= max_run; ++run) {
      add(id_of(std::string(run - 1, c)), c);
    }
  }
  constexpr std::string_view kExtenders = "etaoinshrdlcumwfgypbvkjxqz";
  std::vector<int32_t> queue;
  for (char c = 'a'; c <= 'z'; ++c) queue.push_back(c);
  for (char c = 'A'; c <= 'Z'; ++c) queue.push_back(c);
  for (char c = 'a'; c <= 'z'; ++c) vocab->AddMerge(' ', c);
  for (char c = 'A'; c <= 'Z'; ++c) vocab->AddMerge(' ', c);
  for (char c = 'a'; c <= 'z'; ++c) queue.push_back(id_of(std::string{' ', c}));
  for (char c = 'A'; c <= 'Z'; ++c) queue.push_back(id_of(std::string{' ', c}));
  std::erase(queue, -1);
  for (size_t head = 0; head < queue.size() && !vocab->full(); ++head) {
    const int32_t base = queue[head];
    for (char c : kExtenders) {
      // An existing extension (learned earlier) is still grown further.
      const std::string joined = vocab->tokens[base] + c;
      const auto existing = vocab->ids.find(joined);
      const int32_t id = existing != vocab->ids.end() ? -1 : vocab->AddMerge(base, c);
      if (id >= 0) queue.push_back(id);
      if (existing != vocab->ids.end()) queue.push_back(existing->second);
    }
  }
}

void AppendJsonString(std::string_view s, std::string* out) {
  out->push_back('"');
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(c);
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppendFormat(out, "\\u%04x", static_cast<int>(c));
    } else {
      out->push_back(c);
    }
  }
  out->push_back('"');
}

std::vector<std::string> SpecialTokens(const std::string& style, int32_t vocab_size) {
  if (style == "qwen2") return {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  if (vocab_size < 1024) return {"<|begin_of_text|>", "<|end_of_text|>"};
  // Llama 3.1's 256 special tokens, in order.
  std::vector<std::string> specials = {"<|begin_of_text|>",
                                       "<|end_of_text|>",
                                       "<|reserved_special_token_0|>",
                                       "<|reserved_special_token_1|>",
                                       "<|finetune_right_pad_id|>",
                                       "<|reserved_special_token_2|>",
                                       "<|start_header_id|>",
                                       "<|end_header_id|>",
                                       "<|eom_id|>",
                                       "<|eot_id|>",
                                       "<|python_tag|>"};
  for (int i = 3; specials.size() < 256; ++i) {
    specials.push_back(absl::StrCat("<|reserved_special_token_", i, "|>"));
  }
  return specials;
}

}  // namespace

absl::Status WriteSyntheticTokenizer(const std::string& dir, const SyntheticTokenizerOptions& o,
                                     int32_t* bos_id, int32_t* eos_id) {
  const bool llama3 = o.style == "llama3";
  if (!llama3 && o.style != "qwen2") {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic tokenizer style \"", o.style, "\" is not llama3 or qwen2"));
  }
  const std::vector<std::string> specials = SpecialTokens(o.style, o.vocab_size);
  const int64_t regular = int64_t{o.vocab_size} - static_cast<int64_t>(specials.size());
  if (regular < 256 || o.vocab_size > tokenizer_internal::kMaxTokenId) {
    return absl::InvalidArgumentError(
        absl::StrFormat("synthetic tokenizer vocab_size %d must be in [%d, %d]", o.vocab_size,
                        256 + specials.size(), tokenizer_internal::kMaxTokenId));
  }

  Vocab vocab;
  vocab.capacity = static_cast<size_t>(regular);
  vocab.tokens.reserve(vocab.capacity);
  vocab.ids.reserve(vocab.capacity);
  for (int b = 0; b < 256; ++b) {
    vocab.tokens.emplace_back(1, static_cast<char>(b));
    vocab.ids.emplace(vocab.tokens.back(), b);
  }
  PREFT_RETURN_IF_ERROR(LearnMerges(llama3 ? kLlama3Pattern : kQwen2Pattern, &vocab));
  ExtendMerges(/*digit_groups=*/llama3, &vocab);
  if (!vocab.full()) return absl::InternalError("synthetic tokenizer: merge budget not filled");

  const auto first_special = static_cast<int32_t>(regular);
  *bos_id = llama3 ? first_special : -1;
  *eos_id = first_special + (llama3 ? 1 : 0);

  // The small parts through nlohmann; vocab and merges (megabytes) are written directly.
  ordered_json head;
  head["version"] = "1.0";
  head["truncation"] = nullptr;
  head["padding"] = nullptr;
  head["added_tokens"] = ordered_json::array();
  for (size_t i = 0; i < specials.size(); ++i) {
    head["added_tokens"].push_back({{"id", first_special + static_cast<int32_t>(i)},
                                    {"content", specials[i]},
                                    {"single_word", false},
                                    {"lstrip", false},
                                    {"rstrip", false},
                                    {"normalized", false},
                                    {"special", true}});
  }
  // As the real files: Qwen2/2.5 normalize to NFC, Llama 3 not at all.
  head["normalizer"] = llama3 ? ordered_json(nullptr) : ordered_json({{"type", "NFC"}});
  head["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"},
         {"pattern", {{"Regex", std::string(llama3 ? kLlama3Pattern : kQwen2Pattern)}}},
         {"behavior", "Isolated"},
         {"invert", false}},
        {{"type", "ByteLevel"},
         {"add_prefix_space", false},
         {"trim_offsets", true},
         {"use_regex", false}}}}};
  ordered_json byte_level_post = {{"type", "ByteLevel"},
                                  {"add_prefix_space", true},
                                  {"trim_offsets", false},
                                  {"use_regex", true}};
  if (llama3) {
    const std::string& bos = specials[0];
    ordered_json templ = {
        {"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"pair",
         {{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
          {{"SpecialToken", {{"id", bos}, {"type_id", 1}}}},
          {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
        {"special_tokens", {{bos, {{"id", bos}, {"ids", {*bos_id}}, {"tokens", {bos}}}}}}};
    head["post_processor"] = {{"type", "Sequence"}, {"processors", {byte_level_post, templ}}};
  } else {
    head["post_processor"] = byte_level_post;
  }
  head["decoder"] = {{"type", "ByteLevel"},
                     {"add_prefix_space", true},
                     {"trim_offsets", true},
                     {"use_regex", true}};
  std::string text = head.dump();
  text.pop_back();  // reopen the object for "model"
  absl::StrAppend(&text, R"(,"model":{"type":"BPE","dropout":null,"unk_token":null,)",
                  R"("continuing_subword_prefix":null,"end_of_word_suffix":null,"fuse_unk":false,)",
                  R"("byte_fallback":false,"ignore_merges":)", llama3 ? "true" : "false",
                  R"(,"vocab":{)");
  std::vector<std::string> surfaces;
  surfaces.reserve(vocab.tokens.size());
  for (const std::string& token : vocab.tokens) surfaces.push_back(BytesToSurface(token));
  text.reserve(text.size() + vocab.tokens.size() * 32);
  for (size_t id = 0; id < surfaces.size(); ++id) {
    if (id > 0) text.push_back(',');
    AppendJsonString(surfaces[id], &text);
    absl::StrAppend(&text, ":", id);
  }
  text += R"(},"merges":[)";
  std::string merge;
  for (size_t i = 0; i < vocab.merges.size(); ++i) {
    if (i > 0) text.push_back(',');
    merge = surfaces[vocab.merges[i].first];
    merge.push_back(' ');
    merge += surfaces[vocab.merges[i].second];
    AppendJsonString(merge, &text);
  }
  text += "]}}";

  ordered_json config;
  config["add_bos_token"] = llama3;
  config["add_eos_token"] = false;
  config["bos_token"] = llama3 ? ordered_json(specials[0]) : ordered_json(nullptr);
  config["eos_token"] = specials[llama3 ? 1 : 0];
  if (!llama3) config["pad_token"] = specials[0];
  config["clean_up_tokenization_spaces"] = false;
  config["model_max_length"] = llama3 ? 131072 : 32768;
  config["tokenizer_class"] = llama3 ? "PreTrainedTokenizerFast" : "Qwen2Tokenizer";
  if (!o.chat_template.empty()) config["chat_template"] = o.chat_template;

  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat(dir, ": cannot create: ", ec.message()));
  }
  const std::filesystem::path root(dir);
  PREFT_RETURN_IF_ERROR(base::WriteStringToFile((root / "tokenizer.json").string(), text));
  return base::WriteStringToFile((root / "tokenizer_config.json").string(), config.dump(2) + "\n");
}

}  // namespace preft::text
