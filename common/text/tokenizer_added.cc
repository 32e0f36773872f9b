#include "common/text/tokenizer_added.h"

namespace preft::text::tokenizer_internal {
namespace {

bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

// Approximates a word character: ASCII alphanumerics, '_' and any non-ASCII byte.
bool IsWordByte(char c) {
  const auto b = static_cast<unsigned char>(c);
  return b >= 0x80 || (b >= '0' && b <= '9') || (b >= 'a' && b <= 'z') || (b >= 'A' && b <= 'Z') ||
         b == '_';
}

}  // namespace

void AddedTokenMatcher::Add(std::string_view content, int32_t index) {
  if (content.empty()) return;
  first_byte_[static_cast<unsigned char>(content[0])] = true;
  int32_t node = 0;
  for (char c : content) {
    const auto b = static_cast<unsigned char>(c);
    int32_t next = Child(node, b);
    if (next < 0) {
      next = static_cast<int32_t>(nodes_.size());
      nodes_[node].children.emplace_back(b, next);
      nodes_.emplace_back();
    }
    node = next;
  }
  nodes_[node].index = index;
}

int32_t AddedTokenMatcher::Child(int32_t node, unsigned char b) const {
  for (const auto& [byte, child] : nodes_[node].children) {
    if (byte == b) return child;
  }
  return -1;
}

std::pair<size_t, int32_t> AddedTokenMatcher::LongestAt(std::string_view text, size_t pos) const {
  std::pair<size_t, int32_t> best = {0, -1};
  int32_t node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    node = Child(node, static_cast<unsigned char>(text[i]));
    if (node < 0) break;
    if (nodes_[node].index >= 0) best = {i + 1 - pos, nodes_[node].index};
  }
  return best;
}

AddedTokenMatcher::Match AddedTokenMatcher::Find(std::string_view text, size_t pos, size_t floor,
                                                 const std::vector<AddedToken>& tokens) const {
  for (; pos < text.size(); ++pos) {
    if (!first_byte_[static_cast<unsigned char>(text[pos])]) continue;
    const auto [length, index] = LongestAt(text, pos);
    if (index < 0) continue;
    const AddedToken& token = tokens[index];
    size_t begin = pos, end = pos + length;
    if (token.single_word && ((begin > 0 && IsWordByte(text[begin - 1])) ||
                              (end < text.size() && IsWordByte(text[end])))) {
      continue;
    }
    if (token.lstrip) {
      while (begin > floor && IsSpace(text[begin - 1])) --begin;
    }
    if (token.rstrip) {
      while (end < text.size() && IsSpace(text[end])) ++end;
    }
    return {begin, end, index};
  }
  return {text.size(), text.size(), -1};
}

}  // namespace preft::text::tokenizer_internal
