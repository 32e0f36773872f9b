#include "common/engine/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

namespace preft::engine {
namespace {

std::vector<float> Logits() { return {1.f, 3.f, 2.f, 3.f, -1.f, 0.5f}; }

TEST(SamplerTest, GreedyPicksArgmaxLowestIdOnTies) {
  auto l = Logits();
  SamplingParams p;
  std::vector<std::pair<float, int32_t>> scratch;
  EXPECT_EQ(SampleToken(l.data(), 6, p, 1, 0, &scratch), 1);
}

TEST(SamplerTest, SameSeedAndStepSameToken) {
  auto l = Logits();
  SamplingParams p;
  p.temperature = 1.f;
  std::vector<std::pair<float, int32_t>> scratch;
  for (uint64_t step = 0; step < 50; ++step) {
    EXPECT_EQ(SampleToken(l.data(), 6, p, 7, step, &scratch),
              SampleToken(l.data(), 6, p, 7, step, &scratch));
  }
}

TEST(SamplerTest, FrequenciesFollowTheSoftmax) {
  auto l = Logits();
  SamplingParams p;
  p.temperature = 1.f;
  std::vector<std::pair<float, int32_t>> scratch;
  std::map<int32_t, int> counts;
  constexpr int kDraws = 40000;
  for (int i = 0; i < kDraws; ++i) counts[SampleToken(l.data(), 6, p, 3, i, &scratch)]++;
  double z = 0;
  for (float x : l) z += std::exp(x);
  for (int id = 0; id < 6; ++id) {
    const double expected = std::exp(l[id]) / z;
    EXPECT_NEAR(counts[id] / double(kDraws), expected, 0.01) << "token " << id;
  }
}

TEST(SamplerTest, TopKTopPAndMinPRestrictTheSupport) {
  auto l = Logits();
  std::vector<std::pair<float, int32_t>> scratch;
  SamplingParams k2;
  k2.temperature = 1.f;
  k2.top_k = 2;
  SamplingParams p_small;
  p_small.temperature = 1.f;
  p_small.top_p = 0.3f;  // the two 3.0 logits hold ~0.38 each: only the first survives
  SamplingParams min_p;
  min_p.temperature = 1.f;
  min_p.min_p = 0.5f;  // keeps tokens with p >= 0.5 * p_max: ids 1, 3 (and 2: e^-1 < 0.5: no)
  for (int i = 0; i < 2000; ++i) {
    int32_t a = SampleToken(l.data(), 6, k2, 11, i, &scratch);
    EXPECT_TRUE(a == 1 || a == 3) << a;
    EXPECT_EQ(SampleToken(l.data(), 6, p_small, 11, i, &scratch), 1);
    int32_t c = SampleToken(l.data(), 6, min_p, 11, i, &scratch);
    EXPECT_TRUE(c == 1 || c == 3) << c;
  }
}

TEST(SamplerTest, LogprobsAreTheFullLogSoftmax) {
  auto l = Logits();
  TokenLogprob lp = ComputeLogprobs(l.data(), 6, 2, 3);
  double z = 0;
  for (float x : l) z += std::exp(static_cast<double>(x));
  EXPECT_NEAR(lp.logprob, 2.0 - std::log(z), 1e-12);
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].first, 1);
  EXPECT_EQ(lp.top[1].first, 3);
  EXPECT_EQ(lp.top[2].first, 2);
}

// Processed logprobs describe the distribution SampleToken draws from: a proper distribution
// over the kept tokens (-inf elsewhere), whose draws' frequencies they predict.
TEST(SamplerTest, ProcessedLogprobsAreTheDistributionSampledFrom) {
  const std::vector<float> l = {1.0f, 2.5f, 0.3f, 2.0f, -1.0f, 1.7f};
  std::vector<std::pair<float, int32_t>> scratch;
  SamplingParams p;
  p.temperature = 0.7f;
  // Temperature alone: log_softmax(logits / T).
  double z = 0;
  for (float x : l) z += std::exp(static_cast<double>(x / 0.7f));
  for (int t = 0; t < 6; ++t) {
    const TokenLogprob lp = ComputeProcessedLogprobs(l.data(), 6, p, t, 0, &scratch);
    EXPECT_NEAR(lp.logprob, static_cast<double>(l[t] / 0.7f) - std::log(z), 1e-6) << t;
  }
  // With top-k, top-p and min-p: mass 1 over the kept tokens, and draws follow it.
  p.top_k = 4;
  p.top_p = 0.95f;
  p.min_p = 0.2f;
  double mass = 0;
  std::map<int32_t, double> prob;
  for (int t = 0; t < 6; ++t) {
    const TokenLogprob lp = ComputeProcessedLogprobs(l.data(), 6, p, t, 0, &scratch);
    if (std::isfinite(lp.logprob)) prob[t] = std::exp(lp.logprob);
    mass += std::exp(lp.logprob);
  }
  EXPECT_NEAR(mass, 1.0, 1e-12);
  EXPECT_LT(prob.size(), 6u);
  std::map<int32_t, int> counts;
  const int n = 40000;
  for (int step = 0; step < n; ++step) ++counts[SampleToken(l.data(), 6, p, 17, step, &scratch)];
  for (const auto& [t, c] : counts) {
    ASSERT_TRUE(prob.count(t)) << "drew token " << t << " whose processed logprob is -inf";
    EXPECT_NEAR(static_cast<double>(c) / n, prob[t], 0.01) << t;
  }
  // Alternatives are the most likely kept tokens; greedy reports the raw softmax.
  const TokenLogprob top = ComputeProcessedLogprobs(l.data(), 6, p, 1, 3, &scratch);
  ASSERT_GE(top.top.size(), 1u);
  EXPECT_EQ(top.top[0].first, 1);
  EXPECT_NEAR(top.top[0].second, top.logprob, 1e-15);
  p.temperature = 0;
  p.logprobs = 0;
  p.logprobs_mode = LogprobsMode::kProcessed;
  EXPECT_EQ(LogprobsFor(l.data(), 6, p, 3, &scratch).logprob,
            ComputeLogprobs(l.data(), 6, 3, 0).logprob);
}

TEST(SamplingParamsTest, RejectsBadValuesNamingTheField) {
  SamplingParams p;
  p.top_p = 0.f;
  EXPECT_NE(p.Validate(10).message().find("top_p"), std::string::npos);
  p = {};
  p.temperature = -1.f;
  EXPECT_NE(p.Validate(10).message().find("temperature"), std::string::npos);
  p = {};
  p.max_tokens = 0;
  EXPECT_NE(p.Validate(10).message().find("max_tokens"), std::string::npos);
  p = {};
  p.stop_token_ids = {10};
  EXPECT_NE(p.Validate(10).message().find("stop_token_ids"), std::string::npos);
  p = {};
  p.stop = {""};
  EXPECT_EQ(p.Validate(10).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SamplingParams{}.Validate(10).ok());
}

}  // namespace
}  // namespace preft::engine
