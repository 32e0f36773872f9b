// Decode Start streams on transported KV: outputs, DONE ordering, cancellation, bad Starts.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/engine/engine.h"
#include "common/serving/worker_setup.h"
#include "common/transport/inproc_transport.h"
#include "tests/services/decode/decode_test_fixture.h"
#include "tests/testing/cacheless_backend.h"
#include "tests/testing/fixtures.h"

namespace preft::decode {
namespace {

// A worker whose cache only a device-memory transport could reach (a GPU with no host mirror)
// is refused with a host-memory transport, with what to do instead; colocated it needs none.
TEST_F(DecodeServiceTest, RefusesACachelessEngineWithAHostMemoryTransport) {
  auto make = [] {
    engine::EngineOptions o;
    o.kv_blocks = 16;
    auto e = engine::Engine::Create(
        testing::CachelessBackend::Create(loaded_->model.get(), 16), nullptr, o);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(e).value();
  };
  std::unique_ptr<engine::Engine> engine = make();
  ASSERT_EQ(engine->cache(), nullptr);
  const transport::KvLayout layout = serving::LayoutFor(*engine, loaded_->fingerprint);
  auto refused = DecodeService::Create(
      std::move(engine), std::make_unique<transport::InprocTransport>(), layout, {});
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("inproc transport cannot reach"));
  EXPECT_THAT(refused.status().message(), HasSubstr("--transport cuda_ipc"));
  DecodeServiceOptions colocated;
  colocated.colocated = true;
  colocated.quarantine = kQuarantine;
  auto ok = DecodeService::Create(make(), std::make_unique<transport::InprocTransport>(), layout,
                                  colocated);
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST_F(DecodeServiceTest, TransportedPromptDecodesLikeOneEngine) {
  struct Case {
    const char* id;
    int prompt;
    int max_tokens;
    float temperature;
    uint64_t seed;
  };
  for (const Case& c : {Case{"greedy", 37, 12, 0.f, 3}, Case{"seeded", 21, 9, 0.9f, 11},
                        Case{"one-token", 16, 1, 0.f, 5}}) {
    SCOPED_TRACE(c.id);
    const engine::Request r = MakeRequest(c.id, c.prompt, c.max_tokens, c.temperature, c.seed);
    const engine::GenerationResult ref = Reference(r);
    ReserveResponse res;
    ASSERT_TRUE(Reserve(c.prompt, c.max_tokens, &res).ok());
    EXPECT_EQ(res.generation(), 1u);
    EXPECT_EQ(res.block_tokens(), 16);
    EXPECT_EQ(res.block_ids_size(), (c.prompt + c.max_tokens + 15) / 16);
    EXPECT_EQ(res.lease_ms(), 10000);
    EXPECT_EQ(res.endpoint().transport(), "inproc");
    EXPECT_NE(res.endpoint().layout_hash(), 0u);
    EXPECT_EQ(service_->block_counts().reserved, res.block_ids_size());

    const engine::PrefilledPrompt p = Prefill(r);
    ASSERT_TRUE(Transfer(p, res.reservation_id(), 1, res.block_ids()).ok());
    ASSERT_TRUE(prefill_->ReleasePrefilled(p.request_id).ok());
    const StreamResult got = RunStart(MakeStart(r, p, res));
    ExpectSameAsReference(got, ref);
    ASSERT_FALSE(got.messages.empty());
    ASSERT_GT(got.messages[0].token_ids_size(), 0);
    EXPECT_EQ(got.messages[0].token_ids(0), p.first_token);
    for (size_t i = 0; i + 1 < got.messages.size(); ++i) EXPECT_FALSE(got.messages[i].has_finish());
    const v1::GenerateResponse& last = got.messages.back();
    EXPECT_EQ(last.request_id(), c.id);
    ASSERT_TRUE(last.has_finish());
    EXPECT_EQ(last.finish().reason(), v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(last.finish().usage().prompt_tokens(), c.prompt);
    EXPECT_EQ(last.finish().usage().completion_tokens(), c.max_tokens);
    EXPECT_EQ(last.finish().adapter(), "");
    EXPECT_EQ(last.finish().adapter_version(), 0);
    EXPECT_TRUE(WaitAllFree());
    EXPECT_TRUE(WaitNoStreams());
  }
  EXPECT_EQ(prefill_->allocator().num_free(), 64);
}

TEST_F(DecodeServiceTest, StartBeforeDoneWaitsForIt) {
  const engine::Request r = MakeRequest("early", 30, 8, 0.7f, 4);
  const engine::GenerationResult ref = Reference(r);
  ReserveResponse res;
  ASSERT_TRUE(Reserve(30, 8, &res).ok());
  const engine::PrefilledPrompt p = Prefill(r);
  auto started = std::async(std::launch::async, [&] { return RunStart(MakeStart(r, p, res)); });
  EXPECT_EQ(started.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);
  EXPECT_EQ(service_->active_streams(), 1);
  EXPECT_EQ(service_->block_counts().reserved, res.block_ids_size());
  ASSERT_TRUE(Transfer(p, res.reservation_id(), 1, res.block_ids()).ok());
  ExpectSameAsReference(started.get(), ref);
  EXPECT_TRUE(WaitAllFree());
}

// Two long streams decode side by side; the longer one is cancelled. Its blocks must come back
// while the shorter one is still running: left to finish, it would end after the other.
TEST_F(DecodeServiceTest, CancellingAStreamFreesItsBlocks) {
  const int prompt = 37;
  const engine::Request a = MakeRequest("cancelled", prompt, 1100, 0.f, 6);
  const engine::Request b = MakeRequest("kept", prompt, 1000, 0.f, 7);
  ReserveResponse ra, rb;
  ASSERT_TRUE(Reserve(prompt, 1100, &ra).ok());
  ASSERT_TRUE(Reserve(prompt, 1000, &rb).ok());
  const int32_t na = ra.block_ids_size(), nb = rb.block_ids_size();
  const engine::PrefilledPrompt pa = Prefill(a);
  const engine::PrefilledPrompt pb = Prefill(b);
  ASSERT_TRUE(Transfer(pa, ra.reservation_id(), 1, ra.block_ids()).ok());
  ASSERT_TRUE(Transfer(pb, rb.reservation_id(), 1, rb.block_ids()).ok());
  ASSERT_TRUE(prefill_->ReleasePrefilled(pa.request_id).ok());
  ASSERT_TRUE(prefill_->ReleasePrefilled(pb.request_id).ok());

  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto reader = stub_->Start(&ctx, MakeStart(a, pa, ra));
  v1::GenerateResponse m;
  ASSERT_TRUE(reader->Read(&m));
  EXPECT_EQ(m.token_ids(0), pa.first_token);
  auto kept = std::async(std::launch::async, [&] { return RunStart(MakeStart(b, pb, rb)); });
  ASSERT_TRUE(
      WaitForCounts([&](const DecodeService::BlockCounts& c) { return c.filled == na + nb; }));
  ctx.TryCancel();
  const StreamResult got = Collect(*reader, {m});
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(got.tokens.size(), 1100u);
  EXPECT_TRUE(WaitForCounts([&](const DecodeService::BlockCounts& c) {
    return c.filled == nb && c.reserved == 0;
  })) << "the cancelled request kept its blocks";
  EXPECT_EQ(kept.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the other stream ended first: the cancelled one was not aborted";
  const StreamResult other = kept.get();
  EXPECT_TRUE(other.status.ok()) << other.status.error_message();
  EXPECT_EQ(other.tokens.size(), 1000u);
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(WaitNoStreams());
}

TEST_F(DecodeServiceTest, CancellingAWaitingStartAbortsItsReservation) {
  const engine::Request r = MakeRequest("cancel-waiting", 20, 4, 0.f, 1);
  ReserveResponse res;
  ASSERT_TRUE(Reserve(20, 4, &res).ok());
  const engine::PrefilledPrompt p = Prefill(r);
  grpc::ClientContext ctx;
  auto reader = stub_->Start(&ctx, MakeStart(r, p, res));
  absl::SleepFor(absl::Milliseconds(100));
  ctx.TryCancel();
  EXPECT_EQ(Collect(*reader).status.error_code(), grpc::StatusCode::CANCELLED);
  // A DONE arriving now lands in quarantined blocks and commits nothing.
  ASSERT_TRUE(Transfer(p, res.reservation_id(), 1, res.block_ids()).ok());
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(WaitNoStreams());
  ASSERT_TRUE(prefill_->ReleasePrefilled(p.request_id).ok());
}

TEST_F(DecodeServiceTest, BadStartRequestsAreRefusedAndLeaveTheReservation) {
  const engine::Request r = MakeRequest("bad", 20, 6, 0.f, 2);
  const engine::GenerationResult ref = Reference(r);
  ReserveResponse res;
  ASSERT_TRUE(Reserve(20, 6, &res).ok());
  const engine::PrefilledPrompt p = Prefill(r);
  const StartRequest good = MakeStart(r, p, res);
  struct Case {
    std::function<void(StartRequest&)> edit;
    grpc::StatusCode code;
    const char* message;
  };
  const std::vector<Case> cases = {
      {[&](StartRequest& s) { s.set_reservation_id(res.reservation_id() + 77); },
       grpc::StatusCode::NOT_FOUND, "is unknown"},
      {[](StartRequest& s) { s.set_generation(2); }, grpc::StatusCode::FAILED_PRECONDITION,
       "generation 2 of reservation"},
      {[](StartRequest& s) { s.clear_prompt_ids(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "prompt_ids is empty"},
      {[](StartRequest& s) { s.clear_request_id(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "request_id is empty"},
      {[](StartRequest& s) { s.mutable_sampling()->clear_seed(); },
       grpc::StatusCode::INVALID_ARGUMENT, "sampling.seed"},
      {[](StartRequest& s) { s.clear_first_logprob(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "first_logprob"},
      {[](StartRequest& s) { s.mutable_sampling()->set_max_tokens(100); },
       grpc::StatusCode::INVALID_ARGUMENT, "need 8 blocks of 16 tokens; reservation"},
      {[](StartRequest& s) { s.add_prompt_ids(5000); }, grpc::StatusCode::INVALID_ARGUMENT,
       "outside the vocabulary"},
      {[](StartRequest& s) {
         s.set_adapter("math");
         s.set_adapter_version(3);
       },
       grpc::StatusCode::FAILED_PRECONDITION, "runs no adapters (PreFT mode)"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    StartRequest s = good;
    cases[i].edit(s);
    const StreamResult got = RunStart(s);
    EXPECT_EQ(got.status.error_code(), cases[i].code) << got.status.error_message();
    EXPECT_THAT(got.status.error_message(), HasSubstr(cases[i].message));
    EXPECT_TRUE(got.messages.empty());
  }
  // None of them touched the reservation.
  EXPECT_EQ(service_->block_counts().reserved, res.block_ids_size());
  ASSERT_TRUE(Transfer(p, res.reservation_id(), 1, res.block_ids()).ok());
  ExpectSameAsReference(RunStart(good), ref);
  const StreamResult twice = RunStart(good);
  EXPECT_EQ(twice.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(twice.status.error_message(), HasSubstr("already started"));
  EXPECT_TRUE(WaitAllFree());
  ASSERT_TRUE(prefill_->ReleasePrefilled(p.request_id).ok());
}

}  // namespace
}  // namespace preft::decode
