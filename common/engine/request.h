#pragma once

// A generation request as the engine sees it, and what it reports back.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/engine/request_params.h"
#include "common/model/adapter_weights.h"

namespace preft::engine {

enum class FinishReason { kNone, kLength, kStop, kAbort, kError };
const char* FinishReasonName(FinishReason r);  // "length", "stop", "abort", "error"

// Sent after every generated token, and once more at the end if the request failed.
struct TokenEvent {
  std::string request_id;
  int32_t token_id = -1;                  // -1 on a final error/abort event
  std::string text_delta;                 // complete UTF-8 only
  const TokenLogprob* logprob = nullptr;  // when requested; valid during the callback
  FinishReason finish = FinishReason::kNone;
  absl::Status status;  // not OK for kError
  int64_t cached_prompt_tokens = 0;  // prompt tokens the prefix cache served (OpenAI's cached_tokens)
};

using TokenCallback = std::function<void(const TokenEvent&)>;

// The adapter a request runs with. The engine holds `weights` until the request ends (an
// adapter store's lease: that is what keeps it pinned in its compute slot).
struct RequestAdapter {
  std::shared_ptr<const model::AdapterWeights> weights;  // null: base model only
  std::string name;
  int64_t version = 0;
  // Overrides the adapter's default positions (prompt: LoRAP/DiReFTP; all: LoRA/DiReFT).
  std::optional<model::AdapterPositions> positions;
};

// Prefill tier (DESIGN.md §4): what a prefill-only request hands over once its prompt is in the
// cache and its first token is sampled.
struct PrefilledPrompt {
  std::string request_id;
  int32_t first_token = -1;
  std::optional<TokenLogprob> first_logprob;  // when the request asked for logprobs
  std::vector<int32_t> blocks;                // the prompt's KV, in position order
  int64_t num_tokens = 0;                     // prompt tokens in those blocks
  uint64_t seed = 0;                          // the sampling seed used (decode continues it)
  int64_t cached_tokens = 0;                  // of the prompt, served from the prefix cache
};

// Decode tier: a prompt whose KV another worker computed into blocks of this engine's cache.
struct ImportedPrompt {
  std::vector<int32_t> blocks;  // from Engine::ReserveBlocks; the engine owns them once added
  int32_t first_token = -1;     // sampled by the prefill worker
  std::optional<TokenLogprob> first_logprob;
};

struct Request {
  std::string id;
  std::vector<int32_t> prompt_ids;
  SamplingParams sampling;
  RequestAdapter adapter;
  TokenCallback on_token;  // called on the engine thread; must not block
  // Prefill only: run the prompt, sample the first token, call this (on the engine thread)
  // instead of decoding, and keep the prompt's blocks until Engine::ReleasePrefilled. No token
  // event is sent; errors still end with one.
  std::function<void(const PrefilledPrompt&)> on_prefilled;
  // Decode from an imported prompt: the prompt is not computed here; generation starts by
  // emitting `imported->first_token`. Such a sequence is never recomputed (its KV may come from
  // an adapter this engine does not hold): callers reserve the blocks it will ever need.
  std::optional<ImportedPrompt> imported;
};

// The whole result of a finished request (what `preft generate --json` prints).
struct GenerationResult {
  std::string request_id;
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> token_ids;
  std::string text;
  FinishReason finish = FinishReason::kNone;
  absl::Status status;
  std::vector<TokenLogprob> logprobs;
  int64_t cached_prompt_tokens = 0;  // prompt tokens the prefix cache served
  // The adapter it ran with ("" for the base model), its version and positions.
  std::string adapter;
  int64_t adapter_version = 0;
  std::optional<model::AdapterPositions> adapter_positions;
};

}  // namespace preft::engine
