// Prefix caching through the engine (issue 38): hits are bit-exact against cold runs for the
// base model and every adapter mode, the salt keeps adapters, versions and masks apart, the
// multi-turn rule holds on both sides, and the cache never costs an admission or a block.

#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/adapters/adapter_loader.h"
#include "common/engine/engine.h"
#include "common/model/model.h"
#include "tests/engine/tiny_engine_fixture.h"
#include "tests/testing/fixtures.h"

namespace preft {
namespace {

using engine::Engine;
using engine::GenerationResult;
using engine::Request;
using model::AdapterPositions;
using model::AdapterWeights;

constexpr int64_t kBt = 16;

std::shared_ptr<AdapterWeights> LoadFixtureAdapter(const std::string& name,
                                                   const model::ModelConfig& c) {
  auto a = adapters::LoadAdapter(testing::TinyLlamaFixture() + "/" + name, c);
  EXPECT_TRUE(a.ok()) << a.status();
  return a.ok() ? std::shared_ptr<AdapterWeights>(std::move(a).value()) : nullptr;
}

struct Mode {
  std::string name;
  std::shared_ptr<const AdapterWeights> adapter;
  std::optional<AdapterPositions> positions;
};

class PrefixCacheEngineTest : public engine::TinyEngineTest {
 protected:
  static std::unique_ptr<Engine> MakeEngine(bool caching, int64_t blocks = 64,
                                            int64_t max_cached = 0, int64_t batch_tokens = 512,
                                            int64_t max_running = 256) {
    engine::EngineOptions o;
    o.scheduler.max_running = max_running;
    o.kv_blocks = blocks;
    o.prefix_caching = caching;
    o.max_cached_blocks = max_cached;
    o.scheduler.max_batch_tokens = batch_tokens;
    return TinyEngineTest::MakeEngine(o);
  }

  static Request MakeRequest(const std::string& id, std::vector<int32_t> prompt, int max_tokens,
                             const Mode& mode = {}) {
    Request r;
    r.id = id;
    r.prompt_ids = std::move(prompt);
    r.sampling.max_tokens = max_tokens;
    r.sampling.ignore_eos = true;
    r.sampling.logprobs = 3;
    r.adapter.weights = mode.adapter;
    r.adapter.name = mode.name;
    r.adapter.positions = mode.positions;
    return r;
  }

  static GenerationResult Run(Engine* e, Request r) {
    auto out = e->Generate({std::move(r)});
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? out->at(0) : GenerationResult{};
  }

  // The modes of the product: base, LoRA and LoRAP, DiReFT and DiReFTP.
  static std::vector<Mode> Modes() {
    auto lora = LoadFixtureAdapter("lora", model_->config());
    auto direft = LoadFixtureAdapter("direft", model_->config());
    return {{"base", nullptr, std::nullopt},
            {"lora", lora, AdapterPositions::kAll},
            {"lorap", lora, AdapterPositions::kPrompt},
            {"direft", direft, AdapterPositions::kAll},
            {"direftp", direft, AdapterPositions::kPrompt}};
  }

};

std::vector<int32_t> Tokens(int n, int32_t seed) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = 3 + (seed * 131 + i * 37) % 250;
  return t;
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Bit for bit: tokens and every logprob.
void ExpectIdentical(const GenerationResult& got, const GenerationResult& want,
                     const std::string& what) {
  EXPECT_EQ(got.token_ids, want.token_ids) << what;
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size()) << what;
  for (size_t i = 0; i < got.logprobs.size(); ++i) {
    EXPECT_EQ(got.logprobs[i].logprob, want.logprobs[i].logprob) << what << " step " << i;
    EXPECT_EQ(got.logprobs[i].top, want.logprobs[i].top) << what << " step " << i;
  }
}

// A request whose prompt starts with a cached run computes only the rest, and generates
// exactly what it does cold, for the base model and every adapter mode; a prompt cached whole
// recomputes its last block (its logits are needed).
TEST_F(PrefixCacheEngineTest, HitsAreExactForBaseAndEveryAdapterMode) {
  const std::vector<int32_t> system = Tokens(40, 1);
  for (const Mode& mode : Modes()) {
    SCOPED_TRACE(mode.name);
    const Request second = MakeRequest("b", Concat(system, Tokens(9, 3)), 12, mode);
    const GenerationResult cold = Run(MakeEngine(false).get(), second);
    EXPECT_EQ(cold.cached_prompt_tokens, 0);
    auto e = MakeEngine(true);
    const GenerationResult first = Run(e.get(), MakeRequest("a", Concat(system, Tokens(9, 2)), 12, mode));
    EXPECT_EQ(first.cached_prompt_tokens, 0);
    const GenerationResult warm = Run(e.get(), second);
    EXPECT_EQ(warm.cached_prompt_tokens, 32);  // two full blocks of the shared 40 tokens
    ExpectIdentical(warm, cold, "shared system prompt");
    const GenerationResult again = Run(e.get(), second);  // 49 tokens: 3 full blocks cached
    EXPECT_EQ(again.cached_prompt_tokens, 48);
    ExpectIdentical(again, cold, "whole prompt cached");
    const Request exact = MakeRequest("c", Tokens(48, 4), 12, mode);  // a multiple of a block
    const GenerationResult exact_cold = Run(MakeEngine(false).get(), exact);
    Run(e.get(), exact);
    const GenerationResult exact_warm = Run(e.get(), exact);
    EXPECT_EQ(exact_warm.cached_prompt_tokens, 32);  // the last block is recomputed
    ExpectIdentical(exact_warm, exact_cold, "block-aligned prompt");
    EXPECT_EQ(e->allocator().num_free(), 64);
  }
}

// Blocks are shared only where their KV is the same: never across adapters, versions (a new
// load of the same files is a new version) or the base model; across the prompt and
// all-position modes of one adapter only where the adapter ran on the same tokens.
TEST_F(PrefixCacheEngineTest, TheSaltKeepsAdaptersVersionsAndMasksApart) {
  const std::vector<Mode> modes = Modes();
  const auto lora_v2 = LoadFixtureAdapter("lora", model_->config());
  const std::vector<int32_t> prompt = Tokens(50, 5);
  auto e = MakeEngine(true);
  Run(e.get(), MakeRequest("base", prompt, 4, modes[0]));
  EXPECT_EQ(Run(e.get(), MakeRequest("lorap", prompt, 4, modes[2])).cached_prompt_tokens, 0);
  EXPECT_EQ(Run(e.get(), MakeRequest("direftp", prompt, 4, modes[4])).cached_prompt_tokens, 0);
  EXPECT_EQ(Run(e.get(), MakeRequest("v2", prompt, 4, {"lora", lora_v2, AdapterPositions::kPrompt}))
                .cached_prompt_tokens,
            0);
  EXPECT_EQ(Run(e.get(), MakeRequest("base2", prompt, 4, modes[0])).cached_prompt_tokens, 48);
  // LoRA on all positions runs on every prompt token, as LoRAP does: the prompt's KV is the
  // same, so it is shared (and exact).
  const Request lora_all = MakeRequest("lora", prompt, 8, modes[1]);
  const GenerationResult warm = Run(e.get(), lora_all);
  EXPECT_EQ(warm.cached_prompt_tokens, 48);
  ExpectIdentical(warm, Run(MakeEngine(false).get(), lora_all), "LoRA over LoRAP's prompt");
}

// pyreft's "l3" selects the last three prompt positions, so a block's mask depends on the
// prompt's length: a longer prompt with the same first 48 tokens reuses the blocks whose mask
// is the same (0-31) and not the one that held the shorter prompt's selected positions.
TEST_F(PrefixCacheEngineTest, LengthDependentPositionsReuseOnlyBlocksWithTheSameMask) {
  std::shared_ptr<AdapterWeights> last3 = LoadFixtureAdapter("direft", model_->config());
  ASSERT_TRUE(model::PromptSelection::Parse("l3", &last3->prompt_selection));
  const Mode mode{"direft-l3", last3, AdapterPositions::kPrompt};
  const std::vector<int32_t> shorter = Tokens(50, 6);  // selects 47, 48, 49
  const std::vector<int32_t> longer = Concat(std::vector<int32_t>(shorter.begin(), shorter.begin() + 48),
                                             Tokens(20, 7));  // selects 65, 66, 67
  const Request r = MakeRequest("long", longer, 10, mode);
  const GenerationResult cold = Run(MakeEngine(false).get(), r);
  auto e = MakeEngine(true);
  Run(e.get(), MakeRequest("short", shorter, 10, mode));
  const GenerationResult warm = Run(e.get(), r);
  EXPECT_EQ(warm.cached_prompt_tokens, 32);  // block 2 (32-47) held selected position 47
  ExpectIdentical(warm, cold, "l3 across lengths");
}

// Multi-turn chat: turn 2's prompt is turn 1's prompt, its reply and a new message. A
// prompt-only adapter ran on turn 1's prompt, not on its reply; in turn 2 the reply is prompt
// and adapted, so only turn 1's prompt blocks serve it. A base conversation reuses the reply's
// blocks too. Both exact.
TEST_F(PrefixCacheEngineTest, AReplyDecodedWithoutTheAdapterServesOnlyBaseConversations) {
  const std::vector<Mode> modes = Modes();
  for (const Mode& mode : {modes[0], modes[2], modes[4]}) {
    SCOPED_TRACE(mode.name);
    auto e = MakeEngine(true);
    const std::vector<int32_t> turn1 = Tokens(32, 8);
    const GenerationResult reply = Run(e.get(), MakeRequest("t1", turn1, 32, mode));
    ASSERT_EQ(reply.token_ids.size(), 32u);
    const Request turn2 = MakeRequest("t2", Concat(Concat(turn1, reply.token_ids), Tokens(7, 9)), 8, mode);
    const GenerationResult warm = Run(e.get(), turn2);
    // In the cache: the prompt and 31 reply tokens (the last was sampled, never fed back).
    EXPECT_EQ(warm.cached_prompt_tokens, mode.adapter == nullptr ? 48 : 32);
    ExpectIdentical(warm, Run(MakeEngine(false).get(), turn2), "turn 2");
  }
}

// Loading an adapter again (UpdateAdapter) makes a new version at once: its requests never read
// the old version's blocks, while a request admitted on the old version finishes on them.
TEST_F(PrefixCacheEngineTest, ANewVersionNeverReadsTheOldVersionsBlocks) {
  const Mode v1{"lora", LoadFixtureAdapter("lora", model_->config()), AdapterPositions::kPrompt};
  const Mode v2{"lora", LoadFixtureAdapter("lora", model_->config()), AdapterPositions::kPrompt};
  const std::vector<int32_t> prompt = Tokens(40, 10);
  auto e = MakeEngine(true);
  Run(e.get(), MakeRequest("v1", prompt, 4, v1));
  ASSERT_TRUE(e->Add(MakeRequest("old", prompt, 30, v1)).ok());
  ASSERT_TRUE(e->Step().ok());  // admitted on v1's cached blocks
  const GenerationResult fresh = Run(e.get(), MakeRequest("v2", prompt, 4, v2));
  EXPECT_EQ(fresh.cached_prompt_tokens, 0);
  EXPECT_EQ(e->allocator().num_free(), 64);
}

// Under KV pressure the cache gives blocks back: with room for two sequences, a stream of
// prompts in pairs that share a prefix (run one at a time, so the second finds the first's
// blocks) all finish as they do without the cache, evicting cached blocks on the way; and a
// prompt that needs every block fits while the cache is full.
TEST_F(PrefixCacheEngineTest, EvictionUnderPressureNeverFailsAnAdmission) {
  std::vector<Request> reqs;
  for (int i = 0; i < 24; ++i) {
    reqs.push_back(MakeRequest("r" + std::to_string(i), Tokens(40 + i % 5, i / 2), 20));
  }
  auto cold = MakeEngine(false, /*blocks=*/8, 0, 512, /*max_running=*/1)->Generate(reqs);
  auto e = MakeEngine(true, /*blocks=*/8, 0, 512, /*max_running=*/1);
  auto warm = e->Generate(reqs);
  ASSERT_TRUE(cold.ok() && warm.ok());
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE((*warm)[i].status.ok()) << (*warm)[i].status;
    ExpectIdentical((*warm)[i], (*cold)[i], reqs[i].id);
    EXPECT_EQ((*warm)[i].cached_prompt_tokens, i % 2 == 0 ? 0 : 32) << reqs[i].id;
  }
  EXPECT_GT(e->allocator().evictions(), 0);
  EXPECT_EQ(e->allocator().num_free(), 8);
  EXPECT_GT(e->allocator().num_cached(), 0);
  const GenerationResult big = Run(e.get(), MakeRequest("big", Tokens(120, 11), 7));
  EXPECT_TRUE(big.status.ok()) << big.status;
  EXPECT_EQ(big.token_ids.size(), 7u);
}

// Thousands of requests over a few shared prefixes, random adapters, aborts at random steps and
// a cache small enough to preempt: every request ends, every block comes back, the cap holds.
TEST_F(PrefixCacheEngineTest, NoBlockLeaksUnderRandomAdmitAbortFinish) {
  const std::vector<Mode> modes = Modes();
  auto e = MakeEngine(true, /*blocks=*/24, /*max_cached=*/16, /*batch_tokens=*/64);
  std::mt19937_64 rng(3);
  int next = 0, aborted = 0;
  std::vector<std::string> live;
  std::set<std::string> ended;
  for (int step = 0; step < 3000; ++step) {
    std::erase_if(live, [&](const std::string& id) { return ended.count(id) > 0; });
    if (live.size() < 6 && rng() % 2 == 0) {
      const std::string id = "q" + std::to_string(next++);
      const std::vector<int32_t> prompt =
          Concat(Tokens(16 * static_cast<int>(1 + rng() % 3), static_cast<int32_t>(rng() % 3)),
                 Tokens(static_cast<int>(rng() % 20), static_cast<int32_t>(rng() % 50)));
      Request r = MakeRequest(id, prompt, 1 + static_cast<int>(rng() % 24),
                              modes[rng() % modes.size()]);
      r.on_token = [&ended](const engine::TokenEvent& ev) {
        if (ev.finish != engine::FinishReason::kNone) ended.insert(ev.request_id);
      };
      ASSERT_TRUE(e->Add(std::move(r)).ok());
      live.push_back(id);
    }
    if (!live.empty() && rng() % 9 == 0) {
      const size_t i = rng() % live.size();
      if (e->Abort(live[i]).ok()) ++aborted;
      live.erase(live.begin() + static_cast<long>(i));
    }
    if (e->HasWork()) {
      ASSERT_TRUE(e->Step().ok());
    }
    ASSERT_LE(e->allocator().num_cached(), 16);
  }
  while (e->HasWork()) {
    ASSERT_TRUE(e->Step().ok());
  }
  EXPECT_EQ(e->allocator().num_free(), 24);
  for (int32_t b = 0; b < 24; ++b) EXPECT_EQ(e->allocator().ref_count(b), 0) << b;
  EXPECT_GT(next, 1000);
  EXPECT_GT(aborted, 50);
  EXPECT_GT(e->stats().prefix_hit_tokens, 1000);
  EXPECT_GT(e->stats().preemptions, 0);
}

// A prefill-only request (the prefill tier) skips its cached prefix too and hands over the
// whole prompt's blocks, the cached ones shared; its first token and logprob are the cold ones.
TEST_F(PrefixCacheEngineTest, PrefillOnlyRequestsHandOverSharedBlocks) {
  const Mode lorap = Modes()[2];
  const std::vector<int32_t> system = Tokens(36, 12);
  auto prefill = [&](Engine* e, const std::string& id, const std::vector<int32_t>& prompt) {
    engine::PrefilledPrompt got;
    Request r = MakeRequest(id, prompt, 8, lorap);
    r.on_prefilled = [&](const engine::PrefilledPrompt& p) { got = p; };
    EXPECT_TRUE(e->Generate({std::move(r)}).ok());
    return got;
  };
  auto cold_engine = MakeEngine(false);
  const engine::PrefilledPrompt cold = prefill(cold_engine.get(), "b", Concat(system, Tokens(5, 13)));
  auto e = MakeEngine(true);
  const engine::PrefilledPrompt first = prefill(e.get(), "a", Concat(system, Tokens(5, 14)));
  const engine::PrefilledPrompt warm = prefill(e.get(), "b", Concat(system, Tokens(5, 13)));
  EXPECT_EQ(warm.cached_tokens, 32);
  EXPECT_EQ(warm.first_token, cold.first_token);
  ASSERT_TRUE(warm.first_logprob && cold.first_logprob);
  EXPECT_EQ(warm.first_logprob->logprob, cold.first_logprob->logprob);
  ASSERT_EQ(warm.blocks.size(), 3u);
  EXPECT_EQ(warm.blocks[0], first.blocks[0]);  // shared while both are held
  EXPECT_EQ(warm.blocks[1], first.blocks[1]);
  EXPECT_NE(warm.blocks[2], first.blocks[2]);
  EXPECT_EQ(e->allocator().ref_count(first.blocks[0]), 2);
  ASSERT_TRUE(e->ReleasePrefilled("a").ok());
  ASSERT_TRUE(e->ReleasePrefilled("b").ok());
  EXPECT_EQ(e->allocator().num_free(), 64);
}

}  // namespace
}  // namespace preft
