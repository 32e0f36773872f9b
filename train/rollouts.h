#pragma once

// On-policy rollouts from a running cluster through the public API (the C++ SDK): G seeded
// samples per prompt with the adapter applied prompt-only, each with its sampled tokens'
// processed logprobs (the distribution they were drawn from) and the adapter version that
// served it. Torch-free.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "clients/cpp/preft_client.h"
#include "train/data.h"

namespace preft::train {

struct Rollout {
  int64_t prompt = 0;  // index into the iteration's prompts
  int64_t sample = 0;  // 0 .. G-1
  std::vector<int32_t> token_ids;
  std::vector<double> logprobs;  // the server's, per token
  std::string text;
  int64_t version = 0;           // the adapter version that served it
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
};

struct RolloutOptions {
  std::string adapter;
  v1::AdapterPositions positions = v1::ADAPTER_POSITIONS_PROMPT;
  int64_t group = 4;          // samples per prompt
  float temperature = 1.0f;
  int32_t max_tokens = 64;
  uint64_t seed = 0;          // with the iteration, prompt and sample: each request's seed
  int concurrency = 32;       // requests in flight
};

// G rollouts for each of `prompts` (prompt-major order). Any failed request fails the batch
// with its status, naming the prompt's source.
absl::StatusOr<std::vector<Rollout>> CollectRollouts(client::Client& client,
                                                     const std::vector<const RlPrompt*>& prompts,
                                                     int64_t iteration,
                                                     const RolloutOptions& options);

}  // namespace preft::train
