#include "common/engine/request_params.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace preft::engine {

absl::Status SamplingParams::Validate(int64_t vocab_size) const {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (!(temperature >= 0.f) || std::isinf(temperature))
    return bad("temperature must be >= 0, got ", temperature);
  if (!(top_p > 0.f && top_p <= 1.f)) return bad("top_p must be in (0, 1], got ", top_p);
  if (top_k < 0) return bad("top_k must be >= 0 (0 disables it), got ", top_k);
  if (!(min_p >= 0.f && min_p <= 1.f)) return bad("min_p must be in [0, 1], got ", min_p);
  if (max_tokens < 1) return bad("max_tokens must be >= 1, got ", max_tokens);
  if (logprobs && (*logprobs < 0 || *logprobs > 20))
    return bad("logprobs must be in [0, 20], got ", *logprobs);
  for (int32_t id : stop_token_ids)
    if (id < 0 || id >= vocab_size) return bad("stop_token_ids: ", id, " is not in the vocabulary");
  for (const std::string& s : stop)
    if (s.empty()) return bad("stop strings must not be empty");
  return absl::OkStatus();
}

absl::Status ValidatePrompt(const std::vector<int32_t>& prompt_ids,
                            const model::ModelConfig& config) {
  if (prompt_ids.empty()) return absl::InvalidArgumentError("prompt is empty");
  for (int32_t id : prompt_ids) {
    if (id < 0 || id >= config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt token id ", id, " is outside the vocabulary [0, ", config.vocab_size, ")"));
    }
  }
  const int64_t n = static_cast<int64_t>(prompt_ids.size());
  if (n >= config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt has ", n, " tokens; the model's context is ", config.max_position_embeddings));
  }
  return absl::OkStatus();
}

}  // namespace preft::engine
