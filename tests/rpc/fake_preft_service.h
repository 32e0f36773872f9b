#pragma once

// A fake preft.v1.Preft for the rpc tests: Generate streams two responses (two tokens, then
// the finish message), or, for request id "hang", one response and then nothing until the
// call is cancelled (to test that Server::Shutdown cancels streams that never end).

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "proto/preft/v1/preft.grpc.pb.h"

namespace preft::rpc::fakes {

class TwoResponseReactor final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  explicit TwoResponseReactor(const v1::GenerateRequest& request) {
    first_.set_request_id(request.request_id());
    first_.add_token_ids(11);
    first_.add_token_ids(12);
    first_.set_text("he");
    second_.set_request_id(request.request_id());
    second_.add_token_ids(13);
    second_.set_text("llo");
    v1::Finish* finish = second_.mutable_finish();
    finish->set_reason(v1::FINISH_REASON_STOP);
    finish->mutable_usage()->set_prompt_tokens(
        request.has_token_ids() ? request.token_ids().ids_size() : 0);
    finish->mutable_usage()->set_completion_tokens(3);
    finish->set_adapter(request.model());
    finish->set_adapter_version(request.model().empty() ? 0 : 7);
    StartWrite(&first_);
  }

  void OnWriteDone(bool ok) override {
    if (writes_++ != 0) return;  // the final write's completion, if reported at all
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
      return;
    }
    StartWriteAndFinish(&second_, grpc::WriteOptions(), grpc::Status::OK);
  }
  void OnDone() override { delete this; }

 private:
  v1::GenerateResponse first_;
  v1::GenerateResponse second_;
  int writes_ = 0;  // reactor callbacks are serialised for one call
};

class HangingReactor final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  HangingReactor() {
    first_.set_request_id("hang");
    StartWrite(&first_);
  }

  // Finishes exactly once, after the write is done and the call is cancelled (in either
  // order). Finish is called outside the lock: OnDone may delete the reactor at once.
  void OnWriteDone(bool ok) override {
    if (Set(&write_done_)) Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  }
  void OnCancel() override {
    if (Set(&cancelled_)) Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  }
  void OnDone() override { delete this; }

 private:
  // Sets the flag; true for the caller that completes the pair.
  bool Set(bool* flag) {
    absl::MutexLock lock(&mu_);
    *flag = true;
    return write_done_ && cancelled_;
  }

  v1::GenerateResponse first_;
  absl::Mutex mu_;
  bool write_done_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

class FakePreftService final : public v1::Preft::CallbackService {
 public:
  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override {
    if (request->request_id() == "hang") return new HangingReactor();
    return new TwoResponseReactor(*request);
  }
};

}  // namespace preft::rpc::fakes
