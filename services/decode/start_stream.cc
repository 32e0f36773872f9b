#include "services/decode/start_stream.h"

#include <utility>

#include "common/log/log.h"
#include "common/rpc/status.h"
#include "services/wire/convert.h"

namespace preft::decode {

// A stream's own gRPC call: its sink, and the reactions it forwards; it keeps the stream alive
// until OnDone.
class StartStream::Reactor final : public grpc::ServerWriteReactor<v1::GenerateResponse>,
                                   public StreamSink {
 public:
  explicit Reactor(std::shared_ptr<StartStream> stream) : stream_(std::move(stream)) {}

  void Write(StartStream*, const v1::GenerateResponse& msg) override { StartWrite(&msg); }
  void Finish(StartStream*, const v1::GenerateResponse* last,
              const absl::Status& status) override {
    if (last != nullptr) {
      StartWriteAndFinish(last, grpc::WriteOptions(), rpc::ToGrpcStatus(status));
    } else {
      grpc::ServerWriteReactor<v1::GenerateResponse>::Finish(rpc::ToGrpcStatus(status));
    }
  }

  void OnWriteDone(bool ok) override { stream_->WriteDone(ok); }
  void OnCancel() override { stream_->Cancel(); }
  void OnDone() override {
    stream_->Done();
    delete this;
  }

 private:
  const std::shared_ptr<StartStream> stream_;
};

std::shared_ptr<StartStream> StartStream::Create(StreamFinishInfo info, Hooks hooks) {
  std::shared_ptr<StartStream> stream(new StartStream(std::move(info), std::move(hooks)));
  auto* reactor = new Reactor(stream);
  stream->reactor_ = reactor;
  stream->sink_ = reactor;
  return stream;
}

std::shared_ptr<StartStream> StartStream::Create(StreamFinishInfo info, Hooks hooks,
                                                 StreamSink* sink) {
  std::shared_ptr<StartStream> stream(new StartStream(std::move(info), std::move(hooks)));
  stream->sink_ = sink;
  return stream;
}

StartStream::StartStream(StreamFinishInfo info, Hooks hooks)
    : hooks_(std::move(hooks)), info_(std::move(info)) {
  out_.set_request_id(info_.request_id);
}

StartStream::~StartStream() = default;

void StartStream::OnEvent(const engine::TokenEvent& event) {
  {
    absl::MutexLock lock(&mu_);
    if (finishing_ || failure_) return;
    Event e;
    e.token_id = event.token_id;
    e.text = event.text_delta;
    if (event.logprob != nullptr) e.logprob = *event.logprob;
    e.finish = event.finish;
    e.status = event.status;
    e.cached_prompt_tokens = event.cached_prompt_tokens;
    pending_.push_back(std::move(e));
  }
  Pump();
}

void StartStream::Fail(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    if (finishing_ || failure_) return;
    failure_ = status;
  }
  Pump();
}

void StartStream::ResolveAdapterPositions(v1::AdapterPositions positions) {
  absl::MutexLock lock(&mu_);
  info_.adapter_positions = positions;
}

void StartStream::WriteDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    write_in_flight_ = false;
    if (finishing_) return;  // the final write's completion, if reported at all
  }
  if (!ok) Cancel();  // the client is gone: the write could not be delivered
  Pump();
}

void StartStream::Cancel() {
  bool report = false;
  {
    absl::MutexLock lock(&mu_);
    // After the stream has ended on its own there is nothing left to cancel.
    report = !finishing_ && !cancel_reported_;
    cancel_reported_ = true;
    cancelled_ = true;
  }
  if (report && hooks_.on_cancel) hooks_.on_cancel(this);
  Pump();
}

void StartStream::Done() {
  if (hooks_.on_done) hooks_.on_done(this);
}

void StartStream::Pump() {
  // A sink may report inline (a Streams call that is gone drops the message and calls Done,
  // whose hook lets the service forget the stream): stay alive until this returns.
  const std::shared_ptr<StartStream> self = shared_from_this();
  enum class Action { kNone, kWrite, kWriteAndFinish, kFinish };
  Action action = Action::kNone;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (finishing_ || write_in_flight_) return;
    if (cancelled_) {
      action = Action::kFinish;
      status = absl::CancelledError("the Start call was cancelled");
    } else if (failure_) {
      action = Action::kFinish;
      status = *failure_;
    } else {
      out_.clear_token_ids();
      out_.clear_text();
      out_.clear_logprobs();
      out_.clear_finish();
      bool last = false;
      while (!pending_.empty() && !last && action == Action::kNone) {
        Event& e = pending_.front();
        if (e.token_id < 0 && e.finish != engine::FinishReason::kNone) {
          // The request ended without a token (error or abort): tokens queued before it go
          // out first.
          if (out_.token_ids_size() > 0) break;
          action = Action::kFinish;
          if (e.finish == engine::FinishReason::kAbort) {
            status = absl::CancelledError("request '" + info_.request_id + "' was aborted");
          } else if (e.status.ok()) {
            status = absl::InternalError("request '" + info_.request_id +
                                         "' failed without a status");
          } else {
            status = e.status;
          }
          pending_.pop_front();
          break;
        }
        if (e.token_id >= 0) {
          out_.add_token_ids(e.token_id);
          ++completion_tokens_;
          if (e.logprob) *out_.add_logprobs() = wire::ToProto(*e.logprob);
        }
        out_.mutable_text()->append(e.text);
        if (e.finish != engine::FinishReason::kNone) {
          last = true;
          v1::Finish* f = out_.mutable_finish();
          f->set_reason(wire::ToProto(e.finish));
          f->mutable_usage()->set_prompt_tokens(info_.prompt_tokens);
          f->mutable_usage()->set_completion_tokens(completion_tokens_);
          f->mutable_usage()->set_cached_tokens(
              std::max<int32_t>(info_.cached_tokens, static_cast<int32_t>(e.cached_prompt_tokens)));
          f->set_adapter(info_.adapter);
          f->set_adapter_version(info_.adapter_version);
          f->set_adapter_positions(info_.adapter_positions);
        }
        pending_.pop_front();
      }
      if (action == Action::kNone) {
        if (last) {
          action = Action::kWriteAndFinish;
        } else if (out_.token_ids_size() > 0 || !out_.text().empty()) {
          action = Action::kWrite;
        }
      }
    }
    if (action == Action::kWrite) write_in_flight_ = true;
    if (action == Action::kWriteAndFinish || action == Action::kFinish) finishing_ = true;
  }
  // The flags set above give this thread the sink alone: Done cannot run before Finish.
  switch (action) {
    case Action::kNone:
      break;
    case Action::kWrite:
      sink_->Write(this, out_);
      break;
    case Action::kWriteAndFinish:
      log::Debug(log::Request{info_.request_id}, "stream finished: {} tokens", completion_tokens_);
      sink_->Finish(this, &out_, absl::OkStatus());
      break;
    case Action::kFinish:
      log::Debug(log::Request{info_.request_id}, "stream ended: {} after {} tokens", status,
                 completion_tokens_);
      sink_->Finish(this, nullptr, status);
      break;
  }
}

}  // namespace preft::decode
