#pragma once

// One DecodeWorker.Streams call: many Start and Run streams, opened and cancelled by the
// router's tags, over one gRPC call (a router keeps one per decode worker). Each stream is a
// StartStream like a Start or Run call's own, with this call as its sink: the frames of every
// stream that has something to say while a write is in flight go out together in the next
// message, so the engine's step of 256 sequences costs one write, not 256. The call's end
// (the router's half-close or cancellation, a broken connection, a failed write) cancels every
// stream still open on it; the call finishes once they have all ended.

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "proto/preft/v1/worker.grpc.pb.h"
#include "services/decode/decode_service.h"
#include "services/decode/start_stream.h"

namespace preft::decode {

// Owned by gRPC (deleted at OnDone). Lock order: the decode service's mu, then a stream's,
// then this call's mu_; nothing is called out with mu_ held.
class StreamsCall final
    : public grpc::ServerBidiReactor<worker::v1::StreamsRequest, worker::v1::StreamsResponse>,
      public StreamSink {
 public:
  explicit StreamsCall(DecodeService::Impl* impl);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

  void Write(StartStream* stream, const v1::GenerateResponse& msg) override;
  void Finish(StartStream* stream, const v1::GenerateResponse* last,
              const absl::Status& status) override;

 private:
  // A stream in a message being written, told when the write is done.
  struct Sent {
    std::shared_ptr<StartStream> stream;
    bool end = false;  // its last frame: Done, not WriteDone
  };

  // Opens the request's streams and cancels its tags; false on a protocol error.
  bool Apply(const worker::v1::StreamsRequest& request);
  // Cancels every stream still open (the call is ending).
  void CancelAll();
  // Starts the next write, drops queued frames once the call is broken, or finishes the call
  // when it is ending and no stream is left.
  void Pump();
  // Appends a frame for `stream` to the next message.
  void Queue(StartStream* stream, worker::v1::StreamFrame frame, bool end);

  DecodeService::Impl* const impl_;
  worker::v1::StreamsRequest in_;  // the read in flight

  absl::Mutex mu_;
  std::map<uint64_t, std::shared_ptr<StartStream>> by_tag_ ABSL_GUARDED_BY(mu_);  // open
  std::map<StartStream*, uint64_t> tag_of_ ABSL_GUARDED_BY(mu_);                  // open
  worker::v1::StreamsResponse next_ ABSL_GUARDED_BY(mu_);
  std::vector<Sent> next_sent_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ending_ ABSL_GUARDED_BY(mu_) = false;    // no more reads: finish once streams are gone
  bool broken_ ABSL_GUARDED_BY(mu_) = false;    // writes cannot be delivered
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // Finish called
  absl::Status end_status_ ABSL_GUARDED_BY(mu_);
  // The message being written and who is in it; owned by the thread that set writing_.
  worker::v1::StreamsResponse out_;
  std::vector<Sent> out_sent_;
};

}  // namespace preft::decode
