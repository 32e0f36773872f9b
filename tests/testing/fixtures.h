#pragma once

// Paths of test fixtures, shared by the test binaries.

#include <string>

namespace preft::testing {

// ../shared/fixtures/tiny-llama: a model written by a separate implementation, with
// reference outputs (see its README).
inline std::string TinyLlamaFixture() {
  return std::string(PREFT_SHARED_DIR) + "/fixtures/tiny-llama";
}

}  // namespace preft::testing
