// The Jinja grammar that chat templates use: expressions by recursive descent (one method per
// precedence level), statements by a builder that parses blocks until their closing keyword.

#include "common/text/jinja_parser.h"

#include <algorithm>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/text/jinja.h"
#include "common/text/jinja_ast.h"
#include "common/text/jinja_lexer.h"

namespace preft::text::jinja::internal {

namespace {

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

absl::StatusOr<std::unique_ptr<Block>> BuildTree(std::vector<Chunk> chunks) {
  TreeBuilder builder(std::move(chunks));
  std::string end;
  Parser* rest = nullptr;
  return builder.Parse({}, &end, &rest);
}

}  // namespace preft::text::jinja::internal
