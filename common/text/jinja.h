#pragma once

// The part of Jinja2 that Hugging Face chat templates use, rendered the way transformers'
// apply_chat_template renders them (trim_blocks, lstrip_blocks, loop controls, its tojson), so
// a model's own `chat_template` gives the prompt it was trained on. Debian packages no C++
// Jinja; tests/jinja compares this renderer with Python's jinja2 on real templates.
//
// Supported: {{ }}, {% if/elif/else %}, {% for x in xs [if c] %} with loop.* and else,
// {% set %} (and namespace attributes), break/continue, {% generation %}, comments, whitespace
// control (-); expressions with literals, lists, dicts, attributes, subscripts and slices,
// + - * / // % ~, comparisons, in, and/or/not, conditional expressions, tests (defined, none,
// string, ...), filters (trim, tojson, join, length, upper, lower, default, select/reject,
// selectattr/rejectattr, map, first, last, list, string, int, items, replace, capitalize) and
// string/dict methods (strip, split, startswith, items, get, ...), raise_exception, namespace,
// range. Anything else is refused when parsed, with its line.

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace preft::text::jinja {

using Value = nlohmann::ordered_json;  // keeps dict order, as Python does

struct Node;

class Template {
 public:
  // InvalidArgument naming the line for syntax it cannot parse.
  static absl::StatusOr<Template> Parse(std::string_view source);
  // `context` is a JSON object of the template's variables. raise_exception(msg) in the
  // template is InvalidArgument(msg); type errors name what failed.
  absl::StatusOr<std::string> Render(const Value& context) const;

 private:
  std::shared_ptr<const Node> root_;
};

// Python's json.dumps as transformers' tojson calls it (insertion order, ensure_ascii=False;
// indent < 0: one line with ", " and ": ").
std::string ToJson(const Value& v, int indent = -1);

}  // namespace preft::text::jinja
