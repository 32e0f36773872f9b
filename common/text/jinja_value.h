#pragma once

// How templates see JSON values: Jinja's undefined, Python's truthiness, str() and repr(), and
// json.dumps as transformers' tojson calls it. The evaluator and the public ToJson share them.

#include <string>

#include "common/text/jinja.h"

namespace preft::text::jinja::internal {

// Undefined (a missing variable or key) is nlohmann's `discarded`: distinct from none.
inline Value Undefined() { return Value(Value::value_t::discarded); }
inline bool IsUndefined(const Value& v) { return v.is_discarded(); }

bool Truthy(const Value& v);

// Python's json.dumps of v into *out, `depth` levels in (see ToJson in jinja.h for `indent`).
void DumpJson(const Value& v, int indent, int depth, std::string* out);

// Python's str(): what {{ x }} prints.
std::string PyStr(const Value& v);
// Python's repr(), or str() when `top` (strings print bare only at the top level).
std::string PyRepr(const Value& v, bool top);

}  // namespace preft::text::jinja::internal
