#pragma once

// The decode tier's test fixture, shared by the decode_service_test sources: a real gRPC server
// on loopback, a real engine on the tiny fixture and a real in-process KV transport. The test
// plays the prefill worker: its own engine runs the prompt (prefill-only), and its own
// InprocTransport writes the KV into the reserved blocks and sends the DONE notice.

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/engine/engine.h"
#include "common/rpc/server.h"
#include "common/serving/worker_setup.h"
#include "common/transport/inproc_transport.h"
#include "services/decode/decode_service.h"
#include "services/wire/convert.h"
#include "tests/testing/fixtures.h"

namespace preft::decode {

using ::testing::HasSubstr;
using worker::v1::ReserveRequest;
using worker::v1::ReserveResponse;
using worker::v1::StartRequest;

inline constexpr int64_t kDecodeBlocks = 160;
inline constexpr absl::Duration kQuarantine = absl::Milliseconds(300);

struct StreamResult {
  grpc::Status status;
  std::vector<v1::GenerateResponse> messages;
  std::vector<int32_t> tokens;
  std::string text;
  std::vector<v1::TokenLogprob> logprobs;
};

inline StreamResult Collect(grpc::ClientReader<v1::GenerateResponse>& reader,
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

// Not in an anonymous namespace: its tests live in several files, and GoogleTest wants one
// fixture type per suite.
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

  // The prefill tier's part for `r`: reserve, prefill, push the KV; then the Start for it.
  StartRequest PrefilledStart(const engine::Request& r, ReserveResponse* res) {
    EXPECT_TRUE(Reserve(static_cast<int32_t>(r.prompt_ids.size()), r.sampling.max_tokens, res).ok());
    const engine::PrefilledPrompt p = Prefill(r);
    EXPECT_TRUE(Transfer(p, res->reservation_id(), 1, res->block_ids()).ok());
    EXPECT_TRUE(prefill_->ReleasePrefilled(p.request_id).ok());
    return MakeStart(r, p, *res);
  }

  // The all-position baseline's path for `r` (its adapter is the fixture's "lora"): reserve,
  // prefill, push the KV, then the Start that names the adapter for decode to run too.
  StartRequest BaselineStart(const engine::Request& r, ReserveResponse* res) {
    StartRequest start = PrefilledStart(r, res);
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

  inline static serving::LoadedModel* loaded_ = nullptr;
  std::unique_ptr<DecodeService> service_;
  std::unique_ptr<rpc::Server> server_;
  std::unique_ptr<worker::v1::DecodeWorker::Stub> stub_;
  DecodeService::BlockCounts start_counts_;
  std::unique_ptr<engine::Engine> prefill_;
  std::unique_ptr<transport::InprocTransport> prefill_transport_;
  transport::PeerId peer_ = 0;
};

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

}  // namespace preft::decode
