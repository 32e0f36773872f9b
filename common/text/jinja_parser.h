#pragma once

// Chunks -> the template's tree. Statements nest by their keywords ({% if %} ... {% endif %});
// each tag's body is lexed and parsed by recursive descent with Jinja's precedence. Nesting and
// chain length are bounded so that hostile templates fail with a message, not a stack overflow.

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/text/jinja_ast.h"
#include "common/text/jinja_lexer.h"

namespace preft::text::jinja::internal {

// InvalidArgument, naming the line where it can, for syntax it cannot parse and for anything
// outside the supported subset (see jinja.h).
absl::StatusOr<std::unique_ptr<Block>> BuildTree(std::vector<Chunk> chunks);

}  // namespace preft::text::jinja::internal
