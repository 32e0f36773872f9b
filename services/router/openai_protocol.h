#pragma once

// OpenAI's HTTP API (the subset vLLM serves) as pure translations to and from preft.v1:
// request bodies to GenerateRequests, generation results to response bodies and stream chunks,
// statuses to OpenAI's error shape. No I/O here (openai_server.h serves it), so every rule is a
// unit test.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/text/tokenizer.h"
#include "nlohmann/json.hpp"
#include "proto/preft/v1/preft.pb.h"

namespace preft::router::openai {

// A parsed /v1/completions or /v1/chat/completions body: one GenerateRequest per choice
// (choice index = prompt index * n + sample index).
struct Plan {
  std::string model;  // as the client named it (echoed back)
  std::vector<v1::GenerateRequest> choices;
  int n = 1;  // choices per prompt
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // Completions: `logprobs` (0..20 alternatives); chat: `logprobs: true` + `top_logprobs`.
  std::optional<int> logprobs;
};

// InvalidArgument naming the field (OpenAI's `param`) for a malformed body, and for features
// preft does not have (echo, suffix, penalties, logit_bias), so nothing is silently ignored.
// Prompts are text or token ids; `adapter_positions` ("prompt" or "all") is the extension that
// picks PreFT or all-position application of the adapter `model` names.
absl::StatusOr<Plan> ParseCompletion(const nlohmann::json& body);
// `prompt_ids`: the chat template's rendering of `messages`, tokenized without adding special
// tokens (the template writes them). The caller renders and tokenizes.
absl::StatusOr<Plan> ParseChat(const nlohmann::json& body, const std::vector<int32_t>& prompt_ids);
// The chat messages, checked: [{role, content}] with string content (or text parts).
absl::StatusOr<nlohmann::json> ChatMessages(const nlohmann::json& body);

// One choice's output so far (or in full).
struct ChoiceResult {
  std::vector<int32_t> token_ids;
  std::string text;
  std::vector<v1::TokenLogprob> logprobs;
  std::string finish_reason;  // "" while running; "stop", "length", "abort"
  int32_t prompt_tokens = 0;
  int32_t cached_tokens = 0;  // of prompt_tokens, from a prefix cache
};

// Bodies. `created` is seconds since the epoch; `tokenizer` names tokens in logprobs (may be
// null: then "token_id:N").
nlohmann::json CompletionBody(const std::string& id, int64_t created, const Plan& plan,
                              const std::vector<ChoiceResult>& choices,
                              const text::Tokenizer* tokenizer);
nlohmann::json ChatBody(const std::string& id, int64_t created, const Plan& plan,
                        const std::vector<ChoiceResult>& choices,
                        const text::Tokenizer* tokenizer);
// One stream chunk for choice `index` carrying `delta` (its new tokens, text and logprobs).
nlohmann::json CompletionChunk(const std::string& id, int64_t created, const Plan& plan,
                               int index, const ChoiceResult& delta,
                               const text::Tokenizer* tokenizer);
nlohmann::json ChatChunk(const std::string& id, int64_t created, const Plan& plan, int index,
                         const ChoiceResult& delta, bool first, const text::Tokenizer* tokenizer);
// The final usage-only chunk (stream_options.include_usage).
nlohmann::json UsageChunk(const std::string& id, int64_t created, const Plan& plan, bool chat,
                          int64_t prompt_tokens, int64_t completion_tokens,
                          int64_t cached_tokens = 0);
// With prompt_tokens_details.cached_tokens: prompt tokens a prefix cache served.
nlohmann::json Usage(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens = 0);

// OpenAI's error body and the HTTP status for a status code.
struct HttpError {
  int status = 500;
  nlohmann::json body;
};
HttpError ToHttpError(const absl::Status& status, const std::string& param = "");

// /v1/models: the base model, then each adapter with `parent` = the base.
nlohmann::json ModelsBody(const v1::ListModelsResponse& models, int64_t created);

}  // namespace preft::router::openai
