#pragma once

// `preft train rl`: on-policy RL (GRPO-style) of a prompt-only adapter against a running
// cluster. Each iteration: rollouts of the current adapter version through the public API,
// rewards, group-normalised advantages, a clipped policy-gradient step on the adapter against
// the server's own (processed) logprobs, then a weight sync with UpdateAdapter(expected
// version v) -> v + 1 that touches the prefill tier only. docs/TRAINING.md has the picture.
// Torch-free interface.

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/status/statusor.h"
#include "clients/cpp/preft_client.h"
#include "common/adapters/adapter_writer.h"
#include "common/model/adapter_weights.h"

namespace preft::train {

struct RlOptions {
  client::ClientOptions server;  // the router (address, TLS, token)
  std::string adapter;           // registered name whose versions the loop advances
  std::string model_dir;         // the base model, local (the trainer's copy of the weights)
  std::string prompts_path;      // JSONL (train/data.h: ReadRlPrompts)
  std::string reward = "exact";  // train/reward.h
  std::string answer_marker = "####";
  std::string out_dir;           // rl_log.jsonl, policy/ (what is pushed), the final adapter
  // The registered adapter's current weights. Empty: start from a fresh zero-update adapter of
  // `spec`, pushed first (so trainer and server agree), which makes the next version.
  std::string init_dir;
  adapters::AdapterSpec spec;
  model::AdapterPositions positions = model::AdapterPositions::kPrompt;

  int64_t group = 4;             // G: samples per prompt
  int64_t batch = 8;             // B: prompts per iteration
  int64_t iterations = 10;
  int64_t updates_per_iteration = 1;  // optimizer steps on each batch of rollouts (mu)
  float temperature = 1.0f;
  int32_t max_tokens = 64;
  double lr = 1e-4;
  double clip = 0.2;             // epsilon of the clipped ratio
  double beta = 0.0;             // KL to the starting adapter (k3 estimator); 0: none
  bool scale_by_std = true;      // GRPO's (r - mean) / std; off: Dr. GRPO's (r - mean)
  double weight_decay = 0.0;
  double max_grad_norm = 1.0;
  int64_t batch_tokens = 4096;   // padded tokens per micro-batch
  uint64_t seed = 0;
  int concurrency = 32;          // rollout requests in flight
  int threads = 0;               // trainer compute threads; 0: every core
  int64_t max_length = 4096;
};

struct RlIterationStats {
  int64_t iteration = 0;
  int64_t version = 0;          // the version its rollouts ran on
  double reward_mean = 0;
  double agreement_max = 0;     // max |trainer - server| logprob over its rollout tokens
  double agreement_mean = 0;
  double rollout_s = 0, reward_s = 0, train_s = 0, sync_s = 0;
};

struct RlResult {
  std::vector<RlIterationStats> iterations;
  int64_t final_version = 0;
};

// Errors: InvalidArgument (options, prompts naming file and line), NotFound (the adapter is
// not registered), FailedPrecondition (another writer moved the adapter's version), and the
// server's status for failed rollouts or syncs.
absl::StatusOr<RlResult> RunRl(const RlOptions& options, std::FILE* progress);

}  // namespace preft::train
