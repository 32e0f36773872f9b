#include "services/decode/streams_call.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log/log.h"
#include "common/rpc/status.h"
#include "services/decode/decode_impl.h"

namespace preft::decode {

StreamsCall::StreamsCall(DecodeService::Impl* impl) : impl_(impl) { StartRead(&in_); }

void StreamsCall::OnReadDone(bool ok) {
  if (ok && Apply(in_)) {
    StartRead(&in_);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    ending_ = true;  // the router half-closed or went away, or broke the protocol
  }
  CancelAll();
  Pump();
}

bool StreamsCall::Apply(const worker::v1::StreamsRequest& request) {
  for (const worker::v1::StreamOpen& open : request.open()) {
    std::shared_ptr<StartStream> stream;
    {
      absl::MutexLock lock(&mu_);
      if (by_tag_.count(open.tag()) > 0) {
        end_status_ = absl::InvalidArgumentError(
            absl::StrCat("tag ", open.tag(), " is opened while a stream with it is open"));
        return false;
      }
    }
    switch (open.call_case()) {
      case worker::v1::StreamOpen::kStart:
        stream = impl_->OpenStream(FinishInfoOf(open.start()), this);
        break;
      case worker::v1::StreamOpen::kRun:
        stream = impl_->OpenStream(FinishInfoOf(open.run()), this);
        break;
      default: {
        absl::MutexLock lock(&mu_);
        end_status_ = absl::InvalidArgumentError(
            absl::StrCat("stream ", open.tag(), " opens neither a start nor a run"));
        return false;
      }
    }
    bool ending = false;
    {
      // Known before its first event, which Begin* may cause.
      absl::MutexLock lock(&mu_);
      by_tag_[open.tag()] = stream;
      tag_of_[stream.get()] = open.tag();
      ending = ending_;  // cancelled while this read was being applied
    }
    const absl::Status s = open.has_start() ? impl_->BeginStart(stream, open.start())
                                            : impl_->BeginRun(stream, open.run());
    if (!s.ok()) stream->Fail(s);
    if (ending) stream->Cancel();
  }
  for (uint64_t tag : request.cancel()) {
    std::shared_ptr<StartStream> stream;
    {
      absl::MutexLock lock(&mu_);
      auto it = by_tag_.find(tag);
      if (it == by_tag_.end()) continue;  // ended already
      stream = it->second;
    }
    stream->Cancel();
  }
  return true;
}

void StreamsCall::OnWriteDone(bool ok) {
  std::vector<Sent> sent;
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    sent.swap(out_sent_);
    if (!ok) broken_ = true;
  }
  for (Sent& s : sent) {
    if (s.end) {
      s.stream->Done();
    } else {
      s.stream->WriteDone(ok);  // may queue its next frame
    }
  }
  if (!ok) CancelAll();
  Pump();
}

void StreamsCall::OnCancel() {
  {
    absl::MutexLock lock(&mu_);
    ending_ = true;
    broken_ = true;
  }
  CancelAll();
  Pump();
}

void StreamsCall::OnDone() { delete this; }

void StreamsCall::Write(StartStream* stream, const v1::GenerateResponse& msg) {
  worker::v1::StreamFrame frame;
  *frame.mutable_response() = msg;
  frame.mutable_response()->clear_request_id();  // the router knows its tags
  Queue(stream, std::move(frame), /*end=*/false);
  Pump();
}

void StreamsCall::Finish(StartStream* stream, const v1::GenerateResponse* last,
                         const absl::Status& status) {
  worker::v1::StreamFrame frame;
  if (last != nullptr) {
    *frame.mutable_response() = *last;
    frame.mutable_response()->clear_request_id();
  }
  frame.set_end(true);
  frame.set_code(static_cast<int32_t>(status.code()));
  frame.set_message(std::string(status.message()));
  Queue(stream, std::move(frame), /*end=*/true);
  Pump();
}

void StreamsCall::Queue(StartStream* stream, worker::v1::StreamFrame frame, bool end) {
  absl::MutexLock lock(&mu_);
  auto it = tag_of_.find(stream);
  if (it == tag_of_.end()) return;  // not ours: never happens (a stream has one sink)
  frame.set_tag(it->second);
  Sent sent{by_tag_[it->second], end};
  if (end) {
    by_tag_.erase(it->second);  // a cancel for it from here on is for an ended stream
    tag_of_.erase(it);
  }
  *next_.add_frames() = std::move(frame);
  next_sent_.push_back(std::move(sent));
}

void StreamsCall::CancelAll() {
  std::vector<std::shared_ptr<StartStream>> open;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [tag, stream] : by_tag_) open.push_back(stream);
  }
  for (const auto& stream : open) stream->Cancel();
}

void StreamsCall::Pump() {
  for (;;) {
    std::vector<Sent> dropped;
    absl::Status finish_with;
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      if (writing_ || finished_) return;
      if (!next_sent_.empty() && !broken_) {
        writing_ = true;
        out_.Swap(&next_);
        next_.Clear();
        out_sent_.swap(next_sent_);
        next_sent_.clear();
      } else if (!next_sent_.empty()) {
        dropped.swap(next_sent_);  // nobody to deliver them to
        next_.Clear();
      } else if (ending_ && by_tag_.empty()) {
        finished_ = finish = true;
        finish_with = end_status_;
      } else {
        return;
      }
    }
    if (finish) {
      if (!finish_with.ok()) log::Warn("Streams call ended: {}", finish_with);
      grpc::ServerBidiReactor<worker::v1::StreamsRequest, worker::v1::StreamsResponse>::Finish(
          rpc::ToGrpcStatus(finish_with));
      return;
    }
    if (dropped.empty()) {
      StartWrite(&out_);
      return;
    }
    for (Sent& s : dropped) {
      if (s.end) {
        s.stream->Done();
      } else {
        s.stream->WriteDone(false);  // cancels it; its end comes back here, and is dropped
      }
    }
  }
}

}  // namespace preft::decode
