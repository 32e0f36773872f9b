#pragma once

// What a request asks of the model, checked before anything is reserved: its prompt, how its
// logits turn into tokens and when it stops. Light on purpose: the router checks requests with
// it and links no engine.

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/model/config.h"

namespace preft::engine {

// Which distribution reported logprobs describe (vLLM's logprobs_mode): the model's full
// softmax, or the one the token was actually drawn from (after temperature, top-k, top-p and
// min-p, renormalised; greedy requests report the full softmax). RL trainers need the latter
// for importance ratios against the behaviour policy.
enum class LogprobsMode { kRaw, kProcessed };

struct SamplingParams {
  float temperature = 0.f;  // <= 1e-5 means greedy
  float top_p = 1.f;        // (0, 1]
  int32_t top_k = 0;        // 0 = off
  float min_p = 0.f;        // [0, 1]
  // Requests without a seed get one drawn at admission, so their tokens still do not
  // depend on the batch they ran in.
  std::optional<uint64_t> seed;
  int32_t max_tokens = 16;
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop;  // stop strings; the text is cut before the match
  bool ignore_eos = false;
  // Report the sampled token's logprob and this many top alternatives (nullopt: none).
  std::optional<int32_t> logprobs;
  LogprobsMode logprobs_mode = LogprobsMode::kRaw;

  // InvalidArgument naming the field and the value.
  absl::Status Validate(int64_t vocab_size) const;
};

// One generated token's log-probability (under the distribution SamplingParams::logprobs_mode
// names), with the top alternatives.
struct TokenLogprob {
  int32_t token_id = 0;
  double logprob = 0.0;
  std::vector<std::pair<int32_t, double>> top;
};

// InvalidArgument, naming the token or the lengths, for an empty prompt, an id outside the
// vocabulary or a prompt that leaves no room in the model's context. Engine::Add checks it;
// the router checks it before reserving anything.
absl::Status ValidatePrompt(const std::vector<int32_t>& prompt_ids,
                            const model::ModelConfig& config);

}  // namespace preft::engine
