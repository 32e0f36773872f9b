#pragma once

// The public API (preft.v1.Preft) in front of the prefill and decode tiers. A Generate call:
//   tokenise and validate -> Reserve KV blocks on a decode worker (by free KV and batch load;
//   waits for room until the deadline) -> Prefill on a prefill worker (by adapter residency,
//   then queue depth; a worker that fails is replaced and the prompt is retried into the same
//   reservation with generation + 1) -> Start on the decode worker and relay its token stream.
// Cancelling the call (or Abort) cancels whatever RPC is in flight, so both tiers free the
// request's resources; the reservation of a request that never starts is released.
// Colocated (RouterOptions::colocated, no prefill tier): tokenise and validate -> Run on a
// colocated decode worker (by free KV and batch load; its engine queues what does not fit yet)
// and relay its stream; a worker failing before the first token is replaced.

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "common/model/config.h"
#include "common/text/tokenizer.h"
#include "prometheus/registry.h"
#include "proto/preft/v1/preft.grpc.pb.h"
#include "services/router/access.h"
#include "services/router/adapter_registry.h"
#include "services/router/worker_pool.h"

namespace preft::router {

struct RouterOptions {
  std::string base_name = "base";   // what GenerateRequest.model names the base model by
  std::string base_dtype = "f32";   // reported by ListModels
  int32_t default_max_tokens = 16;
  // Waiting for KV room / a prefill worker when the client set no deadline.
  absl::Duration admission_timeout = absl::Seconds(30);
  absl::Duration lease = absl::Seconds(30);  // reservation lease asked of decode workers
  int max_prefill_attempts = 3;  // workers tried per prompt (prefill; colocated: decode)
  // Threads that admit calls (tokenise, read the registry); every other step of a call is a
  // callback, so this and gRPC's own few threads are all a router runs, however many streams.
  int cpu_threads = 2;
  int admin_threads = 4;  // admin RPCs that wait on disk or workers (RegisterAdapter, loads)
  // How long a decode worker stays a last resort (DecodeView::kv_path_suspect) after a prefill
  // worker could not deliver KV to it.
  absl::Duration kv_path_suspect = absl::Seconds(30);
  // Whole requests on colocated decode workers (DecodeWorker.Run); no prefill workers.
  bool colocated = false;
  AccessOptions access;                      // tokens and the per-client stream cap
  int64_t max_prompt_tokens = 0;             // longer prompts are refused; 0: the model's context
  // Where the router's metrics (router_metrics.h) go; a private registry if null. Must outlive
  // the service.
  prometheus::Registry* metrics = nullptr;
};

class GenerateCall;

// The client's end of a Generate call: the gRPC stream (RouterService::Generate), or a caller in
// this process (RouterService::GenerateInProcess: the OpenAI door, without a gRPC hop).
class GenerateClient {
 public:
  virtual ~GenerateClient() = default;
  // Sends `msg` (valid until then), then calls call()->WriteDone(ok) (false: the client is
  // gone), maybe inline.
  virtual void StartWrite(const v1::GenerateResponse* msg) = 0;
  // The call's end: `status` not OK ends it with that error. Nothing is written after it; the
  // client calls call()->Done() once it is done with the call (maybe inline).
  virtual void Finish(const absl::Status& status) = 0;

 protected:
  // Set before the call starts; call Cancel on it (the client left) until Finish.
  GenerateCall* call() const { return call_; }

 private:
  friend class GenerateCall;
  GenerateCall* call_ = nullptr;
};

// Thread-safe; borrows the tokenizer (may be null: then only token-id prompts), the pool and
// the registry, which must outlive it.
class RouterService final : public v1::Preft::CallbackService {
 public:
  RouterService(const model::ModelConfig& config, const text::Tokenizer* tokenizer,
                WorkerPool* pool, AdapterRegistry* registry, RouterOptions options);
  // Waits for the calls' driver threads (the server must be shut down first).
  ~RouterService() override;

  // Graceful drain: new Generate calls get UNAVAILABLE; running ones finish.
  void StartDrain();
  int64_t active_requests() const;

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;
  // Generate for a caller in this process, with the gRPC API's admission, limits (`caller`
  // names the client for the token check and the per-client stream cap), placement and
  // metrics. `request` and `client` must outlive the call (until the client calls Done).
  void GenerateInProcess(const v1::GenerateRequest& request, Caller caller, absl::Time deadline,
                         GenerateClient* client);
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context,
                                  const v1::AbortRequest* request,
                                  v1::AbortResponse* response) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* RegisterAdapter(grpc::CallbackServerContext* context,
                                            const v1::RegisterAdapterRequest* request,
                                            v1::RegisterAdapterResponse* response) override;
  grpc::ServerUnaryReactor* LoadAdapter(grpc::CallbackServerContext* context,
                                        const v1::LoadAdapterRequest* request,
                                        v1::LoadAdapterResponse* response) override;
  grpc::ServerUnaryReactor* UnloadAdapter(grpc::CallbackServerContext* context,
                                          const v1::UnloadAdapterRequest* request,
                                          v1::UnloadAdapterResponse* response) override;
  grpc::ServerUnaryReactor* ListAdapters(grpc::CallbackServerContext* context,
                                         const v1::ListAdaptersRequest* request,
                                         v1::ListAdaptersResponse* response) override;
  grpc::ServerReadReactor<v1::UpdateAdapterRequest>* UpdateAdapter(
      grpc::CallbackServerContext* context, v1::UpdateAdapterResponse* response) override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace preft::router
