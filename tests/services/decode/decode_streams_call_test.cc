// DecodeWorker.Streams: many Start and Run streams over one call, each behaving as its own call
// would (tokens, codes, cancellation), and the call's end cancelling what is still open.

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tests/services/decode/decode_test_fixture.h"

namespace preft::decode {
namespace {

using worker::v1::StreamFrame;
using worker::v1::StreamsRequest;
using worker::v1::StreamsResponse;

// One Streams call from the test, read synchronously: every stream's messages and end by tag.
class StreamsClient {
 public:
  explicit StreamsClient(worker::v1::DecodeWorker::Stub* stub) {
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    call_ = stub->Streams(&ctx_);
  }

  bool Send(const StreamsRequest& req) { return call_->Write(req); }
  bool OpenRun(uint64_t tag, const worker::v1::RunRequest& run) {
    results_.erase(tag);  // a tag used again names a new stream
    StreamsRequest req;
    auto* open = req.add_open();
    open->set_tag(tag);
    *open->mutable_run() = run;
    return Send(req);
  }
  bool Cancel(uint64_t tag) {
    StreamsRequest req;
    req.add_cancel(tag);
    return Send(req);
  }
  void CancelCall() { ctx_.TryCancel(); }

  // Reads until every tag in `tags` has ended (or the call has); false if the call ended first.
  bool ReadUntilEnded(const std::vector<uint64_t>& tags) {
    auto all_ended = [&] {
      for (uint64_t t : tags)
        if (!results_[t].ended) return false;
      return true;
    };
    StreamsResponse msg;
    while (!all_ended()) {
      if (!call_->Read(&msg)) return false;
      for (const StreamFrame& f : msg.frames()) Apply(f);
    }
    return true;
  }
  // Reads until `tag` has at least one message.
  bool ReadUntilFirst(uint64_t tag) {
    StreamsResponse msg;
    while (results_[tag].result.messages.empty()) {
      if (!call_->Read(&msg)) return false;
      for (const StreamFrame& f : msg.frames()) Apply(f);
    }
    return true;
  }
  // Half-closes and reads to the call's end.
  grpc::Status Close() {
    call_->WritesDone();
    return ReadToEnd();
  }
  grpc::Status ReadToEnd() {
    StreamsResponse msg;
    while (call_->Read(&msg)) {
      for (const StreamFrame& f : msg.frames()) Apply(f);
    }
    return call_->Finish();
  }

  struct Tagged {
    StreamResult result;
    bool ended = false;
  };
  const Tagged& at(uint64_t tag) { return results_[tag]; }

 private:
  void Apply(const StreamFrame& f) {
    Tagged& t = results_[f.tag()];
    ASSERT_FALSE(t.ended) << "a frame for tag " << f.tag() << " after its end";
    if (f.has_response()) {
      const v1::GenerateResponse& m = f.response();
      t.result.messages.push_back(m);
      t.result.tokens.insert(t.result.tokens.end(), m.token_ids().begin(), m.token_ids().end());
      t.result.text += m.text();
      t.result.logprobs.insert(t.result.logprobs.end(), m.logprobs().begin(), m.logprobs().end());
    }
    if (f.end()) {
      t.ended = true;
      t.result.status = grpc::Status(static_cast<grpc::StatusCode>(f.code()), f.message());
    }
  }

  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<StreamsRequest, StreamsResponse>> call_;
  std::map<uint64_t, Tagged> results_;
};

TEST_F(ColocatedDecodeTest, RunsOverOneCallEqualOneEngineAndABadOneFailsAlone) {
  struct Case {
    uint64_t tag;
    engine::Request request;
    engine::GenerationResult ref;
  };
  std::vector<Case> cases;
  cases.push_back({3, MakeRequest("greedy", 33, 14, 0.f, 21), {}});
  cases.push_back({9, MakeRequest("seeded", 20, 11, 0.8f, 5), {}});
  cases.push_back({4, MakeRequest("short", 12, 1, 0.f, 2), {}});
  for (Case& c : cases) c.ref = Reference(c.request);
  worker::v1::RunRequest bad = MakeRun(MakeRequest("bad", 5, 3, 0.f, 1));
  bad.clear_prompt_ids();

  StreamsClient client(stub_.get());
  StreamsRequest req;  // every open in one message, the bad one among them
  for (const Case& c : cases) {
    auto* open = req.add_open();
    open->set_tag(c.tag);
    *open->mutable_run() = MakeRun(c.request);
    if (c.tag == 9) {
      auto* b = req.add_open();
      b->set_tag(7);
      *b->mutable_run() = bad;
    }
  }
  ASSERT_TRUE(client.Send(req));
  ASSERT_TRUE(client.ReadUntilEnded({3, 4, 7, 9}));
  EXPECT_EQ(client.at(7).result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(client.at(7).result.status.error_message(), HasSubstr("prompt_ids is empty"));
  EXPECT_TRUE(client.at(7).result.messages.empty());
  for (const Case& c : cases) {
    SCOPED_TRACE(c.request.id);
    const StreamResult& got = client.at(c.tag).result;
    ExpectSameTokens(got, c.ref);
    ASSERT_FALSE(got.messages.empty());
    for (size_t i = 0; i + 1 < got.messages.size(); ++i) EXPECT_FALSE(got.messages[i].has_finish());
    const v1::Finish& f = got.messages.back().finish();
    EXPECT_EQ(f.reason(), v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(f.usage().prompt_tokens(), static_cast<int>(c.request.prompt_ids.size()));
    EXPECT_EQ(f.usage().completion_tokens(), c.request.sampling.max_tokens);
  }
  // A tag may be used again once its stream has ended.
  const engine::Request again = MakeRequest("again", 9, 4, 0.f, 8);
  ASSERT_TRUE(client.OpenRun(3, MakeRun(again)));
  ASSERT_TRUE(client.ReadUntilEnded({3}));
  EXPECT_TRUE(client.at(3).result.status.ok());
  EXPECT_EQ(client.at(3).result.tokens.size(), 4u);
  // Cancelling a tag that has ended is ignored; a half-close with nothing open ends the call OK.
  ASSERT_TRUE(client.Cancel(4));
  EXPECT_TRUE(client.Close().ok());
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(WaitNoStreams());
}

TEST_F(ColocatedDecodeTest, CancellingATagEndsOnlyThatStreamAndFreesItsBlocks) {
  StreamsClient client(stub_.get());
  ASSERT_TRUE(client.OpenRun(1, MakeRun(MakeRequest("long1", 40, 1500, 0.f, 2))));
  ASSERT_TRUE(client.OpenRun(2, MakeRun(MakeRequest("long2", 30, 1500, 0.f, 3))));
  ASSERT_TRUE(client.ReadUntilFirst(1));
  ASSERT_TRUE(client.ReadUntilFirst(2));
  EXPECT_TRUE(WaitForCounts([](const DecodeService::BlockCounts& c) { return c.sequences == 2; }));
  ASSERT_TRUE(client.Cancel(1));
  ASSERT_TRUE(client.ReadUntilEnded({1}));
  EXPECT_EQ(client.at(1).result.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(client.at(1).result.tokens.size(), 1500u);
  EXPECT_TRUE(WaitForCounts([](const DecodeService::BlockCounts& c) { return c.sequences == 1; }));
  EXPECT_FALSE(client.at(2).ended);
  EXPECT_EQ(service_->active_streams(), 1);
  // The call's end (the router gone) cancels the stream still open on it.
  client.CancelCall();
  EXPECT_FALSE(client.ReadToEnd().ok());
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(WaitNoStreams());
}

TEST_F(ColocatedDecodeTest, AHalfCloseCancelsOpenStreamsAndATagOpenedTwiceEndsTheCall) {
  {
    StreamsClient client(stub_.get());
    ASSERT_TRUE(client.OpenRun(5, MakeRun(MakeRequest("long", 40, 1500, 0.f, 2))));
    ASSERT_TRUE(client.ReadUntilFirst(5));
    EXPECT_TRUE(client.Close().ok());
    EXPECT_TRUE(client.at(5).ended);
    EXPECT_EQ(client.at(5).result.status.error_code(), grpc::StatusCode::CANCELLED);
    EXPECT_TRUE(WaitAllFree());
    EXPECT_TRUE(WaitNoStreams());
  }
  StreamsClient client(stub_.get());
  ASSERT_TRUE(client.OpenRun(7, MakeRun(MakeRequest("first", 40, 1500, 0.f, 2))));
  ASSERT_TRUE(client.ReadUntilFirst(7));
  client.OpenRun(7, MakeRun(MakeRequest("second", 10, 5, 0.f, 3)));
  const grpc::Status end = client.ReadToEnd();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(end.error_message(), HasSubstr("tag 7 is opened while a stream with it is open"));
  EXPECT_EQ(client.at(7).result.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(WaitNoStreams());
}

// The disaggregated path: a Start over the call continues the transported prompt like one
// engine; a Start for an unknown reservation fails alone with Start's code.
TEST_F(DecodeServiceTest, StartsOverAStreamsCallDecodeLikeOneEngine) {
  const engine::Request r = MakeRequest("start", 37, 12, 0.f, 3);
  const engine::GenerationResult ref = Reference(r);
  ReserveResponse res;
  const StartRequest start = PrefilledStart(r, &res);

  StreamsClient client(stub_.get());
  StreamsRequest req;
  auto* open = req.add_open();
  open->set_tag(1);
  *open->mutable_start() = start;
  auto* unknown = req.add_open();
  unknown->set_tag(2);
  *unknown->mutable_start() = start;
  unknown->mutable_start()->set_reservation_id(res.reservation_id() + 1000);
  auto* empty = req.add_open();
  empty->set_tag(3);  // neither a start nor a run
  ASSERT_TRUE(client.Send(req));
  const grpc::Status end = client.ReadToEnd();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(end.error_message(), HasSubstr("stream 3 opens neither a start nor a run"));
  EXPECT_EQ(client.at(2).result.status.error_code(), grpc::StatusCode::NOT_FOUND);
  // Tag 1 ran to its end or was cancelled by the call's end: either way nothing leaks.
  if (client.at(1).result.status.ok()) ExpectSameAsReference(client.at(1).result, ref);
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(WaitNoStreams());

  // The same Start alone on a call of its own, to its end.
  ReserveResponse res2;
  StreamsClient second(stub_.get());
  StreamsRequest one;
  auto* o = one.add_open();
  o->set_tag(1);
  *o->mutable_start() = PrefilledStart(r, &res2);
  ASSERT_TRUE(second.Send(one));
  ASSERT_TRUE(second.ReadUntilEnded({1}));
  ExpectSameAsReference(second.at(1).result, ref);
  EXPECT_EQ(second.at(1).result.messages.back().finish().usage().completion_tokens(), 12);
  EXPECT_TRUE(second.Close().ok());
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(WaitNoStreams());
}

}  // namespace
}  // namespace preft::decode
