#pragma once

// One Generate call, driven by a coroutine (common/rpc/coro.h). Its calls to the workers, its
// waits for capacity and its writes to the client are awaited callback operations, so a call
// holds no thread while it waits: admission (tokenising, the registry) runs on the router's CPU
// pool, the rest on gRPC's callback threads. Retries and deadlines are state in the coroutine's
// frame. Its client is a GenerateClient (router_service.h): a gRPC stream or the OpenAI door.

#include <grpcpp/grpcpp.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/engine/request_params.h"
#include "common/log/log.h"
#include "common/rpc/coro.h"
#include "proto/preft/v1/preft.grpc.pb.h"
#include "proto/preft/v1/worker.grpc.pb.h"
#include "services/router/router_impl.h"

namespace preft::router {

class GenerateCall final {
 public:
  // Starts at once. `request` and `client` outlive the call (until Done); `deadline` is the
  // client's (time_point::max() for none).
  GenerateCall(RouterService::Impl* router, const v1::GenerateRequest& request, Caller caller,
               std::chrono::system_clock::time_point deadline, GenerateClient* client);

  // From the client: the write it was given is done (false: the client is gone).
  void WriteDone(bool ok);
  // From the client: it cancelled or went away. Not after Finish.
  void Cancel();
  // From the client, after Finish: frees the call.
  void Done() { delete this; }

  // Abort RPC: the stream ends with finish ABORT and status OK.
  void Abort();

 private:
  struct Reservation {
    std::shared_ptr<DecodeWorker> worker;
    worker::v1::ReserveResponse r;
  };
  // The decode workers a request may use now: their last views (those it may not use marked
  // unhealthy) and the blocks it needs there.
  struct DecodeChoice {
    std::vector<std::shared_ptr<DecodeWorker>> workers;
    std::vector<DecodeView> views;
    int64_t blocks = 0;
  };
  // The adapter a stream's finish names, as this router resolved it.
  struct FinishAdapter {
    std::string name;
    int64_t version = 0;
    v1::AdapterPositions positions = v1::ADAPTER_POSITIONS_UNSPECIFIED;
  };
  // A worker's token stream, read to its end.
  struct Relayed {
    absl::Status status;
    bool client_gone = false;
    v1::GenerateResponse all;  // non-streaming: everything in one message
  };

  template <typename T>
  using Task = rpc::Task<T>;

  // A worker call failed this way: another worker may succeed.
  rpc::Detached Drive();
  // Everything up to the end of the decode stream; returns the call's status.
  Task<absl::Status> Run();
  // Reserve, prefill, decode: the disaggregated path after admission (a coroutine of its own,
  // so that a colocated call's frame does not hold its locals).
  Task<absl::Status> RunDisaggregated(const std::vector<int32_t>& prompt,
                                      const std::optional<RegisteredAdapter>& adapter,
                                      const engine::SamplingParams& sampling, absl::Time admitted);
  absl::Status Admit(std::vector<int32_t>* prompt, std::optional<RegisteredAdapter>* adapter,
                     engine::SamplingParams* sampling);
  // FAILED_PRECONDITION when no healthy worker is of the kind the request needs (colocated or
  // not; running adapters for the all-position baseline), INVALID_ARGUMENT when it fits in none.
  absl::StatusOr<DecodeChoice> DecodeCandidates(int64_t prompt_tokens, int64_t max_new);
  Task<absl::StatusOr<Reservation>> Reserve(int64_t prompt_tokens, int64_t max_new);
  Task<absl::StatusOr<worker::v1::PrefillResponse>> Prefill(
      Reservation* res, const std::vector<int32_t>& prompt,
      const std::optional<RegisteredAdapter>& adapter, const engine::SamplingParams& sampling);
  Task<absl::Status> Decode(const Reservation& res, const std::vector<int32_t>& prompt,
                            const std::optional<RegisteredAdapter>& adapter,
                            const engine::SamplingParams& sampling,
                            const worker::v1::PrefillResponse& first);
  // The prefix-affinity keys of `prompt` under `adapter` (the base model without one).
  static std::vector<uint64_t> PrefixKeys(const std::optional<RegisteredAdapter>& adapter,
                                          const std::vector<int32_t>& prompt,
                                          int64_t block_tokens);
  // Colocated (colocated_call.cc): Run on a decode worker, relayed; replaces a worker that
  // fails before the first token.
  // The colocated decode worker to try next: most free first, tried ones left out; null when
  // none may take the request now (`*known` says how many workers there are). A plain function
  // so that the candidates do not live in the coroutine's frame while the request runs.
  absl::StatusOr<std::shared_ptr<DecodeWorker>> PickColocated(
      const std::vector<int32_t>& prompt, const std::optional<RegisteredAdapter>& adapter,
      int64_t max_new, const WorkerAttempts& attempts, size_t* known);
  // Opens the request's Run stream on `w` (a plain function: the message lives on its stack,
  // not in the coroutine's frame for the whole stream).
  std::shared_ptr<DecodeStream> OpenRun(DecodeWorker& w, const std::vector<int32_t>& prompt,
                                        const std::optional<RegisteredAdapter>& adapter,
                                        const engine::SamplingParams& sampling,
                                        v1::AdapterPositions positions);
  Task<absl::Status> RunColocated(const std::vector<int32_t>& prompt,
                                  const std::optional<RegisteredAdapter>& adapter,
                                  const engine::SamplingParams& sampling);
  // Relays a Start or Run stream to the client (each message as it comes when the client
  // streams) into *out; the finish names `adapter`. Call with the stream tracked. (An out
  // parameter: a returned Relayed would be held three times in the frames of every stream.)
  Task<bool> Relay(DecodeStream& stream, const std::optional<FinishAdapter>& adapter,
                   Relayed* out);
  // The call's end after a relayed stream from `worker`.
  Task<absl::Status> RelayEnd(const Relayed& relayed, DecodeWorker& worker);
  // Gives the reservation back, not awaited (lease expiry covers a lost Release).
  void Release(const Reservation& res, const std::string& reason);
  // Releases `res` and reserves again on any decode worker (the ranking decides), waiting for
  // room; the error names `failure`, which made the move necessary.
  Task<absl::Status> MoveReservation(Reservation* res, int64_t prompt_tokens, int64_t max_new,
                                     const absl::Status& failure, const std::string& reason);
  int64_t LeaseMs() const;
  // A new reservation (retry_of 0) or the next generation of `retry_of`.
  worker::v1::ReserveRequest ReserveRequestFor(int64_t prompt_tokens, int64_t max_new,
                                               uint64_t retry_of) const;

  // A worker call failed in a way another worker may not: counted, logged, the worker skipped
  // until its next poll if it is gone, and remembered as tried by this request.
  template <typename Worker>
  void AttemptFailed(const char* tier, Worker& w, const absl::Status& s, WorkerAttempts* attempts) {
    router_->metrics->Retried(tier, s);
    attempts->Failed(w.address, s);
    log::Warn(log::Request{id_}, "{} on {} failed ({}); retrying", tier, w.address, s);
    if (s.code() == absl::StatusCode::kUnavailable) WorkerPool::MarkUnhealthy(w);
  }
  // Client context for a worker call: the client's deadline, registered for cancellation.
  void Track(grpc::ClientContext* ctx);
  // A decode stream, registered for cancellation (the client's deadline ends the client's
  // call, whose cancellation ends it).
  void Track(const std::shared_ptr<DecodeStream>& stream);
  // Reserve calls are not cancelled midway (a reservation the worker made must be known here
  // to be released): they get a short deadline instead, and the caller checks stopped() after.
  void ReserveDeadline(grpc::ClientContext* ctx) const;
  void Untrack();
  bool stopped();  // cancelled (or past the deadline) or aborted
  void WatchDeadline();
  void UnwatchDeadline();
  // Sets `reason` (cancelled_ or aborted_), cancels the worker call in progress and ends a
  // capacity wait (outside mu_: its callback may resume the call, which takes mu_).
  void Interrupt(bool* reason);
  // Waits up to 20 ms (a cancel or an abort ends it early), counted as waiting for capacity.
  Task<bool> WaitForCapacity();
  // Time to first token and inter-token latency for `n` tokens relayed now.
  void ObserveTokens(int n);
  // Writes `response` to the client; false when the client is gone. `response` must live
  // until the write is done (it does: the awaiting frame holds it).
  Task<bool> Write(const v1::GenerateResponse& response);
  Task<absl::Status> AbortedResult();

  RouterService::Impl* const router_;
  GenerateClient* const client_;
  const v1::GenerateRequest& request_;  // the client's, until Done
  absl::Status access_;  // the caller's token and stream slot, checked at arrival
  std::string id_;
  absl::Time admission_deadline_;
  std::chrono::system_clock::time_point client_deadline_;
  bool has_deadline_ = false;

  std::mutex mu_;
  bool cancelled_ = false;
  bool aborted_ = false;
  bool expired_ = false;  // the client's deadline passed (cancelled_ is set too)
  // The client's deadline, enforced here for clients that do not enforce it themselves (the
  // OpenAI door calls in process); a gRPC client's deadline also cancels the call through gRPC.
  // The alarm's callback reaches the call through `watch`, which the call's end clears.
  struct DeadlineWatch {
    std::mutex mu;
    GenerateCall* call = nullptr;
  };
  std::shared_ptr<DeadlineWatch> deadline_watch_;
  std::unique_ptr<grpc::Alarm> deadline_alarm_;
  grpc::ClientContext* current_ = nullptr;
  std::shared_ptr<DecodeStream> stream_;  // the decode stream in progress
  // A capacity wait in progress: Cancel and Abort cancel it outside mu_ (its callback may
  // resume the call, which takes mu_), holding a reference so it outlives that.
  std::shared_ptr<grpc::Alarm> waiting_;
  rpc::Rendezvous write_;           // the write in progress and its end
  bool write_ok_ = true;
  int32_t completion_tokens_ = 0;
  // Metrics (driver thread only).
  const absl::Time arrival_;
  RouterMetrics::Positions positions_ = "base";
  int64_t prompt_tokens_ = 0;
  absl::Time prefilled_at_ = absl::InfinitePast();  // the prefill's answer (none colocated)
  absl::Time last_token_at_ = absl::InfinitePast();
  bool needs_decode_adapter_ = false;  // all-position adapter: decode must run it too
  Access::Slot slot_;  // this client's stream, held until the call ends
};

}  // namespace preft::router
