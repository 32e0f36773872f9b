#pragma once

// The decode service's shared state (private to services/decode): the reservation table, the
// Start calls in flight and the quarantine, guarded by one mutex, plus the engine loop, the
// transport and the timer thread. decode_service.cc has the RPC glue and the Start path;
// reservations.cc the reservation life cycle (reserve, retry, DONE, release, lease, quarantine);
// colocated.cc the Run path (whole requests on this worker's engine).

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/adapters/versioned_adapters.h"
#include "common/engine/engine_loop.h"
#include "services/decode/decode_service.h"
#include "services/decode/start_stream.h"

namespace preft::decode {

// What a stream's last message reports (StartRequest and RunRequest name the same fields).
template <typename CallRequest>
StreamFinishInfo FinishInfoOf(const CallRequest& r) {
  StreamFinishInfo info;
  info.request_id = r.request_id();
  info.prompt_tokens = r.prompt_ids_size();
  if constexpr (requires { r.cached_tokens(); }) info.cached_tokens = r.cached_tokens();
  info.adapter = r.adapter();
  info.adapter_version = r.adapter_version();
  info.adapter_positions = r.adapter_positions();
  return info;
}

// Lock order: mu, then EngineLoop's queue (Post). StartStream::Fail, whose Finish may run gRPC
// work, is called only with mu released (see Failures).
struct DecodeService::Impl {
  enum class State { kReserved, kStarted, kReleased };

  struct Reservation {
    uint32_t generation = 1;
    std::vector<int32_t> blocks;  // kReserved only
    absl::Duration lease;
    absl::Time lease_deadline;
    State state = State::kReserved;
    bool done = false;              // the current generation's DONE notice has arrived
    StartStream* waiter = nullptr;  // the Start claiming it, until committed (a key of starts)
    std::string why_released;       // kReleased
    absl::Time forget_at;           // kStarted/kReleased: erased then
  };

  // One Start or Run call, from its handler until gRPC is done with it.
  struct Start {
    std::shared_ptr<StartStream> stream;
    std::string request_id;
    uint64_t reservation_id = 0;      // Start only
    bool claimed = false;             // the reservation's waiter
    bool adapter_pending = false;     // all-position mode or Run: acquiring the adapter's pin
    bool cancelled = false;           // the client went away: never hand it to the engine
    bool committed = false;           // handed to the engine
    engine::Request request;          // `on_token` and `imported` are added at commit
    engine::ImportedPrompt imported;  // the prefill's first token; blocks added at commit
  };

  struct Quarantined {
    absl::Time free_at;
    std::vector<int32_t> blocks;
  };

  // Streams to end once mu is released.
  using Failures = std::vector<std::pair<std::shared_ptr<StartStream>, absl::Status>>;

  // What Reserve asks the engine thread for.
  struct ReservePlan {
    int64_t blocks = 0;
    int64_t max_new_tokens = 0;
    absl::Duration lease;
  };


  explicit Impl(const DecodeServiceOptions& o) : options(o) {
    std::random_device rd;
    // A restarted worker must not take a stale Start for one of its new reservations.
    next_id = (static_cast<uint64_t>(rd()) << 32) | 1;
  }
  ~Impl();

  absl::StatusOr<ReservePlan> PlanReserve(const worker::v1::ReserveRequest& req);
  absl::Status ReserveOnEngine(engine::Engine& e, const worker::v1::ReserveRequest& req,
                               const ReservePlan& plan, worker::v1::ReserveResponse* resp,
                               Failures* failures);
  // A Start or Run stream, registered in `starts` until its sink is done with it: a call of its
  // own (sink null) or `sink`.
  std::shared_ptr<StartStream> OpenStream(StreamFinishInfo info, StreamSink* sink = nullptr);
  // INVALID_ARGUMENT naming the field: an empty id or prompt, a prompt that fills the context,
  // an id outside the vocabulary.
  absl::Status ValidatePrompt(const std::string& request_id,
                              const google::protobuf::RepeatedField<int32_t>& prompt_ids) const;
  absl::Status BeginStart(const std::shared_ptr<StartStream>& stream,
                          const worker::v1::StartRequest& req);
  // Colocated (colocated.cc): validates, pins the adapter, then CommitRun.
  absl::Status BeginRun(const std::shared_ptr<StartStream>& stream,
                        const worker::v1::RunRequest& req);
  void OnRunAdapter(const std::shared_ptr<StartStream>& stream,
                    std::optional<model::AdapterPositions> positions,
                    absl::StatusOr<adapters::AdapterPin> pin);
  // Hands a Run's request to the engine as a local request (the prompt is computed here).
  void CommitRunLocked(Start& start) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void OnAdapter(const std::shared_ptr<StartStream>& stream,
                 absl::StatusOr<adapters::AdapterPin> pin);
  absl::Status Release(const worker::v1::ReleaseRequest& req, Failures* failures);
  void OnDoneNotice(uint64_t id, uint32_t generation);
  void OnStreamCancel(StartStream* stream);
  void OnStreamDone(StartStream* stream);
  void TimerLoop();

  void CommitLocked(Reservation& r, Start& start) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Ends a reservation not started: its waiter (if any) fails with `waiter_status` and its
  // blocks go to quarantine.
  void AbortLocked(uint64_t id, Reservation& r, const std::string& why,
                   const absl::Status& waiter_status, Failures* failures)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Engine thread: reserved -> quarantined, freed after options.quarantine by the timer.
  void QuarantineLocked(std::vector<int32_t> blocks) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  static void Fail(Failures& failures) {
    for (auto& [stream, status] : failures) stream->Fail(status);
    failures.clear();
  }

  const DecodeServiceOptions options;
  model::ModelConfig config;
  int64_t block_tokens = 0;
  int64_t total_blocks = 0;
  worker::v1::TransportEndpoint endpoint;
  std::unique_ptr<adapters::AdapterStore> store;  // all-position and colocated modes only
  std::unique_ptr<adapters::VersionedAdapters> versioned;
  std::unique_ptr<transport::KvTransport> transport;
  std::unique_ptr<engine::EngineLoop> loop;
  std::thread timer;  // lease expiry, quarantine release, forgetting ended reservations

  mutable absl::Mutex mu;
  absl::CondVar timer_cv;
  std::map<uint64_t, Reservation> reservations ABSL_GUARDED_BY(mu);
  std::map<StartStream*, Start> starts ABSL_GUARDED_BY(mu);
  std::vector<Quarantined> quarantine ABSL_GUARDED_BY(mu);
  uint64_t next_id ABSL_GUARDED_BY(mu) = 1;
  bool draining ABSL_GUARDED_BY(mu) = false;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  // Changed on the engine thread only, with the allocator, so block_counts adds up.
  int64_t reserved_blocks ABSL_GUARDED_BY(mu) = 0;
  int64_t quarantined_blocks ABSL_GUARDED_BY(mu) = 0;
  int64_t stale_done_notices ABSL_GUARDED_BY(mu) = 0;  // old generations, unknown ids
};

}  // namespace preft::decode
