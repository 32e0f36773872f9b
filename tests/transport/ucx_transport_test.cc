#include "common/transport/ucx/ucx_transport.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/transport/ucx/ucx_address.h"
#include "tests/transport/kv_test_pattern.h"
#include "tests/transport/transport_test_util.h"

extern char** environ;

namespace preft::transport {
namespace {

using testing::Cache;
using testing::DoneWaiter;
using testing::FillPattern;
using testing::HasPattern;
using testing::IsZero;
using testing::kWait;
using testing::NoticeLog;
using testing::Shape;

UcxTransportOptions Options(const std::string& tls) {
  UcxTransportOptions options;
  options.tls = tls;
  options.net_devices = "lo";  // tcp would advertise eth0 too
  return options;
}

absl::Status WriteAndWait(KvTransport& t, PeerId peer, const BlockTransfer& transfer,
                          absl::Duration timeout = kWait) {
  DoneWaiter done;
  t.Write(peer, transfer, done.Callback());
  std::optional<absl::Status> status = done.Wait(timeout);
  return status.value_or(absl::DeadlineExceededError("test: done did not fire"));
}

class UcxTransportTest : public ::testing::TestWithParam<std::string> {};

// Two UcxTransports over `tls` on caches of the given sizes, both started and the sender
// connected to the receiver (peer < 0 if connecting failed).
struct UcxPair {
  UcxPair(const std::string& tls, int64_t src_blocks, int64_t dst_blocks,
          kv::KvDtype dtype = kv::KvDtype::kF32)
      : src(Cache(src_blocks, dtype)),
        dst(Cache(dst_blocks, dtype)),
        sender(Options(tls)),
        receiver(Options(tls)) {
    const KvLayout layout = KvLayout::ForCache(src->shape(), "tiny");
    EXPECT_TRUE(sender.Start(src.get(), layout, nullptr).ok());
    EXPECT_TRUE(receiver.Start(dst.get(), layout, notices.Callback()).ok());
    absl::StatusOr<PeerId> connected = sender.Connect(receiver.LocalAddress());
    EXPECT_TRUE(connected.ok()) << connected.status();
    peer = connected.value_or(-1);
  }

  std::unique_ptr<kv::KvCache> src, dst;
  NoticeLog notices;
  UcxTransport sender, receiver;
  PeerId peer = -1;
};

TEST_P(UcxTransportTest, CopiesBlocksByteExactBetweenTwoWorkers) {
  UcxPair pair(GetParam(), 16, 20);
  auto& [src, dst, notices, sender, receiver, peer] = pair;
  EXPECT_EQ(receiver.name(), absl::StrCat("ucx(", GetParam(), ")"));
  ASSERT_GE(peer, 0);

  BlockTransfer t;
  t.reservation_id = 42;
  t.generation = 3;
  // 3-5 and 10-11 are runs on both sides; 14, 1, 13 go to the run 3-5 (gathered into one put
  // over TCP, a put each over shared memory).
  t.src_blocks = {3, 4, 5, 9, 0, 10, 11, 14, 1, 13};
  t.dst_blocks = {7, 8, 9, 19, 11, 1, 2, 3, 4, 5};
  for (size_t i = 0; i < t.src_blocks.size(); ++i) FillPattern(*src, t.src_blocks[i], 5, i);
  DoneWaiter done;
  sender.Write(peer, t, done.Callback());
  std::optional<absl::Status> status = done.Wait();
  ASSERT_TRUE(status.has_value()) << "done never fired";
  ASSERT_TRUE(status->ok()) << *status;
  EXPECT_NE(done.thread(), std::this_thread::get_id());
  for (size_t i = 0; i < t.dst_blocks.size(); ++i) {
    EXPECT_TRUE(HasPattern(*dst, t.dst_blocks[i], 5, i)) << "dst block " << t.dst_blocks[i];
  }
  for (int32_t b : {0, 6, 10, 12, 13, 14, 15, 16, 17, 18}) {
    EXPECT_TRUE(IsZero(*dst, b)) << "block " << b << " was not in the transfer";
  }
  // `done` follows the receiver's notice (it is the ACK of it): exactly one, already there.
  EXPECT_EQ(notices.notices(), (std::vector<std::pair<uint64_t, uint32_t>>{{42, 3}}));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(done.calls(), 1);
  EXPECT_EQ(notices.notices().size(), 1u);
  TransportStats stats = sender.stats();
  EXPECT_EQ(stats.transfers, 1);
  EXPECT_EQ(stats.failures, 0);
  EXPECT_EQ(stats.bytes, 10 * 3 * Shape(1).block_bytes());
}

TEST_P(UcxTransportTest, ManyWritesInFlight) {
  UcxPair pair(GetParam(), 32, 32);
  auto& [src, dst, notices, sender, receiver, peer] = pair;
  ASSERT_GE(peer, 0);
  std::vector<std::unique_ptr<DoneWaiter>> waiters;
  for (int i = 0; i < 32; ++i) {
    FillPattern(*src, i, 9, i);
    BlockTransfer t;
    t.reservation_id = 1000 + i;
    t.generation = 1;
    t.src_blocks = {i};
    t.dst_blocks = {31 - i};
    waiters.push_back(std::make_unique<DoneWaiter>());
    sender.Write(peer, t, waiters.back()->Callback());
  }
  for (int i = 0; i < 32; ++i) {
    std::optional<absl::Status> status = waiters[i]->Wait();
    ASSERT_TRUE(status.has_value() && status->ok()) << i;
    EXPECT_TRUE(HasPattern(*dst, 31 - i, 9, i)) << i;
  }
  EXPECT_EQ(notices.notices().size(), 32u);
  EXPECT_EQ(sender.stats().transfers, 32);
}

TEST_P(UcxTransportTest, BadBlockIdsAreInvalidArgument) {
  UcxPair pair(GetParam(), 16, 8);
  auto& [src, dst, notices, sender, receiver, peer] = pair;
  ASSERT_GE(peer, 0);
  FillPattern(*src, 1, 1, 0);
  BlockTransfer t;
  t.src_blocks = {1};
  t.dst_blocks = {8};  // the peer has 8 blocks
  absl::Status s = WriteAndWait(sender, peer, t);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("dst_blocks[0] = 8"), std::string::npos) << s;
  t.src_blocks = {16};
  t.dst_blocks = {0};
  EXPECT_EQ(WriteAndWait(sender, peer, t).code(), absl::StatusCode::kInvalidArgument);
  t.src_blocks = {1, 2};
  EXPECT_EQ(WriteAndWait(sender, peer, t).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteAndWait(sender, /*peer=*/99, t).code(), absl::StatusCode::kUnavailable);
  for (int32_t b = 0; b < 8; ++b) EXPECT_TRUE(IsZero(*dst, b));
  EXPECT_TRUE(notices.notices().empty());
  // The peer is still usable.
  t.src_blocks = {1};
  t.dst_blocks = {7};
  ASSERT_TRUE(WriteAndWait(sender, peer, t).ok());
  EXPECT_TRUE(HasPattern(*dst, 7, 1, 0));
}

// bf16 blocks travel as they are stored: byte for byte, and half of f32's bytes (the UCX
// registration and the per-block stride follow the dtype).
TEST_P(UcxTransportTest, Bf16BlocksCrossByteExactAtHalfTheBytes) {
  UcxPair pair(GetParam(), 16, 20, kv::KvDtype::kBF16);
  auto& [src, dst, notices, sender, receiver, peer] = pair;
  ASSERT_GE(peer, 0);
  BlockTransfer t;
  t.reservation_id = 7;
  t.src_blocks = {3, 4, 5, 12};
  t.dst_blocks = {10, 11, 12, 0};
  for (size_t i = 0; i < t.src_blocks.size(); ++i) FillPattern(*src, t.src_blocks[i], 11, i);
  ASSERT_TRUE(WriteAndWait(sender, peer, t).ok());
  for (size_t i = 0; i < t.dst_blocks.size(); ++i) {
    EXPECT_TRUE(HasPattern(*dst, t.dst_blocks[i], 11, i)) << "dst block " << t.dst_blocks[i];
  }
  for (int32_t b : {1, 9, 13, 19}) EXPECT_TRUE(IsZero(*dst, b)) << "block " << b;
  EXPECT_EQ(sender.stats().bytes, 4 * 3 * Shape(1, kv::KvDtype::kBF16).block_bytes());
}

TEST_P(UcxTransportTest, KvDtypeMismatchIsRefusedNamingBoth) {
  auto a = Cache(4), b = Cache(4, kv::KvDtype::kBF16);
  UcxTransport ta(Options(GetParam())), tb(Options(GetParam()));
  testing::ExpectKvDtypeMismatchRefused(ta, *a, tb, *b);
}

TEST_P(UcxTransportTest, LayoutMismatchIsRefusedNamingBothLayouts) {
  auto a = Cache(4), b = Cache(4);
  const KvLayout la = KvLayout::ForCache(a->shape(), "model-a");
  const KvLayout lb = KvLayout::ForCache(b->shape(), "model-b");
  UcxTransport ta(Options(GetParam())), tb(Options(GetParam()));
  ASSERT_TRUE(ta.Start(a.get(), la, nullptr).ok());
  ASSERT_TRUE(tb.Start(b.get(), lb, nullptr).ok());
  absl::StatusOr<PeerId> id = ta.Connect(tb.LocalAddress());
  ASSERT_EQ(id.status().code(), absl::StatusCode::kFailedPrecondition) << id.status();
  EXPECT_NE(id.status().message().find(la.ToString()), std::string::npos) << id.status();
  EXPECT_NE(id.status().message().find(lb.ToString()), std::string::npos) << id.status();
  EXPECT_EQ(ta.Connect("garbage").status().code(), absl::StatusCode::kInvalidArgument);
  std::string truncated = tb.LocalAddress();
  truncated.resize(truncated.size() - 3);
  EXPECT_EQ(ta.Connect(truncated).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(UcxTransportTest, DestroyedReceiverEndsInAnErrorNotAHang) {
  auto src = Cache(8), dst = Cache(8);
  const KvLayout layout = KvLayout::ForCache(src->shape(), "tiny");
  UcxTransportOptions options = Options(GetParam());
  options.transfer_timeout = absl::Seconds(3);
  UcxTransport sender(options);
  auto receiver = std::make_unique<UcxTransport>(Options(GetParam()));
  ASSERT_TRUE(sender.Start(src.get(), layout, nullptr).ok());
  ASSERT_TRUE(receiver->Start(dst.get(), layout, nullptr).ok());
  PeerId peer = sender.Connect(receiver->LocalAddress()).value_or(-1);
  ASSERT_GE(peer, 0);
  BlockTransfer t;
  t.src_blocks = {0, 1};
  t.dst_blocks = {2, 3};
  ASSERT_TRUE(WriteAndWait(sender, peer, t).ok());
  receiver.reset();
  const absl::Time start = absl::Now();
  absl::Status s = WriteAndWait(sender, peer, t);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.message().find("test: done did not fire"), std::string::npos) << s;
  EXPECT_LT(absl::Now() - start, kWait);
  // The peer is dropped: later writes fail at once.
  EXPECT_EQ(WriteAndWait(sender, peer, t, absl::Seconds(10)).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_GE(sender.stats().failures, 2);
}

TEST(UcxTransportLifecycleTest, CallsBeforeStart) {
  UcxTransport t(Options("posix,self"));
  EXPECT_EQ(t.name(), "ucx");
  EXPECT_EQ(t.LocalAddress(), "");
  EXPECT_EQ(t.Connect("x").status().code(), absl::StatusCode::kFailedPrecondition);
  DoneWaiter done;
  t.Write(0, BlockTransfer{}, done.Callback());
  std::optional<absl::Status> status = done.Wait();
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(status->code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(done.thread(), std::this_thread::get_id());
}

TEST(UcxAddressTest, RoundTripsAndRejectsDamage) {
  UcxPeerAddress a;
  a.layout = KvLayout::ForCache(Shape(4), "m");
  a.num_blocks = 4;
  a.base = 0x7f0000001000;
  a.bytes = 4 * Shape(4).bytes_per_block_all_layers();
  a.worker_address = std::string("\x01\x00\x02", 3);
  a.rkey = "rkey";
  const std::string bytes = EncodeUcxPeerAddress(a);
  absl::StatusOr<UcxPeerAddress> b = DecodeUcxPeerAddress(bytes);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->layout.ToString(), a.layout.ToString());
  EXPECT_EQ(b->num_blocks, 4);
  EXPECT_EQ(b->base, a.base);
  EXPECT_EQ(b->bytes, a.bytes);
  EXPECT_EQ(b->worker_address, a.worker_address);
  EXPECT_EQ(b->rkey, "rkey");
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    EXPECT_FALSE(DecodeUcxPeerAddress(bytes.substr(0, cut)).ok()) << cut;
  }
  std::string flipped = bytes;
  flipped[20] ^= 1;  // inside the layout hash
  EXPECT_FALSE(DecodeUcxPeerAddress(flipped).ok());
}

// ---- Two processes: a ucx_peer child receives ----

// A ucx_peer child with pipes to its stdin and stdout; killed (and reaped) on destruction.
class PeerProcess {
 public:
  static std::unique_ptr<PeerProcess> Spawn(const std::string& tls, const kv::KvCacheShape& shape) {
    ::signal(SIGPIPE, SIG_IGN);  // writing to a killed child must not kill the test
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) return nullptr;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    std::vector<std::string> args = {PREFT_UCX_PEER,
                                     absl::StrCat("layers=", shape.num_layers),
                                     absl::StrCat("blocks=", shape.num_blocks),
                                     absl::StrCat("block_tokens=", shape.block_tokens),
                                     absl::StrCat("kv_heads=", shape.num_kv_heads),
                                     absl::StrCat("head_dim=", shape.head_dim),
                                     "model=tiny"};
    // The child takes its UCX settings from the environment, as a deployed worker would.
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::string_view(*e).rfind("UCX_TLS=", 0) != 0 &&
          std::string_view(*e).rfind("UCX_NET_DEVICES=", 0) != 0) {
        env.emplace_back(*e);
      }
    }
    env.push_back("UCX_TLS=" + tls);
    env.push_back("UCX_NET_DEVICES=lo");
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t pid = 0;
    const int rc = posix_spawn(&pid, PREFT_UCX_PEER, &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    ::close(in[0]);
    ::close(out[1]);
    if (rc != 0) {
      ::close(in[1]);
      ::close(out[0]);
      return nullptr;
    }
    return std::unique_ptr<PeerProcess>(new PeerProcess(pid, in[1], out[0]));
  }

  ~PeerProcess() {
    ::close(stdin_);
    Kill(SIGKILL);
    ::close(stdout_);
  }

  // The next line the child printed, or nullopt after `timeout` or at end of output.
  std::optional<std::string> ReadLine(absl::Duration timeout = kWait) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      const size_t eol = buffer_.find('\n');
      if (eol != std::string::npos) {
        std::string line = buffer_.substr(0, eol);
        buffer_.erase(0, eol + 1);
        return line;
      }
      const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (ms <= 0) return std::nullopt;
      pollfd fd{stdout_, POLLIN, 0};
      if (::poll(&fd, 1, static_cast<int>(ms)) <= 0) continue;
      char chunk[4096];
      const ssize_t n = ::read(stdout_, chunk, sizeof(chunk));
      if (n <= 0) return std::nullopt;
      buffer_.append(chunk, n);
    }
  }
  // The next line starting with `prefix` (skipping others), without the prefix.
  std::optional<std::string> Expect(const std::string& prefix, absl::Duration timeout = kWait) {
    const absl::Time deadline = absl::Now() + timeout;
    while (auto line = ReadLine(deadline - absl::Now())) {
      if (line->rfind(prefix, 0) == 0) return line->substr(prefix.size());
    }
    return std::nullopt;
  }
  bool WriteLine(const std::string& line) {
    const std::string data = line + "\n";
    return ::write(stdin_, data.data(), data.size()) == static_cast<ssize_t>(data.size());
  }
  // Stops the child and returns once the kernel reports it stopped: kill() only queues the
  // signal, and a child still running could finish a transfer the test means to catch in flight.
  bool Stop() {
    if (pid_ <= 0 || ::kill(pid_, SIGSTOP) != 0) return false;
    siginfo_t info{};
    return ::waitid(P_PID, static_cast<id_t>(pid_), &info, WSTOPPED | WNOWAIT) == 0 &&
           info.si_code == CLD_STOPPED;
  }
  void Signal(int sig) {
    if (pid_ > 0) ::kill(pid_, sig);
  }
  void Kill(int sig) {
    if (pid_ <= 0) return;
    ::kill(pid_, sig);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  PeerProcess(pid_t pid, int in, int out) : pid_(pid), stdin_(in), stdout_(out) {}
  pid_t pid_;
  int stdin_, stdout_;
  std::string buffer_;
};

std::string FromHex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

TEST_P(UcxTransportTest, ChildProcessReceivesExactBytes) {
  const kv::KvCacheShape shape = Shape(24);
  auto child = PeerProcess::Spawn(GetParam(), shape);
  ASSERT_NE(child, nullptr);
  std::optional<std::string> address = child->Expect("ADDRESS ");
  ASSERT_TRUE(address.has_value()) << "the child did not start";

  auto src = Cache(16);
  UcxTransport sender(Options(GetParam()));
  ASSERT_TRUE(sender.Start(src.get(), KvLayout::ForCache(shape, "tiny"), nullptr).ok());
  absl::StatusOr<PeerId> peer = sender.Connect(FromHex(*address));
  ASSERT_TRUE(peer.ok()) << peer.status();

  // Two transfers of the same reservation's generations 1 and 2 (a retry), then another.
  struct Step {
    uint64_t reservation, seed;
    uint32_t generation;
    std::vector<int32_t> src, dst;
  };
  for (const Step& step :
       {Step{7, 11, 1, {0, 1, 2, 15}, {20, 3, 4, 5}}, Step{7, 12, 2, {0, 1, 2, 15}, {20, 3, 4, 5}},
        Step{8, 13, 1, {5, 6}, {23, 0}}}) {
    for (size_t i = 0; i < step.src.size(); ++i) FillPattern(*src, step.src[i], step.seed, i);
    ASSERT_TRUE(child->WriteLine(absl::StrCat("EXPECT ", step.reservation, " ", step.seed, " ",
                                              absl::StrJoin(step.dst, ","))));
    ASSERT_EQ(child->Expect("EXPECTING "), std::to_string(step.reservation));
    BlockTransfer t;
    t.reservation_id = step.reservation;
    t.generation = step.generation;
    t.src_blocks = step.src;
    t.dst_blocks = step.dst;
    absl::Status s = WriteAndWait(sender, *peer, t);
    ASSERT_TRUE(s.ok()) << s;
    // The child checked its cache when the notice came, before it acknowledged.
    EXPECT_EQ(child->Expect("VERIFIED "),
              absl::StrCat(step.reservation, " ", step.generation, " ok"));
  }
  EXPECT_EQ(sender.stats().transfers, 3);
}

TEST_P(UcxTransportTest, KilledPeerEndsTheWriteWithAnErrorInBoundedTime) {
  const kv::KvCacheShape shape = Shape(256);
  auto child = PeerProcess::Spawn(GetParam(), shape);
  ASSERT_NE(child, nullptr);
  std::optional<std::string> address = child->Expect("ADDRESS ");
  ASSERT_TRUE(address.has_value()) << "the child did not start";
  auto src = Cache(256);
  UcxTransportOptions options = Options(GetParam());
  options.transfer_timeout = absl::Seconds(10);
  UcxTransport sender(options);
  ASSERT_TRUE(sender.Start(src.get(), KvLayout::ForCache(shape, "tiny"), nullptr).ok());
  absl::StatusOr<PeerId> peer = sender.Connect(FromHex(*address));
  ASSERT_TRUE(peer.ok()) << peer.status();
  BlockTransfer warm;
  warm.src_blocks = {0};
  warm.dst_blocks = {0};
  ASSERT_TRUE(child->WriteLine("EXPECT 0 0 0"));
  ASSERT_TRUE(child->Expect("EXPECTING ").has_value());
  ASSERT_TRUE(WriteAndWait(sender, *peer, warm).ok());

  // Frozen, the child can neither take the data nor acknowledge: the write is in flight when
  // the child dies.
  ASSERT_TRUE(child->Stop());
  BlockTransfer t;
  t.reservation_id = 1;
  for (int32_t b = 0; b < 256; ++b) {
    t.src_blocks.push_back(b);
    t.dst_blocks.push_back(255 - b);
  }
  DoneWaiter done;
  const absl::Time start = absl::Now();
  sender.Write(*peer, t, done.Callback());
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(done.calls(), 0) << "finished while the peer was stopped";
  child->Kill(SIGKILL);
  std::optional<absl::Status> status = done.Wait();
  ASSERT_TRUE(status.has_value()) << "Write hung after the peer died";
  EXPECT_FALSE(status->ok());
  EXPECT_TRUE(status->code() == absl::StatusCode::kUnavailable ||
              status->code() == absl::StatusCode::kDeadlineExceeded)
      << *status;
  EXPECT_LT(absl::Now() - start, kWait);
  EXPECT_EQ(done.calls(), 1);
  // The dead peer is dropped: later writes fail at once.
  EXPECT_EQ(WriteAndWait(sender, *peer, warm, absl::Seconds(10)).code(),
            absl::StatusCode::kUnavailable);
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxTransportTest, ::testing::Values("posix,self", "tcp,self"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (c == ',') c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace preft::transport
