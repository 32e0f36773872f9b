#include "common/base/status_rendezvous.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace preft::base {
namespace {

// Three parties over five rounds; party 1 fails round 2, parties 2 and 0 fail round 4: every
// party gets the round's first error by party, named, and the other rounds are OK.
TEST(StatusRendezvousTest, EveryPartyGetsTheRoundsFirstError) {
  constexpr int kParties = 3, kRounds = 5;
  StatusRendezvous meet(kParties, "rank");
  std::vector<std::vector<absl::Status>> got(kParties);
  std::vector<std::thread> threads;
  for (int p = 0; p < kParties; ++p) {
    threads.emplace_back([&, p] {
      for (int round = 0; round < kRounds; ++round) {
        absl::Status mine;
        if (round == 2 && p == 1) mine = absl::ResourceExhaustedError("no memory for adapter a");
        if (round == 4 && p != 1) mine = absl::InternalError("fault " + std::to_string(p));
        got[p].push_back(meet.Post(p, mine));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int p = 0; p < kParties; ++p) {
    ASSERT_EQ(got[p].size(), static_cast<size_t>(kRounds));
    for (int round : {0, 1, 3}) EXPECT_TRUE(got[p][round].ok()) << p << " " << round;
    EXPECT_EQ(got[p][2].code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(got[p][2].message(), "rank 1: no memory for adapter a");
    EXPECT_EQ(got[p][4].code(), absl::StatusCode::kInternal);
    EXPECT_EQ(got[p][4].message(), "rank 0: fault 0");
  }
}

// No party leaves a round before the last one posts.
TEST(StatusRendezvousTest, WaitsForTheLastParty) {
  StatusRendezvous meet(2, "rank");
  std::atomic<bool> late_posted{false};
  std::atomic<bool> early_saw_late{false};
  std::thread early([&] {
    EXPECT_TRUE(meet.Post(0, absl::OkStatus()).ok());
    early_saw_late = late_posted.load();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  late_posted = true;
  EXPECT_TRUE(meet.Post(1, absl::OkStatus()).ok());
  early.join();
  EXPECT_TRUE(early_saw_late);
}

}  // namespace
}  // namespace preft::base
