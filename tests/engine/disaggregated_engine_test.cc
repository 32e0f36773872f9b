// The engine's two halves of disaggregated serving: a prefill-only request on one engine, its
// KV copied block by block into blocks reserved on another, and decode from the imported
// prompt there. Tokens must equal one engine doing both.

#include <gtest/gtest.h>

#include <cstring>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <string>
#include <vector>

#include "common/backend/cpu_backend.h"
#include "common/engine/engine.h"
#include "common/engine/engine_loop.h"
#include "common/kv/blocks.h"
#include "tests/engine/tiny_engine_fixture.h"
#include "tests/testing/cacheless_backend.h"

namespace preft::engine {
namespace {

class DisaggregatedEngineTest : public TinyEngineTest {
 protected:
  static Request MakeRequest(const std::string& id, int n_prompt, int max_tokens, float temp,
                             uint64_t seed) {
    Request r;
    r.id = id;
    for (int i = 0; i < n_prompt; ++i) r.prompt_ids.push_back((i * 31 + seed * 7) % 298);
    r.sampling.max_tokens = max_tokens;
    r.sampling.temperature = temp;
    r.sampling.seed = seed;
    r.sampling.ignore_eos = true;
    r.sampling.logprobs = 2;
    return r;
  }

  // What a KV transport does: every layer's copy of each block.
  static void CopyBlocks(Engine& from, const std::vector<int32_t>& src, Engine& to,
                         const std::vector<int32_t>& dst) {
    const kv::KvCacheShape& shape = from.cache()->shape();
    for (int64_t l = 0; l < shape.num_layers; ++l) {
      for (size_t i = 0; i < src.size(); ++i) {
        std::memcpy(to.cache()->block_data(l, dst[i]), from.cache()->block_data(l, src[i]),
                    shape.block_bytes());
      }
    }
  }

  // Prefills every request on `prefill`, moves the KV, decodes them together on `decode`.
  static std::vector<GenerationResult> RunSplit(const std::vector<Request>& requests,
                                                Engine& prefill, Engine& decode) {
    std::vector<PrefilledPrompt> handed;
    for (Request r : requests) {
      r.on_prefilled = [&](const PrefilledPrompt& p) { handed.push_back(p); };
      EXPECT_TRUE(prefill.Add(std::move(r)).ok());
    }
    while (prefill.HasWork()) EXPECT_TRUE(prefill.Step().ok());
    EXPECT_EQ(handed.size(), requests.size());
    std::vector<Request> imported;
    for (size_t i = 0; i < requests.size(); ++i) {
      const PrefilledPrompt& p = handed[i];
      EXPECT_EQ(p.request_id, requests[i].id);  // same prompt lengths finish in order
      const int64_t bt = 16;
      const int64_t total = p.num_tokens + requests[i].sampling.max_tokens;
      auto blocks = decode.ReserveBlocks(kv::BlocksFor(total, bt));
      EXPECT_TRUE(blocks.ok()) << blocks.status();
      const std::vector<int32_t> dst(blocks->begin(), blocks->begin() + p.blocks.size());
      CopyBlocks(prefill, p.blocks, decode, dst);
      EXPECT_TRUE(prefill.ReleasePrefilled(p.request_id).ok());
      Request r = requests[i];
      r.sampling.seed = p.seed;
      r.imported = ImportedPrompt{*blocks, p.first_token, p.first_logprob};
      imported.push_back(std::move(r));
    }
    auto out = decode.Generate(std::move(imported));
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? *out : std::vector<GenerationResult>{};
  }

};

TEST_F(DisaggregatedEngineTest, SplitRunEqualsOneEngineGreedyAndSeeded) {
  std::vector<Request> requests;
  for (int i = 0; i < 6; ++i)
    requests.push_back(MakeRequest("r" + std::to_string(i), 37, 12 + i, i % 2 ? 0.9f : 0.f, 3 + i));
  auto whole = MakeEngine(128)->Generate(requests);
  ASSERT_TRUE(whole.ok()) << whole.status();
  auto prefill = MakeEngine(64, /*batch_tokens=*/48);  // chunked prompts
  auto decode = MakeEngine(64);
  const auto split = RunSplit(requests, *prefill, *decode);
  ASSERT_EQ(split.size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(split[i].token_ids, (*whole)[i].token_ids) << i;
    EXPECT_EQ(split[i].text, (*whole)[i].text) << i;
    ASSERT_EQ(split[i].logprobs.size(), (*whole)[i].logprobs.size());
    // Tokens are batch-invariant; logits only to rounding (kernels block by batch size).
    for (size_t t = 0; t < split[i].logprobs.size(); ++t)
      EXPECT_NEAR(split[i].logprobs[t].logprob, (*whole)[i].logprobs[t].logprob, 1e-4) << i << "/" << t;
  }
  EXPECT_EQ(prefill->allocator().num_free(), 64);
  EXPECT_EQ(prefill->num_prefilled_held(), 0);
  EXPECT_EQ(decode->allocator().num_free(), 64);
}

// A CPU backend shaped like a GPU one with a host mirror: the forward runs on a cache of its
// own, and host_cache() (what a KV transport moves) is a separate copy that only KvToHost and
// KvFromHost fill. A split run over two of them gives one engine's tokens only if the engine
// copies a prefilled prompt out before handing it over and an imported one in before decoding.
class MirroredCpuBackend : public testing::CachelessBackend {
 public:
  static std::unique_ptr<MirroredCpuBackend> Create(model::Model* m, int64_t blocks) {
    auto cpu = backend::CpuBackend::Create(m, blocks, 16);
    EXPECT_TRUE(cpu.ok());
    auto mirror = kv::KvCache::Create((*cpu)->cache_shape());
    EXPECT_TRUE(mirror.ok());
    return std::unique_ptr<MirroredCpuBackend>(
        new MirroredCpuBackend(*std::move(cpu), *std::move(mirror)));
  }
  kv::KvCache* host_cache() override { return mirror_.get(); }
  absl::Status KvToHost(const std::vector<int32_t>& blocks) override {
    ++to_host;
    Copy(device_kv(), blocks, mirror_.get());
    return absl::OkStatus();
  }
  absl::Status KvFromHost(const std::vector<int32_t>& blocks) override {
    ++from_host;
    Copy(*mirror_, blocks, &device_kv());
    return absl::OkStatus();
  }
  const char* name() const override { return "cpu-mirrored"; }

  int to_host = 0, from_host = 0;

 private:
  MirroredCpuBackend(std::unique_ptr<backend::CpuBackend> cpu, std::unique_ptr<kv::KvCache> mirror)
      : CachelessBackend(std::move(cpu)), mirror_(std::move(mirror)) {}
  static void Copy(kv::KvCache& from, const std::vector<int32_t>& blocks, kv::KvCache* to) {
    for (int64_t l = 0; l < from.shape().num_layers; ++l) {
      for (int32_t b : blocks) {
        std::memcpy(to->block_data(l, b), from.block_data(l, b), from.shape().block_bytes());
      }
    }
  }
  std::unique_ptr<kv::KvCache> mirror_;
};

TEST_F(DisaggregatedEngineTest, DeviceCachesHandOverThroughTheirHostMirrors) {
  std::vector<Request> requests;
  for (int i = 0; i < 4; ++i)
    requests.push_back(MakeRequest("m" + std::to_string(i), 30 + 5 * i, 10, i % 2 ? 0.9f : 0.f, 7 + i));
  auto whole = MakeEngine(128)->Generate(requests);
  ASSERT_TRUE(whole.ok()) << whole.status();
  auto prefill_owned = MirroredCpuBackend::Create(model_, 64);
  auto decode_owned = MirroredCpuBackend::Create(model_, 64);
  MirroredCpuBackend* prefill_backend = prefill_owned.get();
  MirroredCpuBackend* decode_backend = decode_owned.get();
  EngineOptions chunked;
  chunked.scheduler.max_batch_tokens = 48;
  auto prefill = Engine::Create(std::move(prefill_owned), tokenizer_, chunked);
  auto decode = Engine::Create(std::move(decode_owned), tokenizer_, EngineOptions{});
  ASSERT_TRUE(prefill.ok() && decode.ok());
  const auto split = RunSplit(requests, **prefill, **decode);
  ASSERT_EQ(split.size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(split[i].token_ids, (*whole)[i].token_ids) << i;
  }
  EXPECT_EQ(prefill_backend->to_host, 4);  // once per handed-over prompt
  EXPECT_EQ(prefill_backend->from_host, 0);
  EXPECT_EQ(decode_backend->from_host, 4);  // once per imported prompt
  EXPECT_EQ(decode_backend->to_host, 0);
}

TEST_F(DisaggregatedEngineTest, PrefilledBlocksAreHeldUntilReleased) {
  auto e = MakeEngine(16);
  Request r = MakeRequest("p", 40, 8, 0.f, 1);
  std::vector<int32_t> blocks;
  r.on_prefilled = [&](const PrefilledPrompt& p) { blocks = p.blocks; };
  std::vector<TokenEvent> events;
  r.on_token = [&](const TokenEvent& ev) { events.push_back(ev); };
  ASSERT_TRUE(e->Add(r).ok());
  while (e->HasWork()) ASSERT_TRUE(e->Step().ok());
  EXPECT_EQ(blocks.size(), 3u);  // 40 tokens in blocks of 16
  EXPECT_TRUE(events.empty());   // a prefill-only request streams nothing
  EXPECT_EQ(e->allocator().num_free(), 13);
  EXPECT_EQ(e->Add(r).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(e->ReleasePrefilled("p").ok());
  EXPECT_EQ(e->allocator().num_free(), 16);
  EXPECT_EQ(e->ReleasePrefilled("p").code(), absl::StatusCode::kNotFound);
}

TEST_F(DisaggregatedEngineTest, ImportRejectsBadBlocksAndTokens) {
  auto e = MakeEngine(16);
  auto reserved = e->ReserveBlocks(3);
  ASSERT_TRUE(reserved.ok());
  EXPECT_EQ(e->allocator().num_free(), 13);
  Request r = MakeRequest("i", 40, 8, 0.f, 1);
  r.imported = ImportedPrompt{{(*reserved)[0], (*reserved)[1]}, 5, std::nullopt};
  EXPECT_NE(e->Add(r).message().find("needs 3 blocks, got 2"), std::string::npos);
  r.imported = ImportedPrompt{{(*reserved)[0], (*reserved)[1], 15}, 5, std::nullopt};
  EXPECT_NE(e->Add(r).message().find("block 15 is not a distinct reserved block"), std::string::npos);
  r.imported = ImportedPrompt{*reserved, 100000, std::nullopt};
  EXPECT_EQ(e->Add(r).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e->ReserveBlocks(14).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(e->ReserveBlocks(0).status().code(), absl::StatusCode::kInvalidArgument);
  e->FreeBlocks(*reserved);
  EXPECT_EQ(e->allocator().num_free(), 16);
}

// max_tokens = 1: the imported first token is the whole generation; blocks come back at once.
TEST_F(DisaggregatedEngineTest, ImportedFirstTokenCanFinishTheRequest) {
  auto e = MakeEngine(16);
  auto reserved = e->ReserveBlocks(3);
  ASSERT_TRUE(reserved.ok());
  Request r = MakeRequest("one", 40, 1, 0.f, 1);
  std::vector<TokenEvent> events;
  r.on_token = [&](const TokenEvent& ev) { events.push_back(ev); };
  r.imported = ImportedPrompt{*reserved, 42, std::nullopt};
  EXPECT_NE(e->Add(r).message().find("no first-token logprob"), std::string::npos);
  r.sampling.logprobs.reset();
  ASSERT_TRUE(e->Add(r).ok());
  EXPECT_FALSE(e->HasWork());
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].token_id, 42);
  EXPECT_EQ(events[0].finish, FinishReason::kLength);
  EXPECT_EQ(e->allocator().num_free(), 16);
}

TEST_F(DisaggregatedEngineTest, LoopRunsPostedWorkAndFailsActiveRequestsOnStop) {
  EngineLoop loop(MakeEngine(64));
  EXPECT_EQ(loop.Call([](Engine& e) { return e.allocator().num_free(); }), 64);
  std::mutex mu;
  std::vector<TokenEvent> events;
  Request r = MakeRequest("long", 10, 100000, 0.f, 1);
  r.on_token = [&](const TokenEvent& ev) {
    std::lock_guard<std::mutex> lock(mu);
    events.push_back(ev);
  };
  ASSERT_TRUE(loop.Call([&](Engine& e) { return e.Add(r); }).ok());
  for (;;) {  // it runs without anyone calling Step
    {
      std::lock_guard<std::mutex> lock(mu);
      if (events.size() >= 3) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  loop.Stop();
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(events.back().finish, FinishReason::kError);
  EXPECT_EQ(events.back().status.code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace preft::engine
