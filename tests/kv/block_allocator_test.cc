#include "common/kv/block_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

#include "common/kv/kv_cache.h"

namespace preft::kv {
namespace {

TEST(BlockAllocatorTest, AllocatesDistinctBlocksUntilExhausted) {
  BlockAllocator a(8);
  std::vector<int32_t> got;
  ASSERT_TRUE(a.Allocate(5, &got).ok());
  ASSERT_TRUE(a.Allocate(3, &got).ok());
  EXPECT_EQ(a.num_free(), 0);
  EXPECT_EQ(std::set<int32_t>(got.begin(), got.end()).size(), 8u);
  std::vector<int32_t> none;
  absl::Status s = a.Allocate(1, &none);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("1 blocks, 0 free"), std::string::npos) << s;
  EXPECT_TRUE(none.empty());
}

// Freed runs come back as runs (KV transfers put one run at a time).
TEST(BlockAllocatorTest, FreedRunsAreReallocatedInOrder) {
  BlockAllocator a(16);
  std::vector<int32_t> first, second, again;
  ASSERT_TRUE(a.Allocate(5, &first).ok());
  EXPECT_EQ(first, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  ASSERT_TRUE(a.Allocate(3, &second).ok());
  a.Free(first);
  ASSERT_TRUE(a.Allocate(5, &again).ok());
  EXPECT_EQ(again, first);
}

TEST(BlockAllocatorTest, FailedAllocationTakesNothing) {
  BlockAllocator a(4);
  std::vector<int32_t> got;
  ASSERT_TRUE(a.Allocate(3, &got).ok());
  EXPECT_FALSE(a.Allocate(2, &got).ok());
  EXPECT_EQ(got.size(), 3u);
  EXPECT_EQ(a.num_free(), 1);
}

TEST(BlockAllocatorDeathTest, DoubleFreeIsABrokenInvariant) {
  BlockAllocator a(2);
  std::vector<int32_t> got;
  ASSERT_TRUE(a.Allocate(1, &got).ok());
  a.Free(got[0]);
  EXPECT_DEATH(a.Free(got[0]), "check failed");
}

// Thousands of random sequences growing, finishing and being cancelled: every block is
// accounted for at every step and all come back at the end.
TEST(BlockAllocatorTest, NoLeakUnderRandomAllocFreeCancel) {
  constexpr int32_t kBlocks = 257;
  BlockAllocator a(kBlocks);
  std::mt19937_64 rng(42);
  std::vector<std::vector<int32_t>> live;
  int64_t cancels = 0, completes = 0, failures = 0;
  for (int step = 0; step < 20000; ++step) {
    const int op = static_cast<int>(rng() % 10);
    if (op < 5 || live.empty()) {  // new sequence or growth
      std::vector<int32_t> blocks;
      const int32_t n = 1 + static_cast<int32_t>(rng() % 12);
      if (a.Allocate(n, &blocks).ok()) {
        live.push_back(std::move(blocks));
      } else {
        ++failures;
        EXPECT_LT(a.num_free(), n);
      }
    } else if (op < 7) {  // grow an existing one
      auto& seq = live[rng() % live.size()];
      if (!a.Allocate(1, &seq).ok()) ++failures;
    } else {  // finish or cancel: both free everything
      const size_t i = rng() % live.size();
      a.Free(live[i]);
      (op == 9 ? cancels : completes)++;
      live.erase(live.begin() + static_cast<long>(i));
    }
    int64_t held = 0;
    for (const auto& seq : live) held += static_cast<int64_t>(seq.size());
    ASSERT_EQ(held + a.num_free(), kBlocks) << "at step " << step;
  }
  std::set<int32_t> unique;
  for (const auto& seq : live)
    for (int32_t b : seq) {
      EXPECT_TRUE(a.IsAllocated(b));
      EXPECT_TRUE(unique.insert(b).second) << "block " << b << " handed out twice";
    }
  for (const auto& seq : live) a.Free(seq);
  EXPECT_EQ(a.num_free(), kBlocks);
  EXPECT_GT(cancels, 100);
  EXPECT_GT(completes, 100);
  EXPECT_GT(failures, 10);  // the pool really ran dry along the way
}

TEST(KvCacheTest, LayoutSeparatesLayersBlocksHeadsAndSlots) {
  KvCacheShape shape{2, 3, 4, 2, 8};
  auto cache = KvCache::Create(shape);
  ASSERT_TRUE(cache.ok());
  KvCache& c = **cache;
  EXPECT_EQ(c.bytes(), size_t{2 * 3 * 2 * 2 * 4 * 8 * 4});
  // Every K element (tile [dim][slot]) and V element has its own address, inside the cache.
  std::set<float*> seen;
  for (int l = 0; l < 2; ++l)
    for (int b = 0; b < 3; ++b)
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
          for (int i = 0; i < 8; ++i) {
            EXPECT_TRUE(seen.insert(c.key_tile(l, b, h) + i * 4 + s).second);
            EXPECT_TRUE(seen.insert(c.value(l, b, h, s) + i).second);
          }
  EXPECT_EQ(seen.size(), c.bytes() / sizeof(float));
  EXPECT_EQ(*seen.begin(), c.layer_base(0));
  EXPECT_EQ(c.key_tile(1, 0, 0), c.layer_base(1));
  EXPECT_EQ(KvCache::Create({0, 1, 1, 1, 1}).status().code(), absl::StatusCode::kInvalidArgument);
}

// The sizes follow the dtype (nothing stores bf16 yet; this is the arithmetic the pools and
// transports size themselves by).
TEST(KvCacheTest, BlockBytesFollowTheDtype) {
  const KvCacheShape f32{2, 3, 4, 2, 8};
  KvCacheShape bf16 = f32;
  bf16.dtype = KvDtype::kBF16;
  EXPECT_EQ(f32.element_bytes(), 4);
  EXPECT_EQ(bf16.element_bytes(), 2);
  EXPECT_EQ(bf16.block_elements(), f32.block_elements());
  EXPECT_EQ(f32.block_bytes(), 2 * 2 * 4 * 8 * 4);
  EXPECT_EQ(bf16.block_bytes() * 2, f32.block_bytes());
  EXPECT_EQ(bf16.bytes_per_block_all_layers(), 2 * bf16.block_bytes());
}

}  // namespace
}  // namespace preft::kv
