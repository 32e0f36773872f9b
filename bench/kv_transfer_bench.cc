// KV transfer throughput between two processes through UcxTransport, against a raw probe of
// the same bytes (one contiguous ucp_put_nbx + flush, same UCX settings) measured in the same
// run. The sender (this process) re-executes itself as the receiver.
//
//   kv_transfer_bench [--mib=64] [--reps=7] [--tls=posix,self] [--tls=tcp,self] ...
//   kv_transfer_bench --handoff [--reps=31] [--tls=...]
//     one request's prefill -> decode handoff (16-, 128- and 2048-token prompts) with f32, bf16,
//     fp8 KV: bytes and time per request, against f32 (issue 37's <= 0.55x); 16 tokens (one
//     block) shows the fixed cost of a transfer.
//   --spin-us=N: UcxTransportOptions::spin for every transport (sender and receivers).
//
// Blocks are qwen2.5-0.5b's (24 layers x 16 KiB per block and layer). "scattered" writes every
// block to a shuffled destination (one 16 KiB put each, the usual case: a reservation's blocks
// come from a free list); "contiguous" writes block i to block i (one put per layer).

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/transport/ucx/ucx_put_probe.h"
#include "common/transport/ucx/ucx_transport.h"

extern char** environ;

namespace {

using preft::transport::BlockTransfer;
using preft::transport::KvLayout;
using preft::transport::UcxPutProbe;
using preft::transport::UcxTransport;
using preft::transport::UcxTransportOptions;

preft::kv::KvCacheShape Shape(int64_t num_blocks,
                              preft::kv::KvDtype dtype = preft::kv::KvDtype::kF32) {
  preft::kv::KvCacheShape shape;
  shape.dtype = dtype;
  shape.num_layers = 24;
  shape.num_blocks = num_blocks;
  shape.block_tokens = 16;
  shape.num_kv_heads = 2;
  shape.head_dim = 64;
  return shape;
}

UcxTransportOptions Options(const std::string& tls) {
  UcxTransportOptions options;
  options.tls = tls;
  options.net_devices = "lo";
  // --spin-us reaches the receivers through the environment they inherit.
  int64_t spin_us = 0;
  if (const char* e = std::getenv("PREFT_BENCH_UCX_SPIN_US"); e && absl::SimpleAtoi(e, &spin_us)) {
    options.spin = absl::Microseconds(spin_us);
  }
  return options;
}

std::string Hex(const std::string& bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

std::string Unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

void Say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

[[noreturn]] void Die(const std::string& why) {
  std::fprintf(stderr, "kv_transfer_bench: %s\n", why.c_str());
  std::exit(1);
}

// ---- receiver (child) ----

int Receiver(const std::string& tls, int64_t num_blocks, preft::kv::KvDtype dtype) {
  auto cache = preft::kv::KvCache::Create(Shape(num_blocks, dtype));
  if (!cache.ok()) Die(std::string(cache.status().message()));
  UcxTransport transport(Options(tls));
  absl::Status s = transport.Start(cache->get(),
                                   KvLayout::ForCache(Shape(1, dtype), "qwen2.5-0.5b"),
                                   [](uint64_t, uint32_t) {});
  if (!s.ok()) Die(std::string(s.message()));
  auto probe = UcxPutProbe::Create(Options(tls), (*cache)->layer_data(0), (*cache)->bytes());
  if (!probe.ok()) Die(std::string(probe.status().message()));
  Say("ADDRESS " + Hex(transport.LocalAddress()));
  Say("PROBE " + Hex((*probe)->address()));
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line != "SPIN") continue;
    // Drive the probe's worker until the sender says STOP (the target side of its put).
    Say("SPINNING");
    while (true) {
      for (int i = 0; i < 256; ++i) (*probe)->Progress();
      pollfd fd{0, POLLIN, 0};
      if (::poll(&fd, 1, 0) > 0) break;
    }
    if (!std::getline(std::cin, line)) break;
    Say("STOPPED");
  }
  return 0;
}

// ---- sender ----

class Child {
 public:
  Child(const std::string& tls, int64_t num_blocks,
        preft::kv::KvDtype dtype = preft::kv::KvDtype::kF32) {
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) Die("pipe");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    std::string self = "/proc/self/exe", role = "--receiver", tls_arg = tls,
                blocks = std::to_string(num_blocks),
                dtype_arg = std::string(preft::kv::KvDtypeName(dtype));
    char* argv[] = {self.data(), role.data(),      tls_arg.data(),
                    blocks.data(), dtype_arg.data(), nullptr};
    if (posix_spawn(&pid_, self.c_str(), &actions, nullptr, argv, environ) != 0) Die("spawn");
    posix_spawn_file_actions_destroy(&actions);
    ::close(in[0]);
    ::close(out[1]);
    stdin_ = in[1];
    stdout_ = ::fdopen(out[0], "r");
  }
  ~Child() {
    ::close(stdin_);
    ::waitpid(pid_, nullptr, 0);
    std::fclose(stdout_);
  }
  std::string Expect(const std::string& prefix) {
    char buffer[1 << 16];
    while (std::fgets(buffer, sizeof(buffer), stdout_) != nullptr) {
      std::string line(buffer);
      if (!line.empty() && line.back() == '\n') line.pop_back();
      if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
    }
    Die("receiver ended early, waiting for " + prefix);
  }
  void Send(const std::string& line) {
    const std::string data = line + "\n";
    if (::write(stdin_, data.data(), data.size()) != static_cast<ssize_t>(data.size())) {
      Die("write to receiver");
    }
  }

 private:
  pid_t pid_ = 0;
  int stdin_ = -1;
  FILE* stdout_ = nullptr;
};

double WriteSeconds(UcxTransport& transport, preft::transport::PeerId peer,
                    const BlockTransfer& t) {
  absl::Mutex mu;
  std::optional<absl::Status> result;
  const auto start = std::chrono::steady_clock::now();
  transport.Write(peer, t, [&](absl::Status s) {
    absl::MutexLock lock(&mu);
    result = std::move(s);
  });
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(
      +[](std::optional<absl::Status>* r) { return r->has_value(); }, &result));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!result->ok()) Die("transfer failed: " + std::string(result->message()));
  return seconds;
}

void Run(const std::string& tls, int64_t num_blocks, int reps) {
  Child child(tls, num_blocks);
  const std::string transport_address = Unhex(child.Expect("ADDRESS "));
  const std::string probe_address = Unhex(child.Expect("PROBE "));

  auto cache = preft::kv::KvCache::Create(Shape(num_blocks));
  if (!cache.ok()) Die(std::string(cache.status().message()));
  preft::kv::KvCache& kv = **cache;
  std::mt19937 rng(7);
  for (size_t i = 0; i < kv.bytes(); ++i) kv.layer_data(0)[i] = static_cast<std::byte>(rng());
  UcxTransport transport(Options(tls));
  absl::Status s = transport.Start(&kv, KvLayout::ForCache(Shape(1), "qwen2.5-0.5b"), nullptr);
  if (!s.ok()) Die(std::string(s.message()));
  absl::StatusOr<preft::transport::PeerId> peer = transport.Connect(transport_address);
  if (!peer.ok()) Die(std::string(peer.status().message()));
  auto probe = UcxPutProbe::Create(Options(tls), kv.layer_data(0), kv.bytes());
  if (!probe.ok()) Die(std::string(probe.status().message()));
  s = (*probe)->Connect(probe_address);
  if (!s.ok()) Die(std::string(s.message()));

  // scattered: both sides shuffled (the worst case: a put per block and layer); gathered: the
  // sender's blocks shuffled (a prefill worker's cache after churn) into a run of destination
  // blocks (a decode reservation), staged into one put per layer; contiguous: runs both sides.
  BlockTransfer scattered, gathered, contiguous;
  for (int32_t b = 0; b < num_blocks; ++b) {
    scattered.src_blocks.push_back(b);
    contiguous.src_blocks.push_back(b);
    contiguous.dst_blocks.push_back(b);
  }
  scattered.dst_blocks = scattered.src_blocks;
  std::shuffle(scattered.src_blocks.begin(), scattered.src_blocks.end(), rng);
  std::shuffle(scattered.dst_blocks.begin(), scattered.dst_blocks.end(), rng);
  gathered.src_blocks = scattered.src_blocks;
  gathered.dst_blocks = contiguous.dst_blocks;
  const double bytes = static_cast<double>(kv.bytes());

  auto probe_seconds = [&]() {
    child.Send("SPIN");
    child.Expect("SPINNING");
    absl::StatusOr<double> seconds = (*probe)->Put(kv.bytes(), absl::Seconds(60));
    child.Send("STOP");
    child.Expect("STOPPED");
    if (!seconds.ok()) Die(std::string(seconds.status().message()));
    return *seconds;
  };
  // Warm-up: first touches, endpoint wire-up, registration caches.
  WriteSeconds(transport, *peer, scattered);
  WriteSeconds(transport, *peer, contiguous);
  WriteSeconds(transport, *peer, gathered);
  probe_seconds();

  std::vector<double> t_scattered, t_gathered, t_contiguous, t_probe;
  for (int rep = 0; rep < reps; ++rep) {  // interleaved, so load drifts hit all three alike
    t_scattered.push_back(bytes / WriteSeconds(transport, *peer, scattered) / 1e9);
    t_contiguous.push_back(bytes / WriteSeconds(transport, *peer, contiguous) / 1e9);
    t_gathered.push_back(bytes / WriteSeconds(transport, *peer, gathered) / 1e9);
    t_probe.push_back(bytes / probe_seconds() / 1e9);
  }
  using preft::bench::Median;
  const double scattered_gbps = Median(t_scattered), contiguous_gbps = Median(t_contiguous),
               gathered_gbps = Median(t_gathered), probe_gbps = Median(t_probe);
  std::printf(
      "%-16s %s  %.1f MiB (%lld blocks x 24 layers x 16 KiB)\n"
      "  raw ucp_put_nbx probe (1 put + flush)   %7.2f GB/s\n"
      "  UcxTransport scattered (%5lld puts)     %7.2f GB/s   ratio %.2f\n"
      "  UcxTransport gathered   (dst runs)      %7.2f GB/s   ratio %.2f\n"
      "  UcxTransport contiguous (%3d puts)      %7.2f GB/s   ratio %.2f\n",
      tls.c_str(), transport.name().c_str(), bytes / (1 << 20), static_cast<long long>(num_blocks),
      probe_gbps, static_cast<long long>(num_blocks * 24), scattered_gbps,
      scattered_gbps / probe_gbps, gathered_gbps, gathered_gbps / probe_gbps, 24,
      contiguous_gbps, contiguous_gbps / probe_gbps);
  std::fflush(stdout);
}

// One request's handoff: a prompt's blocks, scattered over the prefill worker's cache, into a
// decode reservation's run of blocks, per KV dtype (a receiver process each, both alive, the
// rounds interleaved so drift hits both alike).
void RunHandoff(const std::string& tls, int reps) {
  using preft::kv::KvDtype;
  constexpr int64_t kBlocks = 256;  // 4096 tokens' worth on each side
  struct Side {
    KvDtype dtype;
    std::unique_ptr<Child> child;
    std::unique_ptr<preft::kv::KvCache> cache;
    std::unique_ptr<UcxTransport> transport;
    preft::transport::PeerId peer = -1;
  };
  std::vector<Side> sides;
  std::mt19937 rng(11);
  for (KvDtype d : {KvDtype::kF32, KvDtype::kBF16, KvDtype::kFp8E4M3}) {
    Side s;
    s.dtype = d;
    s.child = std::make_unique<Child>(tls, kBlocks, d);
    const std::string address = Unhex(s.child->Expect("ADDRESS "));
    (void)s.child->Expect("PROBE ");
    auto cache = preft::kv::KvCache::Create(Shape(kBlocks, d));
    if (!cache.ok()) Die(std::string(cache.status().message()));
    s.cache = *std::move(cache);
    for (size_t i = 0; i < s.cache->bytes(); ++i) s.cache->layer_data(0)[i] = std::byte(rng());
    s.transport = std::make_unique<UcxTransport>(Options(tls));
    absl::Status st = s.transport->Start(s.cache.get(),
                                         KvLayout::ForCache(Shape(1, d), "qwen2.5-0.5b"), nullptr);
    if (!st.ok()) Die(std::string(st.message()));
    absl::StatusOr<preft::transport::PeerId> peer = s.transport->Connect(address);
    if (!peer.ok()) Die(std::string(peer.status().message()));
    s.peer = *peer;
    sides.push_back(std::move(s));
  }
  std::printf("\n%s: one request's KV handoff, median of %d\n"
              "| prompt tokens | kv dtype | bytes | time | bytes vs f32 | time vs f32 |\n"
              "|---|---|---|---|---|---|\n",
              tls.c_str(), reps);
  for (int64_t tokens : {16, 128, 2048}) {
    BlockTransfer t;
    std::vector<int32_t> all(kBlocks);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    const int64_t n = (tokens + 15) / 16;
    t.src_blocks.assign(all.begin(), all.begin() + n);
    for (int32_t b = 0; b < n; ++b) t.dst_blocks.push_back(b + 7);
    for (Side& s : sides) WriteSeconds(*s.transport, s.peer, t);  // warm-up
    std::vector<std::vector<double>> seconds(sides.size());
    for (int rep = 0; rep < reps; ++rep) {
      // Each dtype goes first in turn: the one after a transfer finds the host just woken.
      for (size_t k = 0; k < sides.size(); ++k) {
        const size_t i = (rep + k) % sides.size();
        seconds[i].push_back(WriteSeconds(*sides[i].transport, sides[i].peer, t));
      }
    }
    const double f32_bytes = double(n) * sides[0].cache->shape().bytes_per_block_all_layers();
    const double f32_s = preft::bench::Median(seconds[0]);
    for (size_t i = 0; i < sides.size(); ++i) {
      const double bytes = double(n) * sides[i].cache->shape().bytes_per_block_all_layers();
      const double s = preft::bench::Median(seconds[i]);
      std::printf("| %lld | %s | %.2f MiB | %.0f us | %.2f | %.2f |\n",
                  static_cast<long long>(tokens),
                  std::string(preft::kv::KvDtypeName(sides[i].dtype)).c_str(), bytes / (1 << 20),
                  s * 1e6, bytes / f32_bytes, s / f32_s);
    }
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 5 && std::string(argv[1]) == "--receiver") {
    int64_t blocks = 0;
    if (!absl::SimpleAtoi(argv[3], &blocks)) return 2;
    preft::kv::KvDtype dtype;
    if (!preft::kernels::ParseKvDtype(argv[4], &dtype)) return 2;
    return Receiver(argv[2], blocks, dtype);
  }
  ::signal(SIGPIPE, SIG_IGN);
  int64_t mib = 64;
  int reps = 7;
  bool handoff = false;
  std::vector<std::string> tls;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--mib=", 0) == 0 && absl::SimpleAtoi(arg.substr(6), &mib)) continue;
    if (arg.rfind("--reps=", 0) == 0 && absl::SimpleAtoi(arg.substr(7), &reps)) continue;
    if (arg == "--handoff") {
      handoff = true;
      continue;
    }
    if (arg.rfind("--spin-us=", 0) == 0) {
      ::setenv("PREFT_BENCH_UCX_SPIN_US", arg.substr(10).c_str(), 1);
      continue;
    }
    if (arg.rfind("--tls=", 0) == 0) {
      tls.push_back(arg.substr(6));
      continue;
    }
    Die("usage: kv_transfer_bench [--mib=64] [--reps=7] [--handoff] [--spin-us=N] "
        "[--tls=posix,self]...");
  }
  if (tls.empty()) tls = {"posix,self", "tcp,self"};
  if (handoff) {
    for (const std::string& t : tls) RunHandoff(t, reps);
    return 0;
  }
  const int64_t num_blocks =
      std::max<int64_t>(1, (mib << 20) / Shape(1).bytes_per_block_all_layers());
  std::printf("KV transfer between two processes, median of %d (UCX_NET_DEVICES=lo)\n", reps);
  for (const std::string& t : tls) Run(t, num_blocks, reps);
  return 0;
}
