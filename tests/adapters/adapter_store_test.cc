#include "common/adapters/adapter_store.h"

#include <stdlib.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <latch>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/adapters/adapter_loader.h"
#include "common/adapters/make_adapter.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace preft::adapters {
namespace {

namespace fs = std::filesystem;
using kernels::DType;
using model::AdapterWeights;
using model::Projection;
using ::testing::HasSubstr;

model::ModelConfig TinyConfig(int64_t hidden = 32) {
  model::ModelConfig c;
  c.architecture_name = "LlamaForCausalLM";
  c.model_type = "llama";
  c.hidden_size = hidden;
  c.intermediate_size = 2 * hidden;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = hidden / 2;
  c.vocab_size = 64;
  c.max_position_embeddings = 128;
  return c;
}

// Aborts the test binary if a test hangs (a deadlock must fail, not stall the suite).
class Watchdog {
 public:
  explicit Watchdog(int seconds) {
    thread_ = std::thread([this, seconds] {
      std::unique_lock<std::mutex> lock(mu_);
      if (!cv_.wait_for(lock, std::chrono::seconds(seconds), [this] { return done_; })) {
        std::fprintf(stderr, "adapter_store_test: watchdog fired after %d s (hang)\n", seconds);
        std::abort();
      }
    });
  }
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

// FNV-1a over every value (as f32 bits), scale and bias of the adapter's low-rank pairs.
uint64_t Checksum(const AdapterWeights& w) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      h ^= static_cast<const uint8_t*>(p)[i];
      h *= 1099511628211ull;
    }
  };
  auto matrix = [&](const kernels::MatrixView& m) {
    mix(&m.rows, sizeof m.rows);
    mix(&m.cols, sizeof m.cols);
    for (int64_t i = 0; i < m.rows * m.cols; ++i) {
      const float v = kernels::LoadAsF32(m.data, m.dtype, i);
      mix(&v, sizeof v);
    }
  };
  auto low_rank = [&](const model::LowRank& lr) {
    if (lr.empty()) return;
    matrix(lr.shrink);
    matrix(lr.expand);
    mix(&lr.scale, sizeof lr.scale);
    if (lr.shrink_bias != nullptr) mix(lr.shrink_bias, lr.rank() * sizeof(float));
  };
  for (int64_t l = 0; l < w.num_layers(); ++l) {
    if (w.kind() == model::AdapterKind::kLora) {
      for (int p = 0; p < model::kNumProjections; ++p)
        low_rank(w.lora(l, static_cast<Projection>(p)));
    } else {
      low_rank(w.direft(l));
    }
  }
  return h;
}

class AdapterStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::temp_directory_path() / "preft_store_XXXXXX").string();
    ASSERT_NE(mkdtemp(templ.data()), nullptr);
    root_ = templ;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }

  // Writes a random adapter into root_/name and returns the folder.
  std::string Write(const std::string& name, int64_t rank = 4, uint64_t seed = 1,
                    const model::ModelConfig& config = TinyConfig(),
                    model::AdapterKind kind = model::AdapterKind::kLora) {
    RandomAdapterSpec spec;
    spec.kind = kind;
    spec.rank = rank;
    spec.seed = seed;
    const std::string dir = (fs::path(root_) / name).string();
    const absl::Status s = WriteRandomAdapter(config, spec, dir);
    EXPECT_TRUE(s.ok()) << s;
    return dir;
  }

  static int64_t Bytes(const std::string& dir, DType dtype = DType::kF32) {
    auto w = LoadAdapter(dir, TinyConfig());
    EXPECT_TRUE(w.ok()) << w.status();
    if (!w.ok()) return 0;
    return static_cast<int64_t>((*w)->ConvertTo(dtype)->bytes());
  }

  static uint64_t DirectChecksum(const std::string& dir, DType dtype = DType::kF32) {
    auto w = LoadAdapter(dir, TinyConfig());
    EXPECT_TRUE(w.ok()) << w.status();
    if (!w.ok()) return 0;
    return Checksum(*(*w)->ConvertTo(dtype));
  }

  std::string root_;
};

AdapterStoreOptions Budgets(int64_t host_bytes, int64_t compute_bytes) {
  AdapterStoreOptions o;
  o.host_bytes = host_bytes;
  o.compute_bytes = compute_bytes;
  return o;
}

// Acquires and drops the pin at once; returns the version.
int64_t Touch(AdapterStore& store, const std::string& name) {
  auto pin = store.AcquireBlocking(name);
  EXPECT_TRUE(pin.ok()) << name << ": " << pin.status();
  return pin.ok() ? pin->version : -1;
}

bool InCompute(const AdapterStore& store, const std::string& name) {
  for (const AdapterInfo& info : store.List())
    if (info.name == name) return info.in_compute;
  return false;
}

bool InHost(const AdapterStore& store, const std::string& name) {
  for (const AdapterInfo& info : store.List())
    if (info.name == name) return info.in_host;
  return false;
}

// 1. A scripted sequence with compute room for 2 adapters and host room for 3.
TEST_F(AdapterStoreTest, CountersFollowScriptedSequence) {
  Watchdog watchdog(30);
  const model::ModelConfig config = TinyConfig();
  for (const char* name : {"a", "b", "c", "d"}) Write(name, 4, name[0]);
  const int64_t s = Bytes(root_ + "/a");
  ASSERT_GT(s, 0);
  AdapterStore store(config, Budgets(3 * s, 2 * s));
  for (const char* name : {"a", "b", "c", "d"})
    ASSERT_TRUE(store.Register(name, root_ + "/" + name).ok());

  struct Step {
    const char* name;
    int64_t compute_hits, host_hits, disk_loads, compute_evictions, host_evictions;
  };
  // host LRU / compute LRU after each step, most recent first, in the comments.
  const Step script[] = {
      {"a", 0, 0, 1, 0, 0},  // host a        compute a
      {"a", 1, 0, 1, 0, 0},  // host a        compute a
      {"b", 1, 0, 2, 0, 0},  // host b a      compute b a
      {"c", 1, 0, 3, 1, 0},  // host c b a    compute c b      (a out of compute)
      {"a", 1, 1, 3, 2, 0},  // host a c b    compute a c      (host hit; b out)
      {"d", 1, 1, 4, 3, 1},  // host d a c    compute d a      (b out of host, c out)
      {"b", 1, 1, 5, 4, 2},  // host b d a    compute b d      (from disk again)
      {"d", 2, 1, 5, 4, 2},  // host d b a    compute d b      (a compute hit touches host)
      {"c", 2, 1, 6, 5, 3},  // host c d b    compute c d      (a out of host, b out)
      {"d", 3, 1, 6, 5, 3},  // host d c b    compute d c
      {"a", 3, 1, 7, 6, 4},  // host a d c    compute a d      (b out of host, c out)
      {"d", 4, 1, 7, 6, 4},  // host d a c    compute d a      (the hit keeps d in host ...)
      {"b", 4, 1, 8, 7, 5},  // host b d a    compute b d      (... so c goes, not d)
      {"c", 4, 1, 9, 8, 6},  // host c b d    compute c b      (c from disk again)
  };
  for (const Step& step : script) {
    SCOPED_TRACE(step.name);
    EXPECT_EQ(Touch(store, step.name), 1);
    const AdapterStoreStats st = store.stats();
    EXPECT_EQ(st.compute_hits, step.compute_hits);
    EXPECT_EQ(st.host_hits, step.host_hits);
    EXPECT_EQ(st.disk_loads, step.disk_loads);
    EXPECT_EQ(st.compute_evictions, step.compute_evictions);
    EXPECT_EQ(st.host_evictions, step.host_evictions);
    EXPECT_EQ(st.joined, 0);
    EXPECT_EQ(st.load_failures, 0);
    EXPECT_EQ(st.pinned, 0);
  }
  const AdapterStoreStats st = store.stats();
  EXPECT_EQ(st.compute_bytes_used, 2 * s);
  EXPECT_EQ(st.host_bytes_used, 3 * s);
  EXPECT_TRUE(InCompute(store, "c"));
  EXPECT_TRUE(InCompute(store, "b"));
  EXPECT_FALSE(InCompute(store, "a"));
  EXPECT_FALSE(InCompute(store, "d"));
  EXPECT_TRUE(InHost(store, "d"));
  EXPECT_FALSE(InHost(store, "a"));
}

// Compute hits answer on the caller's thread; misses load on a loader thread.
TEST_F(AdapterStoreTest, MissesLoadOnLoaderThread) {
  Watchdog watchdog(30);
  Write("a");
  AdapterStore store(TinyConfig(), AdapterStoreOptions{});
  ASSERT_TRUE(store.Register("a", root_ + "/a").ok());
  int64_t load_micros = 0;
  for (int i = 0; i < 2; ++i) {
    absl::Notification done;
    std::thread::id callback_thread;
    store.Acquire("a", [&](absl::StatusOr<AdapterPin> pin) {
      EXPECT_TRUE(pin.ok()) << pin.status();
      callback_thread = std::this_thread::get_id();
      done.Notify();
    });
    done.WaitForNotification();
    if (i == 0) {
      EXPECT_NE(callback_thread, std::this_thread::get_id()) << "a miss ran on the caller";
      load_micros = store.stats().disk_load_micros;
      EXPECT_GT(load_micros, 0) << "the load's time is counted";
    } else {
      EXPECT_EQ(callback_thread, std::this_thread::get_id()) << "a hit was deferred";
    }
  }
  EXPECT_EQ(store.stats().disk_loads, 1);
  EXPECT_EQ(store.stats().compute_hits, 1);
  EXPECT_EQ(store.stats().disk_load_micros, load_micros) << "a hit loads nothing";
}

// Loads run on threads loader_nice nicer than the caller's, so on a busy host they take what
// the engine leaves (0: the same priority).
TEST_F(AdapterStoreTest, LoaderThreadsRunNicer) {
  Watchdog watchdog(30);
  Write("a");
  const int mine = ::getpriority(PRIO_PROCESS, 0);  // Linux: the calling thread's nice
  for (int nice : {0, 5}) {
    AdapterStoreOptions options;
    options.loader_nice = nice;
    AdapterStore store(TinyConfig(), options);
    ASSERT_TRUE(store.Register("a", root_ + "/a").ok());
    absl::Notification done;
    int loader = -100;
    store.Acquire("a", [&](absl::StatusOr<AdapterPin> pin) {  // a miss: on the loader
      EXPECT_TRUE(pin.ok()) << pin.status();
      loader = ::getpriority(PRIO_PROCESS, 0);
      done.Notify();
    });
    done.WaitForNotification();
    EXPECT_EQ(loader, std::min(19, mine + nice)) << "loader_nice " << nice;
  }
}

// With a bf16 model both tiers hold bf16 (the compute slot its own arena copy).
TEST_F(AdapterStoreTest, ComputeCopyIsConverted) {
  Watchdog watchdog(30);
  const std::string dir = Write("a", 4, 7);
  AdapterStoreOptions options;
  options.load.dtype = DType::kBF16;
  AdapterStore store(TinyConfig(), options);
  ASSERT_TRUE(store.Register("a", dir).ok());
  auto pin = store.AcquireBlocking("a");
  ASSERT_TRUE(pin.ok()) << pin.status();
  EXPECT_EQ(pin->weights->dtype(), DType::kBF16);
  EXPECT_EQ(Checksum(*pin->weights), DirectChecksum(dir, DType::kBF16));
  const AdapterStoreStats st = store.stats();
  EXPECT_EQ(st.host_bytes_used, Bytes(dir, DType::kBF16));
  EXPECT_EQ(st.compute_bytes_used, Bytes(dir, DType::kBF16));
}

// 2. Pinned adapters stay; an Acquire that needs room waits for a release, then completes.
TEST_F(AdapterStoreTest, PinnedAdaptersAreNeverEvictedAndAcquireWaits) {
  Watchdog watchdog(30);
  for (const char* name : {"a", "b", "c"}) Write(name, 4, name[0]);
  const int64_t s = Bytes(root_ + "/a");
  AdapterStore store(TinyConfig(), Budgets(10 * s, 2 * s));
  for (const char* name : {"a", "b", "c"})
    ASSERT_TRUE(store.Register(name, root_ + "/" + name).ok());

  auto a = store.AcquireBlocking("a");
  auto b = store.AcquireBlocking("b");
  ASSERT_TRUE(a.ok() && b.ok());
  const uint64_t a_sum = Checksum(*a->weights);
  EXPECT_EQ(store.stats().pinned, 2);

  absl::Notification c_done;
  absl::StatusOr<AdapterPin> c;
  store.Acquire("c", [&](absl::StatusOr<AdapterPin> pin) {
    c = std::move(pin);
    c_done.Notify();
  });
  // The load itself finishes; the Acquire then waits for room instead of failing.
  while (store.stats().disk_loads < 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_FALSE(c_done.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  EXPECT_TRUE(InCompute(store, "a"));
  EXPECT_TRUE(InCompute(store, "b"));
  EXPECT_EQ(store.stats().compute_evictions, 0);
  EXPECT_EQ(store.stats().compute_bytes_used, 2 * s);

  // A compute hit on a pinned adapter still answers at once.
  auto a2 = store.AcquireBlocking("a");
  ASSERT_TRUE(a2.ok());
  EXPECT_EQ(a2->weights.get(), a->weights.get());

  // Releasing one of b's pins frees room (a still has two).
  b = absl::CancelledError("released");
  ASSERT_TRUE(c_done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "c");
  EXPECT_TRUE(InCompute(store, "a"));
  EXPECT_FALSE(InCompute(store, "b"));
  EXPECT_EQ(Checksum(*a->weights), a_sum);
  AdapterStoreStats st = store.stats();
  EXPECT_EQ(st.compute_evictions, 1);
  EXPECT_EQ(st.pinned, 2);  // a (two pins) and c
  EXPECT_EQ(st.compute_bytes_used, 2 * s);

  a = absl::CancelledError("released");
  a2 = absl::CancelledError("released");
  c = absl::CancelledError("released");
  EXPECT_EQ(store.stats().pinned, 0);
}

// An adapter alone larger than a tier's budget fails (and is counted) instead of waiting.
TEST_F(AdapterStoreTest, AdapterLargerThanBudgetIsResourceExhausted) {
  Watchdog watchdog(30);
  const std::string dir = Write("a");
  const int64_t s = Bytes(dir);
  for (const auto& [host, compute] : {std::pair{10 * s, s - 1}, std::pair{s - 1, 10 * s}}) {
    AdapterStore store(TinyConfig(), Budgets(host, compute));
    ASSERT_TRUE(store.Register("a", dir).ok());
    auto pin = store.AcquireBlocking("a");
    EXPECT_EQ(pin.status().code(), absl::StatusCode::kResourceExhausted) << pin.status();
    EXPECT_THAT(pin.status().message(), HasSubstr("budget"));
    EXPECT_EQ(store.stats().load_failures, 1);
    EXPECT_EQ(store.stats().compute_bytes_used, 0);
    EXPECT_EQ(store.stats().host_bytes_used, 0);
    EXPECT_EQ(store.Update("a", dir).status().code(), absl::StatusCode::kResourceExhausted);
  }
}

// 3. Sixteen concurrent Acquires of a missing adapter share one load.
TEST_F(AdapterStoreTest, ConcurrentMissesShareOneLoad) {
  Watchdog watchdog(30);
  const model::ModelConfig config = TinyConfig(64);
  RandomAdapterSpec spec;
  spec.rank = 64;  // big enough that the load takes a while
  ASSERT_TRUE(WriteRandomAdapter(config, spec, root_ + "/big").ok());
  AdapterStore store(config, AdapterStoreOptions{});
  ASSERT_TRUE(store.Register("big", root_ + "/big").ok());

  constexpr int kThreads = 16;
  std::latch start(kThreads);
  std::vector<AdapterPin> pins(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      start.arrive_and_wait();
      auto pin = store.AcquireBlocking("big");
      ASSERT_TRUE(pin.ok()) << pin.status();
      pins[i] = *std::move(pin);
    });
  }
  for (std::thread& t : threads) t.join();
  const AdapterStoreStats st = store.stats();
  EXPECT_EQ(st.disk_loads, 1);
  EXPECT_EQ(st.host_hits, 0);
  EXPECT_EQ(st.compute_hits + st.joined, kThreads - 1);
  EXPECT_EQ(st.pinned, 1);
  for (const AdapterPin& pin : pins) EXPECT_EQ(pin.weights.get(), pins[0].weights.get());
}

// 4. Update swaps versions; pins on the old version keep its weights until released.
TEST_F(AdapterStoreTest, UpdateSwapsVersionsAndOldLeasesSurvive) {
  Watchdog watchdog(30);
  const std::string v1_dir = Write("v1", 4, 1);
  const std::string v2_dir = Write("v2", 4, 2);
  const int64_t s = Bytes(v1_dir);
  AdapterStore store(TinyConfig(), Budgets(10 * s, 10 * s));
  ASSERT_TRUE(store.Register("a", v1_dir).ok());

  auto old_lease = store.AcquireBlocking("a");
  ASSERT_TRUE(old_lease.ok());
  EXPECT_EQ(old_lease->version, 1);
  const uint64_t v1_sum = Checksum(*old_lease->weights);
  EXPECT_EQ(v1_sum, DirectChecksum(v1_dir));

  auto version = store.Update("a", v2_dir);
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 2);
  EXPECT_EQ(store.List().at(0).version, 2);
  EXPECT_EQ(store.List().at(0).dir, v2_dir);

  auto new_lease = store.AcquireBlocking("a");
  ASSERT_TRUE(new_lease.ok());
  EXPECT_EQ(new_lease->version, 2);
  EXPECT_NE(new_lease->weights.get(), old_lease->weights.get());
  EXPECT_EQ(Checksum(*new_lease->weights), DirectChecksum(v2_dir));
  EXPECT_NE(Checksum(*new_lease->weights), v1_sum);
  EXPECT_EQ(Checksum(*old_lease->weights), v1_sum);

  AdapterStoreStats st = store.stats();
  EXPECT_EQ(st.compute_bytes_used, 2 * s);  // v1 pinned + v2
  EXPECT_EQ(st.host_bytes_used, s);         // v1's host copy went at the swap
  EXPECT_EQ(st.pinned, 2);
  EXPECT_EQ(st.compute_hits, 1);  // Update placed v2 in a free slot

  old_lease = absl::CancelledError("released");
  st = store.stats();
  EXPECT_EQ(st.compute_bytes_used, s);
  EXPECT_EQ(st.pinned, 1);
  EXPECT_EQ(st.compute_evictions, 0);  // dropping a superseded copy is not an eviction

  // A failed update keeps the current version.
  const std::string bad = Write("bad", 4, 3, TinyConfig(48));
  EXPECT_EQ(store.Update("a", bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Update("a", root_ + "/missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Update("nope", v1_dir).status().code(), absl::StatusCode::kNotFound);
  auto again = store.AcquireBlocking("a");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->version, 2);
  EXPECT_EQ(again->weights.get(), new_lease->weights.get());

  // Back to the first folder, as version 3.
  EXPECT_EQ(*store.Update("a", v1_dir), 3);
  auto v3 = store.AcquireBlocking("a");
  ASSERT_TRUE(v3.ok());
  EXPECT_EQ(v3->version, 3);
  EXPECT_EQ(Checksum(*v3->weights), v1_sum);
  new_lease = absl::CancelledError("released");
  again = absl::CancelledError("released");
  st = store.stats();
  EXPECT_EQ(st.compute_bytes_used, s);
  EXPECT_EQ(st.host_bytes_used, s);
  EXPECT_EQ(st.pinned, 1);
}

// 5. Many adapters, four threads, small budgets: every pin holds the right weights and the
// books balance at the end.
TEST_F(AdapterStoreTest, StressManyAdaptersManyThreads) {
  Watchdog watchdog(120);
  constexpr int kAdapters = 2000;
  constexpr int kThreads = 4;
  constexpr int kHeld = 3;  // pins a thread holds at once
  constexpr int kOpsPerThread = 1500;
  const model::ModelConfig config = TinyConfig(16);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> names(kAdapters);
  std::vector<uint64_t> sums(kAdapters);
  int64_t max_bytes = 0;
  for (int i = 0; i < kAdapters; ++i) {
    names[i] = absl::StrCat("ad", i);
    RandomAdapterSpec spec;
    spec.rank = 1 + i % 4;
    spec.seed = i;
    if (i % 5 == 4) {
      spec.kind = model::AdapterKind::kDireft;
    } else {
      spec.targets = {Projection::kQ, Projection::kV};
    }
    const std::string dir = root_ + "/" + names[i];
    ASSERT_TRUE(WriteRandomAdapter(config, spec, dir).ok());
    auto w = LoadAdapter(dir, config);
    ASSERT_TRUE(w.ok()) << w.status();
    sums[i] = Checksum(**w);
    max_bytes = std::max<int64_t>(max_bytes, (*w)->bytes());
  }
  const double write_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("wrote and checksummed %d adapters in %.2f s\n", kAdapters, write_s);

  AdapterStoreOptions options;
  // Room for every pin the threads can hold at once plus the ones they wait for, so no
  // thread can wait forever on a slot another waiting thread pins.
  options.compute_bytes = kThreads * (kHeld + 1) * max_bytes + max_bytes;
  options.host_bytes = 40 * max_bytes;
  options.loader_threads = 2;
  AdapterStore store(config, options);
  for (int i = 0; i < kAdapters; ++i)
    ASSERT_TRUE(store.Register(names[i], root_ + "/" + names[i]).ok());

  std::atomic<int64_t> acquires{0};
  std::atomic<int> wrong{0};
  std::atomic<int> over_budget{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(1234 + t);
      // A small hot set makes hits as well as misses.
      std::uniform_int_distribution<int> any(0, kAdapters - 1), hot(0, 15), coin(0, 2);
      std::vector<std::pair<int, AdapterPin>> held;
      for (int op = 0; op < kOpsPerThread; ++op) {
        if (held.size() == kHeld) held.erase(held.begin() + rng() % kHeld);
        const int i = coin(rng) == 0 ? any(rng) : hot(rng);
        auto pin = store.AcquireBlocking(names[i]);
        ++acquires;
        if (!pin.ok() || pin->name != names[i] || pin->version != 1 ||
            Checksum(*pin->weights) != sums[i]) {
          ++wrong;
          continue;
        }
        held.emplace_back(i, *std::move(pin));
        if (op % 64 == 0) {
          const AdapterStoreStats st = store.stats();
          if (st.compute_bytes_used > options.compute_bytes ||
              st.host_bytes_used > options.host_bytes)
            ++over_budget;
        }
      }
      for (auto& [i, pin] : held) {
        if (Checksum(*pin.weights) != sums[i]) ++wrong;  // still intact after churn
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(over_budget.load(), 0);
  const AdapterStoreStats st = store.stats();
  EXPECT_EQ(st.pinned, 0);
  EXPECT_EQ(st.load_failures, 0);
  EXPECT_EQ(st.compute_hits + st.joined + st.host_hits + st.disk_loads, acquires.load());
  EXPECT_LE(st.compute_bytes_used, options.compute_bytes);
  EXPECT_LE(st.host_bytes_used, options.host_bytes);
  EXPECT_GT(st.compute_hits, 0);
  EXPECT_GT(st.disk_loads, 0);
  EXPECT_GT(st.compute_evictions, 0);
  EXPECT_GT(st.host_evictions, 0);
  int64_t pins = 0;
  for (const AdapterInfo& info : store.List()) pins += info.pins;
  EXPECT_EQ(pins, 0);
  std::printf("acquires %lld: compute hits %lld, joined %lld, host hits %lld, disk loads %lld\n",
              static_cast<long long>(acquires.load()), static_cast<long long>(st.compute_hits),
              static_cast<long long>(st.joined), static_cast<long long>(st.host_hits),
              static_cast<long long>(st.disk_loads));
}

void Truncate(const std::string& path) {
  const auto size = fs::file_size(path);
  fs::resize_file(path, size / 2);
}

void ReplaceInFile(const std::string& path, const std::string& from, const std::string& to) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << path << " has no " << from;
  text.replace(at, from.size(), to);
  std::ofstream(path, std::ios::trunc) << text;
}

// Writes a NaN over the first value of the safetensors data region (f32 tensors).
void PokeNaN(const std::string& path) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t header_len = 0;
  f.read(reinterpret_cast<char*>(&header_len), 8);
  ASSERT_TRUE(f.good());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  f.seekp(static_cast<std::streamoff>(8 + header_len));
  f.write(reinterpret_cast<const char*>(&nan), sizeof nan);
  ASSERT_TRUE(f.good());
}

// 6. Bad adapters fail with the loader's error, are counted, are retried, and leave others be.
TEST_F(AdapterStoreTest, BadAdaptersFailAloneAndAreRetried) {
  Watchdog watchdog(60);
  const std::string good = Write("good");
  const std::string corrupt = Write("corrupt");
  Truncate(corrupt + "/adapter_model.safetensors");
  const std::string other_base = Write("other_base", 4, 1, TinyConfig(48));
  const std::string rank0 = Write("rank0");
  ReplaceInFile(rank0 + "/adapter_config.json", "\"r\": 4", "\"r\": 0");
  const std::string too_big = Write("too_big", 8);
  const std::string nan = Write("nan");
  PokeNaN(nan + "/adapter_model.safetensors");

  AdapterStoreOptions options;
  options.load.max_rank = 4;
  options.loader_threads = 2;
  AdapterStore store(TinyConfig(), options);
  const std::map<std::string, std::string> bad = {{"corrupt", corrupt},
                                                  {"other_base", other_base},
                                                  {"rank0", rank0},
                                                  {"too_big", too_big},
                                                  {"nan", nan}};
  for (const auto& [name, dir] : bad) ASSERT_TRUE(store.Register(name, dir).ok());
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(store.Register(absl::StrCat("good", i), good).ok());
  const uint64_t good_sum = DirectChecksum(good);

  // Good acquires run alongside the bad ones.
  std::atomic<int> good_ok{0};
  std::thread good_thread([&] {
    for (int round = 0; round < 5; ++round) {
      for (int i = 0; i < 8; ++i) {
        auto pin = store.AcquireBlocking(absl::StrCat("good", i));
        if (pin.ok() && Checksum(*pin->weights) == good_sum) ++good_ok;
      }
    }
  });
  std::map<std::string, absl::Status> errors;
  for (const auto& [name, dir] : bad) errors[name] = store.AcquireBlocking(name).status();
  good_thread.join();
  EXPECT_EQ(good_ok.load(), 40);

  for (const auto& [name, status] : errors) {
    SCOPED_TRACE(name);
    std::printf("%s -> %s\n", name.c_str(), status.ToString().c_str());
    EXPECT_FALSE(status.ok());
    EXPECT_NE(status.code(), absl::StatusCode::kUnknown);
    EXPECT_THAT(status.message(), HasSubstr("adapter '" + name + "'"));
    EXPECT_THAT(status.message(), HasSubstr(bad.at(name)));
  }
  EXPECT_EQ(errors["other_base"].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(errors["rank0"].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(errors["too_big"].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(errors["nan"].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(errors["nan"].message(), HasSubstr("NaN"));
  EXPECT_THAT(errors["too_big"].message(), HasSubstr("rank 8"));
  EXPECT_THAT(errors["rank0"].message(), HasSubstr("\"r\""));
  EXPECT_THAT(errors["other_base"].message(), HasSubstr("48"));

  AdapterStoreStats st = store.stats();
  EXPECT_EQ(st.load_failures, 5);
  EXPECT_EQ(st.disk_loads, 8);
  EXPECT_EQ(st.pinned, 0);

  // Not cached: the next Acquire loads again, and succeeds once the folder is fixed.
  EXPECT_FALSE(store.AcquireBlocking("corrupt").ok());
  EXPECT_EQ(store.stats().load_failures, 6);
  fs::remove_all(corrupt);
  fs::copy(good, corrupt);
  auto fixed = store.AcquireBlocking("corrupt");
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  EXPECT_EQ(Checksum(*fixed->weights), good_sum);
  st = store.stats();
  EXPECT_EQ(st.load_failures, 6);
  EXPECT_EQ(st.disk_loads, 9);
}

// 7. Register / Unregister / NotFound.
TEST_F(AdapterStoreTest, UnregisterKeepsLeasesAndForgetsTheName) {
  Watchdog watchdog(30);
  const std::string dir = Write("a");
  const int64_t s = Bytes(dir);
  AdapterStore store(TinyConfig(), AdapterStoreOptions{});
  EXPECT_EQ(store.Unregister("a").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(store.Register("a", dir).ok());
  EXPECT_EQ(store.Register("a", dir).code(), absl::StatusCode::kAlreadyExists);

  // NotFound answers at once, on the caller's thread.
  bool called = false;
  store.Acquire("nope", [&](absl::StatusOr<AdapterPin> pin) {
    EXPECT_EQ(pin.status().code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(pin.status().message(), HasSubstr("nope"));
    called = true;
  });
  EXPECT_TRUE(called);

  auto pin = store.AcquireBlocking("a");
  ASSERT_TRUE(pin.ok());
  const uint64_t sum = Checksum(*pin->weights);
  ASSERT_TRUE(store.Unregister("a").ok());
  EXPECT_EQ(store.Unregister("a").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.AcquireBlocking("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Update("a", dir).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store.List().empty());
  EXPECT_EQ(Checksum(*pin->weights), sum);
  AdapterStoreStats st = store.stats();
  EXPECT_EQ(st.compute_bytes_used, s);
  EXPECT_EQ(st.host_bytes_used, 0);
  EXPECT_EQ(st.pinned, 1);
  pin = absl::CancelledError("released");
  st = store.stats();
  EXPECT_EQ(st.compute_bytes_used, 0);
  EXPECT_EQ(st.pinned, 0);

  // The name can be registered again, from version 1.
  ASSERT_TRUE(store.Register("a", dir).ok());
  auto again = store.AcquireBlocking("a");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->version, 1);
  EXPECT_EQ(store.stats().disk_loads, 2);
}

// 7. Destroying the store with loads queued and Acquires waiting for room: every callback runs
// once, with Cancelled, nothing hangs, and pins released after the store are safe.
TEST_F(AdapterStoreTest, DestructorCancelsPendingAcquires) {
  Watchdog watchdog(30);
  constexpr int kAdapters = 40;
  for (int i = 0; i < kAdapters; ++i) Write(absl::StrCat("a", i), 4, i);
  const int64_t s = Bytes(root_ + "/a0");

  std::atomic<int> ok{0}, cancelled{0}, other{0};
  auto count = [&](absl::StatusOr<AdapterPin> pin) {
    if (pin.ok()) {
      ++ok;  // the pin is released right here, on a loader thread
    } else if (pin.status().code() == absl::StatusCode::kCancelled) {
      ++cancelled;
    } else {
      ++other;
    }
  };
  absl::StatusOr<AdapterPin> outliving, pin;
  {
    AdapterStore store(TinyConfig(), Budgets(100 * s, 2 * s));
    for (int i = 0; i < kAdapters; ++i) {
      ASSERT_TRUE(store.Register(absl::StrCat("a", i), absl::StrCat(root_, "/a", i)).ok());
    }
    outliving = store.AcquireBlocking("a0");
    pin = store.AcquireBlocking("a1");
    ASSERT_TRUE(outliving.ok() && pin.ok());
    // Compute is full of pins: a2 loads, then waits for room; the rest queue behind it.
    store.Acquire("a2", count);
    while (store.stats().disk_loads < 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    for (int i = 3; i < kAdapters; ++i) store.Acquire(absl::StrCat("a", i), count);
  }
  EXPECT_EQ(cancelled.load(), kAdapters - 2);
  EXPECT_EQ(ok.load(), 0);
  EXPECT_EQ(other.load(), 0);
  ASSERT_TRUE(outliving.ok());
  EXPECT_EQ(Checksum(*outliving->weights), DirectChecksum(root_ + "/a0"));
  outliving = absl::CancelledError("released after the store");
  pin = absl::CancelledError("released after the store");

  // Loads in flight at destruction, pins released inside callbacks: each answered once.
  ok = cancelled = other = 0;
  {
    AdapterStoreOptions options;
    options.loader_threads = 3;
    AdapterStore store(TinyConfig(), options);
    for (int i = 0; i < kAdapters; ++i) {
      ASSERT_TRUE(store.Register(absl::StrCat("a", i), absl::StrCat(root_, "/a", i)).ok());
      store.Acquire(absl::StrCat("a", i), count);
    }
  }
  EXPECT_EQ(ok + cancelled, kAdapters);
  EXPECT_EQ(other.load(), 0);
}

}  // namespace
}  // namespace preft::adapters
