// Python's view of JSON values, so that what a template prints (str of numbers, lists and dicts,
// tojson), and the values its error messages show, match what jinja2 would print.

#include "common/text/jinja_value.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/text/jinja.h"

namespace preft::text::jinja::internal {

namespace {

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

}  // namespace

bool Truthy(const Value& v) {
  if (IsUndefined(v) || v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number_integer()) return v.get<int64_t>() != 0;
  if (v.is_number()) return v.get<double>() != 0;
  if (v.is_string()) return !v.get_ref<const std::string&>().empty();
  return !v.empty();  // list, dict
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

}  // namespace preft::text::jinja::internal
