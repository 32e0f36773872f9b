#pragma once

// The prefill tier (DESIGN.md §4): runs prompts of many adapters together (chunked), samples
// each request's first token, pushes the prompt's KV into the decode worker's reservation
// through the KV transport, and answers once the decode worker has the KV and the DONE notice.
//
// Adapters are named by the router with a folder and a version (PrefillRequest.adapter_path,
// adapter_version); each (name, version) is its own entry in the worker's AdapterStore, loaded
// on first use off the engine thread, so a request finishes on the version it started with and
// an RL weight update only has to reach this tier.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/adapters/adapter_store.h"
#include "common/engine/engine.h"
#include "common/model/config.h"
#include "common/transport/kv_transport.h"
#include "prometheus/registry.h"
#include "proto/preft/v1/worker.grpc.pb.h"

namespace preft::prefill {

struct PrefillServiceOptions {
  // Adapter budgets and loader threads; `store.load.dtype` is set to the model's weight dtype
  // (the only one the engine computes adapters in).
  adapters::AdapterStoreOptions store;
  // Adapter folders must lie under this root (canonical paths); "" accepts none.
  std::string adapter_root;
  // Where the service's metrics (prefill_metrics.h) go; none if null. Must outlive the service.
  prometheus::Registry* metrics = nullptr;
};

// Thread-safe (a gRPC callback service). Takes ownership of the engine (run by its own
// EngineLoop thread) and of the transport, which Create starts on the engine's cache. The
// engine borrows its model, which must outlive the service. Shut the gRPC server down before
// destroying the service.
//
// A Prefill call: validate -> connect the decode peer (once per address) -> pin the adapter
// version (store loader thread) -> queue a prefill-only request on the engine thread -> the
// prompt's KV is written into the reservation (transport thread) -> release the prompt's blocks
// and answer. Cancelling the call aborts the engine request; blocks are freed whatever happens.
class PrefillService final : public worker::v1::PrefillWorker::CallbackService {
 public:
  static absl::StatusOr<std::unique_ptr<PrefillService>> Create(
      std::unique_ptr<engine::Engine> engine, std::unique_ptr<transport::KvTransport> transport,
      const transport::KvLayout& layout, const PrefillServiceOptions& options);
  // Fails requests in flight with UNAVAILABLE, stops the engine and the transport.
  ~PrefillService() override;

  // Graceful drain (SIGTERM): Prefill answers UNAVAILABLE, Status reports draining.
  void StartDrain();
  // Prefill calls in flight (drain waits for 0).
  int64_t active_requests() const;
  // This worker's transport endpoint (what Connect and Status answer).
  const worker::v1::TransportEndpoint& endpoint() const;

  // The engine's block accounting, for tests and metrics. Waits for the engine thread: never
  // call it from an RPC handler or an engine callback. All zero once the service is stopping.
  struct EngineCounts {
    int64_t total_blocks = 0;
    int64_t free_blocks = 0;
    int64_t prefilled_held = 0;  // prompts whose blocks wait for their transfer to end
    int64_t waiting = 0;
    int64_t running = 0;
  };
  EngineCounts engine_counts() const;

  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* context,
                                    const worker::v1::PrefillRequest* request,
                                    worker::v1::PrefillResponse* response) override;
  grpc::ServerUnaryReactor* Status(grpc::CallbackServerContext* context,
                                   const worker::v1::PrefillStatusRequest* request,
                                   worker::v1::PrefillStatusResponse* response) override;
  grpc::ServerUnaryReactor* Connect(grpc::CallbackServerContext* context,
                                    const worker::v1::ConnectRequest* request,
                                    worker::v1::ConnectResponse* response) override;
  grpc::ServerUnaryReactor* LoadAdapter(grpc::CallbackServerContext* context,
                                        const worker::v1::WorkerAdapterRequest* request,
                                        worker::v1::AdapterState* response) override;
  grpc::ServerUnaryReactor* UnloadAdapter(grpc::CallbackServerContext* context,
                                          const worker::v1::WorkerAdapterRequest* request,
                                          worker::v1::UnloadWorkerAdapterResponse* response) override;

 private:
  struct Impl;
  explicit PrefillService(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace preft::prefill
