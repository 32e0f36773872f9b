#include "common/transport/cuda_ipc/cuda_ipc_address.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <random>
#include <string>

namespace preft::transport {
namespace {

CudaIpcPeerAddress Sample() {
  CudaIpcPeerAddress a;
  a.control = std::string("PREFTUCX\0\x01rest", 14);
  a.node = ThisNode();
  a.pid = getpid();
  a.base = 0x7f0000001000ull;
  a.handle = std::string(kCudaIpcHandleBytes, '\x5a');
  a.device = "0000:3b:00.0";
  a.num_layers = 24;
  a.num_blocks = 4096;
  a.block_bytes = 16384;
  return a;
}

TEST(CudaIpcAddressTest, RoundTrips) {
  const CudaIpcPeerAddress a = Sample();
  auto b = DecodeCudaIpcPeerAddress(EncodeCudaIpcPeerAddress(a));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->control, a.control);
  EXPECT_EQ(b->node, a.node);
  EXPECT_EQ(b->pid, a.pid);
  EXPECT_EQ(b->base, a.base);
  EXPECT_EQ(b->handle, a.handle);
  EXPECT_EQ(b->device, a.device);
  EXPECT_EQ(b->num_layers, 24);
  EXPECT_EQ(b->num_blocks, 4096);
  EXPECT_EQ(b->block_bytes, 16384);
  // The node names this machine's kernel, not only its host name.
  EXPECT_NE(a.node.find('/'), std::string::npos);
  EXPECT_GT(a.node.size(), a.node.find('/') + 1) << a.node;
}

TEST(CudaIpcAddressTest, RefusesHostileBytes) {
  const std::string good = EncodeCudaIpcPeerAddress(Sample());
  // Every truncation, and one byte too many.
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_EQ(DecodeCudaIpcPeerAddress(good.substr(0, n)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << n;
  }
  EXPECT_FALSE(DecodeCudaIpcPeerAddress(good + "x").ok());
  // Another transport's address names what it is not.
  const absl::Status ucx = DecodeCudaIpcPeerAddress("PREFTUCX-anything").status();
  EXPECT_NE(ucx.message().find("not a preft CUDA IPC address"), std::string::npos) << ucx;
  std::string version = good;
  version[8] = 9;
  EXPECT_NE(DecodeCudaIpcPeerAddress(version).status().message().find("format version 9"),
            std::string::npos);
  auto refused = [](CudaIpcPeerAddress a) {
    return DecodeCudaIpcPeerAddress(EncodeCudaIpcPeerAddress(a)).status();
  };
  CudaIpcPeerAddress a = Sample();
  a.handle.pop_back();
  EXPECT_NE(refused(a).message().find("a handle of 63 bytes"), std::string::npos);
  a = Sample();
  a.base = 0;
  EXPECT_FALSE(refused(a).ok());
  a = Sample();
  a.control.clear();
  EXPECT_FALSE(refused(a).ok());
  a = Sample();
  a.num_blocks = 0;
  EXPECT_FALSE(refused(a).ok());
  a = Sample();
  a.num_blocks = int64_t{1} << 40;  // layers x blocks x bytes past any device
  EXPECT_NE(refused(a).message().find("a cache of"), std::string::npos);
  a = Sample();
  a.block_bytes = -16384;
  EXPECT_FALSE(refused(a).ok());
  // Random corruption of a good address: refused or decoded, never a crash or a huge read.
  std::mt19937 rng(1234);
  for (int i = 0; i < 20000; ++i) {
    std::string bad = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) bad[rng() % bad.size()] = static_cast<char>(rng());
    (void)DecodeCudaIpcPeerAddress(bad);
  }
}

}  // namespace
}  // namespace preft::transport
