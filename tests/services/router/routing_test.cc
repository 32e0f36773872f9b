#include "services/router/routing.h"

#include <gtest/gtest.h>

#include "services/router/worker_pool.h"

namespace preft::router {
namespace {

DecodeView Decode(int64_t free, int64_t running, bool healthy = true, bool draining = false) {
  DecodeView v;
  v.healthy = healthy;
  v.draining = draining;
  v.free_blocks = free;
  v.total_blocks = 100;
  v.running = running;
  return v;
}

TEST(RoutingTest, BlocksCoverPromptAndEveryNewToken) {
  EXPECT_EQ(BlocksNeeded(16, 0, 16), 1);
  EXPECT_EQ(BlocksNeeded(16, 1, 16), 2);
  EXPECT_EQ(BlocksNeeded(100, 28, 16), 8);
}

TEST(RoutingTest, DecodePrefersMostFreeThenLightestAndSkipsTheUnfit) {
  const std::vector<DecodeView> w = {Decode(10, 0), Decode(50, 9), Decode(50, 2), Decode(3, 0),
                                     Decode(90, 0, /*healthy=*/false),
                                     Decode(90, 0, true, /*draining=*/true)};
  EXPECT_EQ(RankDecode(w, 4), (std::vector<size_t>{2, 1, 0}));
  EXPECT_TRUE(RankDecode(w, 60).empty());
}

TEST(RoutingTest, ADecodeWorkerWithASuspectKvPathIsALastResort) {
  std::vector<DecodeView> w = {Decode(90, 0), Decode(20, 5), Decode(10, 0)};
  w[0].kv_path_suspect = true;  // the most room, but its KV path just failed
  EXPECT_EQ(RankDecode(w, 4), (std::vector<size_t>{1, 2, 0}));
  EXPECT_EQ(RankDecode(w, 30), (std::vector<size_t>{0}));  // the only one with room: still used
}

TEST(RoutingTest, PrefillOrdersResidentFreeSlotLoadingFullThenLoad) {
  PrefillView resident_busy{true, false, 5, 3, 0, true, false};
  PrefillView free_slot{true, false, 0, 0, 1000, false, false};
  PrefillView loading{true, false, 0, 0, 0, false, true};
  PrefillView full{true, false, 0, 0, 10, false, false};
  PrefillView resident_idle{true, false, 1, 0, 0, true, false};
  PrefillView dead{false, false, 0, 0, 1000, true, false};
  const std::vector<PrefillView> w = {full, loading, free_slot, resident_busy, dead, resident_idle};
  // resident_busy's load (8) is over 1.25 x the average (9 + 1 over 5 workers: cap 3): it
  // competes with the free slot on load and loses.
  EXPECT_EQ(RankPrefill(w, /*has_adapter=*/true, /*adapter_bytes=*/500),
            (std::vector<size_t>{5, 2, 3, 1, 0}));
  // Base-model requests only look at load.
  EXPECT_EQ(RankPrefill(w, false, 0), (std::vector<size_t>{0, 1, 2, 5, 3}));
  EXPECT_EQ(Classify(full, true, 500), Residency::kFull);
  EXPECT_EQ(Classify(free_slot, true, 500), Residency::kFreeSlot);
}

// An adapter's holder keeps its requests while it is not much busier than the rest; a holder
// far busier than an idle worker with a free slot gives way (a worker restarted empty once got
// 0 of 640 requests for an adapter another worker held).
TEST(RoutingTest, PrefillAffinityIsBoundedByLoad) {
  PrefillView holder{true, false, 0, 0, 0, true, false};
  PrefillView idle{true, false, 0, 0, 1 << 20, false, false};
  for (int64_t load = 0; load <= 20; ++load) {
    holder.queue_depth = load;
    const std::vector<size_t> order = RankPrefill({holder, idle}, true, 1000);
    // cap = ceil(1.25 x (load + 1) / 2): the holder stays first up to a load of 4, then the
    // idle worker takes over.
    EXPECT_EQ(order.front(), load <= 4 ? 0u : 1u) << "holder load " << load;
  }
  // Base-model requests are unaffected (load only).
  holder.queue_depth = 3;
  EXPECT_EQ(RankPrefill({holder, idle}, false, 0).front(), 1u);
}

TEST(RoutingTest, WorkerSpecsParseAndResolve) {
  EXPECT_EQ(*ResolveSpec("10.0.0.1:9000"), std::vector<std::string>{"10.0.0.1:9000"});
  auto local = ResolveSpec("dns:localhost:7000");
  ASSERT_TRUE(local.ok()) << local.status();
  ASSERT_FALSE(local->empty());
  for (const auto& a : *local) EXPECT_NE(a.find(":7000"), std::string::npos) << a;
  EXPECT_EQ(ResolveSpec("nohost").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveSpec("h:99999").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveSpec("dns:x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveSpec("dns:no-such-host.invalid:80").status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace preft::router
