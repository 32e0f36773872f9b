#pragma once

// The whole cluster in one process: prefill and decode workers (each with its own engine,
// model instance and in-process KV transport, or UCX), served on an internal gRPC server, and
// the router on the public address. What `preft serve` runs, and what the cluster tests drive
// through the public API. The code paths are the multi-process ones: only the transport and
// the channels (in-process gRPC) differ. With `colocated` there is no prefill tier: each decode
// worker runs whole requests in its one engine (the deployment vLLM users run), so benchmarks
// compare the two on the same code.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/rpc/server.h"
#include "common/serving/worker_setup.h"
#include "services/decode/decode_service.h"
#include "services/prefill/prefill_service.h"
#include "services/router/openai_server.h"
#include "services/router/router_service.h"

namespace preft::tools {

inline serving::TransportFlags InprocTransportFlags() {
  serving::TransportFlags t;
  t.kind = "inproc";
  return t;
}

struct EmbeddedClusterOptions {
  std::string model_dir;
  std::string listen = "127.0.0.1:0";  // the router's public address
  int num_prefill = 1;  // not used when colocated
  int num_decode = 1;
  // No prefill workers; decode workers (decode.colocated) run whole requests, which the router
  // (router.colocated) sends them with Run.
  bool colocated = false;
  std::string adapter_root;  // "" refuses adapter registration
  int64_t prefill_kv_bytes = int64_t{256} << 20;
  int64_t decode_kv_bytes = int64_t{512} << 20;
  // --kv-dtype of each tier (serving::kKvDtypeHelp); apart so tests can start a mismatch.
  std::string prefill_kv_dtype = "auto";
  std::string decode_kv_dtype = "auto";
  serving::PrefixCacheFlags prefix_cache;  // every tier's (decode workers cache only colocated)
  int64_t max_batch_tokens = 512;
  int threads = 0;  // per engine; 0: all cores
  // "cuda": each (colocated) worker's forward on the first GPU, its KV cache of
  // decode_kv_bytes in device memory. Colocated only: no KV transport reaches device memory.
  std::string device = "cpu";
  serving::TransportFlags transport = InprocTransportFlags();
  decode::DecodeServiceOptions decode;
  prefill::PrefillServiceOptions prefill;  // adapter_root is filled from above
  router::RouterOptions router;
  absl::Duration poll_interval = absl::Milliseconds(100);  // the router's worker status polls
  int max_request_bytes = 16 << 20;  // the router's; larger messages are RESOURCE_EXHAUSTED
  std::string http_listen;           // the OpenAI-compatible HTTP API; "" for none
  absl::Duration http_request_timeout = absl::Minutes(10);  // each HTTP request's deadline
};

class EmbeddedCluster {
 public:
  static absl::StatusOr<std::unique_ptr<EmbeddedCluster>> Start(EmbeddedClusterOptions options);
  // Drains and shuts everything down.
  ~EmbeddedCluster();

  // The router's address (what clients dial).
  const std::string& address() const;
  // The OpenAI-compatible HTTP API's host:port ("" without options.http_listen).
  std::string http_address() const { return http_ ? http_->address() : ""; }
  int num_decode() const { return static_cast<int>(decode_.size()); }
  int num_prefill() const { return static_cast<int>(prefill_.size()); }
  decode::DecodeService& decode(int i) { return *decode_[i]; }
  // Where decode worker `i` serves (as the router's pool names it).
  const std::string& decode_address(int i) const { return worker_servers_[i]->address(); }
  prefill::PrefillService& prefill(int i) { return *prefill_[i]; }
  router::RouterService& router() { return *router_; }
  router::WorkerPool& pool() { return *pool_; }
  const text::Tokenizer* tokenizer() const { return tokenizer_.get(); }

  // Graceful stop: routers and workers refuse new work, running requests finish (up to
  // `timeout`), then the servers shut down.
  void Drain(absl::Duration timeout);

 private:
  EmbeddedCluster() = default;

  std::vector<std::unique_ptr<model::Model>> models_;  // one per engine (not thread-safe)
  std::unique_ptr<text::Tokenizer> tokenizer_;
  std::vector<std::unique_ptr<decode::DecodeService>> decode_;
  std::vector<std::unique_ptr<prefill::PrefillService>> prefill_;
  std::vector<std::unique_ptr<rpc::Server>> worker_servers_;
  std::unique_ptr<router::WorkerPool> pool_;
  std::unique_ptr<router::AdapterRegistry> registry_;
  std::unique_ptr<router::RouterService> router_;
  std::unique_ptr<rpc::Server> router_server_;
  std::unique_ptr<router::OpenAiServer> http_;  // calls router_server_ in process
};

}  // namespace preft::tools
