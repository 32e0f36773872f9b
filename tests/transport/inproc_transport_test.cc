#include "common/transport/inproc_transport.h"

#include <gtest/gtest.h>

#include <memory>
#include <thread>

#include "tests/transport/kv_test_pattern.h"
#include "tests/transport/transport_test_util.h"

namespace preft::transport {
namespace {

using testing::Cache;
using testing::DoneWaiter;
using testing::FillPattern;
using testing::HasPattern;
using testing::IsZero;
using testing::NoticeLog;
using testing::Shape;


// A sender with a 16-block cache and a receiver with a 20-block cache, connected.
struct Pair {
  explicit Pair(kv::KvDtype dtype = kv::KvDtype::kF32) : src(Cache(16, dtype)), dst(Cache(20, dtype)) {
    const KvLayout layout = KvLayout::ForCache(src->shape(), "tiny");
    EXPECT_TRUE(sender.Start(src.get(), layout, nullptr).ok());
    EXPECT_TRUE(receiver.Start(dst.get(), layout, notices.Callback()).ok());
    auto id = sender.Connect(receiver.LocalAddress());
    EXPECT_TRUE(id.ok()) << id.status();
    peer = id.value_or(-1);
  }
  std::unique_ptr<kv::KvCache> src, dst;
  NoticeLog notices;
  InprocTransport sender, receiver;
  PeerId peer = -1;
};

TEST(InprocTransportTest, CopiesBlocksByteExactAndNotifiesOnce) {
  Pair p;
  BlockTransfer t;
  t.reservation_id = 42;
  t.generation = 3;
  t.src_blocks = {3, 4, 5, 9, 0};
  t.dst_blocks = {7, 8, 2, 19, 11};
  for (size_t i = 0; i < t.src_blocks.size(); ++i) FillPattern(*p.src, t.src_blocks[i], 7, i);
  DoneWaiter done;
  p.sender.Write(p.peer, t, done.Callback());
  std::optional<absl::Status> status = done.Wait();
  ASSERT_TRUE(status.has_value()) << "done never fired";
  ASSERT_TRUE(status->ok()) << *status;
  EXPECT_NE(done.thread(), std::this_thread::get_id());
  for (size_t i = 0; i < t.dst_blocks.size(); ++i) {
    EXPECT_TRUE(HasPattern(*p.dst, t.dst_blocks[i], 7, i)) << "dst block " << t.dst_blocks[i];
  }
  for (int32_t b : {0, 1, 3, 4, 5, 6, 9, 10, 12, 13, 14, 15, 16, 17, 18}) {
    EXPECT_TRUE(IsZero(*p.dst, b)) << "block " << b << " was not in the transfer";
  }
  // The notice came before `done`, exactly once.
  EXPECT_EQ(p.notices.notices(), (std::vector<std::pair<uint64_t, uint32_t>>{{42, 3}}));
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(done.calls(), 1);
  EXPECT_EQ(p.notices.notices().size(), 1u);
  TransportStats stats = p.sender.stats();
  EXPECT_EQ(stats.transfers, 1);
  EXPECT_EQ(stats.failures, 0);
  EXPECT_EQ(stats.bytes, 5 * 3 * Shape(1).block_bytes());
  EXPECT_EQ(p.sender.name(), "inproc");
}

TEST(InprocTransportTest, ManyWritesInOrder) {
  Pair p;
  std::vector<std::unique_ptr<DoneWaiter>> waiters;
  for (int i = 0; i < 16; ++i) {
    FillPattern(*p.src, i, 100 + i, 0);
    BlockTransfer t;
    t.reservation_id = i;
    t.src_blocks = {i};
    t.dst_blocks = {19 - i};
    waiters.push_back(std::make_unique<DoneWaiter>());
    p.sender.Write(p.peer, t, waiters.back()->Callback());
  }
  for (int i = 0; i < 16; ++i) {
    std::optional<absl::Status> status = waiters[i]->Wait();
    ASSERT_TRUE(status.has_value() && status->ok());
    EXPECT_TRUE(HasPattern(*p.dst, 19 - i, 100 + i, 0));
  }
  auto notices = p.notices.notices();
  ASSERT_EQ(notices.size(), 16u);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(notices[i].first, static_cast<uint64_t>(i));
}

TEST(InprocTransportTest, BadBlockIdsAreInvalidArgumentAndTouchNothing) {
  Pair p;
  FillPattern(*p.src, 1, 1, 0);
  struct Case {
    std::vector<int32_t> src, dst;
    const char* message;
  };
  for (const Case& c :
       {Case{{1}, {20}, "dst_blocks[0] = 20"}, Case{{16}, {0}, "src_blocks[0] = 16"},
        Case{{1, -1}, {0, 1}, "src_blocks[1] = -1"},
        Case{{1, 2}, {0}, "src_blocks has 2 ids but dst_blocks has 1"}}) {
    BlockTransfer t;
    t.src_blocks = c.src;
    t.dst_blocks = c.dst;
    DoneWaiter done;
    p.sender.Write(p.peer, t, done.Callback());
    std::optional<absl::Status> status = done.Wait();
    ASSERT_TRUE(status.has_value());
    EXPECT_EQ(status->code(), absl::StatusCode::kInvalidArgument) << *status;
    EXPECT_NE(status->message().find(c.message), std::string::npos) << *status;
  }
  for (int32_t b = 0; b < 20; ++b) EXPECT_TRUE(IsZero(*p.dst, b));
  EXPECT_TRUE(p.notices.notices().empty());
  EXPECT_EQ(p.sender.stats().failures, 4);
}

// bf16 blocks travel as they are stored: byte for byte, half of f32's bytes.
TEST(InprocTransportTest, Bf16BlocksCrossByteExactAtHalfTheBytes) {
  Pair p(kv::KvDtype::kBF16);
  BlockTransfer t;
  t.src_blocks = {2, 3, 15};
  t.dst_blocks = {19, 0, 7};
  for (size_t i = 0; i < t.src_blocks.size(); ++i) FillPattern(*p.src, t.src_blocks[i], 9, i);
  DoneWaiter done;
  p.sender.Write(p.peer, t, done.Callback());
  std::optional<absl::Status> status = done.Wait();
  ASSERT_TRUE(status.has_value() && status->ok());
  for (size_t i = 0; i < t.dst_blocks.size(); ++i) {
    EXPECT_TRUE(HasPattern(*p.dst, t.dst_blocks[i], 9, i)) << "dst block " << t.dst_blocks[i];
  }
  EXPECT_EQ(p.sender.stats().bytes, 3 * 3 * Shape(1, kv::KvDtype::kBF16).block_bytes());
  EXPECT_EQ(2 * Shape(1, kv::KvDtype::kBF16).block_bytes(), Shape(1).block_bytes());
}

TEST(InprocTransportTest, KvDtypeMismatchIsRefusedNamingBoth) {
  auto a = Cache(4), b = Cache(4, kv::KvDtype::kBF16);
  InprocTransport ta, tb;
  testing::ExpectKvDtypeMismatchRefused(ta, *a, tb, *b);
}

TEST(InprocTransportTest, LayoutMismatchIsRefusedNamingBothLayouts) {
  auto a = Cache(4), b = Cache(4);
  InprocTransport ta, tb;
  KvLayout la = KvLayout::ForCache(a->shape(), "model-a");
  KvLayout lb = la;
  lb.head_dim = 16;
  ASSERT_TRUE(ta.Start(a.get(), la, nullptr).ok());
  ASSERT_TRUE(tb.Start(b.get(), lb, nullptr).ok());
  absl::StatusOr<PeerId> id = ta.Connect(tb.LocalAddress());
  ASSERT_EQ(id.status().code(), absl::StatusCode::kFailedPrecondition) << id.status();
  EXPECT_NE(id.status().message().find(la.ToString()), std::string::npos) << id.status();
  EXPECT_NE(id.status().message().find(lb.ToString()), std::string::npos) << id.status();
}

TEST(InprocTransportTest, UnknownOrDestroyedPeerIsUnavailable) {
  auto a = Cache(4);
  InprocTransport ta;
  ASSERT_TRUE(ta.Start(a.get(), KvLayout::ForCache(a->shape(), "m"), nullptr).ok());
  EXPECT_EQ(ta.Connect("inproc:999999").status().code(), absl::StatusCode::kUnavailable);

  BlockTransfer t;
  t.src_blocks = {0};
  t.dst_blocks = {0};
  DoneWaiter unknown;
  ta.Write(/*peer=*/7, t, unknown.Callback());
  ASSERT_TRUE(unknown.Wait().has_value());
  EXPECT_EQ(unknown.Wait()->code(), absl::StatusCode::kUnavailable);

  auto b = Cache(4);
  auto tb = std::make_unique<InprocTransport>();
  ASSERT_TRUE(tb->Start(b.get(), KvLayout::ForCache(b->shape(), "m"), nullptr).ok());
  const std::string address = tb->LocalAddress();
  absl::StatusOr<PeerId> id = ta.Connect(address);
  ASSERT_TRUE(id.ok());
  tb.reset();
  DoneWaiter gone;
  ta.Write(*id, t, gone.Callback());
  ASSERT_TRUE(gone.Wait().has_value());
  EXPECT_EQ(gone.Wait()->code(), absl::StatusCode::kUnavailable) << *gone.Wait();
  EXPECT_EQ(ta.Connect(address).status().code(), absl::StatusCode::kUnavailable);
}

TEST(InprocTransportTest, WriteBeforeStartFailsOnTheWorker) {
  InprocTransport t;
  DoneWaiter done;
  t.Write(0, BlockTransfer{}, done.Callback());
  ASSERT_TRUE(done.Wait().has_value());
  EXPECT_FALSE(done.Wait()->ok());
  EXPECT_NE(done.thread(), std::this_thread::get_id());
}

TEST(InprocTransportTest, TwoSendersIntoOneReceiver) {
  auto dst = Cache(64);
  NoticeLog notices;
  InprocTransport receiver;
  const KvLayout layout = KvLayout::ForCache(dst->shape(), "tiny");
  ASSERT_TRUE(receiver.Start(dst.get(), layout, notices.Callback()).ok());
  auto a = Cache(32), b = Cache(32);
  InprocTransport ta, tb;
  ASSERT_TRUE(ta.Start(a.get(), layout, nullptr).ok());
  ASSERT_TRUE(tb.Start(b.get(), layout, nullptr).ok());
  PeerId pa = *ta.Connect(receiver.LocalAddress()), pb = *tb.Connect(receiver.LocalAddress());
  std::vector<std::unique_ptr<DoneWaiter>> waiters;
  for (int i = 0; i < 32; ++i) {
    FillPattern(*a, i, 1, i);
    FillPattern(*b, i, 2, i);
    BlockTransfer t;
    t.reservation_id = i;
    t.src_blocks = {i};
    t.dst_blocks = {i};
    waiters.push_back(std::make_unique<DoneWaiter>());
    ta.Write(pa, t, waiters.back()->Callback());
    t.reservation_id = 100 + i;
    t.dst_blocks = {32 + i};
    waiters.push_back(std::make_unique<DoneWaiter>());
    tb.Write(pb, t, waiters.back()->Callback());
  }
  for (auto& w : waiters) ASSERT_TRUE(w->Wait().value_or(absl::UnknownError("none")).ok());
  for (int i = 0; i < 32; ++i) {
    EXPECT_TRUE(HasPattern(*dst, i, 1, i));
    EXPECT_TRUE(HasPattern(*dst, 32 + i, 2, i));
  }
  EXPECT_EQ(notices.notices().size(), 64u);
}

}  // namespace
}  // namespace preft::transport
