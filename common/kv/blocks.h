#pragma once

// How many KV blocks hold `tokens`: the one rule the scheduler, the workers' reservations and
// the router's placement must agree on.

#include <cstdint>

#include "common/base/math.h"

namespace preft::kv {

inline int64_t BlocksFor(int64_t tokens, int64_t block_tokens) {
  return base::CeilDiv(tokens, block_tokens);
}

}  // namespace preft::kv
