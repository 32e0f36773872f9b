#pragma once

// Added (and special) tokens of a tokenizer.json, matched as whole strings before
// pre-tokenization (internal to preft_model).

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace preft::text::tokenizer_internal {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool lstrip = false;       // also swallows whitespace before it
  bool rstrip = false;       // also swallows whitespace after it
  bool single_word = false;  // matches only outside words
  // Matched in the normalized text (its content normalized too) rather than the raw text;
  // Hugging Face's default is !special.
  bool normalized = false;
};

// Leftmost-longest matching of added tokens over a byte trie. Immutable after the Adds;
// thread-safe to read.
class AddedTokenMatcher {
 public:
  // `index` is returned by Find for `content` (non-empty); a repeated content keeps the last.
  void Add(std::string_view content, int32_t index);

  struct Match {
    size_t begin;
    size_t end;
    int32_t index;
  };
  // The next match at or after `pos`, with lstrip/rstrip applied (never reaching before
  // `floor`), or index -1 when there is none.
  Match Find(std::string_view text, size_t pos, size_t floor,
             const std::vector<AddedToken>& tokens) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;
    int32_t index = -1;
  };
  int32_t Child(int32_t node, unsigned char b) const;
  // Longest token at text[pos..]: (length, index), index -1 for none.
  std::pair<size_t, int32_t> LongestAt(std::string_view text, size_t pos) const;

  std::vector<Node> nodes_ = std::vector<Node>(1);
  std::array<bool, 256> first_byte_{};
};

}  // namespace preft::text::tokenizer_internal
