#pragma once

// The router's side of DecodeWorker.Streams: one long-lived call per decode worker carries every
// Start and Run stream the router has open there, instead of a gRPC call per request (a call
// costs ~24 KiB on each side and a message per token: bench/NOTES.md step 27). The worker
// batches every stream's tokens of a step into one message; here each stream's arrivals are
// merged into one pending message until its reader takes it, so a client that reads slowly
// gets fewer, larger messages rather than a queue.

#include <grpcpp/grpcpp.h>

#include <coroutine>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/base/thread_pool.h"
#include "proto/preft/v1/worker.grpc.pb.h"

namespace preft::router {

class DecodeStreams;

// One Start or Run stream over a worker's Streams call. Thread-safe.
class DecodeStream {
 public:
  // A stream that has already ended with `status` (no call could carry it).
  static std::shared_ptr<DecodeStream> Failed(absl::Status status);
  DecodeStream(std::shared_ptr<DecodeStreams> call, uint64_t tag)
      : call_(std::move(call)), tag_(tag) {}

  // Awaitable: everything that arrived since the last Read, merged into one message (tokens,
  // text and logprobs appended; the finish with the last), into *msg; false once the stream has
  // ended and all of it was read. Resumed on the thread that delivers (the call's reader, or
  // Cancel's caller). One Read at a time.
  auto Read(v1::GenerateResponse* msg) {
    struct Awaiter {
      DecodeStream* s;
      v1::GenerateResponse* msg;
      bool await_ready() { return s->Ready(); }
      bool await_suspend(std::coroutine_handle<> h) { return s->Suspend(h); }
      bool await_resume() { return s->Take(msg); }
    };
    return Awaiter{this, msg};
  }
  // How the stream ended (once Read gave false): the worker's status for it, CANCELLED after
  // Cancel, UNAVAILABLE when the call broke.
  absl::Status status() const;
  // Ends the stream now with CANCELLED (a Read waiting returns false, resumed on this thread)
  // and tells the worker, which cancels it as it would a cancelled Start or Run call. No effect
  // once it has ended.
  void Cancel();

 private:
  friend class DecodeStreams;
  bool Ready();
  bool Suspend(std::coroutine_handle<> h);
  bool Take(v1::GenerateResponse* msg);
  // From the call: the next frame (its response merged in; its end recorded). Returns the
  // reader to resume, if one waits; *first says whether this was the stream's first message.
  std::coroutine_handle<> Deliver(worker::v1::StreamFrame* frame, bool* first);
  // From the call: it ended; so does the stream, with `status`, unless it had.
  std::coroutine_handle<> End(const absl::Status& status);

  const std::shared_ptr<DecodeStreams> call_;  // null for Failed
  const uint64_t tag_ = 0;
  mutable absl::Mutex mu_;
  v1::GenerateResponse pending_ ABSL_GUARDED_BY(mu_);
  bool has_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool delivered_ ABSL_GUARDED_BY(mu_) = false;  // a message has arrived
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::coroutine_handle<> reader_ ABSL_GUARDED_BY(mu_);
};

// One Streams call to a decode worker. Lives until gRPC is done with it (it holds itself).
// Lock order: a stream's mu_, then the call's; streams are resumed with neither held.
class DecodeStreams final
    : public grpc::ClientBidiReactor<worker::v1::StreamsRequest, worker::v1::StreamsResponse>,
      public std::enable_shared_from_this<DecodeStreams> {
 public:
  // Starts a call on `stub` (the worker at `address`, named in errors). Streams past their
  // first message are resumed on `relay` (null: on the callback thread), which must outlive
  // the call.
  static std::shared_ptr<DecodeStreams> Open(worker::v1::DecodeWorker::Stub* stub,
                                             std::string address, base::ThreadPool* relay);

  // Opens a stream, taking *open (its tag is set here); null, *open untouched, when this call
  // is ending: open another.
  std::shared_ptr<DecodeStream> Start(worker::v1::StreamOpen* open);
  // Ends the call once no stream is open on it (a draining worker waits for its calls to end
  // before it exits): now if none is, else when the last one ends. True if it is ending now.
  bool CloseWhenIdle();
  // Ends the call now: its open streams end UNAVAILABLE.
  void Cancel();
  // Cancel, then waits until gRPC is done with the call. Not on a gRPC callback thread.
  void Shutdown();
  bool ending() const;
  size_t open_streams() const;

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

  DecodeStreams(std::string address, base::ThreadPool* relay)
      : address_(std::move(address)), relay_(relay) {}

 private:
  friend class DecodeStream;
  // A stream is cancelled: forget it and tell the worker.
  void SendCancel(uint64_t tag);
  // Starts the next write if one is due (call with mu_ not held).
  void Flush();
  // After a stream left streams_: true if the call is to end now (CloseWhenIdle); the caller
  // then cancels it.
  bool IdleCloseDueLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the call's part in the hold once no write will be started (see Open).
  void MaybeRemoveHold();

  const std::string address_;
  base::ThreadPool* const relay_;
  grpc::ClientContext context_;
  worker::v1::StreamsResponse in_;  // the read in flight
  std::shared_ptr<DecodeStreams> self_;  // until OnDone
  absl::Notification done_;

  mutable absl::Mutex mu_;
  std::map<uint64_t, std::shared_ptr<DecodeStream>> streams_ ABSL_GUARDED_BY(mu_);  // open
  uint64_t next_tag_ ABSL_GUARDED_BY(mu_) = 0;
  worker::v1::StreamsRequest next_ ABSL_GUARDED_BY(mu_);  // opens and cancels to send
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ending_ ABSL_GUARDED_BY(mu_) = false;  // no write will be started from here on
  bool hold_removed_ ABSL_GUARDED_BY(mu_) = false;
  bool close_when_idle_ ABSL_GUARDED_BY(mu_) = false;
  // The message being written; owned by the thread that set writing_.
  worker::v1::StreamsRequest out_;
};

}  // namespace preft::router
