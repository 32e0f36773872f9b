// CudaIpcTransport on a GPU: blocks of one device cache reach another's, bit for bit, in the
// same process (the peer's pointer) and in another process (the cache mapped through CUDA IPC),
// with the DONE notice over UCX after the bytes. The other process is this binary again,
// running the receiver role (skipped unless PREFT_CUDA_IPC_RECEIVER is set).

#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/synchronization/notification.h"
#include "common/kernels/cuda/runtime.cuh"
#include "common/kv/kv_cache.h"
#include "common/transport/cuda_ipc/cuda_ipc_transport.h"
#include "common/transport/ucx/ucx_transport.h"
#include "tests/transport/kv_test_pattern.h"

extern char** environ;

namespace preft::transport {
namespace {

namespace cuda = kernels::cuda;
using testing::FillPattern;
using testing::HasPattern;
using testing::IsZero;

const kv::KvCacheShape kShape{/*num_layers=*/3, /*num_blocks=*/8, /*block_tokens=*/16,
                              /*num_kv_heads=*/2, /*head_dim=*/32};
constexpr uint64_t kSeed = 7;
const std::vector<int32_t> kSrc = {0, 1, 3, 4};
const std::vector<int32_t> kDst = {5, 6, 2, 3};

// A device cache of kShape with a host image: Upload / Download move the whole of it.
struct DeviceCache {
  std::unique_ptr<kv::KvCache> host;
  void* device = nullptr;
  size_t bytes = 0;

  static std::unique_ptr<DeviceCache> Zeroed() {
    auto c = std::make_unique<DeviceCache>();
    c->host = *kv::KvCache::Create(kShape);
    c->bytes = kShape.num_blocks * kShape.bytes_per_block_all_layers();
    if (cuda::Malloc(&c->device, c->bytes) != 0) return nullptr;
    if (cuda::Memset(c->device, 0, c->bytes, nullptr) != 0) return nullptr;
    std::memset(c->host->layer_base(0), 0, c->bytes);
    return c;
  }
  ~DeviceCache() {
    if (device != nullptr) cuda::Free(device);
  }
  bool Upload() {
    return cuda::CopyToDevice(device, host->layer_base(0), bytes, nullptr) == 0 &&
           cuda::StreamSynchronize(nullptr) == 0;
  }
  bool Download() {
    return cuda::CopyToHost(host->layer_base(0), device, bytes, nullptr) == 0 &&
           cuda::StreamSynchronize(nullptr) == 0;
  }
  kv::DeviceKvView view() const { return {device, kShape}; }
};

std::unique_ptr<UcxTransport> Control() {
  UcxTransportOptions o;
  o.tls = "posix,self";
  return std::make_unique<UcxTransport>(o);
}

KvLayout Layout() { return KvLayout::ForCache(kShape, "cuda-ipc-test"); }

// "" when `cache` holds the pattern in kDst and zeros elsewhere, else what differs.
std::string CheckReceived(DeviceCache& cache) {
  if (!cache.Download()) return "download failed";
  for (int32_t b = 0; b < kShape.num_blocks; ++b) {
    int64_t tag = -1;
    for (size_t i = 0; i < kDst.size(); ++i) {
      if (kDst[i] == b) tag = static_cast<int64_t>(i);
    }
    if (tag >= 0 ? !HasPattern(*cache.host, b, kSeed, tag) : !IsZero(*cache.host, b)) {
      return "block " + std::to_string(b) + (tag >= 0 ? " lacks its pattern" : " was written");
    }
  }
  return "";
}

// The sender's cache: pattern (kSeed, i) in block kSrc[i].
std::unique_ptr<DeviceCache> SenderCache() {
  auto c = DeviceCache::Zeroed();
  if (c == nullptr) return nullptr;
  for (size_t i = 0; i < kSrc.size(); ++i) FillPattern(*c->host, kSrc[i], kSeed, i);
  return c->Upload() ? std::move(c) : nullptr;
}

absl::Status WriteAndWait(KvTransport& t, PeerId peer) {
  BlockTransfer transfer{/*reservation_id=*/42, /*generation=*/3, kSrc, kDst};
  absl::Notification done;
  absl::Status result;
  t.Write(peer, transfer, [&](absl::Status s) {
    result = std::move(s);
    done.Notify();
  });
  if (!done.WaitForNotificationWithTimeout(absl::Seconds(30))) {
    return absl::DeadlineExceededError("no completion in 30 s");
  }
  return result;
}

TEST(CudaIpcTransportTest, BlocksReachAnotherCacheInThisProcess) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  auto from = SenderCache();
  auto to = DeviceCache::Zeroed();
  ASSERT_TRUE(from != nullptr && to != nullptr);
  CudaIpcTransport sender(from->view(), Control());
  CudaIpcTransport receiver(to->view(), Control());
  std::atomic<int> notices{0};
  uint64_t noticed_id = 0;
  uint32_t noticed_generation = 0;
  ASSERT_TRUE(sender.Start(nullptr, Layout(), [](uint64_t, uint32_t) {}).ok());
  ASSERT_TRUE(receiver
                  .Start(nullptr, Layout(),
                         [&](uint64_t id, uint32_t generation) {
                           noticed_id = id;
                           noticed_generation = generation;
                           ++notices;
                         })
                  .ok());
  EXPECT_EQ(receiver.name().rfind("cuda_ipc+ucx(", 0), 0u) << receiver.name();
  auto peer = sender.Connect(receiver.LocalAddress());
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_TRUE(WriteAndWait(sender, *peer).ok());
  EXPECT_EQ(notices.load(), 1);  // before `done`: the ACK answers the notice
  EXPECT_EQ(noticed_id, 42u);
  EXPECT_EQ(noticed_generation, 3u);
  EXPECT_EQ(CheckReceived(*to), "");
  EXPECT_EQ(sender.stats().transfers, 1);
  EXPECT_EQ(sender.stats().bytes,
            static_cast<int64_t>(kSrc.size() * kShape.num_layers * kShape.block_bytes()));

  // Out-of-range blocks are refused before any byte moves.
  BlockTransfer bad{43, 1, {0}, {static_cast<int32_t>(kShape.num_blocks)}};
  absl::Notification refused;
  absl::Status status;
  sender.Write(*peer, bad, [&](absl::Status s) {
    status = std::move(s);
    refused.Notify();
  });
  ASSERT_TRUE(refused.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_EQ(CheckReceived(*to), "");
}

// The receiver's side of the next test, in the child process: prints its address, waits for
// one DONE notice, checks its device cache and prints the verdict.
TEST(CudaIpcTransportTest, ReceiverRole) {
  if (std::getenv("PREFT_CUDA_IPC_RECEIVER") == nullptr) GTEST_SKIP() << "the child's role";
  auto cache = DeviceCache::Zeroed();
  ASSERT_NE(cache, nullptr);
  CudaIpcTransport receiver(cache->view(), Control());
  absl::Notification noticed;
  ASSERT_TRUE(receiver.Start(nullptr, Layout(), [&](uint64_t, uint32_t) { noticed.Notify(); }).ok());
  std::printf("ADDRESS %s\n", absl::BytesToHexString(receiver.LocalAddress()).c_str());
  std::fflush(stdout);
  ASSERT_TRUE(noticed.WaitForNotificationWithTimeout(absl::Seconds(60)));
  const std::string why = CheckReceived(*cache);
  std::printf("VERIFIED %s\n", why.empty() ? "ok" : why.c_str());
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::seconds(1));  // the ACK reaches the sender
}

TEST(CudaIpcTransportTest, BlocksReachAnotherProcessThroughIpc) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  auto from = SenderCache();
  ASSERT_NE(from, nullptr);
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  std::string self = "/proc/self/exe";
  std::string filter = "--gtest_filter=CudaIpcTransportTest.ReceiverRole";
  std::vector<char*> argv = {self.data(), filter.data(), nullptr};
  std::vector<std::string> env_strings = {"PREFT_CUDA_IPC_RECEIVER=1"};
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), envp.data()), 0);
  posix_spawn_file_actions_destroy(&actions);
  close(out[1]);
  FILE* child = fdopen(out[0], "r");
  auto next_line = [&](const std::string& prefix) {
    char line[1 << 16];
    while (std::fgets(line, sizeof(line), child) != nullptr) {
      std::string s(line);
      if (s.rfind(prefix, 0) == 0) return s.substr(prefix.size(), s.find_last_not_of("\n") + 1 - prefix.size());
    }
    return std::string();
  };
  const std::string hex = next_line("ADDRESS ");
  ASSERT_FALSE(hex.empty()) << "the receiver printed no address";
  CudaIpcTransport sender(from->view(), Control());
  ASSERT_TRUE(sender.Start(nullptr, Layout(), [](uint64_t, uint32_t) {}).ok());
  auto first = sender.Connect(absl::HexStringToBytes(hex));
  ASSERT_TRUE(first.ok()) << first.status();
  // Connecting again (as after a dropped peer) reuses the mapping: CUDA opens a handle once.
  auto peer = sender.Connect(absl::HexStringToBytes(hex));
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_NE(*peer, *first);
  EXPECT_TRUE(WriteAndWait(sender, *peer).ok());
  EXPECT_EQ(next_line("VERIFIED "), "ok");
  int status = 0;
  waitpid(pid, &status, 0);
  fclose(child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "receiver status " << status;
}

}  // namespace
}  // namespace preft::transport
