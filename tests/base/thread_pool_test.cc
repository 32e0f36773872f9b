#include "common/base/thread_pool.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "absl/synchronization/notification.h"

namespace preft::base {
namespace {

// The nice value of the thread running this.
int OwnNice() { return getpriority(PRIO_PROCESS, static_cast<id_t>(gettid())); }

TEST(ThreadPoolTest, OneThreadRunsWorkInTheOrderPostedAndFinishesItBeforeJoining) {
  std::vector<int> ran;
  {
    ThreadPool pool(1);
    for (int i = 0; i < 100; ++i) pool.Post([&ran, i] { ran.push_back(i); });
  }  // the destructor runs what was posted
  ASSERT_EQ(ran.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(ran[i], i);
}

TEST(ThreadPoolTest, NiceLowersOnlyThePoolsThreads) {
  const int own = OwnNice();
  int lowered = 0, plain = 0;
  {
    ThreadPool low(1, 10);
    ThreadPool normal(1);
    absl::Notification a, b;
    low.Post([&] { lowered = OwnNice(); a.Notify(); });
    normal.Post([&] { plain = OwnNice(); b.Notify(); });
    a.WaitForNotification();
    b.WaitForNotification();
  }
  EXPECT_EQ(lowered, std::min(19, own + 10));
  EXPECT_EQ(plain, own);
  EXPECT_EQ(OwnNice(), own);  // the poster's thread is untouched
}

}  // namespace
}  // namespace preft::base
