#pragma once

// preft::client — the C++ SDK of a preft cluster's public API (preft.v1.Preft over gRPC):
// generate (streamed to a callback, or blocking), abort, models, adapter admin, health. TLS
// and bearer tokens are options. `preft client` is built on it; docs/CLIENTS.md has examples.
//
//   auto client = preft::client::Client::Connect({.address = "router:50051"});
//   preft::client::GenerateParams p;
//   p.model = "user-42";                                   // an adapter, or "" for the base
//   p.positions = preft::v1::ADAPTER_POSITIONS_PROMPT;     // PreFT
//   auto out = (*client)->Generate(preft::client::Prompt::Text("Hello"), p,
//       [](const preft::v1::GenerateResponse& d) { std::cout << d.text(); return true; });

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/rpc/tls.h"
#include "proto/preft/v1/preft.grpc.pb.h"

namespace preft::client {

struct ClientOptions {
  std::string address = "127.0.0.1:50051";
  rpc::TlsFiles tls;   // none: plaintext; ca: verify the server; cert + key: mutual TLS
  std::string token;   // sent as `authorization: Bearer <token>` when set
  absl::Duration timeout = absl::Minutes(2);  // per call
};

struct Prompt {
  std::string text;
  std::vector<int32_t> token_ids;  // used when not empty
  static Prompt Text(std::string t) { return Prompt{std::move(t), {}}; }
  static Prompt Ids(std::vector<int32_t> ids) { return Prompt{"", std::move(ids)}; }
};

struct GenerateParams {
  std::string model;  // an adapter's name; "" for the base model
  v1::AdapterPositions positions = v1::ADAPTER_POSITIONS_UNSPECIFIED;  // the adapter's default
  int32_t max_tokens = 16;
  float temperature = 0;  // greedy
  float top_p = 1;
  int32_t top_k = 0;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  std::optional<int32_t> logprobs;  // alternatives per token
  // RAW (the model's softmax) or PROCESSED (the distribution sampled from: what RL needs).
  v1::LogprobsMode logprobs_mode = v1::LOGPROBS_MODE_UNSPECIFIED;
  std::string request_id;           // for Abort; the router picks one when empty
};

struct Generation {
  std::string request_id;
  std::vector<int32_t> token_ids;
  std::string text;
  std::vector<v1::TokenLogprob> logprobs;
  v1::Finish finish;  // reason, usage, and the adapter, version and positions it ran with
};

// Thread-safe: calls may run concurrently on one client.
class Client {
 public:
  // InvalidArgument for unreadable TLS files. Connecting is lazy: a down server shows as
  // UNAVAILABLE on the first call.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(ClientOptions options);

  // Runs a generation; `on_delta` (optional) sees each streamed message (new tokens, text,
  // logprobs; the last one carries `finish`) and may return false to cancel (Cancelled).
  // Errors are the server's gRPC status as absl::Status (NotFound for an unknown adapter...).
  absl::StatusOr<Generation> Generate(
      const Prompt& prompt, const GenerateParams& params,
      const std::function<bool(const v1::GenerateResponse&)>& on_delta = nullptr);
  // Ends a running generation (its stream finishes with reason ABORT).
  absl::Status Abort(const std::string& request_id);

  absl::StatusOr<v1::ListModelsResponse> ListModels();
  absl::StatusOr<v1::AdapterInfo> RegisterAdapter(const std::string& name, const std::string& path,
                                                  bool load = false);
  // Loads the adapter's current version onto up to `num_workers` adapter workers (prefill
  // first; 0: the router picks one; `prefill_only`: no decode worker) ahead of traffic; the
  // residency after the load.
  absl::StatusOr<v1::AdapterInfo> LoadAdapter(const std::string& name, int32_t num_workers = 0,
                                              bool prefill_only = false);
  absl::Status UnloadAdapter(const std::string& name, bool unregister = false);
  // Streams adapter_config.json and adapter_model.safetensors from `dir` as the adapter's next
  // version (RL weight sync). NotFound naming a file it cannot read. `progress` (optional)
  // hears the bytes sent so far and in all after each chunk.
  // With `expected_version`, the update is refused (FailedPrecondition) unless the adapter's
  // current version is that one.
  absl::StatusOr<v1::UpdateAdapterResponse> UpdateAdapter(
      const std::string& name, const std::string& dir,
      const std::function<void(int64_t sent, int64_t total)>& progress = nullptr,
      std::optional<int64_t> expected_version = std::nullopt);
  // grpc.health.v1 Check of `service` ("" = the server): true only when SERVING.
  absl::StatusOr<bool> Healthy(const std::string& service = "");

 private:
  Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel);
  void Prepare(grpc::ClientContext* ctx) const;

  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Preft::Stub> stub_;
};

}  // namespace preft::client
