#pragma once

// Rendering a parsed tree: the variables a render sees. The nodes' Eval and Render (jinja_ast.h)
// are defined in jinja_eval.cc, with the filters, tests, methods and functions they call.

#include <map>
#include <string>
#include <vector>

#include "common/text/jinja.h"
#include "common/text/jinja_value.h"

namespace preft::text::jinja::internal {

// One render's variables, innermost scope last; owned by that render (one thread).
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

}  // namespace preft::text::jinja::internal
