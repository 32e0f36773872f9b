#pragma once

// OpenAI-compatible HTTP in front of the router (what vLLM and LoRAX clients send):
//   POST /v1/completions, /v1/chat/completions   (stream: server-sent events, `data: [DONE]`)
//   GET  /v1/models                              (the base model and every adapter)
//   POST /v1/load_lora_adapter, /v1/unload_lora_adapter   (vLLM's runtime adapter API)
//   GET  /health
// Every call becomes preft.v1 calls on `router` (an in-process channel to the router's own
// gRPC server), so tokens, limits, metrics and placement are the gRPC API's, unchanged: the
// `Authorization` header travels as metadata, and the HTTP client's address names the client
// for the per-client stream cap. `model` picks the base model or an adapter by name.

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/model/tokenizer.h"
#include "grpcpp/channel.h"
#include "nlohmann/json.hpp"

namespace httplib {
class Server;
}

namespace preft::router {

using ChatRenderer = std::function<absl::StatusOr<std::string>(const nlohmann::json& messages)>;

// The model folder's chat template (tokenizer_config.json) as a renderer; a null renderer when
// the model has none (chat is then refused); InvalidArgument when it does not parse.
absl::StatusOr<ChatRenderer> ChatRendererFor(const std::string& model_dir);

struct OpenAiServerOptions {
  std::string address = "127.0.0.1:0";  // host:port; port 0 picks one
  std::shared_ptr<grpc::Channel> router;
  const model::Tokenizer* tokenizer = nullptr;  // names tokens in logprobs; may be null
  // Renders chat messages ([{role, content}]) to the prompt text (model::ChatTemplate); null, or
  // no tokenizer: chat is refused (400).
  ChatRenderer render_chat;
  int threads = 64;  // concurrent HTTP requests (a stream holds one)
  absl::Duration timeout = absl::Minutes(10);  // per request
  // Bodies declaring more are answered 413 before they are read (the router's
  // --max-request-bytes, as its gRPC messages).
  int64_t max_body_bytes = 16 << 20;
};

class OpenAiServer {
 public:
  // InvalidArgument for a malformed address or no channel; Unavailable when it cannot bind.
  static absl::StatusOr<std::unique_ptr<OpenAiServer>> Start(OpenAiServerOptions options);
  // Stops accepting, cancels streams in flight and joins.
  ~OpenAiServer();

  const std::string& address() const { return address_; }

 private:
  explicit OpenAiServer(OpenAiServerOptions options);
  void Routes();

  const OpenAiServerOptions options_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::string address_;
};

}  // namespace preft::router
