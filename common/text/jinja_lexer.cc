// Jinja's lexing for the chat-template subset: where tags begin and end, how the whitespace
// around them goes (as transformers configures jinja2), and the tokens inside a tag.

#include "common/text/jinja_lexer.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace preft::text::jinja::internal {

absl::StatusOr<std::vector<Chunk>> Split(std::string_view src) {
  std::vector<Chunk> out;
  size_t pos = 0;
  int line = 1;
  bool strip_next = false;   // a "-" closed the previous tag
  bool trim_newline = false;  // trim_blocks: drop one newline after a block tag
  auto count_lines = [](std::string_view s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); };
  while (pos <= src.size()) {
    size_t open = src.find('{', pos);
    while (open != std::string_view::npos && open + 1 < src.size() && src[open + 1] != '{' &&
           src[open + 1] != '%' && src[open + 1] != '#') {
      open = src.find('{', open + 1);
    }
    if (open + 1 >= src.size()) open = std::string_view::npos;
    std::string text(src.substr(pos, open == std::string_view::npos ? std::string_view::npos : open - pos));
    if (trim_newline && !text.empty() && text[0] == '\n') text.erase(0, 1);
    if (strip_next) text.erase(0, text.find_first_not_of(" \t\r\n") == std::string::npos ? text.size() : text.find_first_not_of(" \t\r\n"));
    const int text_line = line;
    line += count_lines(src.substr(pos, open == std::string_view::npos ? src.size() - pos : open - pos));
    if (open == std::string_view::npos) {
      if (!text.empty()) out.push_back({Chunk::kText, text, text_line});
      break;
    }
    const char type = src[open + 1];
    const bool strip_before = open + 2 < src.size() && src[open + 2] == '-';
    if (strip_before) {
      text.erase(text.find_last_not_of(" \t\r\n") == std::string::npos ? 0 : text.find_last_not_of(" \t\r\n") + 1);
    } else if (type != '{') {
      // lstrip_blocks: the spaces and tabs before a block or comment tag that begins its line.
      const size_t nl = open == 0 ? std::string_view::npos : src.rfind('\n', open - 1);
      const size_t line_begin = nl == std::string_view::npos ? 0 : nl + 1;
      const std::string_view indent = src.substr(line_begin, open - line_begin);
      if ((line_begin > pos || (line_begin == 0 && pos == 0)) &&
          indent.find_first_not_of(" \t") == std::string_view::npos &&
          text.size() >= indent.size()) {
        text.erase(text.size() - indent.size());
      }
    }
    if (!text.empty()) out.push_back({Chunk::kText, text, text_line});
    const std::string close = type == '{' ? "}}" : type == '%' ? "%}" : "#}";
    const size_t end = src.find(close, open + 2);
    if (end == std::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line, ": unclosed '{", std::string(1, type), "'"));
    }
    const bool strip_after = src[end - 1] == '-' && end - 1 >= open + 2 + strip_before;
    const size_t body_start = open + 2 + (strip_before ? 1 : 0);
    const size_t body_end = strip_after ? end - 1 : end;
    std::string body(src.substr(body_start, body_end > body_start ? body_end - body_start : 0));
    if (type == '{') out.push_back({Chunk::kExpr, body, line});
    if (type == '%') out.push_back({Chunk::kStmt, body, line});
    line += count_lines(src.substr(open, end + 2 - open));
    strip_next = strip_after;
    trim_newline = type != '{';  // trim_blocks: block and comment tags
    pos = end + 2;
  }
  return out;
}

absl::StatusOr<std::vector<Token>> Lex(const std::string& s, int line) {
  std::vector<Token> out;
  size_t i = 0;
  auto err = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", what));
  };
  while (i < s.size()) {
    const char c = s[i];
    if (absl::ascii_isspace(c)) { ++i; continue; }
    if (absl::ascii_isalpha(c) || c == '_') {
      size_t j = i;
      while (j < s.size() && (absl::ascii_isalnum(s[j]) || s[j] == '_')) ++j;
      out.push_back({Token::kName, s.substr(i, j - i)});
      i = j;
    } else if (absl::ascii_isdigit(c)) {
      size_t j = i;
      bool is_float = false;
      while (j < s.size() && (absl::ascii_isdigit(s[j]) || (s[j] == '.' && j + 1 < s.size() && absl::ascii_isdigit(s[j + 1])))) {
        is_float |= s[j] == '.';
        ++j;
      }
      out.push_back({is_float ? Token::kFloat : Token::kInt, s.substr(i, j - i)});
      i = j;
    } else if (c == '\'' || c == '"') {
      std::string v;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != c; ++j) {
        if (s[j] == '\\' && j + 1 < s.size()) {
          const char e = s[++j];
          switch (e) {
            case 'n': v += '\n'; break;
            case 't': v += '\t'; break;
            case 'r': v += '\r'; break;
            case '\\': v += '\\'; break;
            case '\'': v += '\''; break;
            case '"': v += '"'; break;
            default: v += '\\'; v += e;
          }
        } else {
          v += s[j];
        }
      }
      if (j >= s.size()) return err("unterminated string");
      out.push_back({Token::kString, v});
      i = j + 1;
    } else {
      static const char* kOps[] = {"==", "!=", "<=", ">=", "//", "**", "(", ")", "[", "]", "{", "}",
                                   ",", ".", ":", "|", "+", "-", "*", "/", "%", "~", "<", ">", "="};
      bool found = false;
      for (const char* op : kOps) {
        if (s.compare(i, std::strlen(op), op) == 0) {
          out.push_back({Token::kOp, op});
          i += std::strlen(op);
          found = true;
          break;
        }
      }
      if (!found) return err(absl::StrCat("unexpected character '", std::string(1, c), "'"));
    }
  }
  out.push_back({Token::kEnd, ""});
  return out;
}

}  // namespace preft::text::jinja::internal
