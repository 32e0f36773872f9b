// The decode tier on a real gRPC server on loopback, a real engine on the tiny fixture and a
// real in-process KV transport. The test plays the prefill worker: its own engine runs the
// prompt (prefill-only), and its own InprocTransport writes the KV into the reserved blocks and
// sends the DONE notice.

#include "services/decode/decode_service.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/metrics/metrics_server.h"
#include "services/decode/decode_metrics.h"
#include "tests/testing/http_get.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/adapters/adapter_loader.h"
#include "common/engine/engine.h"
#include "services/wire/convert.h"
#include "common/rpc/server.h"
#include "common/serving/worker_setup.h"
#include "common/transport/inproc_transport.h"
#include "tests/testing/cacheless_backend.h"
#include "tests/testing/fixtures.h"

namespace preft::decode {
namespace {

using ::testing::HasSubstr;
using worker::v1::ReserveRequest;
using worker::v1::ReserveResponse;
using worker::v1::StartRequest;

constexpr int64_t kDecodeBlocks = 160;
constexpr absl::Duration kQuarantine = absl::Milliseconds(300);

struct StreamResult {
  grpc::Status status;
  std::vector<v1::GenerateResponse> messages;
  std::vector<int32_t> tokens;
  std::string text;
  std::vector<v1::TokenLogprob> logprobs;
};

StreamResult Collect(grpc::ClientReader<v1::GenerateResponse>& reader,
                     std::vector<v1::GenerateResponse> first = {}) {
  StreamResult out;
  out.messages = std::move(first);
  v1::GenerateResponse m;
  while (reader.Read(&m)) out.messages.push_back(m);
  out.status = reader.Finish();
  for (const auto& msg : out.messages) {
    out.tokens.insert(out.tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
    out.text += msg.text();
    out.logprobs.insert(out.logprobs.end(), msg.logprobs().begin(), msg.logprobs().end());
  }
  return out;
}

class DecodeServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto m = serving::LoadModel(testing::TinyLlamaFixture());
    ASSERT_TRUE(m.ok()) << m.status();
    loaded_ = new serving::LoadedModel(std::move(m).value());
  }

  static std::unique_ptr<engine::Engine> MakeEngine(int64_t kv_blocks) {
    engine::EngineOptions o;
    o.kv_blocks = kv_blocks;
    o.num_threads = 1;
    auto e = engine::Engine::Create(loaded_->model.get(), loaded_->tokenizer.get(), o);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(e).value();
  }

  void SetUp() override { StartService(DecodeServiceOptions{}); }

  void StartService(DecodeServiceOptions o) {
    StopService();
    o.quarantine = kQuarantine;
    auto engine = MakeEngine(kDecodeBlocks);
    const transport::KvLayout layout = serving::LayoutFor(*engine, loaded_->fingerprint);
    auto service = DecodeService::Create(std::move(engine),
                                         std::make_unique<transport::InprocTransport>(), layout, o);
    ASSERT_TRUE(service.ok()) << service.status();
    service_ = std::move(service).value();
    rpc::ServerOptions so;
    so.services = {service_.get()};
    auto server = rpc::Server::Start(so);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(server).value();
    stub_ = worker::v1::DecodeWorker::NewStub(
        grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
    start_counts_ = service_->block_counts();
    ASSERT_EQ(start_counts_.total, kDecodeBlocks);
    ASSERT_EQ(start_counts_.free, kDecodeBlocks);

    // The prefill side.
    prefill_ = MakeEngine(64);
    prefill_transport_ = std::make_unique<transport::InprocTransport>();
    ASSERT_TRUE(prefill_transport_
                    ->Start(prefill_->cache(), serving::LayoutFor(*prefill_, loaded_->fingerprint),
                            [](uint64_t, uint32_t) {})
                    .ok());
    worker::v1::DecodeStatusResponse status;
    ASSERT_TRUE(CallStatus(&status).ok());
    auto peer = prefill_transport_->Connect(status.endpoint().address());
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  void StopService() {
    if (server_) server_->Shutdown(absl::Seconds(2));
    server_.reset();
    service_.reset();
    prefill_transport_.reset();
    prefill_.reset();
  }

  void TearDown() override { StopService(); }

  static engine::Request MakeRequest(const std::string& id, int n_prompt, int max_tokens,
                                     float temperature, uint64_t seed) {
    engine::Request r;
    r.id = id;
    for (int i = 0; i < n_prompt; ++i) r.prompt_ids.push_back((i * 31 + seed * 7) % 298);
    r.sampling.max_tokens = max_tokens;
    r.sampling.temperature = temperature;
    r.sampling.seed = seed;
    r.sampling.ignore_eos = true;
    r.sampling.logprobs = 2;
    return r;
  }

  static engine::GenerationResult Reference(const engine::Request& r) {
    auto out = MakeEngine(kDecodeBlocks)->Generate({r});
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? (*out)[0] : engine::GenerationResult{};
  }

  grpc::Status Reserve(int32_t num_tokens, int32_t max_new_tokens, ReserveResponse* out,
                       int64_t lease_ms = 0, uint64_t retry_of = 0) {
    ReserveRequest req;
    req.set_request_id("test");
    req.set_num_tokens(num_tokens);
    req.set_max_new_tokens(max_new_tokens);
    req.set_lease_ms(lease_ms);
    req.set_retry_of(retry_of);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return stub_->Reserve(&ctx, req, out);
  }

  grpc::Status Release(uint64_t id, uint32_t generation) {
    worker::v1::ReleaseRequest req;
    req.set_reservation_id(id);
    req.set_generation(generation);
    req.set_reason("test");
    worker::v1::ReleaseResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return stub_->Release(&ctx, req, &resp);
  }

  grpc::Status CallStatus(worker::v1::DecodeStatusResponse* out) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return stub_->Status(&ctx, worker::v1::DecodeStatusRequest(), out);
  }

  // The prefill worker's compute: the prompt's KV in prefill_'s cache and the first token.
  engine::PrefilledPrompt Prefill(engine::Request r) {
    engine::PrefilledPrompt handed;
    r.on_prefilled = [&](const engine::PrefilledPrompt& p) { handed = p; };
    r.on_token = nullptr;
    EXPECT_TRUE(prefill_->Add(std::move(r)).ok());
    while (prefill_->HasWork()) EXPECT_TRUE(prefill_->Step().ok());
    return handed;
  }

  // The prefill worker's push: the prompt's blocks into the first reserved blocks, then the
  // DONE notice for (id, generation).
  absl::Status Transfer(const engine::PrefilledPrompt& p, uint64_t id, uint32_t generation,
                        const google::protobuf::RepeatedField<int32_t>& reserved) {
    transport::BlockTransfer t;
    t.reservation_id = id;
    t.generation = generation;
    t.src_blocks = p.blocks;
    t.dst_blocks.assign(reserved.begin(), reserved.begin() + p.blocks.size());
    std::promise<absl::Status> done;
    prefill_transport_->Write(peer_, t, [&](absl::Status s) { done.set_value(s); });
    return done.get_future().get();
  }

  static StartRequest MakeStart(const engine::Request& r, const engine::PrefilledPrompt& p,
                                const ReserveResponse& res) {
    StartRequest s;
    s.set_reservation_id(res.reservation_id());
    s.set_generation(res.generation());
    s.set_request_id(r.id);
    for (int32_t id : r.prompt_ids) s.add_prompt_ids(id);
    s.set_first_token_id(p.first_token);
    if (p.first_logprob) *s.mutable_first_logprob() = wire::ToProto(*p.first_logprob);
    *s.mutable_sampling() = wire::ToProto(r.sampling);
    s.mutable_sampling()->set_seed(p.seed);
    return s;
  }

  // The all-position baseline's path for `r` (its adapter is the fixture's "lora"): reserve,
  // prefill, push the KV, then the Start that names the adapter for decode to run too.
  StartRequest BaselineStart(const engine::Request& r, ReserveResponse* res) {
    EXPECT_TRUE(Reserve(static_cast<int32_t>(r.prompt_ids.size()), r.sampling.max_tokens, res).ok());
    const engine::PrefilledPrompt p = Prefill(r);
    EXPECT_TRUE(Transfer(p, res->reservation_id(), 1, res->block_ids()).ok());
    EXPECT_TRUE(prefill_->ReleasePrefilled(p.request_id).ok());
    StartRequest start = MakeStart(r, p, *res);
    start.set_adapter("lora");
    start.set_adapter_version(1);
    start.set_adapter_path("lora");
    start.set_adapter_positions(v1::ADAPTER_POSITIONS_ALL);
    return start;
  }

  StreamResult RunStart(const StartRequest& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    auto reader = stub_->Start(&ctx, req);
    return Collect(*reader);
  }

  // Polls block_counts until `pred` holds (up to 5 s).
  bool WaitForCounts(const std::function<bool(const DecodeService::BlockCounts&)>& pred) {
    const absl::Time until = absl::Now() + absl::Seconds(5);
    while (absl::Now() < until) {
      if (pred(service_->block_counts())) return true;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return pred(service_->block_counts());
  }
  // How long until every block is free again, from now.
  absl::Duration TimeUntilAllFree() {
    const absl::Time t0 = absl::Now();
    EXPECT_TRUE(WaitAllFree());
    return absl::Now() - t0;
  }
  // gRPC ends a call on the server (OnDone) a little after the client has its status.
  bool WaitNoStreams() {
    return WaitForCounts(
        [&](const DecodeService::BlockCounts&) { return service_->active_streams() == 0; });
  }
  bool WaitAllFree() {
    return WaitForCounts([&](const DecodeService::BlockCounts& c) {
      return c.free == start_counts_.free && c.reserved == 0 && c.quarantined == 0 &&
             c.filled == 0;
    });
  }

  static void ExpectSameAsReference(const StreamResult& got, const engine::GenerationResult& ref) {
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    EXPECT_EQ(got.tokens, ref.token_ids);
    EXPECT_EQ(got.text, ref.text);
    ASSERT_EQ(got.logprobs.size(), ref.logprobs.size());
    for (size_t t = 0; t < ref.logprobs.size(); ++t) {
      EXPECT_EQ(got.logprobs[t].token_id(), ref.logprobs[t].token_id) << t;
      EXPECT_EQ(got.logprobs[t].logprob(), ref.logprobs[t].logprob) << t;
      ASSERT_EQ(got.logprobs[t].top_size(), static_cast<int>(ref.logprobs[t].top.size())) << t;
      for (int k = 0; k < got.logprobs[t].top_size(); ++k) {
        EXPECT_EQ(got.logprobs[t].top(k).token_id(), ref.logprobs[t].top[k].first) << t;
        EXPECT_EQ(got.logprobs[t].top(k).logprob(), ref.logprobs[t].top[k].second) << t;
      }
    }
  }

  static serving::LoadedModel* loaded_;
  std::unique_ptr<DecodeService> service_;
  std::unique_ptr<rpc::Server> server_;
  std::unique_ptr<worker::v1::DecodeWorker::Stub> stub_;
  DecodeService::BlockCounts start_counts_;
  std::unique_ptr<engine::Engine> prefill_;
  std::unique_ptr<transport::InprocTransport> prefill_transport_;
  transport::PeerId peer_ = 0;
};
serving::LoadedModel* DecodeServiceTest::loaded_ = nullptr;

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

TEST_F(DecodeServiceTest, StartWithoutDoneFailsAtLeaseEndAndQuarantines) {
  const engine::Request r = MakeRequest("never", 20, 4, 0.f, 1);
  ReserveResponse res;
  ASSERT_TRUE(Reserve(20, 4, &res, /*lease_ms=*/300).ok());
  EXPECT_EQ(res.lease_ms(), 300);
  const engine::PrefilledPrompt p = Prefill(r);
  const absl::Time t0 = absl::Now();
  const StreamResult got = RunStart(MakeStart(r, p, res));
  const absl::Time failed = absl::Now();
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(got.status.error_message(), HasSubstr("no DONE notice"));
  EXPECT_GE(failed - t0, absl::Milliseconds(250));
  EXPECT_TRUE(got.tokens.empty());
  const int32_t n = res.block_ids_size();
  EXPECT_TRUE(WaitForCounts([&](const DecodeService::BlockCounts& c) {
    return c.quarantined == n && c.reserved == 0 && c.free == kDecodeBlocks - n;
  }));
  // The quarantine started when the Start failed: no block is free before it ends.
  EXPECT_TRUE(WaitAllFree());
  EXPECT_GE(absl::Now() - failed, kQuarantine - absl::Milliseconds(50));
  // The reservation is gone: a second Start says so.
  const StreamResult again = RunStart(MakeStart(r, p, res));
  EXPECT_EQ(again.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(again.status.error_message(), HasSubstr("lease of 300 ms expired"));
  ASSERT_TRUE(prefill_->ReleasePrefilled(p.request_id).ok());
}

TEST_F(DecodeServiceTest, ReleaseQuarantinesThenFreesAndLeaseExpiryFrees) {
  ReserveResponse res;
  ASSERT_TRUE(Reserve(40, 24, &res).ok());
  const int32_t n = res.block_ids_size();
  EXPECT_EQ(n, 4);
  EXPECT_EQ(service_->block_counts().reserved, n);
  // Generation 0 is proto3's "not set": refused, not taken for a stale Release.
  EXPECT_EQ(Release(res.reservation_id(), 0).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(service_->block_counts().reserved, res.block_ids_size());
  ASSERT_TRUE(Release(res.reservation_id(), res.generation()).ok());
  EXPECT_GE(TimeUntilAllFree(), kQuarantine - absl::Milliseconds(50));
  EXPECT_TRUE(Release(res.reservation_id(), res.generation()).ok());  // idempotent
  const grpc::Status unknown = Release(res.reservation_id() + 1000, 1);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(unknown.error_message(), HasSubstr("is unknown"));

  ReserveResponse leased;
  ASSERT_TRUE(Reserve(40, 24, &leased, /*lease_ms=*/150).ok());
  EXPECT_NE(leased.reservation_id(), res.reservation_id());
  EXPECT_EQ(service_->block_counts().reserved, n);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(service_->block_counts().reserved, n);  // still within its lease
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(Release(leased.reservation_id(), leased.generation()).ok());
}

TEST_F(DecodeServiceTest, RetryFencesTheOldGeneration) {
  const engine::Request r = MakeRequest("retry", 33, 10, 0.8f, 9);
  const engine::GenerationResult ref = Reference(r);
  ReserveResponse first;
  ASSERT_TRUE(Reserve(33, 10, &first).ok());
  ReserveResponse second;
  ASSERT_TRUE(Reserve(33, 10, &second, 0, /*retry_of=*/first.reservation_id()).ok());
  EXPECT_EQ(second.reservation_id(), first.reservation_id());
  EXPECT_EQ(second.generation(), 2u);
  const std::set<int32_t> old_blocks(first.block_ids().begin(), first.block_ids().end());
  for (int32_t b : second.block_ids()) EXPECT_EQ(old_blocks.count(b), 0u) << b;
  const int32_t n = second.block_ids_size();
  EXPECT_TRUE(WaitForCounts([&](const DecodeService::BlockCounts& c) {
    return c.reserved == n && c.quarantined == first.block_ids_size();
  }));

  // Another prompt's KV, written by a late prefill of generation 1 into the old blocks.
  const engine::PrefilledPrompt stale = Prefill(MakeRequest("stale", 33, 10, 0.f, 2));
  const engine::PrefilledPrompt p = Prefill(r);
  auto started = std::async(std::launch::async, [&] { return RunStart(MakeStart(r, p, second)); });
  ASSERT_TRUE(Transfer(stale, first.reservation_id(), 1, first.block_ids()).ok());
  EXPECT_EQ(started.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "a DONE of generation 1 committed generation 2";
  ASSERT_TRUE(Transfer(p, second.reservation_id(), 2, second.block_ids()).ok());
  // And once more, racing the decode.
  ASSERT_TRUE(Transfer(stale, first.reservation_id(), 1, first.block_ids()).ok());
  ExpectSameAsReference(started.get(), ref);
  ASSERT_TRUE(prefill_->ReleasePrefilled("stale").ok());
  ASSERT_TRUE(prefill_->ReleasePrefilled(p.request_id).ok());
  EXPECT_TRUE(WaitAllFree());

  // Started reservations cannot be retried; a stale Release of generation 1 is ignored.
  EXPECT_TRUE(Release(first.reservation_id(), 1).ok());
  ReserveResponse third;
  const grpc::Status s = Reserve(33, 10, &third, 0, first.reservation_id());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("was started"));
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

TEST_F(DecodeServiceTest, ExhaustionAndDrain) {
  ReserveResponse big;
  ASSERT_TRUE(Reserve(1000, 600, &big).ok());  // 100 of 160 blocks
  ReserveResponse more;
  const grpc::Status s = Reserve(1000, 600, &more);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("need 100 KV blocks"));
  EXPECT_THAT(s.error_message(), HasSubstr("60 of 160 blocks are free (100 reserved"));
  worker::v1::DecodeStatusResponse status;
  ASSERT_TRUE(CallStatus(&status).ok());
  EXPECT_EQ(status.free_blocks(), 60);
  EXPECT_EQ(status.total_blocks(), 160);
  EXPECT_EQ(status.reserved_blocks(), 100);
  EXPECT_EQ(status.block_tokens(), 16);
  EXPECT_FALSE(status.draining());
  EXPECT_EQ(status.endpoint().transport(), "inproc");
  ASSERT_TRUE(Release(big.reservation_id(), big.generation()).ok());

  // A stream started before the drain runs to its end.
  const engine::Request r = MakeRequest("drained", 25, 40, 0.f, 8);
  const engine::GenerationResult ref = Reference(r);
  ReserveResponse res;
  ASSERT_TRUE(Reserve(25, 40, &res).ok());
  const engine::PrefilledPrompt p = Prefill(r);
  ASSERT_TRUE(Transfer(p, res.reservation_id(), 1, res.block_ids()).ok());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto reader = stub_->Start(&ctx, MakeStart(r, p, res));
  v1::GenerateResponse m;
  ASSERT_TRUE(reader->Read(&m));
  service_->StartDrain();
  const grpc::Status refused = Reserve(10, 10, &more);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(refused.error_message(), HasSubstr("draining"));
  ASSERT_TRUE(CallStatus(&status).ok());
  EXPECT_TRUE(status.draining());
  ExpectSameAsReference(Collect(*reader, {m}), ref);
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(WaitNoStreams());
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

// The all-position baseline: decode applies the request's adapter to the tokens it generates,
// so its output equals one engine running the adapter everywhere (and differs from PreFT's
// prompt-only run).
TEST_F(DecodeServiceTest, AllPositionBaselineRunsTheAdapterOnGeneratedTokens) {
  DecodeServiceOptions o;
  o.all_position_adapters = true;
  o.adapter_root = testing::TinyLlamaFixture();
  StartService(o);
  auto w = adapters::LoadAdapter(testing::TinyLlamaFixture() + "/lora", loaded_->model->config());
  ASSERT_TRUE(w.ok()) << w.status();
  const std::shared_ptr<const model::AdapterWeights> weights = std::move(w).value();
  engine::Request r = MakeRequest("lora-all", 30, 10, 0.f, 3);
  r.adapter = engine::RequestAdapter{weights, "lora", 1, model::AdapterPositions::kAll};
  const engine::GenerationResult ref = Reference(r);
  engine::Request prompt_only = r;
  prompt_only.adapter.positions = model::AdapterPositions::kPrompt;
  ASSERT_NE(Reference(prompt_only).token_ids, ref.token_ids)
      << "the fixture cannot tell them apart";

  ReserveResponse res;
  StartRequest start = BaselineStart(r, &res);
  const StreamResult got = RunStart(start);
  ExpectSameAsReference(got, ref);
  ASSERT_FALSE(got.messages.empty());
  const v1::Finish& f = got.messages.back().finish();
  EXPECT_EQ(f.adapter(), "lora");
  EXPECT_EQ(f.adapter_version(), 1);
  EXPECT_EQ(f.adapter_positions(), v1::ADAPTER_POSITIONS_ALL);
  EXPECT_TRUE(WaitAllFree());

  // An adapter outside the root fails the Start and aborts its reservation.
  ASSERT_TRUE(Reserve(30, 10, &res).ok());
  start.set_reservation_id(res.reservation_id());
  start.set_adapter_path("../../../../etc");
  const StreamResult bad = RunStart(start);
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.status.error_message(), HasSubstr("outside the adapter root"));
  EXPECT_TRUE(WaitAllFree());
}

// A colocated worker (the deployment without disaggregation): Run computes the prompt here,
// with the request's adapter at its positions, and decodes it in the same engine.
class ColocatedDecodeTest : public DecodeServiceTest {
 protected:
  void SetUp() override {
    DecodeServiceOptions o;
    o.colocated = true;
    o.adapter_root = testing::TinyLlamaFixture();
    StartService(o);
  }

  static worker::v1::RunRequest MakeRun(const engine::Request& r) {
    worker::v1::RunRequest run;
    run.set_request_id(r.id);
    for (int32_t id : r.prompt_ids) run.add_prompt_ids(id);
    *run.mutable_sampling() = wire::ToProto(r.sampling);
    return run;
  }

  StreamResult CallRun(const worker::v1::RunRequest& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto reader = stub_->Run(&ctx, req);
    return Collect(*reader);
  }

  // Requests batched together: the same tokens and text as one engine running each alone; the
  // logprobs agree to float rounding (the kernels' summation order depends on the batch).
  static void ExpectSameTokens(const StreamResult& got, const engine::GenerationResult& ref) {
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    EXPECT_EQ(got.tokens, ref.token_ids);
    EXPECT_EQ(got.text, ref.text);
    ASSERT_EQ(got.logprobs.size(), ref.logprobs.size());
    for (size_t t = 0; t < ref.logprobs.size(); ++t)
      EXPECT_NEAR(got.logprobs[t].logprob(), ref.logprobs[t].logprob, 1e-4) << t;
  }
};

TEST_F(ColocatedDecodeTest, RunEqualsOneEngineWithAndWithoutAdapters) {
  auto lora = adapters::LoadAdapter(testing::TinyLlamaFixture() + "/lora", loaded_->model->config());
  auto direft =
      adapters::LoadAdapter(testing::TinyLlamaFixture() + "/direft", loaded_->model->config());
  ASSERT_TRUE(lora.ok() && direft.ok());
  struct Case {
    const char* id;
    const char* adapter;  // "" for the base model
    v1::AdapterPositions positions;
    float temperature;
  };
  const std::shared_ptr<const model::AdapterWeights> lora_w = std::move(lora).value();
  const std::shared_ptr<const model::AdapterWeights> direft_w = std::move(direft).value();
  struct Call {
    worker::v1::RunRequest run;
    engine::GenerationResult ref;
    v1::AdapterPositions positions;  // what the finish reports
  };
  std::vector<Call> calls;
  for (const Case& c : {Case{"base", "", v1::ADAPTER_POSITIONS_UNSPECIFIED, 0.f},
                        Case{"lora", "lora", v1::ADAPTER_POSITIONS_ALL, 0.f},
                        Case{"lorap", "lora", v1::ADAPTER_POSITIONS_PROMPT, 0.8f},
                        Case{"direft", "direft", v1::ADAPTER_POSITIONS_UNSPECIFIED, 0.f},
                        Case{"direftp", "direft", v1::ADAPTER_POSITIONS_PROMPT, 0.8f}}) {
    engine::Request r = MakeRequest(c.id, 33, 14, c.temperature, 21);
    const std::string adapter = c.adapter;
    Call call{MakeRun(r), {}, v1::ADAPTER_POSITIONS_UNSPECIFIED};
    if (!adapter.empty()) {
      r.adapter = engine::RequestAdapter{adapter == "lora" ? lora_w : direft_w, adapter, 1,
                                         wire::FromProto(c.positions)};
      call.run.set_adapter(adapter);
      call.run.set_adapter_version(1);
      call.run.set_adapter_path(adapter);
      call.run.set_adapter_positions(c.positions);
      call.positions =
          wire::ToProto(r.adapter.positions.value_or(r.adapter.weights->default_positions));
    }
    // All before the calls: the reference engine shares the service's model and its scratch.
    call.ref = Reference(r);
    calls.push_back(std::move(call));
  }
  std::vector<std::future<void>> running;
  for (const Call& call : calls) {
    running.push_back(std::async(std::launch::async, [this, &call] {
      SCOPED_TRACE(call.run.request_id());
      const StreamResult got = CallRun(call.run);
      ExpectSameTokens(got, call.ref);
      ASSERT_FALSE(got.messages.empty());
      const v1::Finish& f = got.messages.back().finish();
      EXPECT_EQ(f.reason(), v1::FINISH_REASON_LENGTH);
      EXPECT_EQ(f.usage().prompt_tokens(), 33);
      EXPECT_EQ(f.usage().completion_tokens(), 14);
      EXPECT_EQ(f.adapter(), call.run.adapter());
      EXPECT_EQ(f.adapter_positions(), call.positions);
    }));
  }
  for (auto& f : running) f.get();
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(WaitNoStreams());
  worker::v1::DecodeStatusResponse status;
  ASSERT_TRUE(CallStatus(&status).ok());
  EXPECT_TRUE(status.colocated());
  EXPECT_EQ(status.free_blocks(), kDecodeBlocks);
}

TEST_F(ColocatedDecodeTest, BadRunsAndReserveAreRefused) {
  const engine::Request r = MakeRequest("bad", 10, 4, 0.f, 1);
  auto expect = [&](const worker::v1::RunRequest& run, grpc::StatusCode code,
                    const std::string& part) {
    const StreamResult got = CallRun(run);
    EXPECT_EQ(got.status.error_code(), code) << got.status.error_message();
    EXPECT_THAT(got.status.error_message(), HasSubstr(part));
  };
  worker::v1::RunRequest run = MakeRun(r);
  run.clear_request_id();
  expect(run, grpc::StatusCode::INVALID_ARGUMENT, "request_id is empty");
  run = MakeRun(r);
  run.clear_prompt_ids();
  expect(run, grpc::StatusCode::INVALID_ARGUMENT, "prompt_ids is empty");
  run = MakeRun(r);
  for (int i = 0; i < 2048; ++i) run.add_prompt_ids(1);
  expect(run, grpc::StatusCode::INVALID_ARGUMENT, "the model's context is 2048");
  run = MakeRun(r);
  run.set_prompt_ids(3, 99999);
  expect(run, grpc::StatusCode::INVALID_ARGUMENT, "prompt_ids[3] = 99999");
  run = MakeRun(r);
  run.mutable_sampling()->set_top_p(3.f);
  expect(run, grpc::StatusCode::INVALID_ARGUMENT, "top_p");
  run = MakeRun(r);
  run.set_adapter("lora");
  run.set_adapter_version(1);
  expect(run, grpc::StatusCode::INVALID_ARGUMENT, "without adapter_path");
  run.set_adapter_path("no-such-adapter");
  expect(run, grpc::StatusCode::NOT_FOUND, "no-such-adapter");
  run.set_adapter_path("../../../../etc");
  expect(run, grpc::StatusCode::INVALID_ARGUMENT, "outside the adapter root");
  ReserveResponse res;
  const grpc::Status reserve = Reserve(10, 4, &res);
  EXPECT_EQ(reserve.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(reserve.error_message(), HasSubstr("colocated decode worker: send Run"));
  service_->StartDrain();
  expect(MakeRun(r), grpc::StatusCode::UNAVAILABLE, "draining");
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(WaitNoStreams());
}

// Its blocks count as filled while it runs (Status and metrics see them), and cancelling the
// call aborts the engine request and frees them.
TEST_F(ColocatedDecodeTest, CancellingARunFreesItsBlocks) {
  engine::Request r = MakeRequest("long", 40, 1500, 0.f, 2);
  grpc::ClientContext ctx;
  auto reader = stub_->Run(&ctx, MakeRun(r));
  v1::GenerateResponse m;
  ASSERT_TRUE(reader->Read(&m));
  EXPECT_TRUE(WaitForCounts([](const DecodeService::BlockCounts& c) {
    return c.sequences == 1 && c.filled >= 3 && c.free + c.filled == c.total;
  }));
  worker::v1::DecodeStatusResponse status;
  ASSERT_TRUE(CallStatus(&status).ok());
  EXPECT_EQ(status.running(), 1);
  EXPECT_LT(status.free_blocks(), kDecodeBlocks);
  ctx.TryCancel();
  const StreamResult got = Collect(*reader, {m});
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(got.tokens.size(), 1500u);
  EXPECT_TRUE(WaitAllFree());
  EXPECT_TRUE(WaitNoStreams());
}

// LoadAdapter warms a worker that runs adapters (one disk load, then requests hit), and is
// refused, naming why, by a PreFT decode worker, which never reads adapters.
TEST_F(DecodeServiceTest, LoadAdapterWarmsOnlyWorkersThatRunAdapters) {
  worker::v1::WorkerAdapterRequest req;
  req.set_name("lora");
  req.set_version(1);
  req.set_path("lora");
  worker::v1::AdapterState state;
  {
    grpc::ClientContext ctx;
    const grpc::Status s = stub_->LoadAdapter(&ctx, req, &state);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("runs no adapters"));
    grpc::ClientContext uctx;
    worker::v1::UnloadWorkerAdapterResponse unloaded;
    EXPECT_TRUE(stub_->UnloadAdapter(&uctx, req, &unloaded).ok());
  }
  DecodeServiceOptions o;
  o.all_position_adapters = true;
  o.adapter_root = testing::TinyLlamaFixture();
  StartService(o);
  {
    grpc::ClientContext ctx;
    const grpc::Status s = stub_->LoadAdapter(&ctx, req, &state);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(state.name(), "lora");
  EXPECT_EQ(state.version(), 1);
  EXPECT_EQ(state.residency(), v1::ADAPTER_RESIDENCY_RESIDENT);
  EXPECT_GT(state.bytes(), 0);
  worker::v1::DecodeStatusResponse status;
  ASSERT_TRUE(CallStatus(&status).ok());
  ASSERT_EQ(status.adapters_size(), 1);
  EXPECT_EQ(status.adapters(0).name(), "lora");
  EXPECT_EQ(status.adapters(0).residency(), v1::ADAPTER_RESIDENCY_RESIDENT);
  EXPECT_EQ(status.adapters(0).bytes(), state.bytes());
  const adapters::AdapterStoreStats loaded = service_->adapter_store()->stats();
  EXPECT_EQ(loaded.disk_loads, 1);
  EXPECT_EQ(loaded.compute_bytes_used, state.bytes());
  EXPECT_EQ(loaded.pinned, 0);  // resident, not leased

  // A request on it is a compute hit: no second load.
  auto w = adapters::LoadAdapter(testing::TinyLlamaFixture() + "/lora", loaded_->model->config());
  ASSERT_TRUE(w.ok()) << w.status();
  engine::Request r = MakeRequest("warm", 20, 4, 0.f, 5);
  r.adapter = engine::RequestAdapter{std::move(w).value(), "lora", 1,
                                     model::AdapterPositions::kAll};
  const engine::GenerationResult ref = Reference(r);
  ReserveResponse res;
  ExpectSameAsReference(RunStart(BaselineStart(r, &res)), ref);
  const adapters::AdapterStoreStats after = service_->adapter_store()->stats();
  EXPECT_EQ(after.disk_loads, 1);
  EXPECT_EQ(after.compute_hits, loaded.compute_hits + 1);

  // Unloading forgets it (its copy leaves once the finished request's lease is gone); a
  // missing folder is the store's NOT_FOUND.
  ASSERT_TRUE(WaitAllFree());
  grpc::ClientContext uctx;
  worker::v1::UnloadWorkerAdapterResponse unloaded;
  ASSERT_TRUE(stub_->UnloadAdapter(&uctx, req, &unloaded).ok());
  EXPECT_TRUE(WaitForCounts([&](const DecodeService::BlockCounts&) {
    return service_->adapter_store()->stats().compute_bytes_used == 0;
  }));
  EXPECT_TRUE(service_->adapter_store()->List().empty());
  status.Clear();
  ASSERT_TRUE(CallStatus(&status).ok());
  EXPECT_EQ(status.adapters_size(), 0);
  req.set_name("gone");
  req.set_path("no-such-adapter");
  grpc::ClientContext gctx;
  EXPECT_EQ(stub_->LoadAdapter(&gctx, req, &state).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(WaitAllFree());
}

TEST_F(DecodeServiceTest, RunNeedsAColocatedWorker) {
  worker::v1::RunRequest run;
  run.set_request_id("r");
  run.add_prompt_ids(1);
  grpc::ClientContext ctx;
  auto reader = stub_->Run(&ctx, run);
  const StreamResult got = Collect(*reader);
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(got.status.error_message(), HasSubstr("start it with --colocated"));
  worker::v1::DecodeStatusResponse status;
  ASSERT_TRUE(CallStatus(&status).ok());
  EXPECT_FALSE(status.colocated());
  EXPECT_TRUE(WaitNoStreams());
}

}  // namespace
}  // namespace preft::decode

namespace preft::decode {
namespace {

// The value of the sample named exactly `series` in a Prometheus text exposition, or -1.
double Sample(const std::string& exposition, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(exposition, '\n')) {
    if (absl::ConsumePrefix(&line, series) && absl::ConsumePrefix(&line, " ")) {
      double v = -1;
      return absl::SimpleAtod(line, &v) ? v : -1;
    }
  }
  return -1;
}

// Refreshes `m` and returns the exposition served at `address`.
std::string Scrape(DecodeMetrics& m, const std::string& address) {
  m.Refresh();
  auto body = testing::HttpGet(address, "/metrics");
  EXPECT_TRUE(body.ok()) << body.status();
  return body.ok() ? *body : std::string();
}

// GET /metrics shows the KV block states and usage the service reports.
TEST_F(DecodeServiceTest, MetricsEndpointShowsKvBlockStates) {
  auto server = metrics::MetricsServer::Start("127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status();
  DecodeMetrics m((*server)->registry(), service_.get(), absl::Hours(1));
  auto scrape = [&] { return Scrape(m, (*server)->address()); };
  std::string text = scrape();
  EXPECT_EQ(Sample(text, "preft:kv_blocks{state=\"free\"}"), kDecodeBlocks) << text;
  EXPECT_EQ(Sample(text, "preft:kv_cache_usage_perc"), 0);
  EXPECT_EQ(Sample(text, "preft:num_requests_running"), 0);
  EXPECT_EQ(Sample(text, "preft:num_requests_waiting"), 0);
  ReserveResponse res;
  ASSERT_TRUE(Reserve(40, 8, &res).ok());  // 48 tokens: 3 blocks
  text = scrape();
  EXPECT_EQ(Sample(text, "preft:num_requests_waiting"), 1) << text;
  EXPECT_EQ(Sample(text, "preft:kv_blocks{state=\"reserved\"}"), 3) << text;
  EXPECT_EQ(Sample(text, "preft:kv_blocks{state=\"free\"}"), kDecodeBlocks - 3);
  EXPECT_NEAR(Sample(text, "preft:kv_cache_usage_perc"), 3.0 / kDecodeBlocks, 1e-9);
  EXPECT_FALSE(testing::HttpGet((*server)->address(), "/nothing").ok());
  EXPECT_EQ(metrics::MetricsServer::Start("nonsense").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(metrics::MetricsServer::Start("256.0.0.1:0").status().code(),
            absl::StatusCode::kUnavailable);  // not an address of this host
}

// A worker serving adapters (the all-position baseline) also exports its adapter store: the
// first request's adapter is a disk load, the second a compute hit.
TEST_F(DecodeServiceTest, MetricsShowTheAdapterStoreOfABaselineWorker) {
  DecodeServiceOptions o;
  o.all_position_adapters = true;
  o.adapter_root = testing::TinyLlamaFixture();
  o.store.compute_bytes = int64_t{3} << 20;
  StartService(o);
  auto server = metrics::MetricsServer::Start("127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status();
  DecodeMetrics m((*server)->registry(), service_.get(), absl::Hours(1));
  auto scrape = [&] { return Scrape(m, (*server)->address()); };
  std::string text = scrape();
  EXPECT_EQ(Sample(text, "preft:adapter_capacity_bytes{tier=\"compute\"}"), 3 << 20) << text;
  EXPECT_EQ(Sample(text, "preft:adapter_acquires_total{result=\"disk_load\"}"), 0) << text;
  EXPECT_EQ(Sample(text, "preft:adapter_disk_load_seconds_total"), 0) << text;
  auto w = adapters::LoadAdapter(testing::TinyLlamaFixture() + "/lora", loaded_->model->config());
  ASSERT_TRUE(w.ok()) << w.status();
  const std::shared_ptr<const model::AdapterWeights> weights = std::move(w).value();
  for (int i = 0; i < 2; ++i) {
    engine::Request r = MakeRequest(absl::StrCat("lora-all-", i), 20, 4, 0.f, 3);
    r.adapter = engine::RequestAdapter{weights, "lora", 1, model::AdapterPositions::kAll};
    ReserveResponse res;
    ASSERT_TRUE(RunStart(BaselineStart(r, &res)).status.ok());
  }
  EXPECT_TRUE(WaitAllFree());
  text = scrape();
  EXPECT_EQ(Sample(text, "preft:adapter_acquires_total{result=\"disk_load\"}"), 1) << text;
  EXPECT_EQ(Sample(text, "preft:adapter_acquires_total{result=\"compute_hit\"}"), 1) << text;
  EXPECT_GT(Sample(text, "preft:adapter_disk_load_seconds_total"), 0) << text;
  EXPECT_EQ(Sample(text, "preft:adapters{state=\"compute\"}"), 1) << text;
  EXPECT_GT(Sample(text, "preft:adapter_bytes{tier=\"compute\"}"), 0) << text;
}

}  // namespace
}  // namespace preft::decode
