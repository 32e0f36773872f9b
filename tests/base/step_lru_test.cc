#include "common/base/step_lru.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

namespace preft::base {
namespace {

TEST(StepLruTest, DropsLeastRecentlyUsedFirstUntilTheIncomingBytesFit) {
  StepLru lru(100);
  lru.Insert(1, 40);
  lru.BeginStep();
  lru.Insert(2, 40);
  lru.BeginStep();
  lru.Touch(1);  // 1 is now more recent than 2
  lru.BeginStep();
  EXPECT_EQ(lru.bytes(), 80u);
  EXPECT_TRUE(lru.MakeRoom(20).empty());  // 100 fits exactly
  EXPECT_EQ(lru.MakeRoom(30), std::vector<uint64_t>{2});
  EXPECT_FALSE(lru.Contains(2));
  EXPECT_TRUE(lru.Contains(1));
  EXPECT_EQ(lru.bytes(), 40u);
  EXPECT_EQ(lru.MakeRoom(100), std::vector<uint64_t>{1});
  EXPECT_EQ(lru.bytes(), 0u);
  EXPECT_EQ(lru.size(), 0u);
}

TEST(StepLruTest, NeverDropsWhatTheCurrentStepUses) {
  StepLru lru(50);
  lru.Insert(1, 30);
  lru.BeginStep();
  lru.Insert(2, 30);  // over budget within one step: allowed
  lru.Touch(1);
  EXPECT_TRUE(lru.MakeRoom(30).empty());
  EXPECT_EQ(lru.bytes(), 60u);
  lru.BeginStep();
  lru.Touch(2);
  // 1 is the only candidate: dropping it is not enough for 30 more, but it goes.
  EXPECT_EQ(lru.MakeRoom(30), std::vector<uint64_t>{1});
  EXPECT_EQ(lru.bytes(), 30u);
  EXPECT_TRUE(lru.MakeRoom(30).empty());
}

TEST(StepLruTest, ShrinkToZeroKeepsOnlyTheCurrentStep) {
  StepLru lru(StepLru::kNoBudget);
  lru.Insert(1, 5);
  lru.Insert(2, 5);
  lru.BeginStep();
  lru.Insert(3, 5);
  EXPECT_TRUE(lru.MakeRoom(1000).empty());  // no budget: nothing to make room for
  EXPECT_EQ(lru.ShrinkTo(0), (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(lru.bytes(), 5u);
  EXPECT_TRUE(lru.Contains(3));
}

TEST(StepLruTest, EraseForgetsAKeyAndItsBytes) {
  StepLru lru(10);
  lru.Insert(7, 4);
  lru.Erase(7);
  lru.Erase(7);  // absent: nothing happens
  EXPECT_EQ(lru.bytes(), 0u);
  lru.Insert(7, 6);  // may come back
  EXPECT_EQ(lru.bytes(), 6u);
}

// Random steps against a brute-force model: bytes exact, the budget kept whenever the step's
// own entries allow it, victims always the oldest entries outside the step.
TEST(StepLruTest, MatchesABruteForceModelOverRandomSteps) {
  std::mt19937 rng(3);
  StepLru lru(1000);
  struct Model {
    size_t bytes;
    uint64_t last_use;  // global use counter
    uint64_t step;
  };
  std::map<uint64_t, Model> model;
  uint64_t clock = 0, step = 0;
  for (int s = 0; s < 2000; ++s) {
    lru.BeginStep();
    ++step;
    const int uses = 1 + rng() % 4;
    for (int u = 0; u < uses; ++u) {
      const uint64_t key = rng() % 40;
      if (lru.Contains(key)) {
        ASSERT_TRUE(model.contains(key));
        lru.Touch(key);
        model[key].last_use = ++clock;
        model[key].step = step;
        continue;
      }
      ASSERT_FALSE(model.contains(key));
      const size_t bytes = 50 + rng() % 200;
      // Expected victims: oldest first, outside this step, until the bytes fit.
      std::vector<std::pair<uint64_t, uint64_t>> by_age;
      size_t total = 0;
      for (const auto& [k, m] : model) {
        total += m.bytes;
        by_age.push_back({m.last_use, k});
      }
      std::sort(by_age.begin(), by_age.end());
      std::vector<uint64_t> expect;
      for (const auto& [age, k] : by_age) {
        if (total + bytes <= 1000 || model[k].step == step) break;
        total -= model[k].bytes;
        expect.push_back(k);
      }
      ASSERT_EQ(lru.MakeRoom(bytes), expect) << "step " << s;
      for (uint64_t k : expect) model.erase(k);
      lru.Insert(key, bytes);
      model[key] = {bytes, ++clock, step};
      size_t sum = 0;
      for (const auto& [k, m] : model) sum += m.bytes;
      ASSERT_EQ(lru.bytes(), sum);
      ASSERT_EQ(lru.size(), model.size());
    }
  }
}

}  // namespace
}  // namespace preft::base
