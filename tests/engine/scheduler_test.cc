#include "common/engine/scheduler.h"

#include <gtest/gtest.h>

namespace preft::engine {
namespace {

SchedulerConfig Config(int64_t budget, int64_t max_running = 256) {
  SchedulerConfig c;
  c.max_batch_tokens = budget;
  c.max_running = max_running;
  c.block_tokens = 16;
  return c;
}

TEST(SchedulerTest, DecodeTokensComeBeforePromptChunks) {
  // Two decoding sequences and one waiting 100-token prompt, budget 40.
  std::vector<SequenceView> running = {{33, 32, 2}, {17, 16, 1}};
  std::vector<SequenceView> waiting = {{100, 0, 0}};
  ScheduleDecision d = Schedule(Config(40), running, waiting, 100, 100);
  ASSERT_EQ(d.items.size(), 3u);
  EXPECT_TRUE(d.items[0].running);
  EXPECT_EQ(d.items[0].num_new, 1);
  EXPECT_EQ(d.items[0].new_blocks, 1);  // token 33 starts a third block
  EXPECT_EQ(d.items[1].num_new, 1);
  EXPECT_EQ(d.items[1].new_blocks, 1);
  EXPECT_FALSE(d.items[2].running);
  EXPECT_EQ(d.items[2].num_new, 38);  // chunked: rest of the budget
  EXPECT_EQ(d.items[2].new_blocks, 3);
}

TEST(SchedulerTest, ChunkedPrefillContinuesNextStep) {
  std::vector<SequenceView> running = {{100, 38, 3}};
  ScheduleDecision d = Schedule(Config(40), running, {}, 100, 100);
  ASSERT_EQ(d.items.size(), 1u);
  EXPECT_EQ(d.items[0].num_new, 40);
  EXPECT_EQ(d.items[0].new_blocks, 2);  // 78 tokens -> 5 blocks
}

TEST(SchedulerTest, AdmissionIsFcfsByFreeBlocks) {
  std::vector<SequenceView> waiting = {{40, 0, 0}, {10, 0, 0}};
  // The first needs 3 blocks, only 2 free: nothing is admitted, the second does not overtake.
  ScheduleDecision d = Schedule(Config(512), {}, waiting, 2, 100);
  EXPECT_TRUE(d.items.empty());
  EXPECT_TRUE(d.rejected.empty());
}

TEST(SchedulerTest, PromptWhoseAdapterIsNotReadyIsPassedOver) {
  // The first prompt's adapter is still being copied: the second is admitted in its place,
  // and the first neither takes budget nor blocks, nor is rejected.
  std::vector<SequenceView> waiting = {{40, 0, 0, /*ready=*/false}, {10, 0, 0}};
  ScheduleDecision d = Schedule(Config(512), {}, waiting, 100, 100);
  ASSERT_EQ(d.items.size(), 1u);
  EXPECT_FALSE(d.items[0].running);
  EXPECT_EQ(d.items[0].index, 1);
  EXPECT_EQ(d.items[0].num_new, 10);
  EXPECT_TRUE(d.rejected.empty());
  // Once ready it is admitted first again (arrival order).
  waiting[0].ready = true;
  d = Schedule(Config(512), {}, waiting, 100, 100);
  ASSERT_EQ(d.items.size(), 2u);
  EXPECT_EQ(d.items[0].index, 0);
  EXPECT_EQ(d.items[1].index, 1);
}

TEST(SchedulerTest, PromptThatCanNeverFitIsRejected) {
  std::vector<SequenceView> waiting = {{160, 0, 0}, {10, 0, 0}};
  // 160 tokens + 1 generated need 11 blocks; the whole cache has 10.
  ScheduleDecision d = Schedule(Config(512), {}, waiting, 10, 10);
  ASSERT_EQ(d.rejected.size(), 1u);
  EXPECT_EQ(d.rejected[0], 0);
  ASSERT_EQ(d.items.size(), 1u);
  EXPECT_EQ(d.items[0].index, 1);
}

TEST(SchedulerTest, NewestRunningSequenceIsPreemptedWhenBlocksRunOut) {
  // Both sit at a block boundary and need one more block; only one is free... none free.
  std::vector<SequenceView> running = {{33, 32, 2}, {17, 16, 1}, {49, 48, 3}};
  ScheduleDecision d = Schedule(Config(512), running, {}, 0, 6);
  ASSERT_EQ(d.preempted.size(), 1u);
  EXPECT_EQ(d.preempted[0], 2);  // newest frees 3 blocks: enough for the other two
  ASSERT_EQ(d.items.size(), 2u);
  EXPECT_EQ(d.items[0].index, 0);
  EXPECT_EQ(d.items[1].index, 1);
}

TEST(SchedulerTest, MaxRunningCapsAdmission) {
  std::vector<SequenceView> running = {{17, 16, 2}};
  std::vector<SequenceView> waiting = {{5, 0, 0}, {5, 0, 0}};
  ScheduleDecision d = Schedule(Config(512, 2), running, waiting, 100, 100);
  ASSERT_EQ(d.items.size(), 2u);  // the running one + one admitted
  EXPECT_FALSE(d.items[1].running);
  EXPECT_EQ(d.items[1].index, 0);
}

TEST(SchedulerTest, IsAPureFunction) {
  std::vector<SequenceView> running = {{33, 32, 2}, {200, 100, 7}};
  std::vector<SequenceView> waiting = {{64, 0, 0}, {300, 0, 0}};
  ScheduleDecision a = Schedule(Config(128), running, waiting, 20, 40);
  ScheduleDecision b = Schedule(Config(128), running, waiting, 20, 40);
  ASSERT_EQ(a.items.size(), b.items.size());
  for (size_t i = 0; i < a.items.size(); ++i) {
    EXPECT_EQ(a.items[i].index, b.items[i].index);
    EXPECT_EQ(a.items[i].num_new, b.items[i].num_new);
  }
  int64_t tokens = 0;
  for (const auto& it : a.items) tokens += it.num_new;
  EXPECT_LE(tokens, 128);
}

}  // namespace
}  // namespace preft::engine
