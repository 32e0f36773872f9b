// The prefill tier on a real gRPC server (loopback), a real engine on the fixture model and a
// real in-process KV transport. The test plays the decode worker: it reserves blocks in its own
// engine, sends Prefill with them, checks the DONE notice, then decodes from the imported
// prompt. Every result must equal one engine doing the whole request, and no call may leave
// blocks behind on the prefill worker.

#include "services/prefill/prefill_service.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/adapters/adapter_loader.h"
#include "common/adapters/make_adapter.h"
#include "common/engine/engine.h"
#include "common/kv/blocks.h"
#include "common/model/model.h"
#include "common/rpc/server.h"
#include "common/transport/inproc_transport.h"
#include "proto/preft/v1/worker.grpc.pb.h"
#include "services/wire/convert.h"
#include "services/wire/kv_path.h"
#include "tests/testing/cacheless_backend.h"
#include "tests/testing/fixtures.h"

namespace preft::prefill {
namespace {

namespace fs = std::filesystem;
using engine::Engine;
using engine::GenerationResult;
using model::AdapterPositions;
using worker::v1::PrefillRequest;
using worker::v1::PrefillResponse;

constexpr int64_t kBlockTokens = 16;
constexpr int64_t kPrefillBlocks = 64;
const char kModelId[] = "tiny-llama-fixture";

// One request as the test describes it; `dir` names an adapter folder under the root.
struct Case {
  std::string id;
  std::vector<int32_t> prompt;
  float temperature = 0.f;
  uint64_t seed = 1;
  int max_tokens = 8;
  std::string adapter;  // "" = base model
  std::string dir;
  int64_t version = 1;
  std::optional<AdapterPositions> positions;
};

Case Base(std::string id, std::vector<int32_t> prompt, float temperature, uint64_t seed,
          int max_tokens) {
  Case c;
  c.id = std::move(id);
  c.prompt = std::move(prompt);
  c.temperature = temperature;
  c.seed = seed;
  c.max_tokens = max_tokens;
  return c;
}

Case Adapted(Case c, const std::string& adapter, const std::string& dir,
             std::optional<AdapterPositions> positions, int64_t version = 1) {
  c.adapter = adapter;
  c.dir = dir;
  c.positions = positions;
  c.version = version;
  return c;
}

std::vector<int32_t> Prompt(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 31 + salt * 7 + 3) % 298);
  return p;
}

// What the decode worker owns: an engine the test thread drives and a transport on its cache
// that records DONE notices.
struct DecodeSide {
  std::unique_ptr<Engine> engine;
  std::unique_ptr<transport::InprocTransport> transport;
  transport::KvLayout layout;
  absl::Mutex mu;
  std::vector<std::pair<uint64_t, uint32_t>> notices ABSL_GUARDED_BY(mu);

  std::vector<std::pair<uint64_t, uint32_t>> Notices() {
    absl::MutexLock lock(&mu);
    return notices;
  }
};

class PrefillServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto m = model::Model::Load(testing::TinyLlamaFixture());
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(m).value().release();
    // Adapter folders must lie under the root: copies of the fixture's, a second LoRA version
    // and a LoRA written for a wider model. One root per process (ctest runs each test of this
    // binary in its own process, in parallel).
    root_ = new std::string(::testing::TempDir() + "/preft_prefill_service_adapters_" +
                            std::to_string(getpid()));
    fs::remove_all(*root_);
    fs::create_directories(*root_);
    for (const char* name : {"lora", "direft"}) {
      fs::copy(testing::TinyLlamaFixture() + "/" + name, *root_ + "/" + name,
               fs::copy_options::recursive);
    }
    adapters::RandomAdapterSpec spec;
    spec.seed = 77;
    ASSERT_TRUE(adapters::WriteRandomAdapter(model_->config(), spec, *root_ + "/lora_v2").ok());
    model::ModelConfig wide = model_->config();
    wide.hidden_size = 128;
    ASSERT_TRUE(adapters::WriteRandomAdapter(wide, spec, *root_ + "/wide").ok());
    weights_ = new std::map<std::string, std::shared_ptr<const model::AdapterWeights>>;
  }

  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(*root_, ec);
    delete weights_;
    delete root_;
    delete model_;
  }

  void SetUp() override {
    StartPrefill();
    decode_ = MakeDecode(1024, kModelId);
  }

  void TearDown() override {
    if (server_) server_->Shutdown(absl::Seconds(2));
    server_.reset();
    service_.reset();
  }

  static std::unique_ptr<Engine> MakeEngine(int64_t kv_blocks, int64_t batch_tokens = 512) {
    engine::EngineOptions o;
    o.kv_blocks = kv_blocks;
    o.scheduler.max_batch_tokens = batch_tokens;
    o.scheduler.block_tokens = kBlockTokens;
    auto e = Engine::Create(model_, nullptr, o);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(e).value();
  }

  // Chunked prompts (48 tokens a step) on the prefill worker: a prompt spans several steps.
  void StartPrefill() {
    auto engine = MakeEngine(kPrefillBlocks, /*batch_tokens=*/48);
    layout_ = transport::KvLayout::ForCache(engine->cache()->shape(), kModelId);
    PrefillServiceOptions options;
    options.adapter_root = *root_;
    auto service = PrefillService::Create(
        std::move(engine), std::make_unique<transport::InprocTransport>(), layout_, options);
    ASSERT_TRUE(service.ok()) << service.status();
    service_ = std::move(service).value();
    rpc::ServerOptions so;
    so.services = {service_.get()};
    auto server = rpc::Server::Start(so);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(server).value();
    stub_ = worker::v1::PrefillWorker::NewStub(
        grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  }

  static std::unique_ptr<DecodeSide> MakeDecode(int64_t kv_blocks, const std::string& model_id) {
    auto d = std::make_unique<DecodeSide>();
    d->engine = MakeEngine(kv_blocks);
    d->layout = transport::KvLayout::ForCache(d->engine->cache()->shape(), model_id);
    d->transport = std::make_unique<transport::InprocTransport>();
    DecodeSide* raw = d.get();
    EXPECT_TRUE(d->transport
                    ->Start(d->engine->cache(), d->layout,
                            [raw](uint64_t id, uint32_t generation) {
                              absl::MutexLock lock(&raw->mu);
                              raw->notices.emplace_back(id, generation);
                            })
                    .ok());
    return d;
  }

  static std::shared_ptr<const model::AdapterWeights> Weights(const std::string& dir) {
    auto& w = (*weights_)[dir];
    if (w == nullptr) {
      auto a = adapters::LoadAdapter(*root_ + "/" + dir, model_->config());
      EXPECT_TRUE(a.ok()) << a.status();
      if (a.ok()) w = std::move(a).value();
    }
    return w;
  }

  static engine::SamplingParams Sampling(const Case& c) {
    engine::SamplingParams s;
    s.temperature = c.temperature;
    s.seed = c.seed;
    s.max_tokens = c.max_tokens;
    s.ignore_eos = true;
    s.logprobs = 3;
    return s;
  }

  static engine::Request EngineRequest(const Case& c) {
    engine::Request r;
    r.id = c.id;
    r.prompt_ids = c.prompt;
    r.sampling = Sampling(c);
    if (!c.adapter.empty()) {
      r.adapter.weights = Weights(c.dir);
      r.adapter.name = c.adapter;
      r.adapter.version = c.version;
      r.adapter.positions = c.positions;
    }
    return r;
  }

  // One engine doing the whole of every case, together.
  static std::vector<GenerationResult> RunWhole(const std::vector<Case>& cases) {
    std::vector<engine::Request> requests;
    for (const Case& c : cases) requests.push_back(EngineRequest(c));
    auto out = MakeEngine(256)->Generate(std::move(requests));
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? std::move(out).value() : std::vector<GenerationResult>{};
  }

  // Reserves the blocks the request can ever need on the decode side.
  std::vector<int32_t> Reserve(const Case& c, DecodeSide& d) {
    const int64_t total = static_cast<int64_t>(c.prompt.size()) + c.max_tokens;
    auto blocks = d.engine->ReserveBlocks(kv::BlocksFor(total, kBlockTokens));
    EXPECT_TRUE(blocks.ok()) << blocks.status();
    return blocks.ok() ? *blocks : std::vector<int32_t>{};
  }

  PrefillRequest MakePrefill(const Case& c, const std::vector<int32_t>& blocks,
                             uint64_t reservation, DecodeSide& d) {
    PrefillRequest p;
    p.set_request_id(c.id);
    for (int32_t t : c.prompt) p.add_prompt_ids(t);
    *p.mutable_sampling() = wire::ToProto(Sampling(c));
    if (!c.adapter.empty()) {
      p.set_adapter(c.adapter);
      p.set_adapter_path(*root_ + "/" + c.dir);
      p.set_adapter_version(c.version);
      p.set_adapter_positions(wire::ToProto(c.positions));
    }
    p.set_reservation_id(reservation);
    p.set_generation(1);
    for (int32_t b : blocks) p.add_block_ids(b);
    p.set_block_tokens(kBlockTokens);
    *p.mutable_decode_endpoint() = wire::MakeEndpoint(*d.transport, d.layout);
    return p;
  }

  grpc::Status CallPrefill(const PrefillRequest& request, PrefillResponse* response,
                           absl::Duration deadline = absl::Seconds(30)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::microseconds(absl::ToInt64Microseconds(deadline)));
    const grpc::Status s = stub_->Prefill(&ctx, request, response);
    last_blamed_kv_path_ = ctx.GetServerTrailingMetadata().count(wire::kKvPathFailedKey) > 0;
    return s;
  }
  bool last_blamed_kv_path_ = false;  // the last CallPrefill's answer blamed the KV path

  worker::v1::PrefillStatusResponse CallStatus() {
    grpc::ClientContext ctx;
    worker::v1::PrefillStatusRequest request;
    worker::v1::PrefillStatusResponse response;
    const grpc::Status s = stub_->Status(&ctx, request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response;
  }

  // Decodes every prefilled case on the decode side (positions ALL keep the adapter there) and
  // compares with one engine doing the whole request.
  void DecodeAndCompare(const std::vector<Case>& cases,
                        const std::vector<std::vector<int32_t>>& blocks,
                        const std::vector<PrefillResponse>& responses, DecodeSide& d) {
    const std::vector<GenerationResult> whole = RunWhole(cases);
    ASSERT_EQ(whole.size(), cases.size());
    std::vector<engine::Request> imported;
    for (size_t i = 0; i < cases.size(); ++i) {
      const PrefillResponse& got = responses[i];
      ASSERT_FALSE(whole[i].token_ids.empty());
      EXPECT_EQ(got.first_token_id(), whole[i].token_ids[0]) << cases[i].id;
      // Float sums follow the batch's shape (chunks, other prompts): equal within 1e-4.
      EXPECT_NEAR(got.first_logprob().logprob(), whole[i].logprobs[0].logprob, 1e-4) << cases[i].id;
      EXPECT_EQ(got.first_logprob().token_id(), got.first_token_id()) << cases[i].id;
      ASSERT_EQ(got.first_logprob().top_size(), 3) << cases[i].id;
      engine::Request r = EngineRequest(cases[i]);
      const bool all = !r.adapter.weights
                           ? false
                           : r.adapter.positions.value_or(r.adapter.weights->default_positions) ==
                                 AdapterPositions::kAll;
      if (!all) r.adapter = engine::RequestAdapter{};  // PreFT: decode runs the base model
      r.imported = engine::ImportedPrompt{blocks[i], got.first_token_id(),
                                          wire::FromProto(got.first_logprob())};
      imported.push_back(std::move(r));
    }
    auto split = d.engine->Generate(std::move(imported));
    ASSERT_TRUE(split.ok()) << split.status();
    for (size_t i = 0; i < cases.size(); ++i) {
      EXPECT_EQ((*split)[i].token_ids, whole[i].token_ids) << cases[i].id;
      ASSERT_EQ((*split)[i].logprobs.size(), whole[i].logprobs.size()) << cases[i].id;
      for (size_t t = 0; t < whole[i].logprobs.size(); ++t) {
        EXPECT_NEAR((*split)[i].logprobs[t].logprob, whole[i].logprobs[t].logprob, 1e-4)
            << cases[i].id << " step " << t;
      }
    }
  }

  // Prefills each case (one at a time), then decodes and compares them all.
  void RunAndCompare(const std::vector<Case>& cases) {
    std::vector<std::vector<int32_t>> blocks;
    std::vector<PrefillResponse> responses;
    for (size_t i = 0; i < cases.size(); ++i) {
      blocks.push_back(Reserve(cases[i], *decode_));
      PrefillResponse response;
      const grpc::Status s =
          CallPrefill(MakePrefill(cases[i], blocks.back(), 100 + i, *decode_), &response);
      ASSERT_TRUE(s.ok()) << cases[i].id << ": " << s.error_message();
      // DONE arrives before the answer.
      ASSERT_FALSE(decode_->Notices().empty());
      EXPECT_EQ(decode_->Notices().back(), (std::pair<uint64_t, uint32_t>(100 + i, 1)));
      const int64_t n = kv::BlocksFor(cases[i].prompt.size(), kBlockTokens);
      EXPECT_EQ(response.transfer_bytes(),
                n * decode_->engine->cache()->shape().bytes_per_block_all_layers());
      EXPECT_GT(response.compute_us(), 0);
      EXPECT_GE(response.queue_us(), 0);
      EXPECT_GE(response.transfer_us(), 0);
      responses.push_back(response);
    }
    DecodeAndCompare(cases, blocks, responses, *decode_);
  }

  void ExpectNothingHeld() {
    const PrefillService::EngineCounts c = service_->engine_counts();
    EXPECT_EQ(c.prefilled_held, 0);
    EXPECT_EQ(c.free_blocks, kPrefillBlocks);
    EXPECT_EQ(c.total_blocks, kPrefillBlocks);
    EXPECT_EQ(c.waiting, 0);
    EXPECT_EQ(c.running, 0);
    const worker::v1::PrefillStatusResponse status = CallStatus();
    EXPECT_EQ(status.queue_depth(), 0);
    EXPECT_EQ(status.running(), 0);
    EXPECT_EQ(service_->active_requests(), 0);
  }

  // Waits until the prefill worker holds nothing (cancelled work ends on its own).
  void WaitNothingHeld() {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      const PrefillService::EngineCounts c = service_->engine_counts();
      if (c.prefilled_held == 0 && c.free_blocks == kPrefillBlocks && c.waiting == 0 &&
          c.running == 0 && service_->active_requests() == 0) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    ExpectNothingHeld();
  }

  static model::Model* model_;
  static std::string* root_;
  static std::map<std::string, std::shared_ptr<const model::AdapterWeights>>* weights_;

  transport::KvLayout layout_;
  std::unique_ptr<PrefillService> service_;
  std::unique_ptr<rpc::Server> server_;
  std::unique_ptr<worker::v1::PrefillWorker::Stub> stub_;
  std::unique_ptr<DecodeSide> decode_;
};
model::Model* PrefillServiceTest::model_ = nullptr;
std::string* PrefillServiceTest::root_ = nullptr;
std::map<std::string, std::shared_ptr<const model::AdapterWeights>>* PrefillServiceTest::weights_ =
    nullptr;

// A prefill worker whose cache lives where the transport cannot read it (a GPU with no host
// mirror, under a host-memory transport) is refused at start, naming the transport.
TEST_F(PrefillServiceTest, RefusesACachelessEngineWithAHostMemoryTransport) {
  engine::EngineOptions o;
  o.kv_blocks = 16;
  auto engine = Engine::Create(testing::CachelessBackend::Create(model_, 16), nullptr, o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const transport::KvLayout layout =
      transport::KvLayout::ForCache((*engine)->backend().cache_shape(), kModelId);
  auto refused = PrefillService::Create(*std::move(engine),
                                        std::make_unique<transport::InprocTransport>(), layout, {});
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("the inproc transport cannot read"),
            std::string::npos)
      << refused.status();
}

TEST_F(PrefillServiceTest, BaseModelSplitEqualsOneEngine) {
  std::vector<Case> cases;
  cases.push_back(Base("greedy", Prompt(37, 1), 0.f, 3, 10));
  cases.push_back(Base("seeded", Prompt(37, 2), 0.9f, 11, 10));
  cases.push_back(Base("one-block", Prompt(16, 3), 0.7f, 5, 6));  // exactly one block
  cases.push_back(Base("short", Prompt(3, 4), 0.f, 5, 6));
  RunAndCompare(cases);
  ExpectNothingHeld();
}

TEST_F(PrefillServiceTest, AdaptersSplitEqualsOneEngine) {
  std::vector<Case> cases;
  cases.push_back(
      Adapted(Base("lora-all", Prompt(37, 1), 0.f, 3, 10), "lora", "lora", AdapterPositions::kAll));
  cases.push_back(Adapted(Base("lora-prompt", Prompt(37, 1), 0.f, 3, 10), "lora", "lora",
                          AdapterPositions::kPrompt));
  cases.push_back(Adapted(Base("lora-prompt-seeded", Prompt(20, 2), 0.8f, 9, 10), "lora", "lora",
                          AdapterPositions::kPrompt));
  cases.push_back(
      Adapted(Base("direft", Prompt(40, 3), 0.f, 3, 10), "direft", "direft", std::nullopt));
  cases.push_back(Adapted(Base("direft-prompt", Prompt(40, 3), 0.f, 3, 10), "direft", "direft",
                          AdapterPositions::kPrompt));
  std::vector<std::vector<int32_t>> blocks;
  std::vector<PrefillResponse> responses;
  for (size_t i = 0; i < cases.size(); ++i) {
    blocks.push_back(Reserve(cases[i], *decode_));
    PrefillResponse response;
    const grpc::Status s =
        CallPrefill(MakePrefill(cases[i], blocks.back(), i + 1, *decode_), &response);
    ASSERT_TRUE(s.ok()) << cases[i].id << ": " << s.error_message();
    EXPECT_EQ(response.adapter_version(), 1) << cases[i].id;
    const auto want = cases[i].positions.value_or(AdapterPositions::kAll);  // fixtures' default
    EXPECT_EQ(response.adapter_positions(), wire::ToProto(want)) << cases[i].id;
    responses.push_back(response);
  }
  DecodeAndCompare(cases, blocks, responses, *decode_);
  ExpectNothingHeld();
  // The base model reports no adapter.
  PrefillResponse base;
  const Case c = Base("base", Prompt(10, 9), 0.f, 1, 4);
  ASSERT_TRUE(CallPrefill(MakePrefill(c, Reserve(c, *decode_), 99, *decode_), &base).ok());
  EXPECT_EQ(base.adapter_version(), 0);
  EXPECT_EQ(base.adapter_positions(), v1::ADAPTER_POSITIONS_UNSPECIFIED);
}

TEST_F(PrefillServiceTest, ConcurrentPrefillsWithMixedAdaptersAllMatch) {
  std::vector<Case> cases;
  for (int i = 0; i < 16; ++i) {
    Case c = Base("c" + std::to_string(i), Prompt(20 + 3 * i, i), i % 3 ? 0.8f : 0.f,
                  static_cast<uint64_t>(40 + i), 6);
    switch (i % 4) {
      case 1:
        c.adapter = c.dir = "lora";
        c.positions = AdapterPositions::kPrompt;
        break;
      case 2:
        c.adapter = c.dir = "direft";
        c.positions = AdapterPositions::kAll;
        break;
      case 3:
        c.adapter = c.dir = "lora";
        break;
      default:
        break;  // base model
    }
    cases.push_back(c);
  }
  std::vector<std::vector<int32_t>> blocks;
  std::vector<PrefillRequest> requests;
  for (size_t i = 0; i < cases.size(); ++i) {
    blocks.push_back(Reserve(cases[i], *decode_));
    requests.push_back(MakePrefill(cases[i], blocks.back(), 1000 + i, *decode_));
  }
  std::vector<PrefillResponse> responses(cases.size());
  std::vector<grpc::Status> statuses(cases.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < cases.size(); ++i) {
    threads.emplace_back([&, i] { statuses[i] = CallPrefill(requests[i], &responses[i]); });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_TRUE(statuses[i].ok()) << cases[i].id << ": " << statuses[i].error_message();
  }
  std::vector<std::pair<uint64_t, uint32_t>> notices = decode_->Notices();
  std::sort(notices.begin(), notices.end());
  ASSERT_EQ(notices.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(notices[i].first, 1000 + i);
  DecodeAndCompare(cases, blocks, responses, *decode_);
  ExpectNothingHeld();
}

TEST_F(PrefillServiceTest, BadRequestsAreRefusedWithTheirField) {
  const Case base = Base("bad", Prompt(37, 1), 0.f, 3, 6);
  const std::vector<int32_t> blocks = Reserve(base, *decode_);
  PrefillResponse response;
  auto expect = [&](const PrefillRequest& r, grpc::StatusCode code, const std::string& text) {
    const grpc::Status s = CallPrefill(r, &response);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_NE(s.error_message().find(text), std::string::npos) << s.error_message();
  };
  PrefillRequest r = MakePrefill(base, blocks, 1, *decode_);
  r.mutable_sampling()->clear_seed();
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "sampling.seed");

  r = MakePrefill(base, blocks, 1, *decode_);
  r.mutable_block_ids()->Truncate(2);  // 37 tokens need 3 blocks
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "block_ids has 2 ids");

  r = MakePrefill(base, blocks, 1, *decode_);
  r.set_block_tokens(32);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "block_tokens is 32");

  r = MakePrefill(base, blocks, 1, *decode_);
  r.clear_request_id();
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "request_id");

  r = MakePrefill(base, blocks, 1, *decode_);
  r.clear_prompt_ids();
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "prompt_ids");

  r = MakePrefill(base, blocks, 1, *decode_);
  r.set_prompt_ids(0, 300);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "prompt_ids[0] is 300");

  // A decode worker on another model's layout.
  std::unique_ptr<DecodeSide> other = MakeDecode(16, "another-model");
  r = MakePrefill(base, blocks, 1, *other);
  expect(r, grpc::StatusCode::FAILED_PRECONDITION, other->layout.ToString());
  expect(r, grpc::StatusCode::FAILED_PRECONDITION, layout_.ToString());

  Case adapter = base;
  adapter.adapter = "lora";
  adapter.dir = "missing";
  expect(MakePrefill(adapter, blocks, 1, *decode_), grpc::StatusCode::NOT_FOUND, "missing");
  r = MakePrefill(adapter, blocks, 1, *decode_);
  r.set_adapter_path(testing::TinyLlamaFixture() + "/lora");  // real, but outside the root
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "outside the adapter root");
  r.set_adapter_path(*root_ + "/..");
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "outside the adapter root");
  r.clear_adapter_path();
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "adapter_path");

  adapter.adapter = "wide";
  adapter.dir = "wide";  // written for hidden size 128
  r = MakePrefill(adapter, blocks, 1, *decode_);
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "adapter 'wide' version 1: ");
  expect(r, grpc::StatusCode::INVALID_ARGUMENT, "expected [8, 64]");  // the loader's words
  // Known but never loaded: on disk only.
  const worker::v1::PrefillStatusResponse status = CallStatus();
  ASSERT_EQ(status.adapters_size(), 1);
  EXPECT_EQ(status.adapters(0).name(), "wide");
  EXPECT_EQ(status.adapters(0).residency(), v1::ADAPTER_RESIDENCY_DISK);
  EXPECT_EQ(status.adapters(0).bytes(), 0);
  EXPECT_EQ(status.loading(), 0);
  // Nothing reached the decode side; nothing is held here.
  EXPECT_TRUE(decode_->Notices().empty());
  ExpectNothingHeld();
}

TEST_F(PrefillServiceTest, PromptLargerThanTheCacheFailsWithTheEngineError) {
  const Case c = Base("huge", Prompt(int(kPrefillBlocks * kBlockTokens + 20), 1), 0.f, 3, 2);
  PrefillResponse response;
  const grpc::Status s = CallPrefill(MakePrefill(c, Reserve(c, *decode_), 1, *decode_), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("KV blocks"), std::string::npos) << s.error_message();
  EXPECT_FALSE(last_blamed_kv_path_);  // the prompt's own failure
  ExpectNothingHeld();
}

TEST_F(PrefillServiceTest, LostDecodePeerFailsUnavailableAndLeaksNothing) {
  const Case c = Base("gone", Prompt(37, 1), 0.f, 3, 6);
  const std::vector<int32_t> blocks = Reserve(c, *decode_);
  const PrefillRequest request = MakePrefill(c, blocks, 1, *decode_);
  PrefillResponse response;
  ASSERT_TRUE(CallPrefill(request, &response).ok());  // connected
  EXPECT_FALSE(last_blamed_kv_path_);
  decode_->transport.reset();                         // the decode worker goes away
  const grpc::Status s = CallPrefill(request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_NE(s.error_message().find("KV transfer"), std::string::npos) << s.error_message();
  EXPECT_TRUE(last_blamed_kv_path_) << "the router must learn the decode side failed";
  ExpectNothingHeld();
  // Never connected: Connect itself fails.
  std::unique_ptr<DecodeSide> fresh = MakeDecode(16, kModelId);
  const PrefillRequest to_fresh = MakePrefill(c, blocks, 2, *fresh);
  fresh->transport.reset();
  EXPECT_EQ(CallPrefill(to_fresh, &response).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(last_blamed_kv_path_);
  ExpectNothingHeld();
}

TEST_F(PrefillServiceTest, CancelledCallsLeaveNoBlocksBehind) {
  // Long prompts (13 chunks each) with deadlines that end them at every stage.
  std::vector<std::thread> threads;
  std::vector<PrefillRequest> requests;
  for (int i = 0; i < 8; ++i) {
    Case c = Base("cancel" + std::to_string(i), Prompt(600, i), 0.f, 3, 2);
    if (i % 2) c.adapter = c.dir = "lora";
    requests.push_back(MakePrefill(c, Reserve(c, *decode_), i + 1, *decode_));
  }
  std::vector<grpc::Status> statuses(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back([&, i] {
      PrefillResponse response;
      statuses[i] = CallPrefill(requests[i], &response, absl::Milliseconds(2 + 15 * i));
    });
  }
  for (std::thread& t : threads) t.join();
  int cancelled = 0;
  for (const grpc::Status& s : statuses) {
    EXPECT_TRUE(s.ok() || s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
        << s.error_message();
    cancelled += !s.ok();
  }
  EXPECT_GT(cancelled, 0);
  WaitNothingHeld();
}

// Shutdown with prompts queued, computing and transferring: every call is answered and the
// service goes away without waiting for them.
TEST_F(PrefillServiceTest, ShutdownAnswersEveryCallInFlight) {
  std::vector<PrefillRequest> requests;
  for (int i = 0; i < 6; ++i) {
    Case c = Base("down" + std::to_string(i), Prompt(500, i), 0.f, 3, 2);
    if (i % 2) c = Adapted(c, "direft", "direft", std::nullopt);
    requests.push_back(MakePrefill(c, Reserve(c, *decode_), i + 1, *decode_));
  }
  std::vector<grpc::Status> statuses(requests.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back([&, i] {
      PrefillResponse response;
      statuses[i] = CallPrefill(requests[i], &response);
    });
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (service_->active_requests() < 2 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  server_->Shutdown(absl::ZeroDuration());
  service_.reset();
  for (std::thread& t : threads) t.join();
  for (const grpc::Status& s : statuses) {
    EXPECT_TRUE(s.ok() || s.error_code() == grpc::StatusCode::CANCELLED ||
                s.error_code() == grpc::StatusCode::UNAVAILABLE)
        << s.error_code() << " " << s.error_message();
  }
}

TEST_F(PrefillServiceTest, NewerAdapterVersionIsUsedAndReported) {
  Case v1 = Adapted(Base("v1", Prompt(30, 1), 0.f, 3, 8), "lora", "lora", AdapterPositions::kAll);
  Case v2 = v1;
  v2.id = "v2";
  v2.dir = "lora_v2";
  v2.version = 2;
  std::vector<PrefillResponse> responses(2);
  std::vector<std::vector<int32_t>> blocks;
  blocks.push_back(Reserve(v1, *decode_));
  ASSERT_TRUE(CallPrefill(MakePrefill(v1, blocks[0], 1, *decode_), &responses[0]).ok());
  worker::v1::PrefillStatusResponse status = CallStatus();
  ASSERT_EQ(status.adapters_size(), 1);
  EXPECT_EQ(status.adapters(0).name(), "lora");
  EXPECT_EQ(status.adapters(0).version(), 1);
  EXPECT_EQ(status.adapters(0).residency(), v1::ADAPTER_RESIDENCY_RESIDENT);
  EXPECT_GT(status.adapters(0).bytes(), 0);
  EXPECT_EQ(status.adapters(0).pins(), 0);
  EXPECT_EQ(status.loading(), 0);
  EXPECT_EQ(status.adapter_bytes_total(), adapters::AdapterStoreOptions{}.compute_bytes);
  EXPECT_EQ(status.adapter_bytes_free(), status.adapter_bytes_total() - status.adapters(0).bytes());
  EXPECT_FALSE(status.draining());
  EXPECT_EQ(status.endpoint().layout_hash(), layout_.Hash());
  EXPECT_EQ(status.endpoint().transport(), "inproc");

  blocks.push_back(Reserve(v2, *decode_));
  ASSERT_TRUE(CallPrefill(MakePrefill(v2, blocks[1], 2, *decode_), &responses[1]).ok());
  EXPECT_EQ(responses[0].adapter_version(), 1);
  EXPECT_EQ(responses[1].adapter_version(), 2);
  EXPECT_NE(responses[0].first_logprob().logprob(), responses[1].first_logprob().logprob());
  DecodeAndCompare({v1, v2}, blocks, responses, *decode_);
  status = CallStatus();
  ASSERT_EQ(status.adapters_size(), 1);
  EXPECT_EQ(status.adapters(0).name(), "lora");
  EXPECT_EQ(status.adapters(0).version(), 2);
  EXPECT_EQ(status.adapters(0).residency(), v1::ADAPTER_RESIDENCY_RESIDENT);

  // The router moved on: version 1 is refused from now on.
  PrefillResponse stale;
  const grpc::Status s = CallPrefill(MakePrefill(v1, blocks[0], 3, *decode_), &stale);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("superseded by version 2"), std::string::npos);
  ExpectNothingHeld();
}

TEST_F(PrefillServiceTest, ConnectChecksTheLayoutAndAnswersOurEndpoint) {
  grpc::ClientContext ctx;
  worker::v1::ConnectRequest request;
  request.set_peer("decode-0");
  *request.mutable_endpoint() = wire::MakeEndpoint(*decode_->transport, decode_->layout);
  worker::v1::ConnectResponse response;
  ASSERT_TRUE(stub_->Connect(&ctx, request, &response).ok());
  EXPECT_EQ(response.endpoint().SerializeAsString(), service_->endpoint().SerializeAsString());
  EXPECT_EQ(response.endpoint().layout(), layout_.ToString());

  std::unique_ptr<DecodeSide> other = MakeDecode(16, "another-model");
  grpc::ClientContext ctx2;
  *request.mutable_endpoint() = wire::MakeEndpoint(*other->transport, other->layout);
  const grpc::Status s = stub_->Connect(&ctx2, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find(other->layout.ToString()), std::string::npos);
  EXPECT_NE(s.error_message().find(layout_.ToString()), std::string::npos);
}

TEST_F(PrefillServiceTest, DrainingRefusesNewPrompts) {
  const Case c = Base("late", Prompt(10, 1), 0.f, 3, 4);
  service_->StartDrain();
  PrefillResponse response;
  const grpc::Status s = CallPrefill(MakePrefill(c, Reserve(c, *decode_), 1, *decode_), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(s.error_message().find("draining"), std::string::npos);
  EXPECT_TRUE(CallStatus().draining());
  EXPECT_EQ(service_->active_requests(), 0);
}

}  // namespace
}  // namespace preft::prefill
