// A receiving peer in its own process, driven by ucx_transport_test over stdin/stdout.
//
//   ucx_peer layers=L blocks=N block_tokens=T kv_heads=H head_dim=D model=M
// prints "ADDRESS <hex>" once started. Then, per stdin line:
//   "EXPECT <reservation> <seed> <dst,dst,...>"  -> "EXPECTING <reservation>"
// and for each DONE notice it checks the expected blocks (dst_blocks[i] must hold the pattern
// (seed, i) in every layer; blocks never expected must still be zero) and prints
// "VERIFIED <reservation> <generation> ok" or "... bad <why>". EOF ends it.
// UCX settings come from the environment (UCX_TLS, UCX_NET_DEVICES).

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/transport/ucx/ucx_transport.h"
#include "tests/transport/kv_test_pattern.h"

namespace {

using preft::transport::testing::HasPattern;
using preft::transport::testing::IsZero;

struct Expectation {
  uint64_t seed = 0;
  std::vector<int32_t> dst;
};

absl::Mutex mu;
std::map<uint64_t, Expectation> expected ABSL_GUARDED_BY(mu);
std::set<int32_t> touched ABSL_GUARDED_BY(mu);

void Say(const std::string& line) {
  absl::MutexLock lock(&mu);  // one writer at a time
  std::fprintf(stdout, "%s\n", line.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i < argc; ++i) {
    std::pair<std::string, std::string> kv = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    args[kv.first] = kv.second;
  }
  auto arg = [&](const char* name, int64_t fallback) {
    int64_t v = fallback;
    if (args.count(name) && !absl::SimpleAtoi(args[name], &v)) std::exit(2);
    return v;
  };
  preft::kv::KvCacheShape shape;
  shape.num_layers = arg("layers", 3);
  shape.num_blocks = arg("blocks", 16);
  shape.block_tokens = arg("block_tokens", 4);
  shape.num_kv_heads = arg("kv_heads", 2);
  shape.head_dim = arg("head_dim", 8);
  auto cache = preft::kv::KvCache::Create(shape);
  if (!cache.ok()) return 3;
  preft::kv::KvCache& kv = **cache;

  preft::transport::UcxTransport transport;
  auto on_done = [&kv](uint64_t reservation, uint32_t generation) {
    std::string verdict = "ok";
    {
      absl::MutexLock lock(&mu);
      auto it = expected.find(reservation);
      if (it == expected.end()) {
        verdict = "bad unexpected reservation";
      } else {
        for (size_t i = 0; i < it->second.dst.size(); ++i) {
          if (!HasPattern(kv, it->second.dst[i], it->second.seed, i)) {
            verdict = "bad dst block " + std::to_string(it->second.dst[i]);
          }
        }
        for (int32_t b = 0; b < kv.shape().num_blocks; ++b) {
          if (touched.count(b) == 0 && !IsZero(kv, b)) {
            verdict = "bad block " + std::to_string(b) + " written but not expected";
          }
        }
      }
    }
    Say("VERIFIED " + std::to_string(reservation) + " " + std::to_string(generation) + " " +
        verdict);
  };
  const std::string model = args.count("model") ? args["model"] : "tiny";
  absl::Status started =
      transport.Start(&kv, preft::transport::KvLayout::ForCache(shape, model), on_done);
  if (!started.ok()) {
    std::fprintf(stderr, "ucx_peer: %s\n", std::string(started.message()).c_str());
    return 4;
  }
  std::string hex;
  static const char kDigits[] = "0123456789abcdef";
  for (unsigned char c : transport.LocalAddress()) {
    hex += kDigits[c >> 4];
    hex += kDigits[c & 15];
  }
  Say("ADDRESS " + hex);

  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string verb, dst_list;
    uint64_t reservation = 0;
    Expectation e;
    if (!(in >> verb >> reservation >> e.seed >> dst_list) || verb != "EXPECT") {
      Say("ERROR bad command: " + line);
      continue;
    }
    for (absl::string_view id : absl::StrSplit(dst_list, ',', absl::SkipEmpty())) {
      int32_t b = 0;
      if (absl::SimpleAtoi(id, &b)) e.dst.push_back(b);
    }
    {
      absl::MutexLock lock(&mu);
      touched.insert(e.dst.begin(), e.dst.end());
      expected[reservation] = std::move(e);
    }
    Say("EXPECTING " + std::to_string(reservation));
  }
  return 0;
}
