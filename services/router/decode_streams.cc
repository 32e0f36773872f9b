#include "services/router/decode_streams.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log/log.h"
#include "common/rpc/status.h"

namespace preft::router {

std::shared_ptr<DecodeStream> DecodeStream::Failed(absl::Status status) {
  auto s = std::make_shared<DecodeStream>(nullptr, 0);
  absl::MutexLock lock(&s->mu_);
  s->ended_ = true;
  s->status_ = std::move(status);
  return s;
}

absl::Status DecodeStream::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

bool DecodeStream::Ready() {
  absl::MutexLock lock(&mu_);
  return has_pending_ || ended_;
}

bool DecodeStream::Suspend(std::coroutine_handle<> h) {
  absl::MutexLock lock(&mu_);
  if (has_pending_ || ended_) return false;  // arrived since Ready: go on
  reader_ = h;
  return true;
}

bool DecodeStream::Take(v1::GenerateResponse* msg) {
  absl::MutexLock lock(&mu_);
  if (!has_pending_) return false;  // ended, and everything was read
  msg->Clear();
  msg->Swap(&pending_);
  has_pending_ = false;
  return true;
}

std::coroutine_handle<> DecodeStream::Deliver(worker::v1::StreamFrame* frame, bool* first) {
  absl::MutexLock lock(&mu_);
  if (ended_) return {};  // cancelled here; the worker's end crossed our cancel
  *first = !delivered_;
  delivered_ = true;
  if (frame->has_response()) {
    v1::GenerateResponse* r = frame->mutable_response();
    if (!has_pending_) {
      pending_.Swap(r);
      has_pending_ = true;
    } else {
      pending_.mutable_token_ids()->MergeFrom(r->token_ids());
      pending_.mutable_text()->append(r->text());
      pending_.mutable_logprobs()->MergeFrom(r->logprobs());
      if (r->has_finish()) pending_.mutable_finish()->Swap(r->mutable_finish());
    }
  }
  if (frame->end()) {
    ended_ = true;
    status_ = absl::Status(static_cast<absl::StatusCode>(frame->code()), frame->message());
  }
  return std::exchange(reader_, {});
}

std::coroutine_handle<> DecodeStream::End(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  if (ended_) return {};
  ended_ = true;
  status_ = status;
  return std::exchange(reader_, {});
}

void DecodeStream::Cancel() {
  std::coroutine_handle<> reader;
  {
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    ended_ = true;
    status_ = absl::CancelledError("cancelled");
    reader = std::exchange(reader_, {});
  }
  if (call_ != nullptr) call_->SendCancel(tag_);
  if (reader) reader.resume();
}

std::shared_ptr<DecodeStreams> DecodeStreams::Open(worker::v1::DecodeWorker::Stub* stub,
                                                   std::string address,
                                                   base::ThreadPool* relay) {
  auto call = std::make_shared<DecodeStreams>(std::move(address), relay);
  call->self_ = call;
  stub->async()->Streams(&call->context_, call.get());
  // Writes start from outside reactions (a request opening a stream), so gRPC must not end the
  // call between them: the hold lasts until no write will be started (MaybeRemoveHold).
  call->AddHold();
  call->StartRead(&call->in_);
  call->StartCall();
  return call;
}

std::shared_ptr<DecodeStream> DecodeStreams::Start(worker::v1::StreamOpen* open) {
  std::shared_ptr<DecodeStream> stream;
  {
    absl::MutexLock lock(&mu_);
    if (ending_) return nullptr;
    const uint64_t tag = ++next_tag_;
    open->set_tag(tag);
    stream = std::make_shared<DecodeStream>(shared_from_this(), tag);
    streams_.emplace(tag, stream);
    next_.add_open()->Swap(open);
  }
  Flush();
  return stream;
}

void DecodeStreams::SendCancel(uint64_t tag) {
  bool close = false;
  {
    absl::MutexLock lock(&mu_);
    if (streams_.erase(tag) == 0 || ending_) return;  // ended, or nothing can be sent
    next_.add_cancel(tag);
    close = IdleCloseDueLocked();
  }
  if (close) {
    Cancel();  // the cancel need not reach the worker: the call's end cancels its streams
  } else {
    Flush();
  }
}

bool DecodeStreams::IdleCloseDueLocked() {
  if (!close_when_idle_ || !streams_.empty() || ending_) return false;
  ending_ = true;
  return true;
}

void DecodeStreams::Flush() {
  {
    absl::MutexLock lock(&mu_);
    if (writing_ || ending_ || (next_.open_size() == 0 && next_.cancel_size() == 0)) return;
    writing_ = true;
    // A fresh message, not a cleared one: Clear keeps every StreamOpen of the largest batch
    // (a burst of thousands) with its prompt, for as long as the call lives.
    worker::v1::StreamsRequest fresh;
    fresh.Swap(&next_);
    out_.Swap(&fresh);
  }
  StartWrite(&out_);
}

void DecodeStreams::OnWriteDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) ending_ = true;  // the call is broken; OnDone ends its streams
  }
  Flush();
  MaybeRemoveHold();
}

void DecodeStreams::OnReadDone(bool ok) {
  if (!ok) {
    {
      absl::MutexLock lock(&mu_);
      ending_ = true;
    }
    MaybeRemoveHold();
    return;
  }
  // Delivered before the next read, so a stream's frames keep their order; resumed after it,
  // so the worker's next message is on its way while the readers run.
  std::vector<std::shared_ptr<DecodeStream>> to;
  bool close = false;
  {
    absl::MutexLock lock(&mu_);
    to.reserve(in_.frames_size());
    for (const worker::v1::StreamFrame& f : in_.frames()) {
      auto it = streams_.find(f.tag());
      if (it == streams_.end()) {
        to.push_back(nullptr);  // cancelled here
        continue;
      }
      to.push_back(it->second);
      if (f.end()) streams_.erase(it);
    }
    close = IdleCloseDueLocked();
  }
  // Streams hearing their first message are relayed here, the rest on the relay threads, which
  // run below this one in priority: a batch holds up to a step's worth of streams (256 on a busy
  // worker), and on a saturated router relaying the others first would add their relay time,
  // and every other worker's batch queued with it, to the new ones' time to first token.
  std::vector<std::coroutine_handle<>> firsts, rest;
  for (int i = 0; i < in_.frames_size(); ++i) {
    if (to[i] == nullptr) continue;
    bool first = false;
    std::coroutine_handle<> r = to[i]->Deliver(in_.mutable_frames(i), &first);
    if (!r) continue;
    (first || relay_ == nullptr ? firsts : rest).push_back(r);
  }
  in_.Clear();
  if (close) {
    context_.TryCancel();
    MaybeRemoveHold();
  }
  StartRead(&in_);
  if (!rest.empty()) {
    relay_->Post([rest = std::move(rest)] {
      for (std::coroutine_handle<> r : rest) r.resume();
    });
  }
  for (std::coroutine_handle<> r : firsts) r.resume();
}

void DecodeStreams::OnDone(const grpc::Status& status) {
  std::map<uint64_t, std::shared_ptr<DecodeStream>> open;
  {
    absl::MutexLock lock(&mu_);
    ending_ = true;
    open.swap(streams_);
  }
  // Whatever ended the call (the worker gone, its drain, our Shutdown), the streams on it did
  // not finish: UNAVAILABLE, which the router retries where the client has seen nothing yet.
  const absl::Status end = absl::UnavailableError(absl::StrCat(
      "the Streams call to decode worker ", address_, " ended: ",
      status.ok() ? std::string("OK") : rpc::FromGrpcStatus(status).ToString()));
  if (!open.empty()) log::Warn("{} with {} streams open", end, open.size());
  std::vector<std::coroutine_handle<>> readers;
  for (auto& [tag, stream] : open) {
    if (std::coroutine_handle<> r = stream->End(end)) readers.push_back(r);
  }
  for (std::coroutine_handle<> r : readers) r.resume();
  done_.Notify();
  std::shared_ptr<DecodeStreams> self = std::move(self_);  // may be the last reference
}

void DecodeStreams::MaybeRemoveHold() {
  {
    absl::MutexLock lock(&mu_);
    if (!ending_ || writing_ || hold_removed_) return;
    hold_removed_ = true;
  }
  RemoveHold();
}

bool DecodeStreams::CloseWhenIdle() {
  {
    absl::MutexLock lock(&mu_);
    if (ending_) return true;
    close_when_idle_ = true;
    if (!IdleCloseDueLocked()) return false;
  }
  context_.TryCancel();
  MaybeRemoveHold();
  return true;
}

void DecodeStreams::Cancel() {
  {
    absl::MutexLock lock(&mu_);
    ending_ = true;
  }
  context_.TryCancel();
  MaybeRemoveHold();
}

void DecodeStreams::Shutdown() {
  Cancel();
  done_.WaitForNotification();
}

bool DecodeStreams::ending() const {
  absl::MutexLock lock(&mu_);
  return ending_;
}

size_t DecodeStreams::open_streams() const {
  absl::MutexLock lock(&mu_);
  return streams_.size();
}

}  // namespace preft::router
