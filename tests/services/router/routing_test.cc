#include "services/router/routing.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "services/router/prefix_affinity.h"
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

// Which decode workers a request may use, and the errors that name the fix.
TEST(RoutingTest, DecodeEligibilityFollowsTheDeploymentAndTheAdapterMode) {
  auto colocated = [](DecodeView v) {
    v.colocated = true;
    return v;
  };
  auto with_adapters = [](DecodeView v) {
    v.adapters = true;
    return v;
  };
  // A request of 10 + 20 tokens needs 2 blocks of 16 where it may run.
  std::vector<DecodeView> views = {Decode(50, 0), colocated(Decode(50, 0))};
  auto blocks = EligibleDecode(&views, {.prompt_tokens = 10, .max_new_tokens = 20});
  ASSERT_TRUE(blocks.ok()) << blocks.status();
  EXPECT_EQ(*blocks, 2);
  EXPECT_TRUE(views[0].healthy);
  EXPECT_FALSE(views[1].healthy);  // the other deployment kind
  // Only the other kind is up: an error naming the flag to fix, from either side.
  views = {colocated(Decode(50, 0))};
  auto wrong = EligibleDecode(&views, {.prompt_tokens = 10, .max_new_tokens = 20});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(wrong.status().message().find("start the router with --colocated"), std::string::npos);
  views = {Decode(50, 0)};
  wrong = EligibleDecode(&views, {.colocated = true, .prompt_tokens = 10, .max_new_tokens = 20});
  EXPECT_NE(wrong.status().message().find("start them with --colocated"), std::string::npos);
  // All positions: only workers that run adapters; none does -> the flag to start them with.
  views = {Decode(50, 0), with_adapters(Decode(50, 0))};
  ASSERT_TRUE(EligibleDecode(&views, {.decode_adapter = true, .prompt_tokens = 10,
                                      .max_new_tokens = 20}).ok());
  EXPECT_FALSE(views[0].healthy);
  EXPECT_TRUE(views[1].healthy);
  views = {Decode(50, 0)};
  wrong = EligibleDecode(&views, {.decode_adapter = true, .prompt_tokens = 10,
                                  .max_new_tokens = 20});
  EXPECT_NE(wrong.status().message().find("--adapters all-positions"), std::string::npos);
  // Colocated workers run the adapter themselves: no adapter flag needed there.
  views = {colocated(Decode(50, 0))};
  EXPECT_TRUE(EligibleDecode(&views, {.colocated = true, .decode_adapter = true,
                                      .prompt_tokens = 10, .max_new_tokens = 20}).ok());
  // Larger than every worker, all of them up: refused; with one down (it may be larger): wait.
  views = {Decode(50, 0), Decode(50, 0)};
  auto big = EligibleDecode(&views, {.prompt_tokens = 1000, .max_new_tokens = 700});
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(big.status().message().find("needs 107 KV blocks; the largest decode worker has 100"),
            std::string::npos) << big.status();
  views = {Decode(50, 0), Decode(50, 0, /*healthy=*/false)};
  EXPECT_TRUE(EligibleDecode(&views, {.prompt_tokens = 1000, .max_new_tokens = 700}).ok());
  // Before the first poll nobody is healthy: no error, the request waits for capacity.
  views = {Decode(0, 0, false)};
  EXPECT_TRUE(EligibleDecode(&views, {.colocated = true, .prompt_tokens = 1}).ok());
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

// A prompt goes where its prefix went last (its KV is probably cached there) while that worker
// is not much busier than the rest; a hot prefix spreads past the bound. Adapter residency
// ranks first: a prefix under the adapter is worth nothing where the adapter is not loaded.
TEST(RoutingTest, PrefixAffinityIsBoundedByLoad) {
  PrefillView holder{true, false, 0, 0, 0, true, false};
  holder.prefix_blocks = 12;
  PrefillView idle{true, false, 0, 0, 1 << 20, true, false};
  PrefillView shorter = idle;
  shorter.prefix_blocks = 3;
  for (int64_t load = 0; load <= 20; ++load) {
    holder.queue_depth = load;
    EXPECT_EQ(RankPrefill({idle, holder}, /*has_adapter=*/false, 0).front(),
              load <= 4 ? 1u : 0u) << "holder load " << load;
  }
  holder.queue_depth = 2;
  EXPECT_EQ(RankPrefill({shorter, holder, idle}, false, 0), (std::vector<size_t>{1, 0, 2}));
  PrefillView no_adapter = holder;
  no_adapter.adapter_resident = false;
  no_adapter.adapter_bytes_free = 0;
  EXPECT_EQ(RankPrefill({no_adapter, idle}, /*has_adapter=*/true, 1000).front(), 1u);

  // Colocated workers: the prefix ranks before free blocks, under the same bound.
  std::vector<DecodeView> w = {Decode(90, 0), Decode(40, 1)};
  w[1].prefix_blocks = 5;
  EXPECT_EQ(RankDecode(w, 0).front(), 1u);
  w[1].running = 9;
  EXPECT_EQ(RankDecode(w, 0).front(), 0u);
}

// Keys chain blocks under an adapter version; a worker matches as deep as the prompt it was
// last given; the oldest keys are forgotten past the capacity, deepest blocks first.
TEST(RoutingTest, PrefixAffinityRemembersWhereEachPrefixWent) {
  std::vector<int32_t> system(64), other(64);
  for (int i = 0; i < 64; ++i) {
    system[i] = i;
    other[i] = 1000 + i;
  }
  std::vector<int32_t> longer = system;
  longer.insert(longer.end(), other.begin(), other.end());
  const auto keys = PrefixAffinity::Keys("", 0, system, 16);
  ASSERT_EQ(keys.size(), 4u);
  EXPECT_EQ(PrefixAffinity::Keys("", 0, {1, 2, 3}, 16).size(), 0u);  // no full block
  EXPECT_NE(PrefixAffinity::Keys("a", 1, system, 16), keys);
  EXPECT_NE(PrefixAffinity::Keys("a", 1, system, 16), PrefixAffinity::Keys("a", 2, system, 16));
  const auto long_keys = PrefixAffinity::Keys("", 0, longer, 16);
  ASSERT_EQ(long_keys.size(), 8u);
  EXPECT_TRUE(std::equal(keys.begin(), keys.end(), long_keys.begin()));

  PrefixAffinity affinity(/*capacity=*/10);
  affinity.Record(keys, "w1");
  affinity.Record(long_keys, "w2");  // w2 now has the system prompt's blocks too
  auto m = affinity.Match(long_keys);
  EXPECT_EQ(m["w2"], 8);
  EXPECT_EQ(m.count("w1"), 0u);
  affinity.Record(keys, "w1");
  m = affinity.Match(long_keys);
  EXPECT_EQ(m["w1"], 4);
  EXPECT_EQ(m["w2"], 8);
  EXPECT_TRUE(affinity.Match(PrefixAffinity::Keys("", 0, other, 16)).empty());
  // 8 keys held; 4 more push out 2, w2's deepest.
  affinity.Record(PrefixAffinity::Keys("", 0, other, 16), "w3");
  m = affinity.Match(long_keys);
  EXPECT_EQ(m["w1"], 4);
  EXPECT_EQ(m["w2"], 6);
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

// Free KV blocks alone once let a burst fill one worker's batch (max_running) while another had
// places; a worker whose running and queued reach its max_running ranks after those with room
// in their batch, and still before none (its engine queues).
TEST(RoutingTest, AFullBatchRanksAfterWorkersWithPlacesInTheirBatch) {
  DecodeView roomy;  // most free blocks, but its batch is full
  roomy.healthy = true;
  roomy.free_blocks = 900;
  roomy.running = 250;
  roomy.queue_depth = 6;
  roomy.max_running = 256;
  DecodeView places = roomy;  // fewer free blocks, places in its batch
  places.free_blocks = 100;
  places.running = 10;
  places.queue_depth = 0;
  DecodeView unknown = roomy;  // reports no max_running: taken to have places
  unknown.free_blocks = 500;
  unknown.max_running = 0;
  EXPECT_EQ(RankDecode({roomy, places, unknown}, 10), (std::vector<size_t>{2, 1, 0}));
  EXPECT_EQ(RankDecode({roomy}, 10), (std::vector<size_t>{0}));  // full, yet not left out
}

// ---- The retry policy shared by prefill and colocated calls ----

TEST(RetryTest, OnlyWorkerFailuresAreRetryable) {
  for (absl::StatusCode c : {absl::StatusCode::kUnavailable, absl::StatusCode::kInternal,
                             absl::StatusCode::kAborted, absl::StatusCode::kUnknown}) {
    EXPECT_TRUE(Retryable(c)) << absl::StatusCodeToString(c);
  }
  for (absl::StatusCode c :
       {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
        absl::StatusCode::kResourceExhausted, absl::StatusCode::kCancelled,
        absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kFailedPrecondition,
        absl::StatusCode::kPermissionDenied}) {
    EXPECT_FALSE(Retryable(c)) << absl::StatusCodeToString(c);
  }
}

TEST(RetryTest, ARequestRunsElsewhereOnlyBeforeTheClientSawOutput) {
  const absl::Status gone = absl::UnavailableError("worker gone");
  EXPECT_TRUE(RetryElsewhere(gone, /*client_saw_output=*/false));
  EXPECT_FALSE(RetryElsewhere(gone, /*client_saw_output=*/true));
  EXPECT_FALSE(RetryElsewhere(absl::OkStatus(), false));
  EXPECT_FALSE(RetryElsewhere(absl::InvalidArgumentError("bad prompt"), false));
}

struct FakeWorker {
  std::string address;
};

TEST(RetryTest, FailedWorkersAreLeftOutUntilEveryOneFailed) {
  const std::vector<std::shared_ptr<FakeWorker>> workers = {
      std::make_shared<FakeWorker>(FakeWorker{"a:1"}), std::make_shared<FakeWorker>(FakeWorker{"b:2"})};
  WorkerAttempts attempts(3, "none was healthy");
  EXPECT_EQ(attempts.last_error(), "none was healthy");
  attempts.Failed("a:1", absl::UnavailableError("connection refused"));
  EXPECT_EQ(attempts.last_error(), "a:1: connection refused");
  std::vector<DecodeView> views(2);
  for (DecodeView& v : views) v.healthy = true;
  attempts.ExcludeTried(workers, &views);
  EXPECT_FALSE(views[0].healthy);
  EXPECT_TRUE(views[1].healthy);

  attempts.ForgetTriedIfAllFailed(workers.size());  // b:2 not tried yet: a:1 stays out
  EXPECT_TRUE(attempts.Tried("a:1"));
  attempts.Failed("b:2", absl::InternalError("engine failed"));
  attempts.ForgetTriedIfAllFailed(workers.size());  // both failed once: both may be tried again
  EXPECT_FALSE(attempts.Tried("a:1"));
  EXPECT_FALSE(attempts.Tried("b:2"));
  EXPECT_FALSE(attempts.exhausted());
}

TEST(RetryTest, AttemptsEndAtTheLimitAndAKvPathFailureCountsWithoutBlamingTheWorker) {
  WorkerAttempts attempts(2, "no prefill worker is available");
  attempts.FailedElsewhere("p:1", absl::UnavailableError("KV write to d:9 failed"));
  EXPECT_FALSE(attempts.Tried("p:1"));  // the prefill worker is not to blame
  EXPECT_EQ(attempts.last_error(), "p:1: KV write to d:9 failed");
  EXPECT_FALSE(attempts.exhausted());
  attempts.Failed("p:1", absl::UnavailableError("gone"));
  EXPECT_TRUE(attempts.exhausted());
  EXPECT_EQ(attempts.max_attempts(), 2);
}

}  // namespace
}  // namespace preft::router
