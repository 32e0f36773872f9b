#pragma once

// OpenAI-compatible HTTP in front of the router (what vLLM and LoRAX clients send):
//   POST /v1/completions, /v1/chat/completions   (stream: server-sent events, `data: [DONE]`)
//   GET  /v1/models                              (the base model and every adapter)
//   POST /v1/load_lora_adapter, /v1/unload_lora_adapter   (vLLM's runtime adapter API)
//   GET  /health
// A completion is a Generate call per choice straight to the router's service in this process
// (RouterService::GenerateInProcess: no gRPC hop, which cost ~23 KiB per open stream), with the
// gRPC API's admission, token check, limits, metrics and placement: the `Authorization` header
// is the caller's token and the HTTP client's address names it for the per-client stream cap.
// The other routes are preft.v1 calls on `router` (an in-process channel to the router's own
// gRPC server). `model` picks the base model or an adapter by name.

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/http/event_server.h"
#include "common/text/tokenizer.h"
#include "grpcpp/channel.h"
#include "nlohmann/json.hpp"

namespace preft::router {

class RouterService;

using ChatRenderer = std::function<absl::StatusOr<std::string>(const nlohmann::json& messages)>;

// The model folder's chat template (tokenizer_config.json) as a renderer; a null renderer when
// the model has none (chat is then refused); InvalidArgument when it does not parse.
absl::StatusOr<ChatRenderer> ChatRendererFor(const std::string& model_dir);

struct OpenAiServerOptions {
  // Address, threads, deadlines, body limit and connection caps of the HTTP server
  // (http::EventServerOptions); `http.always_served` is set to /health. Bodies declaring more
  // than `http.max_body_bytes` are answered 413 before they are read (the router's
  // --max-request-bytes, as its gRPC messages).
  http::EventServerOptions http;
  std::shared_ptr<grpc::Channel> router;
  RouterService* generate = nullptr;  // the same router's service: completions go straight to it
  const text::Tokenizer* tokenizer = nullptr;  // names tokens in logprobs; may be null
  // Renders chat messages ([{role, content}]) to the prompt text (text::ChatTemplate); null, or
  // no tokenizer: chat is refused (400).
  ChatRenderer render_chat;
  absl::Duration timeout = absl::Minutes(10);  // per request
};

// Serves the API on an event-driven server (http::EventServer): a streamed completion holds no
// thread while it waits for tokens.
class OpenAiServer {
 public:
  // InvalidArgument for a malformed address or no channel; Unavailable when it cannot bind.
  static absl::StatusOr<std::unique_ptr<OpenAiServer>> Start(OpenAiServerOptions options);
  // Stop(zero): cancels streams in flight, waits for their calls to end.
  ~OpenAiServer();

  const std::string& address() const;
  // Stops accepting; responses in progress may end until `grace` passes, then the rest are
  // cancelled. Returns when every call it made has ended.
  void Stop(absl::Duration grace);
  http::EventServer::Stats stats() const;

  class Impl;

 private:
  explicit OpenAiServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace preft::router
