#pragma once

// The parsed template: expression and statement nodes. jinja_parser.cc builds them and
// jinja_eval.cc defines their Eval and Render, so the tree is the only thing those two share.
// A tree is read-only once built; each render brings its own Context.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/text/jinja.h"

namespace preft::text::jinja {
namespace internal {

struct Context;  // jinja_eval.h

struct Expr {
  virtual ~Expr() = default;
  virtual absl::StatusOr<Value> Eval(Context& ctx) const = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

struct Literal : Expr {
  Value v;
  explicit Literal(Value x) : v(std::move(x)) {}
  absl::StatusOr<Value> Eval(Context&) const override;
};

struct Name : Expr {
  std::string name;
  explicit Name(std::string n) : name(std::move(n)) {}
  absl::StatusOr<Value> Eval(Context& ctx) const override;
};

struct ListExpr : Expr {
  std::vector<ExprPtr> items;
  absl::StatusOr<Value> Eval(Context& ctx) const override;
};

struct DictExpr : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
  absl::StatusOr<Value> Eval(Context& ctx) const override;
};

struct Subscript : Expr {
  ExprPtr target, index;
  absl::StatusOr<Value> Eval(Context& ctx) const override;
};

struct Slice : Expr {
  ExprPtr target, start, stop, step;  // each may be null
  absl::StatusOr<Value> Eval(Context& ctx) const override;
};

struct Attribute : Expr {
  ExprPtr target;
  std::string name;
  absl::StatusOr<Value> Eval(Context& ctx) const override;
};

struct Unary : Expr {
  std::string op;
  ExprPtr x;
  absl::StatusOr<Value> Eval(Context& ctx) const override;
};

struct Binary : Expr {
  std::string op;
  ExprPtr a, b;
  absl::StatusOr<Value> Eval(Context& ctx) const override;
};

struct Conditional : Expr {
  ExprPtr cond, then, otherwise;  // otherwise may be null (undefined)
  absl::StatusOr<Value> Eval(Context& ctx) const override;
};

struct Args {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> named;
};

struct TestExpr : Expr {
  ExprPtr x;
  std::string name;
  Args args;
  bool negate = false;
  absl::StatusOr<Value> Eval(Context& ctx) const override;
};

struct FilterExpr : Expr {
  ExprPtr x;
  std::string name;
  Args args;
  absl::StatusOr<Value> Eval(Context& ctx) const override;
};

struct Call : Expr {
  ExprPtr callee;  // a Name (global function) or an Attribute (method)
  Args args;
  absl::StatusOr<Value> Eval(Context& ctx) const override;
};

enum class Flow { kNormal, kBreak, kContinue };

}  // namespace internal

// Declared in jinja.h: a Template holds the root of its tree.
struct Node {
  virtual ~Node() = default;
  virtual absl::StatusOr<internal::Flow> Render(internal::Context& ctx, std::string* out) const = 0;
};

namespace internal {

using NodePtr = std::unique_ptr<Node>;

struct Block : Node {
  std::vector<NodePtr> children;
  absl::StatusOr<Flow> Render(Context& ctx, std::string* out) const override;
};

struct Text : Node {
  std::string text;
  absl::StatusOr<Flow> Render(Context&, std::string* out) const override;
};

struct Print : Node {
  ExprPtr x;
  absl::StatusOr<Flow> Render(Context& ctx, std::string* out) const override;
};

struct If : Node {
  std::vector<std::pair<ExprPtr, std::unique_ptr<Block>>> branches;  // null condition: else
  absl::StatusOr<Flow> Render(Context& ctx, std::string* out) const override;
};

struct For : Node {
  std::vector<std::string> targets;
  ExprPtr iterable, filter;
  std::unique_ptr<Block> body, otherwise;
  absl::StatusOr<Flow> Render(Context& ctx, std::string* out) const override;
  void Bind(Context& ctx, const Value& item) const;
};

struct Set : Node {
  std::string name, attribute;  // attribute: `set ns.attr = ...`
  ExprPtr x;
  absl::StatusOr<Flow> Render(Context& ctx, std::string*) const override;
};

struct LoopControl : Node {
  Flow flow;
  absl::StatusOr<Flow> Render(Context&, std::string*) const override;
};

}  // namespace internal
}  // namespace preft::text::jinja
