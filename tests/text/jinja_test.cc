// The renderer's refusals: hostile or unsupported templates fail with a message (and a line),
// never a crash, a hang or unbounded memory. Rendering semantics are checked against jinja2
// itself by oracle_test.py.

#include "common/text/jinja.h"

#include <gtest/gtest.h>

namespace preft::text::jinja {
namespace {

absl::Status ParseError(const std::string& source) { return Template::Parse(source).status(); }

absl::StatusOr<std::string> Render(const std::string& source, const Value& ctx = Value::object()) {
  auto t = Template::Parse(source);
  if (!t.ok()) return t.status();
  return t->Render(ctx);
}

TEST(JinjaTest, RendersTheBasics) {
  EXPECT_EQ(*Render("{{ a + 1 }}-{{ b | upper }}", {{"a", 1}, {"b", "x"}}), "2-X");
  EXPECT_EQ(*Render("{% for x in xs %}{{ x }}{% if not loop.last %},{% endif %}{% endfor %}",
                    {{"xs", {1, 2, 3}}}),
            "1,2,3");
  EXPECT_EQ(*Render("  {% if true %}\n  yes\n  {% endif %}\n"), "  yes\n");  // lstrip/trim_blocks
  EXPECT_EQ(*Render("{{ x | tojson(indent=2) }}", {{"x", {{"k", {1}}}}}),
            "{\n  \"k\": [\n    1\n  ]\n}");
}

TEST(JinjaTest, SyntaxErrorsNameTheLine) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"ok\n{{ a ", "line 2: unclosed"},
      {"{% if x %}never closed", "missing {% endif %}"},
      {"{% for x in %}{% endfor %}", "expected an expression"},
      {"{% macro m() %}{% endmacro %}", "{% macro %} is not supported"},
      {"{{ 'unterminated }}", "unterminated string"},
      {"{{ a $ b }}", "unexpected character '$'"},
      {"{{ a b }}", "unexpected tokens"},
      {"{% set x %}block{% endset %}", "expected '='"},
      {"{{ x[] }}", "empty subscript"},
      {"{% endfor %}", "{% endfor %} is not supported"},
  };
  for (const auto& [source, needle] : cases) {
    const absl::Status s = ParseError(source);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << source;
    EXPECT_NE(s.message().find(needle), std::string::npos) << source << " -> " << s;
  }
}

TEST(JinjaTest, HostileTemplatesAreBounded) {
  EXPECT_FALSE(
      Template::Parse("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}").ok());
  EXPECT_FALSE(Template::Parse("{{ " + std::string(100000, '-') + "1 }}").ok());
  EXPECT_TRUE(Template::Parse("{{ " + std::string(50000, 'a') + " }}").ok());  // long, not deep
  std::string chain = "{{ 1";
  for (int i = 0; i < 100000; ++i) chain += " + 1";
  EXPECT_FALSE(Template::Parse(chain + " }}").ok());
  std::string nested;
  for (int i = 0; i < 1000; ++i) nested += "{% if true %}";
  EXPECT_FALSE(Template::Parse(nested).ok());
  EXPECT_FALSE(Render("{% for i in range(1000000000) %}{% endfor %}").ok());
  EXPECT_FALSE(Render("{{ 'x' * 1000000000 }}").ok());
  EXPECT_FALSE(Render("{{ 1 // 0 }}").ok());
  for (const char* partial : {"{", "{{", "{%", "{#", "{{-", "}}", "{% if", "{{ a.", "{{ a[1:"}) {
    (void)Template::Parse(partial);  // must not crash
  }
}

TEST(JinjaTest, RuntimeErrorsAreStatuses) {
  EXPECT_EQ(Render("{{ raise_exception('roles must alternate') }}").status().message(),
            "roles must alternate");
  EXPECT_FALSE(Render("{% for x in 5 %}{% endfor %}").ok());
  EXPECT_FALSE(Render("{{ 'a' - 1 }}").ok());
  EXPECT_FALSE(Render("{{ x | no_such_filter }}").ok());
  EXPECT_FALSE(Render("{{ no_such_function() }}").ok());
  EXPECT_FALSE(Render("{% set n.a = 1 %}").ok());  // not a namespace
  EXPECT_FALSE(Render("{{ 1 in 2 }}").ok());
  EXPECT_FALSE(Template::Parse("{{ x }}")->Render(Value::array()).ok());
}

}  // namespace
}  // namespace preft::text::jinja
