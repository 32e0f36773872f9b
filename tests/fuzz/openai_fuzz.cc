// libFuzzer target: the OpenAI request parsers (completions, chat messages, chat) on arbitrary
// bytes must return a Status, never crash; every plan they accept keeps preft's bounds (1-64
// choices, token ids within int32 and not negative, positive max_tokens when set).

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "nlohmann/json.hpp"
#include "services/router/openai_protocol.h"

namespace {

void Check(const absl::StatusOr<preft::router::openai::Plan>& plan) {
  if (!plan.ok()) return;
  if (plan->choices.empty() || plan->choices.size() > 64) std::abort();
  for (const auto& c : plan->choices) {
    for (int32_t id : c.token_ids().ids()) {
      if (id < 0) std::abort();
    }
    if (c.sampling().has_max_tokens() && c.sampling().max_tokens() < 1) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const nlohmann::json body =
      nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) return 0;
  Check(preft::router::openai::ParseCompletion(body));
  (void)preft::router::openai::ChatMessages(body);
  Check(preft::router::openai::ParseChat(body, {1, 2, 3}));
  return 0;
}
