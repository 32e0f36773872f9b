#include <gtest/gtest.h>

#include "common/transport/kv_transport.h"

namespace preft::transport {
namespace {

kv::KvCacheShape Shape() {
  kv::KvCacheShape shape;
  shape.num_layers = 24;
  shape.num_blocks = 100;
  shape.block_tokens = 16;
  shape.num_kv_heads = 2;
  shape.head_dim = 64;
  return shape;
}

TEST(KvLayoutTest, ForCacheCopiesTheShapeButNotThePoolSize) {
  KvLayout a = KvLayout::ForCache(Shape(), "qwen2.5-0.5b");
  EXPECT_EQ(a.num_layers, 24);
  EXPECT_EQ(a.num_kv_heads, 2);
  EXPECT_EQ(a.head_dim, 64);
  EXPECT_EQ(a.block_tokens, 16);
  EXPECT_EQ(a.dtype, "f32");
  kv::KvCacheShape bigger = Shape();
  bigger.num_blocks = 5000;  // decode pools are larger than prefill pools: still compatible
  EXPECT_EQ(KvLayout::ForCache(bigger, "qwen2.5-0.5b").Hash(), a.Hash());
}

TEST(KvLayoutTest, ForCacheNamesTheDtype) {
  kv::KvCacheShape bf16 = Shape();
  bf16.dtype = kv::KvDtype::kBF16;
  const KvLayout a = KvLayout::ForCache(bf16, "qwen2.5-0.5b");
  EXPECT_EQ(a.dtype, "bf16");
  EXPECT_NE(a.Hash(), KvLayout::ForCache(Shape(), "qwen2.5-0.5b").Hash());
}

TEST(KvLayoutTest, HashIsStableAcrossProcessesAndBuilds) {
  // A constant (FNV-1a of the canonical fields, recomputed independently in Python): the hash
  // is exchanged between processes, so it must never depend on the run or the build.
  KvLayout a = KvLayout::ForCache(Shape(), "qwen2.5-0.5b");
  EXPECT_EQ(a.Hash(), KvLayout::ForCache(Shape(), "qwen2.5-0.5b").Hash());
  EXPECT_EQ(a.Hash(), 0x01ab4fe97a2c8899ull) << std::hex << a.Hash();
}

TEST(KvLayoutTest, EveryFieldChangesTheHash) {
  const KvLayout base = KvLayout::ForCache(Shape(), "qwen2.5-0.5b");
  std::vector<KvLayout> variants(8, base);
  variants[0].model = "qwen2.5-1.5b";
  variants[1].dtype = "bf16";
  variants[2].num_layers = 28;
  variants[3].num_kv_heads = 4;
  variants[4].head_dim = 128;
  variants[5].block_tokens = 32;
  variants[6].layout_version = 2;
  variants[7].model = "qwen2.5-0.5b ";  // any byte counts
  for (const KvLayout& v : variants) {
    EXPECT_NE(v.Hash(), base.Hash()) << v.ToString();
  }
  // Field boundaries are part of the hash: ("ab","c") differs from ("a","bc").
  auto layout = [](std::string model, std::string dtype) {
    KvLayout l = KvLayout::ForCache(Shape(), std::move(model));
    l.dtype = std::move(dtype);
    return l;
  };
  EXPECT_NE(layout("ab", "c").Hash(), layout("a", "bc").Hash());
}

TEST(KvLayoutTest, ToStringNamesEveryField) {
  EXPECT_EQ(KvLayout::ForCache(Shape(), "m").ToString(),
            "{model=m dtype=f32 layers=24 kv_heads=2 head_dim=64 block_tokens=16 layout=v1}");
}

TEST(CheckPeerLayoutTest, NamesADtypeMismatchFirstAndOtherMismatchesByLayout) {
  const KvLayout f32 = KvLayout::ForCache(Shape(), "m");
  EXPECT_TRUE(CheckPeerLayout(f32, f32.Hash(), "peer x", f32.ToString()).ok());

  kv::KvCacheShape bf16_shape = Shape();
  bf16_shape.dtype = kv::KvDtype::kBF16;
  const KvLayout bf16 = KvLayout::ForCache(bf16_shape, "m");
  const absl::Status dtype = CheckPeerLayout(f32, bf16.Hash(), "decode worker d:1", bf16.ToString());
  EXPECT_EQ(dtype.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(dtype.message().find("KV layout mismatch: decode worker d:1 stores KV as bf16, this "
                                 "worker as f32; start prefill and decode workers with the same "
                                 "--kv-dtype"),
            std::string::npos)
      << dtype;

  kv::KvCacheShape other = Shape();
  other.block_tokens = 32;
  const KvLayout blocks = KvLayout::ForCache(other, "m");
  const absl::Status shape = CheckPeerLayout(f32, blocks.Hash(), "peer y", blocks.ToString());
  EXPECT_EQ(shape.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(shape.message(), "KV layout mismatch: peer y has " + blocks.ToString() +
                                 ", this worker has " + f32.ToString());
  // A peer that described nothing (an old one): the hash alone refuses it.
  const absl::Status bare = CheckPeerLayout(f32, blocks.Hash(), "peer z", "");
  EXPECT_NE(bare.message().find("peer z has (not described)"), std::string::npos) << bare;
}

TEST(ValidateTransferTest, NamesTheBadField) {
  BlockTransfer t;
  t.src_blocks = {0, 1};
  t.dst_blocks = {0};
  absl::Status s = ValidateTransfer(t, 4, 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("src_blocks has 2 ids but dst_blocks has 1"), std::string::npos) << s;
  t.dst_blocks = {0, 4};
  s = ValidateTransfer(t, 4, 4);
  EXPECT_NE(s.message().find("dst_blocks[1] = 4"), std::string::npos) << s;
  t.src_blocks = {-1, 0};
  s = ValidateTransfer(t, 4, 8);
  EXPECT_NE(s.message().find("src_blocks[0] = -1"), std::string::npos) << s;
  t.src_blocks = {3, 0};
  EXPECT_TRUE(ValidateTransfer(t, 4, 8).ok());
}

}  // namespace
}  // namespace preft::transport
