// The public entry points. A template is split and parsed once (jinja_lexer, jinja_parser) into a
// read-only tree that each Render walks with its own variables (jinja_eval).

#include "common/text/jinja.h"

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/text/jinja_ast.h"
#include "common/text/jinja_eval.h"
#include "common/text/jinja_lexer.h"
#include "common/text/jinja_parser.h"
#include "common/text/jinja_value.h"

namespace preft::text::jinja {

absl::StatusOr<Template> Template::Parse(std::string_view source) {
  absl::StatusOr<std::vector<internal::Chunk>> chunks = internal::Split(source);
  if (!chunks.ok()) return chunks.status();
  absl::StatusOr<std::unique_ptr<internal::Block>> root = internal::BuildTree(*std::move(chunks));
  if (!root.ok()) return root.status();
  Template t;
  t.root_ = std::shared_ptr<const Node>(std::move(root).value());
  return t;
}

absl::StatusOr<std::string> Template::Render(const Value& context) const {
  if (!context.is_object()) return absl::InvalidArgumentError("the context must be an object");
  internal::Context ctx;
  ctx.scopes.emplace_back();
  for (auto it = context.begin(); it != context.end(); ++it) ctx.scopes.back()[it.key()] = it.value();
  ctx.scopes.emplace_back();  // the template's own `set`s
  std::string out;
  absl::StatusOr<internal::Flow> f = root_->Render(ctx, &out);
  if (!f.ok()) return f.status();
  return out;
}

std::string ToJson(const Value& v, int indent) {
  std::string out;
  internal::DumpJson(v, indent, 0, &out);
  return out;
}

}  // namespace preft::text::jinja
