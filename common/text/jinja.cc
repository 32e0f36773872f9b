#include "common/text/jinja.h"

#include <cmath>
#include <cstring>
#include <ctime>
#include <functional>
#include <map>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

namespace preft::text::jinja {

namespace {

// Bounds on what a template may build (range(), "x" * n): templates come from model folders.
constexpr int64_t kMaxItems = 1 << 20;

// Undefined (a missing variable or key) is nlohmann's `discarded`: distinct from none.
Value Undefined() { return Value(Value::value_t::discarded); }
bool IsUndefined(const Value& v) { return v.is_discarded(); }

bool Truthy(const Value& v) {
  if (IsUndefined(v) || v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number_integer()) return v.get<int64_t>() != 0;
  if (v.is_number()) return v.get<double>() != 0;
  if (v.is_string()) return !v.get_ref<const std::string&>().empty();
  return !v.empty();  // list, dict
}

std::string PyFloat(double d) {
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (std::isnan(d)) return "nan";
  if (d == std::floor(d) && std::fabs(d) < 1e16) return absl::StrCat(static_cast<int64_t>(d), ".0");
  char buf[32];
  // Shortest form that reads back (Python's repr).
  for (int p = 1; p <= 17; ++p) {
    std::snprintf(buf, sizeof(buf), "%.*g", p, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  return buf;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

void DumpJson(const Value& v, int indent, int depth, std::string* out) {
  const std::string pad = indent >= 0 ? std::string(indent * (depth + 1), ' ') : "";
  const std::string close_pad = indent >= 0 ? std::string(indent * depth, ' ') : "";
  const char* item_sep = indent >= 0 ? "," : ", ";
  if (v.is_object()) {
    if (v.empty()) return out->append("{}"), void();
    out->append(indent >= 0 ? "{\n" : "{");
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (!first) out->append(item_sep).append(indent >= 0 ? "\n" : "");
      first = false;
      out->append(pad).append(JsonString(it.key())).append(": ");
      DumpJson(it.value(), indent, depth + 1, out);
    }
    out->append(indent >= 0 ? "\n" + close_pad + "}" : "}");
  } else if (v.is_array()) {
    if (v.empty()) return out->append("[]"), void();
    out->append(indent >= 0 ? "[\n" : "[");
    for (size_t i = 0; i < v.size(); ++i) {
      if (i > 0) out->append(item_sep).append(indent >= 0 ? "\n" : "");
      out->append(pad);
      DumpJson(v[i], indent, depth + 1, out);
    }
    out->append(indent >= 0 ? "\n" + close_pad + "]" : "]");
  } else if (v.is_string()) {
    out->append(JsonString(v.get<std::string>()));
  } else if (v.is_boolean()) {
    out->append(v.get<bool>() ? "true" : "false");
  } else if (v.is_number_float()) {
    out->append(PyFloat(v.get<double>()));
  } else if (v.is_number()) {
    out->append(v.dump());
  } else {
    out->append("null");
  }
}

// Python's str(): what {{ x }} prints.
std::string PyRepr(const Value& v, bool top);
std::string PyStr(const Value& v) { return PyRepr(v, true); }
std::string PyRepr(const Value& v, bool top) {
  if (IsUndefined(v)) return "";
  if (v.is_string()) {
    if (top) return v.get<std::string>();
    const std::string& s = v.get_ref<const std::string&>();
    const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
    std::string out(1, q);
    for (char c : s) {
      if (c == q || c == '\\') out += '\\';
      if (c == '\n') { out += "\\n"; continue; }
      out += c;
    }
    return out + q;
  }
  if (v.is_null()) return "None";
  if (v.is_boolean()) return v.get<bool>() ? "True" : "False";
  if (v.is_number_float()) return PyFloat(v.get<double>());
  if (v.is_number()) return v.dump();
  std::vector<std::string> parts;
  if (v.is_array()) {
    for (const Value& x : v) parts.push_back(PyRepr(x, false));
    return "[" + absl::StrJoin(parts, ", ") + "]";
  }
  for (auto it = v.begin(); it != v.end(); ++it) {
    parts.push_back(PyRepr(Value(it.key()), false) + ": " + PyRepr(it.value(), false));
  }
  return "{" + absl::StrJoin(parts, ", ") + "}";
}

// ---------------------------------------------------------------------------------------------
// Source -> tokens of text and tags, with whitespace control applied.

struct Chunk {
  enum Kind { kText, kExpr, kStmt } kind;
  std::string text;
  int line;
};

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

// ---------------------------------------------------------------------------------------------
// Expressions.

struct Token {
  enum Kind { kName, kString, kInt, kFloat, kOp, kEnd } kind;
  std::string text;
};

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

struct Context;

struct Expr {
  virtual ~Expr() = default;
  virtual absl::StatusOr<Value> Eval(Context& ctx) const = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

struct Context {
  std::vector<std::map<std::string, Value>> scopes;
  Value Lookup(const std::string& name) const {
    for (auto it = scopes.rbegin(); it != scopes.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    return Undefined();
  }
  Value* Find(const std::string& name) {
    for (auto it = scopes.rbegin(); it != scopes.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return &f->second;
    }
    return nullptr;
  }
};

absl::Status TypeError(const std::string& what) { return absl::InvalidArgumentError(what); }

struct Literal : Expr {
  Value v;
  explicit Literal(Value x) : v(std::move(x)) {}
  absl::StatusOr<Value> Eval(Context&) const override { return v; }
};

struct Name : Expr {
  std::string name;
  explicit Name(std::string n) : name(std::move(n)) {}
  absl::StatusOr<Value> Eval(Context& ctx) const override { return ctx.Lookup(name); }
};

struct ListExpr : Expr {
  std::vector<ExprPtr> items;
  absl::StatusOr<Value> Eval(Context& ctx) const override {
    Value out = Value::array();
    for (const ExprPtr& e : items) {
      absl::StatusOr<Value> v = e->Eval(ctx);
      if (!v.ok()) return v;
      out.push_back(*std::move(v));
    }
    return out;
  }
};

struct DictExpr : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
  absl::StatusOr<Value> Eval(Context& ctx) const override {
    Value out = Value::object();
    for (const auto& [k, e] : items) {
      absl::StatusOr<Value> key = k->Eval(ctx);
      if (!key.ok()) return key;
      absl::StatusOr<Value> v = e->Eval(ctx);
      if (!v.ok()) return v;
      out[PyStr(*key)] = *std::move(v);
    }
    return out;
  }
};

// a[b] and a.b: keys of dicts, indices of lists and strings (negative from the end).
Value Item(const Value& a, const Value& key) {
  if (a.is_object()) {
    const std::string k = key.is_string() ? key.get<std::string>() : PyStr(key);
    auto it = a.find(k);
    return it == a.end() ? Undefined() : *it;
  }
  if ((a.is_array() || a.is_string()) && key.is_number_integer()) {
    const int64_t n = a.is_array() ? static_cast<int64_t>(a.size())
                                   : static_cast<int64_t>(a.get_ref<const std::string&>().size());
    int64_t i = key.get<int64_t>();
    if (i < 0) i += n;
    if (i < 0 || i >= n) return Undefined();
    if (a.is_array()) return a[static_cast<size_t>(i)];
    return Value(std::string(1, a.get_ref<const std::string&>()[static_cast<size_t>(i)]));
  }
  return Undefined();
}

struct Subscript : Expr {
  ExprPtr target, index;
  absl::StatusOr<Value> Eval(Context& ctx) const override {
    absl::StatusOr<Value> a = target->Eval(ctx);
    if (!a.ok()) return a;
    absl::StatusOr<Value> k = index->Eval(ctx);
    if (!k.ok()) return k;
    return Item(*a, *k);
  }
};

struct Slice : Expr {
  ExprPtr target, start, stop, step;  // each may be null
  absl::StatusOr<Value> Eval(Context& ctx) const override {
    absl::StatusOr<Value> a = target->Eval(ctx);
    if (!a.ok()) return a;
    if (!a->is_array() && !a->is_string()) return TypeError("only lists and strings can be sliced");
    const int64_t n = a->is_array() ? static_cast<int64_t>(a->size())
                                    : static_cast<int64_t>(a->get_ref<const std::string&>().size());
    auto bound = [&](const ExprPtr& e) -> absl::StatusOr<std::optional<int64_t>> {
      if (e == nullptr) return std::optional<int64_t>();
      absl::StatusOr<Value> v = e->Eval(ctx);
      if (!v.ok()) return v.status();
      if (v->is_null()) return std::optional<int64_t>();
      if (!v->is_number_integer()) return TypeError("slice bounds must be integers");
      return std::optional<int64_t>(v->get<int64_t>());
    };
    auto st = bound(step);
    if (!st.ok()) return st.status();
    const int64_t s = st->value_or(1);
    if (s == 0) return TypeError("slice step cannot be zero");
    auto b = bound(start);
    if (!b.ok()) return b.status();
    auto e = bound(stop);
    if (!e.ok()) return e.status();
    auto clamp = [&](std::optional<int64_t> x, int64_t dflt) {
      if (!x) return dflt;
      int64_t v = *x < 0 ? *x + n : *x;
      return s > 0 ? std::clamp<int64_t>(v, 0, n) : std::clamp<int64_t>(v, -1, n - 1);
    };
    const int64_t lo = clamp(*b, s > 0 ? 0 : n - 1), hi = clamp(*e, s > 0 ? n : -1);
    Value out = a->is_array() ? Value::array() : Value("");
    for (int64_t i = lo; s > 0 ? i < hi : i > hi; i += s) {
      if (a->is_array()) {
        out.push_back((*a)[static_cast<size_t>(i)]);
      } else {
        out.get_ref<std::string&>() += a->get_ref<const std::string&>()[static_cast<size_t>(i)];
      }
    }
    return out;
  }
};

struct Attribute : Expr {
  ExprPtr target;
  std::string name;
  absl::StatusOr<Value> Eval(Context& ctx) const override {
    absl::StatusOr<Value> a = target->Eval(ctx);
    if (!a.ok()) return a;
    return Item(*a, Value(name));
  }
};

struct Unary : Expr {
  std::string op;
  ExprPtr x;
  absl::StatusOr<Value> Eval(Context& ctx) const override {
    absl::StatusOr<Value> v = x->Eval(ctx);
    if (!v.ok()) return v;
    if (op == "not") return Value(!Truthy(*v));
    if (v->is_number_integer()) return Value(-v->get<int64_t>());
    if (v->is_number()) return Value(-v->get<double>());
    return TypeError("unary minus needs a number");
  }
};

absl::StatusOr<Value> Arith(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") return Value(PyStr(a) + PyStr(b));
  if (op == "+" && a.is_string() && b.is_string()) {
    return Value(a.get<std::string>() + b.get<std::string>());
  }
  if (op == "+" && a.is_array() && b.is_array()) {
    Value out = a;
    for (const Value& x : b) out.push_back(x);
    return out;
  }
  if (op == "*" && a.is_string() && b.is_number_integer()) {
    if (b.get<int64_t>() * static_cast<int64_t>(a.get_ref<const std::string&>().size()) > kMaxItems) {
      return TypeError("string repetition too long");
    }
    std::string out;
    for (int64_t i = 0; i < b.get<int64_t>(); ++i) out += a.get<std::string>();
    return Value(out);
  }
  if (!a.is_number() || !b.is_number() || a.is_boolean() || b.is_boolean()) {
    return TypeError(absl::StrCat("cannot apply '", op, "' to ", PyRepr(a, false), " and ",
                                  PyRepr(b, false)));
  }
  const bool ints = a.is_number_integer() && b.is_number_integer();
  if (ints && op != "/") {
    const int64_t x = a.get<int64_t>(), y = b.get<int64_t>();
    if ((op == "//" || op == "%") && y == 0) return TypeError("division by zero");
    if (op == "+") return Value(x + y);
    if (op == "-") return Value(x - y);
    if (op == "*") return Value(x * y);
    const int64_t q = x / y - ((x % y != 0) && ((x < 0) != (y < 0)));  // floor division
    if (op == "//") return Value(q);
    if (op == "%") return Value(x - q * y);
  }
  const double x = a.get<double>(), y = b.get<double>();
  if (op == "+") return Value(x + y);
  if (op == "-") return Value(x - y);
  if (op == "*") return Value(x * y);
  if (y == 0) return TypeError("division by zero");
  if (op == "/") return Value(x / y);
  if (op == "//") return Value(std::floor(x / y));
  return Value(x - std::floor(x / y) * y);
}

bool Equal(const Value& a, const Value& b) {
  if (IsUndefined(a) || IsUndefined(b)) return IsUndefined(a) && IsUndefined(b);
  return a == b;
}

absl::StatusOr<bool> Contains(const Value& container, const Value& x) {
  if (container.is_string()) {
    if (!x.is_string()) return TypeError("'in <string>' needs a string on the left");
    return absl::StrContains(container.get_ref<const std::string&>(), x.get_ref<const std::string&>());
  }
  if (container.is_array()) {
    for (const Value& v : container)
      if (Equal(v, x)) return true;
    return false;
  }
  if (container.is_object()) return x.is_string() && container.contains(x.get<std::string>());
  if (IsUndefined(container) || container.is_null()) return TypeError("'in' on an undefined value");
  return TypeError("'in' needs a string, list or dict");
}

absl::StatusOr<bool> Compare(const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return Equal(a, b);
  if (op == "!=") return !Equal(a, b);
  if (op == "in") return Contains(b, a);
  if (op == "not in") {
    absl::StatusOr<bool> c = Contains(b, a);
    if (!c.ok()) return c;
    return !*c;
  }
  const bool nums = a.is_number() && b.is_number();
  const bool strs = a.is_string() && b.is_string();
  if (!nums && !strs) return TypeError(absl::StrCat("cannot compare with '", op, "'"));
  const int c = nums ? (a.get<double>() < b.get<double>() ? -1 : a.get<double>() > b.get<double>())
                     : a.get_ref<const std::string&>().compare(b.get_ref<const std::string&>());
  if (op == "<") return c < 0;
  if (op == ">") return c > 0;
  if (op == "<=") return c <= 0;
  return c >= 0;
}

struct Binary : Expr {
  std::string op;
  ExprPtr a, b;
  absl::StatusOr<Value> Eval(Context& ctx) const override {
    absl::StatusOr<Value> x = a->Eval(ctx);
    if (!x.ok()) return x;
    if (op == "and") return Truthy(*x) ? b->Eval(ctx) : x;
    if (op == "or") return Truthy(*x) ? x : b->Eval(ctx);
    absl::StatusOr<Value> y = b->Eval(ctx);
    if (!y.ok()) return y;
    if (op == "==" || op == "!=" || op == "<" || op == ">" || op == "<=" || op == ">=" ||
        op == "in" || op == "not in") {
      absl::StatusOr<bool> c = Compare(op, *x, *y);
      if (!c.ok()) return c.status();
      return Value(*c);
    }
    return Arith(op, *x, *y);
  }
};

struct Conditional : Expr {
  ExprPtr cond, then, otherwise;  // otherwise may be null (undefined)
  absl::StatusOr<Value> Eval(Context& ctx) const override {
    absl::StatusOr<Value> c = cond->Eval(ctx);
    if (!c.ok()) return c;
    if (Truthy(*c)) return then->Eval(ctx);
    return otherwise ? otherwise->Eval(ctx) : absl::StatusOr<Value>(Undefined());
  }
};

struct Args {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> named;
};

struct EvaluatedArgs {
  std::vector<Value> positional;
  std::map<std::string, Value> named;
  const Value* Get(size_t i, const std::string& name) const {
    if (i < positional.size()) return &positional[i];
    auto it = named.find(name);
    return it == named.end() ? nullptr : &it->second;
  }
};

absl::StatusOr<EvaluatedArgs> EvalArgs(const Args& args, Context& ctx) {
  EvaluatedArgs out;
  for (const ExprPtr& e : args.positional) {
    absl::StatusOr<Value> v = e->Eval(ctx);
    if (!v.ok()) return v.status();
    out.positional.push_back(*std::move(v));
  }
  for (const auto& [name, e] : args.named) {
    absl::StatusOr<Value> v = e->Eval(ctx);
    if (!v.ok()) return v.status();
    out.named[name] = *std::move(v);
  }
  return out;
}

absl::StatusOr<bool> Test(const std::string& name, const Value& v, const EvaluatedArgs& args) {
  if (name == "defined") return !IsUndefined(v);
  if (name == "undefined") return IsUndefined(v);
  if (name == "none") return v.is_null();
  if (name == "string") return v.is_string();
  if (name == "number") return v.is_number() && !v.is_boolean();
  if (name == "integer") return v.is_number_integer();
  if (name == "float") return v.is_number_float();
  if (name == "boolean") return v.is_boolean();
  if (name == "true") return v.is_boolean() && v.get<bool>();
  if (name == "false") return v.is_boolean() && !v.get<bool>();
  if (name == "mapping") return v.is_object();
  if (name == "sequence" || name == "iterable") return v.is_array() || v.is_string() || v.is_object();
  if (name == "odd" || name == "even") {
    if (!v.is_number_integer()) return TypeError("odd/even need an integer");
    return (v.get<int64_t>() % 2 != 0) == (name == "odd");
  }
  if (name == "equalto" || name == "eq" || name == "sameas") {
    const Value* other = args.Get(0, "value");
    if (other == nullptr) return TypeError("'equalto' needs a value");
    return Equal(v, *other);
  }
  return TypeError(absl::StrCat("unknown test '", name, "'"));
}

struct TestExpr : Expr {
  ExprPtr x;
  std::string name;
  Args args;
  bool negate = false;
  absl::StatusOr<Value> Eval(Context& ctx) const override {
    absl::StatusOr<Value> v = x->Eval(ctx);
    if (!v.ok()) return v;
    absl::StatusOr<EvaluatedArgs> a = EvalArgs(args, ctx);
    if (!a.ok()) return a.status();
    absl::StatusOr<bool> t = Test(name, *v, *a);
    if (!t.ok()) return t.status();
    return Value(*t != negate);
  }
};

std::string Trim(const std::string& s, const std::string& chars = " \t\n\r\f\v") {
  const size_t b = s.find_first_not_of(chars);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(chars) - b + 1);
}

absl::StatusOr<Value> Iterable(const Value& v) {
  if (v.is_array()) return v;
  if (v.is_object()) {
    Value keys = Value::array();
    for (auto it = v.begin(); it != v.end(); ++it) keys.push_back(it.key());
    return keys;
  }
  if (v.is_string()) {
    Value chars = Value::array();
    for (char c : v.get<std::string>()) chars.push_back(std::string(1, c));
    return chars;
  }
  return TypeError(absl::StrCat("cannot iterate over ", IsUndefined(v) ? "an undefined value" : PyRepr(v, false)));
}

absl::StatusOr<Value> Filter(const std::string& name, const Value& v, const EvaluatedArgs& args) {
  if (name == "trim") return Value(Trim(PyStr(v)));
  if (name == "upper" || name == "lower") {
    std::string s = PyStr(v);
    name == "upper" ? absl::AsciiStrToUpper(&s) : absl::AsciiStrToLower(&s);
    return Value(s);
  }
  if (name == "capitalize") {
    std::string s = PyStr(v);
    absl::AsciiStrToLower(&s);
    if (!s.empty()) s[0] = absl::ascii_toupper(s[0]);
    return Value(s);
  }
  if (name == "string") return Value(PyStr(v));
  if (name == "safe" || name == "e" || name == "escape") return v;  // chat prompts: no HTML
  if (name == "int") {
    if (v.is_number()) return Value(static_cast<int64_t>(v.get<double>()));
    int64_t i = 0;
    return Value(v.is_string() && absl::SimpleAtoi(v.get<std::string>(), &i) ? i : 0);
  }
  if (name == "tojson") {
    const Value* indent = args.Get(0, "indent");
    return Value(ToJson(v, indent != nullptr && indent->is_number_integer() ? indent->get<int>() : -1));
  }
  if (name == "length" || name == "count") {
    if (v.is_string()) return Value(static_cast<int64_t>(v.get_ref<const std::string&>().size()));
    if (v.is_array() || v.is_object()) return Value(static_cast<int64_t>(v.size()));
    return TypeError("length of a value that has none");
  }
  if (name == "default" || name == "d") {
    const Value* d = args.Get(0, "default_value");
    const Value* boolean = args.Get(1, "boolean");
    const bool use = IsUndefined(v) || (boolean != nullptr && Truthy(*boolean) && !Truthy(v));
    return use ? (d != nullptr ? *d : Value("")) : v;
  }
  if (name == "items") {
    if (!v.is_object()) return TypeError("items needs a dict");
    Value out = Value::array();
    for (auto it = v.begin(); it != v.end(); ++it) out.push_back(Value::array({it.key(), it.value()}));
    return out;
  }
  absl::StatusOr<Value> list = Iterable(v);
  if (!list.ok()) return list;
  if (name == "list") return list;
  if (name == "first") return list->empty() ? Undefined() : list->front();
  if (name == "last") return list->empty() ? Undefined() : list->back();
  if (name == "join") {
    const Value* sep = args.Get(0, "d");
    std::vector<std::string> parts;
    for (const Value& x : *list) parts.push_back(PyStr(x));
    return Value(absl::StrJoin(parts, sep != nullptr ? PyStr(*sep) : ""));
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    const bool attr = absl::EndsWith(name, "attr");
    const bool keep_match = absl::StartsWith(name, "select");
    size_t next = 0;
    std::string attribute;
    if (attr) {
      if (args.positional.empty()) return TypeError(name + " needs an attribute");
      attribute = PyStr(args.positional[next++]);
    }
    EvaluatedArgs test_args;
    std::string test;
    if (next < args.positional.size()) test = PyStr(args.positional[next++]);
    for (; next < args.positional.size(); ++next) test_args.positional.push_back(args.positional[next]);
    Value out = Value::array();
    for (const Value& x : *list) {
      const Value subject = attr ? Item(x, Value(attribute)) : x;
      bool match = Truthy(subject);
      if (!test.empty()) {
        absl::StatusOr<bool> t = Test(test, subject, test_args);
        if (!t.ok()) return t.status();
        match = *t;
      }
      if (match == keep_match) out.push_back(x);
    }
    return out;
  }
  if (name == "map") {
    const Value* attribute = args.Get(99, "attribute");
    Value out = Value::array();
    for (const Value& x : *list) {
      if (attribute != nullptr) {
        out.push_back(Item(x, *attribute));
      } else if (!args.positional.empty()) {
        EvaluatedArgs rest;
        rest.positional.assign(args.positional.begin() + 1, args.positional.end());
        absl::StatusOr<Value> y = Filter(PyStr(args.positional[0]), x, rest);
        if (!y.ok()) return y;
        out.push_back(*std::move(y));
      } else {
        return TypeError("map needs attribute= or a filter name");
      }
    }
    return out;
  }
  if (name == "replace") {
    const Value* from = args.Get(0, "old");
    const Value* to = args.Get(1, "new");
    if (from == nullptr || to == nullptr) return TypeError("replace needs old and new");
    return Value(absl::StrReplaceAll(PyStr(v), {{PyStr(*from), PyStr(*to)}}));
  }
  return TypeError(absl::StrCat("unknown filter '", name, "'"));
}

struct FilterExpr : Expr {
  ExprPtr x;
  std::string name;
  Args args;
  absl::StatusOr<Value> Eval(Context& ctx) const override {
    absl::StatusOr<Value> v = x->Eval(ctx);
    if (!v.ok()) return v;
    absl::StatusOr<EvaluatedArgs> a = EvalArgs(args, ctx);
    if (!a.ok()) return a.status();
    return Filter(name, *v, *a);
  }
};

// Methods of strings and dicts that templates call (Python's).
absl::StatusOr<Value> Method(const Value& self, const std::string& name, const EvaluatedArgs& a) {
  const Value* arg0 = a.Get(0, "");
  if (self.is_string()) {
    const std::string& s = self.get_ref<const std::string&>();
    const std::string chars = arg0 != nullptr && arg0->is_string() ? arg0->get<std::string>() : " \t\n\r\f\v";
    if (name == "strip") return Value(Trim(s, chars));
    if (name == "lstrip") {
      const size_t b = s.find_first_not_of(chars);
      return Value(b == std::string::npos ? "" : s.substr(b));
    }
    if (name == "rstrip") {
      const size_t e = s.find_last_not_of(chars);
      return Value(e == std::string::npos ? "" : s.substr(0, e + 1));
    }
    if (name == "upper" || name == "lower") return Filter(name, self, a);
    if (name == "startswith" || name == "endswith") {
      if (arg0 == nullptr || !arg0->is_string()) return TypeError(name + " needs a string");
      return Value(name == "startswith" ? absl::StartsWith(s, arg0->get<std::string>())
                                        : absl::EndsWith(s, arg0->get<std::string>()));
    }
    if (name == "split") {
      Value out = Value::array();
      if (arg0 == nullptr || arg0->is_null()) {
        for (absl::string_view p : absl::StrSplit(s, absl::ByAnyChar(" \t\n\r"), absl::SkipEmpty())) out.push_back(std::string(p));
      } else {
        for (absl::string_view p : absl::StrSplit(s, arg0->get<std::string>())) out.push_back(std::string(p));
      }
      return out;
    }
    if (name == "replace") return Filter("replace", self, a);
    if (name == "title" || name == "capitalize") return Filter("capitalize", self, a);
  }
  if (self.is_object()) {
    if (name == "items") return Filter("items", self, a);
    if (name == "keys" || name == "values") {
      Value out = Value::array();
      for (auto it = self.begin(); it != self.end(); ++it) out.push_back(name == "keys" ? Value(it.key()) : it.value());
      return out;
    }
    if (name == "get") {
      if (arg0 == nullptr) return TypeError("get needs a key");
      const Value v = Item(self, *arg0);
      const Value* d = a.Get(1, "default");
      return IsUndefined(v) ? (d != nullptr ? *d : Value(nullptr)) : v;
    }
  }
  return TypeError(absl::StrCat("unknown method '", name, "' of ", PyRepr(self, false)));
}

struct Call : Expr {
  ExprPtr callee;  // a Name (global function) or an Attribute (method)
  Args args;
  absl::StatusOr<Value> Eval(Context& ctx) const override {
    absl::StatusOr<EvaluatedArgs> a = EvalArgs(args, ctx);
    if (!a.ok()) return a.status();
    if (const auto* attr = dynamic_cast<const Attribute*>(callee.get())) {
      absl::StatusOr<Value> self = attr->target->Eval(ctx);
      if (!self.ok()) return self;
      return Method(*self, attr->name, *a);
    }
    const auto* fn = dynamic_cast<const Name*>(callee.get());
    if (fn == nullptr) return TypeError("only functions and methods can be called");
    if (fn->name == "raise_exception") {
      return absl::InvalidArgumentError(a->positional.empty() ? "raise_exception" : PyStr(a->positional[0]));
    }
    if (fn->name == "strftime_now") {
      if (a->positional.empty() || !a->positional[0].is_string()) return TypeError("strftime_now needs a format");
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof(buf), a->positional[0].get<std::string>().c_str(), &tm);
      return Value(std::string(buf, n));
    }
    if (fn->name == "namespace") {
      Value ns = Value::object();
      for (const auto& [k, v] : a->named) ns[k] = v;
      ns["__namespace__"] = true;
      return ns;
    }
    if (fn->name == "range") {
      int64_t lo = 0, hi = 0, step = 1;
      const auto& p = a->positional;
      for (const Value& x : p)
        if (!x.is_number_integer()) return TypeError("range needs integers");
      if (p.size() == 1) hi = p[0].get<int64_t>();
      if (p.size() >= 2) lo = p[0].get<int64_t>(), hi = p[1].get<int64_t>();
      if (p.size() == 3) step = p[2].get<int64_t>();
      if (step == 0 || p.empty() || p.size() > 3) return TypeError("bad range");
      if ((hi - lo) / step > kMaxItems) return TypeError("range too long");
      Value out = Value::array();
      for (int64_t i = lo; step > 0 ? i < hi : i > hi; i += step) out.push_back(i);
      return out;
    }
    return TypeError(absl::StrCat("unknown function '", fn->name, "'"));
  }
};

class Parser {
 public:
  Parser(std::vector<Token> tokens, int line) : t_(std::move(tokens)), line_(line) {}

  absl::StatusOr<ExprPtr> Expression() {
    // Hostile nesting ("((((...") must fail, not overflow the stack.
    if (++depth_ > kMaxDepth) return Error("expressions nested too deeply");
    absl::StatusOr<ExprPtr> x = Conditional();
    --depth_;
    return x;
  }
  // Without a trailing `if ... else`: a for loop's iterable, before its filter.
  absl::StatusOr<ExprPtr> OrExpression() { return Or(); }
  bool AtEnd() const { return t_[i_].kind == Token::kEnd; }
  bool IsName(const char* s) const { return t_[i_].kind == Token::kName && t_[i_].text == s; }
  bool IsOp(const char* s) const { return t_[i_].kind == Token::kOp && t_[i_].text == s; }
  const Token& Next() { return t_[i_++]; }
  const Token& Peek(size_t k = 0) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat("line ", line_, ": ", what,
                                                   AtEnd() ? " at the end" : " at '" + t_[i_].text + "'"));
  }
  absl::Status Expect(const char* op) {
    if (!IsOp(op)) return Error(absl::StrCat("expected '", op, "'"));
    ++i_;
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Identifier() {
    if (t_[i_].kind != Token::kName) return Error("expected a name");
    return t_[i_++].text;
  }

 private:
  absl::StatusOr<ExprPtr> Conditional() {
    absl::StatusOr<ExprPtr> x = Or();
    if (!x.ok()) return x;
    if (!IsName("if")) return x;
    ++i_;
    auto c = std::make_unique<struct Conditional>();
    c->then = *std::move(x);
    absl::StatusOr<ExprPtr> cond = Or();
    if (!cond.ok()) return cond;
    c->cond = *std::move(cond);
    if (IsName("else")) {
      ++i_;
      absl::StatusOr<ExprPtr> e = Conditional();
      if (!e.ok()) return e;
      c->otherwise = *std::move(e);
    }
    return ExprPtr(std::move(c));
  }
  template <typename Sub>
  absl::StatusOr<ExprPtr> LeftAssoc(Sub sub, std::initializer_list<const char*> ops, bool names) {
    absl::StatusOr<ExprPtr> x = (this->*sub)();
    if (!x.ok()) return x;
    for (;;) {
      const char* matched = nullptr;
      for (const char* op : ops)
        if (names ? IsName(op) : IsOp(op)) matched = op;
      if (matched == nullptr) return x;
      ++i_;
      if (absl::Status s = Grow(); !s.ok()) return s;
      absl::StatusOr<ExprPtr> y = (this->*sub)();
      if (!y.ok()) return y;
      auto b = std::make_unique<Binary>();
      b->op = matched;
      b->a = *std::move(x);
      b->b = *std::move(y);
      x = ExprPtr(std::move(b));
    }
  }
  absl::StatusOr<ExprPtr> Or() { return LeftAssoc(&Parser::And, {"or"}, true); }
  absl::StatusOr<ExprPtr> And() { return LeftAssoc(&Parser::Not, {"and"}, true); }
  absl::StatusOr<ExprPtr> Not() {
    if (!IsName("not")) return Compare();
    if (++depth_ > kMaxDepth) return Error("expressions nested too deeply");
    ++i_;
    absl::StatusOr<ExprPtr> x = Not();
    --depth_;
    if (!x.ok()) return x;
    auto u = std::make_unique<Unary>();
    u->op = "not";
    u->x = *std::move(x);
    return ExprPtr(std::move(u));
  }
  absl::StatusOr<ExprPtr> Compare() {
    absl::StatusOr<ExprPtr> x = Concat();
    if (!x.ok()) return x;
    for (;;) {
      std::string op;
      if (IsOp("==") || IsOp("!=") || IsOp("<") || IsOp(">") || IsOp("<=") || IsOp(">=")) {
        op = Next().text;
      } else if (IsName("in")) {
        ++i_;
        op = "in";
      } else if (IsName("not") && Peek(1).kind == Token::kName && Peek(1).text == "in") {
        i_ += 2;
        op = "not in";
      } else if (IsName("is")) {
        ++i_;
        auto t = std::make_unique<TestExpr>();
        if (IsName("not")) {
          ++i_;
          t->negate = true;
        }
        absl::StatusOr<std::string> name = Identifier();
        if (!name.ok()) return name.status();
        t->name = *name;
        t->x = *std::move(x);
        if (IsOp("(")) {
          if (absl::Status s = ArgList(&t->args); !s.ok()) return s;
        } else if (!AtEnd() && (Peek().kind == Token::kString || Peek().kind == Token::kInt)) {
          absl::StatusOr<ExprPtr> arg = Primary();  // "is equalto 5"
          if (!arg.ok()) return arg;
          t->args.positional.push_back(*std::move(arg));
        }
        x = ExprPtr(std::move(t));
        continue;
      } else {
        return x;
      }
      if (absl::Status s = Grow(); !s.ok()) return s;
      absl::StatusOr<ExprPtr> y = Concat();
      if (!y.ok()) return y;
      auto b = std::make_unique<Binary>();
      b->op = op;
      b->a = *std::move(x);
      b->b = *std::move(y);
      x = ExprPtr(std::move(b));
    }
  }
  absl::StatusOr<ExprPtr> Concat() { return LeftAssoc(&Parser::Additive, {"~"}, false); }
  absl::StatusOr<ExprPtr> Additive() { return LeftAssoc(&Parser::Multiplicative, {"+", "-"}, false); }
  absl::StatusOr<ExprPtr> Multiplicative() {
    return LeftAssoc(&Parser::UnaryMinus, {"*", "/", "//", "%"}, false);
  }
  absl::StatusOr<ExprPtr> UnaryMinus() {
    if (!IsOp("-")) return Postfix();
    ++i_;
    if (++depth_ > kMaxDepth) return Error("expressions nested too deeply");
    absl::StatusOr<ExprPtr> x = UnaryMinus();
    --depth_;
    if (!x.ok()) return x;
    auto u = std::make_unique<Unary>();
    u->op = "-";
    u->x = *std::move(x);
    return ExprPtr(std::move(u));
  }
  absl::Status ArgList(Args* args) {
    if (absl::Status s = Expect("("); !s.ok()) return s;
    while (!IsOp(")")) {
      if (Peek().kind == Token::kName && Peek(1).kind == Token::kOp && Peek(1).text == "=") {
        std::string name = Next().text;
        ++i_;
        absl::StatusOr<ExprPtr> v = Expression();
        if (!v.ok()) return v.status();
        args->named.emplace_back(name, *std::move(v));
      } else {
        absl::StatusOr<ExprPtr> v = Expression();
        if (!v.ok()) return v.status();
        args->positional.push_back(*std::move(v));
      }
      if (!IsOp(",")) break;
      ++i_;
    }
    return Expect(")");
  }
  absl::StatusOr<ExprPtr> Postfix() {
    absl::StatusOr<ExprPtr> x = Primary();
    if (!x.ok()) return x;
    for (;;) {
      if ((IsOp(".") || IsOp("[") || IsOp("(") || IsOp("|")) && !Grow().ok()) return Grow();
      if (IsOp(".")) {
        ++i_;
        absl::StatusOr<std::string> name = Identifier();
        if (!name.ok()) return name.status();
        auto a = std::make_unique<Attribute>();
        a->target = *std::move(x);
        a->name = *name;
        x = ExprPtr(std::move(a));
      } else if (IsOp("[")) {
        ++i_;
        ExprPtr parts[3];
        int colons = 0;
        for (;;) {
          if (IsOp("]")) break;
          if (IsOp(":")) {
            if (++colons > 2) return Error("too many ':' in a slice");
            ++i_;
            continue;
          }
          absl::StatusOr<ExprPtr> e = Expression();
          if (!e.ok()) return e;
          parts[colons] = *std::move(e);
        }
        ++i_;
        if (colons == 0) {
          if (!parts[0]) return Error("empty subscript");
          auto s = std::make_unique<Subscript>();
          s->target = *std::move(x);
          s->index = std::move(parts[0]);
          x = ExprPtr(std::move(s));
        } else {
          auto s = std::make_unique<Slice>();
          s->target = *std::move(x);
          s->start = std::move(parts[0]);
          s->stop = std::move(parts[1]);
          s->step = std::move(parts[2]);
          x = ExprPtr(std::move(s));
        }
      } else if (IsOp("(")) {
        auto c = std::make_unique<Call>();
        c->callee = *std::move(x);
        if (absl::Status s = ArgList(&c->args); !s.ok()) return s;
        x = ExprPtr(std::move(c));
      } else if (IsOp("|")) {
        ++i_;
        auto f = std::make_unique<FilterExpr>();
        absl::StatusOr<std::string> name = Identifier();
        if (!name.ok()) return name.status();
        f->name = *name;
        f->x = *std::move(x);
        if (IsOp("(")) {
          if (absl::Status s = ArgList(&f->args); !s.ok()) return s;
        }
        x = ExprPtr(std::move(f));
      } else {
        return x;
      }
    }
  }
  absl::StatusOr<ExprPtr> Primary() {
    const Token& t = Peek();
    if (t.kind == Token::kString) {
      std::string s = Next().text;
      while (Peek().kind == Token::kString) s += Next().text;  // adjacent literals join
      return ExprPtr(std::make_unique<Literal>(Value(s)));
    }
    if (t.kind == Token::kInt) return ExprPtr(std::make_unique<Literal>(Value(std::stoll(Next().text))));
    if (t.kind == Token::kFloat) return ExprPtr(std::make_unique<Literal>(Value(std::stod(Next().text))));
    if (t.kind == Token::kName) {
      const std::string n = Next().text;
      if (n == "true" || n == "True") return ExprPtr(std::make_unique<Literal>(Value(true)));
      if (n == "false" || n == "False") return ExprPtr(std::make_unique<Literal>(Value(false)));
      if (n == "none" || n == "None") return ExprPtr(std::make_unique<Literal>(Value(nullptr)));
      return ExprPtr(std::make_unique<Name>(n));
    }
    if (IsOp("(")) {
      ++i_;
      absl::StatusOr<ExprPtr> x = Expression();
      if (!x.ok()) return x;
      if (absl::Status s = Expect(")"); !s.ok()) return s;
      return x;
    }
    if (IsOp("[")) {
      ++i_;
      auto l = std::make_unique<ListExpr>();
      while (!IsOp("]")) {
        absl::StatusOr<ExprPtr> x = Expression();
        if (!x.ok()) return x;
        l->items.push_back(*std::move(x));
        if (!IsOp(",")) break;
        ++i_;
      }
      if (absl::Status s = Expect("]"); !s.ok()) return s;
      return ExprPtr(std::move(l));
    }
    if (IsOp("{")) {
      ++i_;
      auto d = std::make_unique<DictExpr>();
      while (!IsOp("}")) {
        absl::StatusOr<ExprPtr> k = Expression();
        if (!k.ok()) return k;
        if (absl::Status s = Expect(":"); !s.ok()) return s;
        absl::StatusOr<ExprPtr> v = Expression();
        if (!v.ok()) return v;
        d->items.emplace_back(*std::move(k), *std::move(v));
        if (!IsOp(",")) break;
        ++i_;
      }
      if (absl::Status s = Expect("}"); !s.ok()) return s;
      return ExprPtr(std::move(d));
    }
    return Error("expected an expression");
  }

  // Chains (a + b + ..., a.b.c..., x|f|g...) build trees as deep as they are long; rendering
  // recurses through them, so their length is bounded too.
  absl::Status Grow() {
    return ++nodes_ > kMaxNodes ? Error("expression too long") : absl::OkStatus();
  }
  static constexpr int kMaxDepth = 64;
  static constexpr int kMaxNodes = 2000;
  int nodes_ = 0;
  std::vector<Token> t_;
  size_t i_ = 0;
  int line_;
  int depth_ = 0;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Statements.

enum class Flow { kNormal, kBreak, kContinue };

struct Node {
  virtual ~Node() = default;
  virtual absl::StatusOr<Flow> Render(Context& ctx, std::string* out) const = 0;
};

namespace {

using NodePtr = std::unique_ptr<Node>;

struct Block : Node {
  std::vector<NodePtr> children;
  absl::StatusOr<Flow> Render(Context& ctx, std::string* out) const override {
    for (const NodePtr& n : children) {
      absl::StatusOr<Flow> f = n->Render(ctx, out);
      if (!f.ok() || *f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }
};

struct Text : Node {
  std::string text;
  absl::StatusOr<Flow> Render(Context&, std::string* out) const override {
    out->append(text);
    return Flow::kNormal;
  }
};

struct Print : Node {
  ExprPtr x;
  absl::StatusOr<Flow> Render(Context& ctx, std::string* out) const override {
    absl::StatusOr<Value> v = x->Eval(ctx);
    if (!v.ok()) return v.status();
    out->append(PyStr(*v));
    return Flow::kNormal;
  }
};

struct If : Node {
  std::vector<std::pair<ExprPtr, std::unique_ptr<Block>>> branches;  // null condition: else
  absl::StatusOr<Flow> Render(Context& ctx, std::string* out) const override {
    for (const auto& [cond, body] : branches) {
      if (cond) {
        absl::StatusOr<Value> c = cond->Eval(ctx);
        if (!c.ok()) return c.status();
        if (!Truthy(*c)) continue;
      }
      return body->Render(ctx, out);
    }
    return Flow::kNormal;
  }
};

struct For : Node {
  std::vector<std::string> targets;
  ExprPtr iterable, filter;
  std::unique_ptr<Block> body, otherwise;
  absl::StatusOr<Flow> Render(Context& ctx, std::string* out) const override {
    absl::StatusOr<Value> v = iterable->Eval(ctx);
    if (!v.ok()) return v.status();
    absl::StatusOr<Value> items = v->is_object() && targets.size() == 2
                                      ? Filter("items", *v, EvaluatedArgs())
                                      : Iterable(*v);
    if (!items.ok()) return items.status();
    std::vector<Value> kept;
    for (const Value& item : *items) {
      if (filter) {
        ctx.scopes.emplace_back();
        Bind(ctx, item);
        absl::StatusOr<Value> keep = filter->Eval(ctx);
        ctx.scopes.pop_back();
        if (!keep.ok()) return keep.status();
        if (!Truthy(*keep)) continue;
      }
      kept.push_back(item);
    }
    if (kept.empty()) return otherwise ? otherwise->Render(ctx, out) : Flow::kNormal;
    const int64_t n = static_cast<int64_t>(kept.size());
    for (int64_t i = 0; i < n; ++i) {
      ctx.scopes.emplace_back();
      Bind(ctx, kept[i]);
      ctx.scopes.back()["loop"] = Value{{"index", i + 1},        {"index0", i},
                                        {"revindex", n - i},     {"revindex0", n - i - 1},
                                        {"first", i == 0},       {"last", i == n - 1},
                                        {"length", n},
                                        {"previtem", i > 0 ? kept[i - 1] : Undefined()},
                                        {"nextitem", i + 1 < n ? kept[i + 1] : Undefined()}};
      absl::StatusOr<Flow> f = body->Render(ctx, out);
      // `set` inside a loop does not leak out of it (Jinja scoping), namespaces excepted.
      ctx.scopes.pop_back();
      if (!f.ok()) return f;
      if (*f == Flow::kBreak) break;
    }
    return Flow::kNormal;
  }
  void Bind(Context& ctx, const Value& item) const {
    if (targets.size() == 1) {
      ctx.scopes.back()[targets[0]] = item;
    } else {
      for (size_t k = 0; k < targets.size(); ++k) ctx.scopes.back()[targets[k]] = item.is_array() && k < item.size() ? item[k] : Undefined();
    }
  }
};

struct Set : Node {
  std::string name, attribute;  // attribute: `set ns.attr = ...`
  ExprPtr x;
  absl::StatusOr<Flow> Render(Context& ctx, std::string*) const override {
    absl::StatusOr<Value> v = x->Eval(ctx);
    if (!v.ok()) return v.status();
    if (attribute.empty()) {
      ctx.scopes.back()[name] = *std::move(v);
      return Flow::kNormal;
    }
    Value* ns = ctx.Find(name);
    if (ns == nullptr || !ns->is_object() || !ns->contains("__namespace__")) {
      return absl::InvalidArgumentError(absl::StrCat("'", name, "' is not a namespace"));
    }
    (*ns)[attribute] = *std::move(v);
    return Flow::kNormal;
  }
};

struct LoopControl : Node {
  Flow flow;
  absl::StatusOr<Flow> Render(Context&, std::string*) const override { return flow; }
};

// Chunks -> a tree, one statement at a time.
class TreeBuilder {
 public:
  explicit TreeBuilder(std::vector<Chunk> chunks) : chunks_(std::move(chunks)) {}

  // Parses until one of `ends` (a statement keyword) and returns it in *end ("" at EOF).
  absl::StatusOr<std::unique_ptr<Block>> Parse(std::initializer_list<const char*> ends, std::string* end, Parser** rest) {
    if (++depth_ > 64) return absl::InvalidArgumentError("blocks nested too deeply");
    struct Leave {
      int* d;
      ~Leave() { --*d; }
    } leave{&depth_};
    auto block = std::make_unique<Block>();
    while (pos_ < chunks_.size()) {
      const Chunk& c = chunks_[pos_++];
      if (c.kind == Chunk::kText) {
        auto t = std::make_unique<Text>();
        t->text = c.text;
        block->children.push_back(std::move(t));
        continue;
      }
      absl::StatusOr<std::vector<Token>> tokens = Lex(c.text, c.line);
      if (!tokens.ok()) return tokens.status();
      parsers_.push_back(std::make_unique<Parser>(*std::move(tokens), c.line));
      Parser& p = *parsers_.back();
      if (c.kind == Chunk::kExpr) {
        auto print = std::make_unique<Print>();
        absl::StatusOr<ExprPtr> x = p.Expression();
        if (!x.ok()) return x.status();
        if (!p.AtEnd()) return p.Error("unexpected tokens after the expression");
        print->x = *std::move(x);
        block->children.push_back(std::move(print));
        continue;
      }
      absl::StatusOr<std::string> keyword = p.Identifier();
      if (!keyword.ok()) return keyword.status();
      for (const char* e : ends) {
        if (*keyword == e) {
          *end = *keyword;
          *rest = &p;
          return block;
        }
      }
      absl::StatusOr<NodePtr> node = Statement(*keyword, p, c.line);
      if (!node.ok()) return node.status();
      if (*node) block->children.push_back(*std::move(node));
    }
    if (ends.size() > 0) {
      return absl::InvalidArgumentError(absl::StrCat("missing {% ", *(ends.end() - 1), " %}"));
    }
    *end = "";
    return block;
  }

 private:
  absl::StatusOr<NodePtr> Statement(const std::string& keyword, Parser& p, int line) {
    auto done = [&](NodePtr n) -> absl::StatusOr<NodePtr> {
      if (!p.AtEnd()) return p.Error(absl::StrCat("unexpected tokens in {% ", keyword, " %}"));
      return n;
    };
    if (keyword == "if") {
      auto node = std::make_unique<If>();
      absl::StatusOr<ExprPtr> cond = p.Expression();
      if (!cond.ok()) return cond.status();
      if (!p.AtEnd()) return p.Error("unexpected tokens in {% if %}");
      for (;;) {
        std::string end;
        Parser* rest = nullptr;
        absl::StatusOr<std::unique_ptr<Block>> body = Parse({"elif", "else", "endif"}, &end, &rest);
        if (!body.ok()) return body.status();
        node->branches.emplace_back(std::move(cond).value(), *std::move(body));
        if (end == "endif") break;
        if (end == "else") {
          cond = ExprPtr();
        } else {
          cond = rest->Expression();
          if (!cond.ok()) return cond.status();
        }
      }
      return NodePtr(std::move(node));
    }
    if (keyword == "for") {
      auto node = std::make_unique<For>();
      for (;;) {
        absl::StatusOr<std::string> target = p.Identifier();
        if (!target.ok()) return target.status();
        node->targets.push_back(*target);
        if (!p.IsOp(",")) break;
        p.Next();
      }
      if (!p.IsName("in")) return p.Error("expected 'in'");
      p.Next();
      // The iterable stops before a trailing `if` (a loop filter), not a conditional expression.
      absl::StatusOr<ExprPtr> it = p.OrExpression();
      if (!it.ok()) return it.status();
      node->iterable = *std::move(it);
      if (p.IsName("if")) {
        p.Next();
        absl::StatusOr<ExprPtr> f = p.Expression();
        if (!f.ok()) return f.status();
        node->filter = *std::move(f);
      }
      if (!p.AtEnd()) return p.Error("unexpected tokens in {% for %}");
      std::string end;
      Parser* rest = nullptr;
      absl::StatusOr<std::unique_ptr<Block>> body = Parse({"else", "endfor"}, &end, &rest);
      if (!body.ok()) return body.status();
      node->body = *std::move(body);
      if (end == "else") {
        absl::StatusOr<std::unique_ptr<Block>> other = Parse({"endfor"}, &end, &rest);
        if (!other.ok()) return other.status();
        node->otherwise = *std::move(other);
      }
      return NodePtr(std::move(node));
    }
    if (keyword == "set") {
      auto node = std::make_unique<Set>();
      absl::StatusOr<std::string> name = p.Identifier();
      if (!name.ok()) return name.status();
      node->name = *name;
      if (p.IsOp(".")) {
        p.Next();
        absl::StatusOr<std::string> attr = p.Identifier();
        if (!attr.ok()) return attr.status();
        node->attribute = *attr;
      }
      if (!p.IsOp("=")) return p.Error("expected '=' ({% set %} blocks are not supported)");
      p.Next();
      absl::StatusOr<ExprPtr> x = p.Expression();
      if (!x.ok()) return x.status();
      node->x = *std::move(x);
      return done(std::move(node));
    }
    if (keyword == "break" || keyword == "continue") {
      auto node = std::make_unique<LoopControl>();
      node->flow = keyword == "break" ? Flow::kBreak : Flow::kContinue;
      return done(std::move(node));
    }
    if (keyword == "generation" || keyword == "endgeneration") {  // transformers' marker
      return done(nullptr);
    }
    return absl::InvalidArgumentError(
        absl::StrCat("line ", line, ": {% ", keyword, " %} is not supported"));
  }

  std::vector<Chunk> chunks_;
  size_t pos_ = 0;
  int depth_ = 0;
  std::vector<std::unique_ptr<Parser>> parsers_;
};

}  // namespace

absl::StatusOr<Template> Template::Parse(std::string_view source) {
  absl::StatusOr<std::vector<Chunk>> chunks = Split(source);
  if (!chunks.ok()) return chunks.status();
  TreeBuilder builder(*std::move(chunks));
  std::string end;
  Parser* rest = nullptr;
  absl::StatusOr<std::unique_ptr<Block>> root = builder.Parse({}, &end, &rest);
  if (!root.ok()) return root.status();
  Template t;
  t.root_ = std::shared_ptr<const Node>(std::move(root).value());
  return t;
}

absl::StatusOr<std::string> Template::Render(const Value& context) const {
  if (!context.is_object()) return absl::InvalidArgumentError("the context must be an object");
  Context ctx;
  ctx.scopes.emplace_back();
  for (auto it = context.begin(); it != context.end(); ++it) ctx.scopes.back()[it.key()] = it.value();
  ctx.scopes.emplace_back();  // the template's own `set`s
  std::string out;
  absl::StatusOr<Flow> f = root_->Render(ctx, &out);
  if (!f.ok()) return f.status();
  return out;
}

std::string ToJson(const Value& v, int indent) {
  std::string out;
  DumpJson(v, indent, 0, &out);
  return out;
}

}  // namespace preft::text::jinja
