#pragma once

// Template source -> chunks (text and tags) -> the tokens of one tag. Whitespace control (-,
// trim_blocks, lstrip_blocks) is settled here, while the source is at hand, so the parser sees
// text exactly as it is printed.

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace preft::text::jinja::internal {

// Text between tags, or the body of a {{ }} (kExpr) or {% %} (kStmt) tag; comments are dropped.
struct Chunk {
  enum Kind { kText, kExpr, kStmt } kind;
  std::string text;
  int line;
};

// InvalidArgument naming the line of an unclosed tag.
absl::StatusOr<std::vector<Chunk>> Split(std::string_view src);

struct Token {
  enum Kind { kName, kString, kInt, kFloat, kOp, kEnd } kind;
  std::string text;
};

// The tokens of one tag's body `s`, ending with kEnd; `line` is for the error messages.
absl::StatusOr<std::vector<Token>> Lex(const std::string& s, int line);

}  // namespace preft::text::jinja::internal
