// Evaluation with Python's semantics where templates can tell the difference (floor division,
// negative indices, slices, `in`), and the builtins chat templates call: tests, filters, string
// and dict methods, range, namespace, raise_exception and strftime_now.

#include "common/text/jinja_eval.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/text/jinja.h"
#include "common/text/jinja_ast.h"
#include "common/text/jinja_value.h"

namespace preft::text::jinja::internal {

namespace {

// Bounds on what a template may build (range(), "x" * n): templates come from model folders.
constexpr int64_t kMaxItems = 1 << 20;

absl::Status TypeError(const std::string& what) { return absl::InvalidArgumentError(what); }

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

}  // namespace

// Expressions.

absl::StatusOr<Value> Literal::Eval(Context&) const { return v; }

absl::StatusOr<Value> Name::Eval(Context& ctx) const { return ctx.Lookup(name); }

absl::StatusOr<Value> ListExpr::Eval(Context& ctx) const {
  Value out = Value::array();
  for (const ExprPtr& e : items) {
    absl::StatusOr<Value> v = e->Eval(ctx);
    if (!v.ok()) return v;
    out.push_back(*std::move(v));
  }
  return out;
}

absl::StatusOr<Value> DictExpr::Eval(Context& ctx) const {
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

absl::StatusOr<Value> Subscript::Eval(Context& ctx) const {
  absl::StatusOr<Value> a = target->Eval(ctx);
  if (!a.ok()) return a;
  absl::StatusOr<Value> k = index->Eval(ctx);
  if (!k.ok()) return k;
  return Item(*a, *k);
}

absl::StatusOr<Value> Slice::Eval(Context& ctx) const {
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

absl::StatusOr<Value> Attribute::Eval(Context& ctx) const {
  absl::StatusOr<Value> a = target->Eval(ctx);
  if (!a.ok()) return a;
  return Item(*a, Value(name));
}

absl::StatusOr<Value> Unary::Eval(Context& ctx) const {
  absl::StatusOr<Value> v = x->Eval(ctx);
  if (!v.ok()) return v;
  if (op == "not") return Value(!Truthy(*v));
  if (v->is_number_integer()) return Value(-v->get<int64_t>());
  if (v->is_number()) return Value(-v->get<double>());
  return TypeError("unary minus needs a number");
}

absl::StatusOr<Value> Binary::Eval(Context& ctx) const {
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

absl::StatusOr<Value> Conditional::Eval(Context& ctx) const {
  absl::StatusOr<Value> c = cond->Eval(ctx);
  if (!c.ok()) return c;
  if (Truthy(*c)) return then->Eval(ctx);
  return otherwise ? otherwise->Eval(ctx) : absl::StatusOr<Value>(Undefined());
}

absl::StatusOr<Value> TestExpr::Eval(Context& ctx) const {
  absl::StatusOr<Value> v = x->Eval(ctx);
  if (!v.ok()) return v;
  absl::StatusOr<EvaluatedArgs> a = EvalArgs(args, ctx);
  if (!a.ok()) return a.status();
  absl::StatusOr<bool> t = Test(name, *v, *a);
  if (!t.ok()) return t.status();
  return Value(*t != negate);
}

absl::StatusOr<Value> FilterExpr::Eval(Context& ctx) const {
  absl::StatusOr<Value> v = x->Eval(ctx);
  if (!v.ok()) return v;
  absl::StatusOr<EvaluatedArgs> a = EvalArgs(args, ctx);
  if (!a.ok()) return a.status();
  return Filter(name, *v, *a);
}

absl::StatusOr<Value> Call::Eval(Context& ctx) const {
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

// Statements.

absl::StatusOr<Flow> Block::Render(Context& ctx, std::string* out) const {
  for (const NodePtr& n : children) {
    absl::StatusOr<Flow> f = n->Render(ctx, out);
    if (!f.ok() || *f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

absl::StatusOr<Flow> Text::Render(Context&, std::string* out) const {
  out->append(text);
  return Flow::kNormal;
}

absl::StatusOr<Flow> Print::Render(Context& ctx, std::string* out) const {
  absl::StatusOr<Value> v = x->Eval(ctx);
  if (!v.ok()) return v.status();
  out->append(PyStr(*v));
  return Flow::kNormal;
}

absl::StatusOr<Flow> If::Render(Context& ctx, std::string* out) const {
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

absl::StatusOr<Flow> For::Render(Context& ctx, std::string* out) const {
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
void For::Bind(Context& ctx, const Value& item) const {
  if (targets.size() == 1) {
    ctx.scopes.back()[targets[0]] = item;
  } else {
    for (size_t k = 0; k < targets.size(); ++k) ctx.scopes.back()[targets[k]] = item.is_array() && k < item.size() ? item[k] : Undefined();
  }
}

absl::StatusOr<Flow> Set::Render(Context& ctx, std::string*) const {
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

absl::StatusOr<Flow> LoopControl::Render(Context&, std::string*) const { return flow; }

}  // namespace preft::text::jinja::internal
