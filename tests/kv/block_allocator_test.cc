#include "common/kv/block_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
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

BlockHash HashOf(int32_t token) {
  return HashBlock(BlockHash{}, 0, &token, nullptr, 1);
}

// A published block outlives its last holder as an evictable block: found again by its hash,
// counted as free, and reclaimed only after the plain free blocks are gone, least recently
// freed first.
TEST(BlockAllocatorTest, CachedBlocksStayUntilAnAllocationNeedsThem) {
  BlockAllocator a(4, /*max_cached=*/4);
  std::vector<int32_t> seq;
  ASSERT_TRUE(a.Allocate(3, &seq).ok());
  for (int32_t i = 0; i < 3; ++i) a.Publish(seq[i], HashOf(i));
  EXPECT_EQ(a.num_cached(), 3);
  a.Free(seq);
  EXPECT_EQ(a.num_free(), 4);
  EXPECT_EQ(a.num_evictable(), 3);
  EXPECT_EQ(a.Peek(HashOf(1)), seq[1]);
  EXPECT_EQ(a.Peek(HashOf(7)), -1);

  // A hit holds the block (no longer evictable); another holder shares it.
  EXPECT_EQ(a.Acquire(HashOf(0)), seq[0]);
  EXPECT_EQ(a.Acquire(HashOf(0)), seq[0]);
  EXPECT_EQ(a.ref_count(seq[0]), 2);
  EXPECT_EQ(a.num_free(), 3);
  // Allocation takes the plain free block first, then the LRU: Free(seq) let go of seq[2]
  // first (last block first), so it is evicted before seq[1].
  std::vector<int32_t> more;
  ASSERT_TRUE(a.Allocate(1, &more).ok());
  EXPECT_EQ(a.num_cached(), 3);
  ASSERT_TRUE(a.Allocate(1, &more).ok());
  EXPECT_EQ(more.back(), seq[2]);
  EXPECT_EQ(a.Peek(HashOf(2)), -1);
  EXPECT_EQ(a.evictions(), 1);
  ASSERT_TRUE(a.Allocate(1, &more).ok());
  EXPECT_EQ(more.back(), seq[1]);
  EXPECT_EQ(a.num_free(), 0);
  EXPECT_FALSE(a.Allocate(1, &more).ok());  // seq[0] is held, never taken
  a.Free(seq[0]);
  a.Free(seq[0]);
  EXPECT_EQ(a.Peek(HashOf(0)), seq[0]);  // cached again once free
  a.Free(more);
  EXPECT_EQ(a.num_free(), 4);
}

// One address names one block: publishing a second block under it keeps that block private.
// At the cap the oldest evictable block gives up its address; with none evictable the new one
// stays private. Without a cache (cap 0) nothing is ever found.
TEST(BlockAllocatorTest, PublishKeepsOneBlockPerHashAndHoldsTheCap) {
  BlockAllocator a(6, /*max_cached=*/2);
  std::vector<int32_t> b;
  ASSERT_TRUE(a.Allocate(4, &b).ok());
  a.Publish(b[0], HashOf(1));
  a.Publish(b[1], HashOf(1));  // same content computed twice
  EXPECT_EQ(a.Peek(HashOf(1)), b[0]);
  a.Publish(b[2], HashOf(2));
  a.Publish(b[3], HashOf(3));  // at the cap, nothing evictable: stays private
  EXPECT_EQ(a.Peek(HashOf(3)), -1);
  EXPECT_EQ(a.num_cached(), 2);
  a.Free(b[0]);
  a.Publish(b[3], HashOf(3));  // the evictable b[0] gives up its address for it
  EXPECT_EQ(a.Peek(HashOf(1)), -1);
  EXPECT_EQ(a.Peek(HashOf(3)), b[3]);
  EXPECT_EQ(a.num_cached(), 2);
  a.Free({b[1], b[2], b[3]});
  EXPECT_EQ(a.num_free(), 6);

  BlockAllocator none(4);
  std::vector<int32_t> c;
  ASSERT_TRUE(none.Allocate(1, &c).ok());
  none.Publish(c[0], HashOf(1));
  EXPECT_EQ(none.Peek(HashOf(1)), -1);
}

// The hash covers the parent, the salt, every token and every mask bit.
TEST(BlockHashTest, EveryInputChangesTheHash) {
  const int32_t tokens[4] = {1, 2, 3, 4};
  const uint8_t mask[4] = {0, 0, 1, 0};
  const BlockHash base = HashBlock(BlockHash{}, 0, tokens, nullptr, 4);
  EXPECT_EQ(base, HashBlock(BlockHash{}, 0, tokens, nullptr, 4));
  const uint8_t zeros[4] = {};
  EXPECT_EQ(base, HashBlock(BlockHash{}, 0, tokens, zeros, 4));  // no mask = all zeros
  EXPECT_NE(base, HashBlock(HashOf(9), 0, tokens, nullptr, 4));
  EXPECT_NE(base, HashBlock(BlockHash{}, 5, tokens, nullptr, 4));
  EXPECT_NE(base, HashBlock(BlockHash{}, 0, tokens, mask, 4));
  EXPECT_NE(base, HashBlock(BlockHash{}, 0, tokens, nullptr, 3));
  const int32_t other[4] = {1, 2, 3, 5};
  EXPECT_NE(base, HashBlock(BlockHash{}, 0, other, nullptr, 4));
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

// Thousands of random sequences sharing cached prefixes (each block's address is its chain of
// "tokens", from a small alphabet so prefixes repeat), growing, finishing and being cancelled,
// with a cap on cached blocks: every block's holders are counted exactly, free blocks are
// what nobody holds, and everything comes back at the end.
TEST(BlockAllocatorTest, NoLeakWithSharedPrefixesUnderRandomAdmitFinishCancel) {
  constexpr int32_t kBlocks = 97;
  BlockAllocator a(kBlocks, /*max_cached=*/60);
  std::mt19937_64 rng(7);
  struct Seq {
    std::vector<int32_t> blocks;
    BlockHash last{};
  };
  std::vector<Seq> live;
  int64_t hits = 0, ends = 0;
  auto next_hash = [&](const BlockHash& parent) {
    const int32_t token = static_cast<int32_t>(rng() % 3);
    return HashBlock(parent, 0, &token, nullptr, 1);
  };
  for (int step = 0; step < 20000; ++step) {
    const int op = static_cast<int>(rng() % 10);
    if (op < 4 || live.empty()) {  // admit: take the cached run, then allocate the rest
      Seq s;
      const int len = 1 + static_cast<int>(rng() % 6);
      std::vector<BlockHash> chain;
      for (int i = 0; i < len; ++i) chain.push_back(next_hash(i == 0 ? BlockHash{} : chain.back()));
      int i = 0;
      for (; i < len; ++i) {
        const int32_t b = a.Acquire(chain[i]);
        if (b < 0) break;
        s.blocks.push_back(b);
        ++hits;
      }
      std::vector<int32_t> fresh;
      if (!a.Allocate(len - i, &fresh).ok()) {
        a.Free(s.blocks);
        continue;
      }
      for (int32_t b : fresh) {
        a.Publish(b, chain[s.blocks.size()]);
        s.blocks.push_back(b);
      }
      s.last = chain.back();
      live.push_back(std::move(s));
    } else if (op < 6) {  // grow (a decode step filling a new block)
      Seq& s = live[rng() % live.size()];
      std::vector<int32_t> fresh;
      if (a.Allocate(1, &fresh).ok()) {
        s.last = next_hash(s.last);
        a.Publish(fresh[0], s.last);
        s.blocks.push_back(fresh[0]);
      }
    } else {  // finish or cancel
      const size_t i = rng() % live.size();
      a.Free(live[i].blocks);
      live.erase(live.begin() + static_cast<long>(i));
      ++ends;
    }
    std::map<int32_t, int32_t> holders;
    for (const Seq& s : live)
      for (int32_t b : s.blocks) ++holders[b];
    ASSERT_EQ(static_cast<int32_t>(holders.size()) + a.num_free(), kBlocks) << "step " << step;
    for (const auto& [b, n] : holders) ASSERT_EQ(a.ref_count(b), n) << "block " << b;
    ASSERT_LE(a.num_cached(), 60);
  }
  for (const Seq& s : live) a.Free(s.blocks);
  EXPECT_EQ(a.num_free(), kBlocks);
  for (int32_t b = 0; b < kBlocks; ++b) EXPECT_EQ(a.ref_count(b), 0);
  EXPECT_GT(hits, 1000);
  EXPECT_GT(a.evictions(), 100);
  EXPECT_GT(ends, 1000);
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
