#pragma once

// One Start (or Run) stream on its way to the router: the engine's token events are queued and
// written one message at a time (events that arrive while a write is in flight go out together
// in the next message); the last message carries the finish. The messages go to a StreamSink:
// the stream's own gRPC call (DecodeWorker.Start, .Run) or its tag on a Streams call shared by
// many streams (streams_call.h). The decode service learns of the client's cancellation and of
// the stream's end through hooks.

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/engine/request.h"
#include "proto/preft/v1/preft.pb.h"

namespace preft::decode {

// What the last message reports besides the counts (copied from the StartRequest or
// RunRequest).
struct StreamFinishInfo {
  std::string request_id;
  int32_t prompt_tokens = 0;
  int32_t cached_tokens = 0;  // Start: the prefill's; Run: the engine's (its token events)
  std::string adapter;
  int64_t adapter_version = 0;
  v1::AdapterPositions adapter_positions = v1::ADAPTER_POSITIONS_UNSPECIFIED;
};

class StartStream;

// Where a stream's messages go. Called by the stream with none of its locks held; at most one
// Write in flight per stream, then one Finish.
class StreamSink {
 public:
  virtual ~StreamSink() = default;
  // Delivers `msg` (copy it: the stream reuses it after WriteDone), then calls
  // stream->WriteDone(ok), maybe inline.
  virtual void Write(StartStream* stream, const v1::GenerateResponse& msg) = 0;
  // The stream's end: `last` (null: none) then `status`; then stream->Done(), maybe inline.
  virtual void Finish(StartStream* stream, const v1::GenerateResponse* last,
                      const absl::Status& status) = 0;
};

// Thread-safe: fed by the engine thread (OnEvent), the decode service (Fail) and its sink's
// callbacks. Shared by its sink, the engine request's on_token callback and the service, it
// outlives its call: events after the stream ended are dropped. Never blocks; at most one write
// is in flight and Finish is called once, never with a write in flight.
class StartStream : public std::enable_shared_from_this<StartStream> {
 public:
  struct Hooks {
    // Once, on a gRPC thread, when the client cancels or goes away (before on_done).
    std::function<void(StartStream*)> on_cancel;
    // Once, when gRPC is done with the call (the reactor is gone). Last of all hooks.
    std::function<void(StartStream*)> on_done;
  };

  // A stream on a call of its own: reactor() is owned by gRPC, return it from the handler.
  static std::shared_ptr<StartStream> Create(StreamFinishInfo info, Hooks hooks);
  // A stream whose messages go to `sink`, which must outlive the stream's Done.
  static std::shared_ptr<StartStream> Create(StreamFinishInfo info, Hooks hooks,
                                             StreamSink* sink);
  ~StartStream();

  // Null for a stream created with a sink.
  grpc::ServerWriteReactor<v1::GenerateResponse>* reactor() { return reactor_; }

  // The engine's event for this request (engine thread). A token is queued; a finish ends
  // the stream after the queued tokens (with `finish` set on the last message); an error
  // ends it with the event's status, an abort with CANCELLED.
  void OnEvent(const engine::TokenEvent& event);
  // Ends the stream with `status` (not OK) once the write in flight, if any, is done. Queued
  // tokens are dropped. Ignored once the stream is finishing.
  void Fail(const absl::Status& status);
  // Run: the positions an UNSPECIFIED request resolved to (the adapter's default), known once
  // its lease is in. Call before the engine has the request.
  void ResolveAdapterPositions(v1::AdapterPositions positions);

  // For the sink: the write it was given is done (false: undeliverable, the client is gone).
  void WriteDone(bool ok);
  // For the sink: the client cancelled or went away. Calls on_cancel the first time.
  void Cancel();
  // For the sink: the end it was given is delivered (or dropped); calls on_done.
  void Done();

 private:
  class Reactor;
  struct Event {
    int32_t token_id = -1;
    std::string text;
    std::optional<engine::TokenLogprob> logprob;
    engine::FinishReason finish = engine::FinishReason::kNone;
    absl::Status status;
    int64_t cached_prompt_tokens = 0;
  };

  StartStream(StreamFinishInfo info, Hooks hooks);
  // Starts the next write or the Finish when one is due; the gRPC calls run outside mu_.
  void Pump();
  const Hooks hooks_;
  grpc::ServerWriteReactor<v1::GenerateResponse>* reactor_ = nullptr;  // gRPC owns; until OnDone
  StreamSink* sink_ = nullptr;  // reactor_ for a call of its own

  absl::Mutex mu_;
  StreamFinishInfo info_ ABSL_GUARDED_BY(mu_);
  std::deque<Event> pending_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Status> failure_ ABSL_GUARDED_BY(mu_);
  int32_t completion_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool cancel_reported_ ABSL_GUARDED_BY(mu_) = false;
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;  // Finish (or StartWriteAndFinish) called
  // The message being written; touched only by the thread that set write_in_flight_ or
  // finishing_ (gRPC reads it until the write is done).
  v1::GenerateResponse out_;
};

}  // namespace preft::decode
