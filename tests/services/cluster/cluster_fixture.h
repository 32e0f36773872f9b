#pragma once

// The embedded cluster on the tiny fixture, with its adapters (lora, lora_rs, direft) under a
// temporary adapter root and registered, and the checks its tests share: outputs equal the
// fixture's references and one engine's, cancellation and abort free every worker. Tests
// derive from it and change the cluster in Configure (colocated, transports, tokens, ...).

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/adapters/adapter_loader.h"
#include "common/base/mapped_file.h"
#include "common/engine/engine.h"
#include "nlohmann/json.hpp"
#include "services/wire/convert.h"
#include "tests/services/cluster/cluster_client.h"
#include "tests/testing/fixtures.h"
#include "tools/preft/embedded_cluster.h"

namespace preft::tools {

namespace fs = std::filesystem;
using testing::Generate;

class EmbeddedClusterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(fs::path(::testing::TempDir()) / ("cluster_adapters_" + std::to_string(getpid())));
    fs::remove_all(*root_);
    fs::create_directories(*root_);
    for (const char* a : {"lora", "lora_rs", "direft"})
      fs::copy(testing::TinyLlamaFixture() + "/" + a, *root_ / a);
  }

  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*root_, ec);
  }

  void SetUp() override {
    // The registry is durable (it lives in the root): each test starts with none.
    for (const char* state : {".preft-registry", ".preft-versions"}) fs::remove_all(*root_ / state);
    EmbeddedClusterOptions o;
    o.model_dir = testing::TinyLlamaFixture();
    o.adapter_root = root_->string();
    o.num_prefill = 2;
    o.num_decode = 2;
    o.prefill_kv_bytes = 8 << 20;
    o.decode_kv_bytes = 3 << 19;  // 128 blocks of 16 tokens: 2048 per worker
    o.decode.all_position_adapters = true;  // the fixture's LoRA/DiReFT modes need it
    o.threads = 1;
    o.decode.quarantine = absl::Milliseconds(50);
    o.router.admission_timeout = absl::Seconds(2);
    Configure(&o);
    auto c = EmbeddedCluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = std::move(c).value();
    stub_ = testing::PreftStub(cluster_->address());
    for (const char* a : {"lora", "lora_rs", "direft"}) {
      grpc::ClientContext ctx;
      if (!o.router.access.admin_token.empty()) {
        ctx.AddMetadata("authorization", "Bearer " + o.router.access.admin_token);
      }
      v1::RegisterAdapterRequest req;
      req.set_name(a);
      req.set_path(a);
      v1::RegisterAdapterResponse r;
      const grpc::Status registered = stub_->RegisterAdapter(&ctx, req, &r);
      ASSERT_TRUE(registered.ok()) << a << ": " << registered.error_message();
    }
  }

  virtual void Configure(EmbeddedClusterOptions*) {}

  // Reserves `tokens` of KV on every decode worker, as another router would.
  void HoldDecodeKv(int tokens) {
    for (const auto& w : cluster_->pool().decode()) {
      grpc::ClientContext ctx;
      worker::v1::ReserveRequest req;
      req.set_request_id("hog");
      req.set_num_tokens(tokens - 8);
      req.set_max_new_tokens(8);
      req.set_lease_ms(30000);
      worker::v1::ReserveResponse r;
      ASSERT_TRUE(w->stub->Reserve(&ctx, req, &r).ok());
      held_.emplace_back(w.get(), r);
    }
    cluster_->pool().PollNow();
  }
  void ReleaseHeldKv() {
    for (auto& [w, res] : held_) {
      grpc::ClientContext ctx;
      worker::v1::ReleaseRequest req;
      req.set_reservation_id(res.reservation_id());
      req.set_generation(res.generation());
      worker::v1::ReleaseResponse r;
      EXPECT_TRUE(w->stub->Release(&ctx, req, &r).ok());
    }
    held_.clear();
  }

  // Every block on every worker is back where it started.
  void ExpectNoLeaks() {
    auto clean = [&] {
      for (int i = 0; i < cluster_->num_decode(); ++i) {
        const auto b = cluster_->decode(i).block_counts();
        if (b.free != b.total || cluster_->decode(i).active_streams() != 0) return false;
      }
      for (int i = 0; i < cluster_->num_prefill(); ++i)
        if (cluster_->prefill(i).active_requests() != 0) return false;
      return true;
    };
    const absl::Time until = absl::Now() + absl::Seconds(5);
    while (!clean() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(20));
    if (clean()) return;
    for (int i = 0; i < cluster_->num_decode(); ++i) {
      const auto b = cluster_->decode(i).block_counts();
      ADD_FAILURE() << "decode " << i << ": free " << b.free << "/" << b.total << " reserved "
                    << b.reserved << " quarantined " << b.quarantined << " filled " << b.filled
                    << " streams " << cluster_->decode(i).active_streams();
    }
    for (int i = 0; i < cluster_->num_prefill(); ++i)
      ADD_FAILURE() << "prefill " << i << " active " << cluster_->prefill(i).active_requests();
  }

  static v1::GenerateRequest Request(const std::vector<int32_t>& prompt, int max_tokens,
                                     const std::string& model = "",
                                     v1::AdapterPositions positions = v1::ADAPTER_POSITIONS_UNSPECIFIED) {
    v1::GenerateRequest r;
    for (int32_t t : prompt) r.mutable_token_ids()->add_ids(t);
    r.set_model(model);
    r.set_adapter_positions(positions);
    r.set_stream(true);
    r.mutable_sampling()->set_max_tokens(max_tokens);
    r.mutable_sampling()->set_ignore_eos(true);
    return r;
  }

  // Every case of the fixture's reference.json (base, lora, lora_rs, lorap, direft, direftp:
  // outputs of transformers + PEFT + pyreft), all at once through the cluster.
  void ReproduceFixtureModes() {
  auto text = base::ReadFileToString(testing::TinyLlamaFixture() + "/reference.json");
  ASSERT_TRUE(text.ok());
  const nlohmann::json ref = nlohmann::json::parse(*text);
  std::vector<v1::GenerateRequest> requests;
  for (const auto& c : ref["cases"]) {
    std::string model;
    v1::AdapterPositions pos = v1::ADAPTER_POSITIONS_UNSPECIFIED;
    if (!c["adapter"].is_null()) {
      model = c["adapter"];
      pos = c["adapter_positions"] == "prompt" ? v1::ADAPTER_POSITIONS_PROMPT
                                               : v1::ADAPTER_POSITIONS_ALL;
    }
    v1::GenerateRequest r = Request(c["prompt_ids"].get<std::vector<int32_t>>(),
                                    static_cast<int>(c["token_ids"].size()), model, pos);
    r.mutable_sampling()->set_logprobs(2);
    requests.push_back(r);
  }
  std::vector<testing::GenerateOutcome> got(requests.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i)
    threads.emplace_back([&, i] { got[i] = Generate(stub_.get(), requests[i]); });
  for (auto& t : threads) t.join();
  std::set<std::string> modes;
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& c = ref["cases"][i];
    const std::string mode = c["mode"];
    modes.insert(mode);
    ASSERT_TRUE(got[i].status.ok()) << mode << ": " << got[i].status.error_message();
    EXPECT_EQ(got[i].token_ids, c["token_ids"].get<std::vector<int32_t>>()) << mode;
    ASSERT_EQ(got[i].logprobs.size(), c["logprobs"].size()) << mode;
    for (size_t t = 0; t < got[i].logprobs.size(); ++t)
      EXPECT_NEAR(got[i].logprobs[t].logprob(), c["logprobs"][t]["logprob"].get<double>(), 1e-4)
          << mode << " step " << t;
    EXPECT_EQ(got[i].finish.reason(), v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(got[i].finish.usage().completion_tokens(), static_cast<int>(c["token_ids"].size()));
    if (!c["adapter"].is_null()) {
      EXPECT_EQ(got[i].finish.adapter(), c["adapter"].get<std::string>());
      EXPECT_EQ(got[i].finish.adapter_version(), 1);
    }
  }
  EXPECT_EQ(modes.size(), 6u);
  ExpectNoLeaks();
  }

  // Cancelling streams mid-way (half of them with an adapter) frees every worker.
  void CancelMidStream() {
    std::vector<std::thread> threads;
    for (int i = 0; i < 4; ++i) {
      threads.emplace_back([&, i] {
        auto r = Request({1, 2, 3, 4, 5}, 400, i % 2 ? "lora" : "");
        auto out = Generate(stub_.get(), r, 60, [](const v1::GenerateResponse&, grpc::ClientContext* ctx) {
          ctx->TryCancel();
        });
        EXPECT_EQ(out.status.error_code(), grpc::StatusCode::CANCELLED);
      });
    }
    for (auto& t : threads) t.join();
    ExpectNoLeaks();
  }

  // Abort ends the stream with finish ABORT; the id is unknown afterwards.
  void AbortMidStream() {
    auto r = Request({1, 2, 3, 4, 5}, 500);
    r.set_request_id("to-abort");
    std::atomic<bool> sent{false};
    auto out = Generate(stub_.get(), r, 60, [&](const v1::GenerateResponse&, grpc::ClientContext*) {
      if (sent.exchange(true)) return;
      grpc::ClientContext ctx;
      v1::AbortRequest a;
      a.set_request_id("to-abort");
      v1::AbortResponse resp;
      EXPECT_TRUE(stub_->Abort(&ctx, a, &resp).ok());
    });
    EXPECT_TRUE(out.status.ok()) << out.status.error_message();
    EXPECT_EQ(out.finish.reason(), v1::FINISH_REASON_ABORT);
    EXPECT_LT(out.token_ids.size(), 500u);
    grpc::ClientContext ctx;
    v1::AbortRequest a;
    a.set_request_id("to-abort");
    v1::AbortResponse resp;
    EXPECT_EQ(stub_->Abort(&ctx, a, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
    ExpectNoLeaks();
  }

  // Prefix caching through the public API: a prompt sent again computes only its last block
  // (the finish reports the rest as cached_tokens) and generates the same tokens; an adapter's
  // first request never reads the base model's blocks. Sequential, so each finds the last's.
  void RepeatedPromptsReportCachedTokens() {
    std::vector<int32_t> prompt(40);
    for (int i = 0; i < 40; ++i) prompt[i] = 5 + (i * 7) % 200;
    for (const std::string& model : {std::string(""), std::string("lora")}) {
      SCOPED_TRACE("model '" + model + "'");
      const v1::GenerateRequest r = Request(prompt, 6, model, v1::ADAPTER_POSITIONS_PROMPT);
      const testing::GenerateOutcome first = testing::Generate(stub_.get(), r);
      ASSERT_TRUE(first.status.ok()) << first.status.error_message();
      EXPECT_EQ(first.finish.usage().cached_tokens(), 0);
      const testing::GenerateOutcome again = testing::Generate(stub_.get(), r);
      ASSERT_TRUE(again.status.ok()) << again.status.error_message();
      EXPECT_EQ(again.finish.usage().prompt_tokens(), 40);
      EXPECT_EQ(again.finish.usage().cached_tokens(), 32);
      EXPECT_EQ(again.token_ids, first.token_ids);
    }
    ExpectNoLeaks();
  }

  // Greedy and seeded requests of every adapter mode (base, LoRA, LoRAP, DiReFT, DiReFTP), all
  // at once: each stream's tokens and text equal one engine's (no cluster) running them, that
  // engine storing KV as `kv_dtype` (the cluster's).
  void MixedLoadEqualsOneEngine(kv::KvDtype kv_dtype = kv::KvDtype::kF32) {
    auto m = model::Model::Load(testing::TinyLlamaFixture());
    ASSERT_TRUE(m.ok());
    std::map<std::string, std::shared_ptr<const model::AdapterWeights>> weights;
    for (const char* a : {"lora", "direft"}) {
      auto w = adapters::LoadAdapter((*root_ / a).string(), (*m)->config());
      ASSERT_TRUE(w.ok()) << w.status();
      weights[a] = std::move(w).value();
    }
    struct Mode {
      const char* adapter;  // "" for the base model
      v1::AdapterPositions positions;
    };
    std::vector<v1::GenerateRequest> requests;
    std::vector<engine::Request> alone;
    for (const Mode& mode : {Mode{"", v1::ADAPTER_POSITIONS_UNSPECIFIED},
                             Mode{"lora", v1::ADAPTER_POSITIONS_ALL},
                             Mode{"lora", v1::ADAPTER_POSITIONS_PROMPT},
                             Mode{"direft", v1::ADAPTER_POSITIONS_ALL},
                             Mode{"direft", v1::ADAPTER_POSITIONS_PROMPT}}) {
      for (int seeded = 0; seeded < 2; ++seeded) {
        for (int p = 0; p < 2; ++p) {
          const int n = static_cast<int>(requests.size());
          std::vector<int32_t> prompt;
          for (int i = 0; i < 9 + 13 * p; ++i) prompt.push_back((n * 37 + i * 11) % 290 + 3);
          v1::GenerateRequest r = Request(prompt, 10 + 3 * p, mode.adapter, mode.positions);
          r.set_stream(p == 0);
          if (seeded) {
            r.mutable_sampling()->set_temperature(0.9f);
            r.mutable_sampling()->set_top_p(0.95f);
            r.mutable_sampling()->set_seed(500 + n);
          }
          engine::Request e;
          e.id = "alone-" + std::to_string(n);
          e.prompt_ids = prompt;
          e.sampling = wire::FromProto(r.sampling());
          const std::string adapter = mode.adapter;
          if (!adapter.empty())
            e.adapter = {weights[adapter], adapter, 1, wire::FromProto(mode.positions)};
          requests.push_back(std::move(r));
          alone.push_back(std::move(e));
        }
      }
    }
    engine::EngineOptions eo;
    eo.kv_blocks = 256;
    eo.kv_dtype = kv_dtype;
    auto e = engine::Engine::Create(m->get(), cluster_->tokenizer(), eo);
    ASSERT_TRUE(e.ok());
    auto want = (*e)->Generate(alone);
    ASSERT_TRUE(want.ok()) << want.status();
    std::vector<testing::GenerateOutcome> got(requests.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < requests.size(); ++i)
      threads.emplace_back([&, i] { got[i] = Generate(stub_.get(), requests[i]); });
    for (auto& t : threads) t.join();
    for (size_t i = 0; i < requests.size(); ++i) {
      SCOPED_TRACE(requests[i].ShortDebugString());
      ASSERT_TRUE(got[i].status.ok()) << got[i].status.error_message();
      EXPECT_EQ(got[i].token_ids, (*want)[i].token_ids);
      EXPECT_EQ(got[i].text, (*want)[i].text);
      EXPECT_EQ(got[i].finish.adapter(), requests[i].model());
      if (!requests[i].model().empty()) {
        EXPECT_EQ(got[i].finish.adapter_positions(), wire::ToProto((*want)[i].adapter_positions));
      }
    }
    ExpectNoLeaks();
  }

  inline static fs::path* root_ = nullptr;
  std::unique_ptr<EmbeddedCluster> cluster_;
  std::vector<std::pair<router::DecodeWorker*, worker::v1::ReserveResponse>> held_;  // HoldDecodeKv
  std::unique_ptr<v1::Preft::Stub> stub_;
};

}  // namespace preft::tools
