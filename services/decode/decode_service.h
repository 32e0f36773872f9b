#pragma once

// The decode tier (DESIGN.md §4): owns a KV pool, lends blocks to prefill workers under
// reservations, and decodes every user together on the base model.
//
// A reservation's life: Reserve allocates the blocks the request can ever need (prompt +
// max_new_tokens, so an imported prompt is never preempted: it could not be recomputed here)
// under a lease and generation 1 -> a prefill worker writes the prompt's KV into the first
// blocks and its DONE notice (reservation id, generation) arrives through the transport ->
// Start commits the reservation (waiting for DONE until the lease ends) and the engine decodes
// from the imported prompt, streaming tokens. Release, lease expiry or a cancelled Start before
// commit abort the reservation: its blocks are quarantined (no write of a dead prefill can still
// land in a block reused by someone else) and then freed. Reserve with `retry_of` keeps the
// reservation id, bumps the generation and swaps in fresh blocks (the old ones are quarantined):
// late writes and DONE notices of the old generation cannot touch the new attempt.
//
// Colocated (options.colocated; the deployment vLLM users run without disaggregation): Run
// takes a whole request, pins its adapter, and the engine computes the prompt and decodes it
// in the same batch as every other Run; such a sequence may be preempted and recomputed. Reserve
// is refused, so no imported prompt (which must never be preempted) shares that cache.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/adapters/adapter_store.h"
#include "common/engine/engine.h"
#include "common/transport/kv_transport.h"
#include "proto/preft/v1/worker.grpc.pb.h"

namespace preft::decode {

struct DecodeServiceOptions {
  absl::Duration default_lease = absl::Seconds(10);  // when ReserveRequest.lease_ms is 0
  absl::Duration max_lease = absl::Seconds(120);     // longer requests are clipped to this
  // How long an aborted reservation's blocks stay unusable before they are freed: longer than
  // any write of a prefill worker can take to land (the transport's transfer timeout).
  absl::Duration quarantine = absl::Seconds(2);
  // The all-position baseline: decode applies the request's adapter to generated tokens, so it
  // needs an adapter store. Off (PreFT): StartRequest.adapter must be empty.
  bool all_position_adapters = false;
  adapters::AdapterStoreOptions store;
  // Colocated: Run computes prompts here (with an adapter store, like the baseline's) and
  // Reserve is refused. Off: Run is refused.
  bool colocated = false;
  // All-position baseline and colocated: StartRequest/RunRequest.adapter_path must lie under
  // this folder (canonical paths; see adapters::VersionedAdapters). "" accepts none.
  std::string adapter_root;
};

// Thread-safe (a gRPC callback service). Takes ownership of the engine (run by its own
// EngineLoop thread) and of the transport, which Create starts on the engine's cache.
//
// Codes: Reserve is RESOURCE_EXHAUSTED when the blocks are not free (the message names the
// counts), UNAVAILABLE while draining, NOT_FOUND for a `retry_of` that is unknown, started or
// released. Start is NOT_FOUND for an unknown or released reservation, FAILED_PRECONDITION for
// a generation other than the current one, a reservation already started or claimed by
// another Start, or an adapter in PreFT mode; INVALID_ARGUMENT for a bad request (validated
// before the reservation is touched, so it stays usable); DEADLINE_EXCEEDED at the lease's end
// without DONE; ABORTED when a retry or Release supersedes the generation it waits for. A Start
// that has claimed its reservation and then fails or is cancelled aborts the reservation.
// Release of a started reservation, of a released one or of an older generation is a no-op.
// Streams carries many Start and Run streams over one call (a router keeps one per worker):
// each behaves as its own call would; the call's end cancels the streams still open on it.
// Run is FAILED_PRECONDITION unless colocated (Reserve is FAILED_PRECONDITION if colocated),
// INVALID_ARGUMENT for a bad request, UNAVAILABLE while draining, and fails with the adapter
// store's status when its adapter cannot be pinned. LoadAdapter is FAILED_PRECONDITION on a
// worker without adapters, else the adapter store's status (as Run's).
//
// Shut the gRPC server down (which ends every call) before destroying the service.
class DecodeService final : public worker::v1::DecodeWorker::CallbackService {
 public:
  static absl::StatusOr<std::unique_ptr<DecodeService>> Create(
      std::unique_ptr<engine::Engine> engine, std::unique_ptr<transport::KvTransport> transport,
      const transport::KvLayout& layout, const DecodeServiceOptions& options);
  // Fails streams still open with UNAVAILABLE, stops the transport, then the engine.
  ~DecodeService() override;

  // Graceful drain (SIGTERM): Reserve answers UNAVAILABLE, Status reports draining; streams
  // already started run to the end.
  void StartDrain();
  // Start and Run streams still open (drain waits for 0).
  int64_t active_streams() const;
  // This worker's KV transport endpoint (its `transport` names what UCX opened).
  const worker::v1::TransportEndpoint& endpoint() const;
  // The "grpc" transport's address is this worker's own gRPC address, known once the server is
  // bound: call this before the worker reports ready. No effect on other transports.
  void SetAdvertisedAddress(const std::string& address);

  // The adapter store (workers serving adapters: all-position or colocated; null otherwise)
  // and the options it was built with, for metrics.
  const adapters::AdapterStore* adapter_store() const;
  const DecodeServiceOptions& options() const;

  // Block accounting, for tests and metrics.
  struct BlockCounts {
    int32_t total = 0;
    int32_t free = 0;         // in the allocator
    int32_t reserved = 0;     // held by reservations not yet started
    int32_t quarantined = 0;  // aborted, waiting to be freed
    int32_t filled = 0;       // held by running sequences (decoding, or colocated prompts)
    // Not blocks: running sequences, reservations waiting for their prompt's KV, and
    // (colocated) requests queued for room in the batch.
    int32_t sequences = 0;
    int32_t reservations_waiting = 0;
    int32_t queued = 0;
  };
  // Taken on the engine thread, so the counts add up to total; waits for the current step.
  BlockCounts block_counts() const;

  grpc::ServerUnaryReactor* Reserve(grpc::CallbackServerContext* context,
                                    const worker::v1::ReserveRequest* request,
                                    worker::v1::ReserveResponse* response) override;
  grpc::ServerWriteReactor<v1::GenerateResponse>* Start(
      grpc::CallbackServerContext* context, const worker::v1::StartRequest* request) override;
  grpc::ServerWriteReactor<v1::GenerateResponse>* Run(
      grpc::CallbackServerContext* context, const worker::v1::RunRequest* request) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* context,
                                    const worker::v1::ReleaseRequest* request,
                                    worker::v1::ReleaseResponse* response) override;
  grpc::ServerUnaryReactor* Status(grpc::CallbackServerContext* context,
                                   const worker::v1::DecodeStatusRequest* request,
                                   worker::v1::DecodeStatusResponse* response) override;
  grpc::ServerReadReactor<worker::v1::KvChunk>* WriteKv(grpc::CallbackServerContext* context,
                                                        worker::v1::KvWriteAck* response) override;
  grpc::ServerUnaryReactor* LoadAdapter(grpc::CallbackServerContext* context,
                                        const worker::v1::WorkerAdapterRequest* request,
                                        worker::v1::AdapterState* response) override;
  grpc::ServerUnaryReactor* UnloadAdapter(grpc::CallbackServerContext* context,
                                          const worker::v1::WorkerAdapterRequest* request,
                                          worker::v1::UnloadWorkerAdapterResponse* response) override;
  grpc::ServerBidiReactor<worker::v1::StreamsRequest, worker::v1::StreamsResponse>* Streams(
      grpc::CallbackServerContext* context) override;

 private:
  friend class StreamsCall;
  struct Impl;
  explicit DecodeService(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace preft::decode
