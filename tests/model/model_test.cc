#include "common/model/model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "common/base/mapped_file.h"
#include "common/engine/engine.h"
#include "nlohmann/json.hpp"
#include "tests/testing/fixtures.h"

namespace preft::model {
namespace {

// The fixture's `base` cases: greedy tokens identical, logprobs within 1e-4 (chosen token
// and the top-5 alternatives).
TEST(ModelTest, ReproducesFixtureBaseCases) {
  const std::string dir = testing::TinyLlamaFixture();
  auto model = Model::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  auto text = base::ReadFileToString(dir + "/reference.json");
  ASSERT_TRUE(text.ok());
  const nlohmann::json ref = nlohmann::json::parse(*text);
  engine::EngineOptions options;
  options.kv_blocks = 64;
  auto eng = engine::Engine::Create(model->get(), nullptr, options);
  ASSERT_TRUE(eng.ok());
  int cases = 0;
  double max_diff = 0;
  for (const auto& c : ref["cases"]) {
    if (c["mode"] != "base") continue;
    engine::Request r;
    r.id = "case" + std::to_string(cases++);
    r.prompt_ids = c["prompt_ids"].get<std::vector<int32_t>>();
    r.sampling.max_tokens = static_cast<int32_t>(c["token_ids"].size());
    r.sampling.ignore_eos = true;
    r.sampling.logprobs = 5;
    std::vector<engine::Request> reqs;
    reqs.push_back(std::move(r));
    auto out = (*eng)->Generate(std::move(reqs));
    ASSERT_TRUE(out.ok()) << out.status();
    const auto& res = out->front();
    EXPECT_EQ(res.token_ids, c["token_ids"].get<std::vector<int32_t>>()) << "case " << cases;
    for (size_t i = 0; i < res.logprobs.size(); ++i) {
      const auto& want = c["logprobs"][i];
      max_diff = std::max(max_diff, std::abs(res.logprobs[i].logprob - want["logprob"].get<double>()));
      for (size_t k = 0; k < 5; ++k) {
        EXPECT_EQ(res.logprobs[i].top[k].first, want["top"][k][0].get<int32_t>());
        max_diff = std::max(max_diff,
                            std::abs(res.logprobs[i].top[k].second - want["top"][k][1].get<double>()));
      }
    }
  }
  EXPECT_EQ(cases, 3);
  EXPECT_LT(max_diff, 1e-4);
  std::printf("fixture base cases: max |logprob diff| = %.3g\n", max_diff);
}

// A batch that names blocks outside the cache, a cache of another model's shape, or fewer
// blocks than its context: InvalidArgument naming the problem, never a write out of bounds.
TEST(ModelTest, ForwardRefusesBatchesThatDoNotFitTheCache) {
  auto model = Model::Load(testing::TinyLlamaFixture());
  ASSERT_TRUE(model.ok()) << model.status();
  auto cache = kv::KvCache::Create((*model)->CacheShape(4));
  ASSERT_TRUE(cache.ok());
  base::AlignedVector<float> logits;
  const std::vector<int32_t> tokens = {1, 2, 3};
  struct Case {
    std::vector<int32_t> blocks;
    int64_t context_len;
    const char* message;
  };
  for (const Case& c : {Case{{4}, 3, "outside the cache"}, Case{{-1}, 3, "outside the cache"},
                        Case{{0}, 20, "cannot hold"}}) {
    ForwardBatch batch;
    batch.AddSequence(c.blocks.data(), 1, tokens.data(), 3, c.context_len, true);
    const absl::Status s = (*model)->Forward(batch, cache->get(), &logits);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(c.message), std::string::npos) << s;
  }
  const kv::KvCacheShape shape = (*model)->CacheShape(4);
  auto other = kv::KvCache::Create({shape.num_layers + 1, 4, 16, shape.num_kv_heads, shape.head_dim});
  ASSERT_TRUE(other.ok());
  const std::vector<int32_t> block = {0};
  ForwardBatch batch;
  batch.AddSequence(block.data(), 1, tokens.data(), 3, 3, true);
  const absl::Status s = (*model)->Forward(batch, other->get(), &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("does not match the model"), std::string::npos) << s;
}

TEST(ModelTest, MissingFolderIsNotFound) {
  auto model = Model::Load("/nonexistent/model");
  EXPECT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("/nonexistent/model"), std::string::npos)
      << model.status();
}

}  // namespace
}  // namespace preft::model
