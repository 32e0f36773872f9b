#pragma once

// Waiting for a transport's callbacks in tests, with generous bounds (a loaded 2-core machine).

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/kv/kv_cache.h"
#include "common/transport/kv_transport.h"
#include "gtest/gtest.h"

namespace preft::transport::testing {

inline constexpr absl::Duration kWait = absl::Seconds(30);

// A small cache shape (3 layers, 4-token blocks, 2 KV heads of 8) and a cache of it.
inline kv::KvCacheShape Shape(int64_t num_blocks, kv::KvDtype dtype = kv::KvDtype::kF32) {
  kv::KvCacheShape shape;
  shape.dtype = dtype;
  shape.num_layers = 3;
  shape.num_blocks = num_blocks;
  shape.block_tokens = 4;
  shape.num_kv_heads = 2;
  shape.head_dim = 8;
  return shape;
}

inline std::unique_ptr<kv::KvCache> Cache(int64_t num_blocks,
                                          kv::KvDtype dtype = kv::KvDtype::kF32) {
  auto cache = kv::KvCache::Create(Shape(num_blocks, dtype));
  EXPECT_TRUE(cache.ok()) << cache.status();
  return *std::move(cache);
}

// The `done` of one Write: its status, how often it fired and on which thread.
class DoneWaiter {
 public:
  std::function<void(absl::Status)> Callback() {
    return [this](absl::Status status) {
      absl::MutexLock lock(&mu_);
      ++calls_;
      status_ = std::move(status);
      thread_ = std::this_thread::get_id();
    };
  }
  // The status, or nullopt when `done` has not fired within `timeout`.
  std::optional<absl::Status> Wait(absl::Duration timeout = kWait) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(
        absl::Condition(
            +[](DoneWaiter* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) { return w->calls_ > 0; },
            this),
        timeout);
    return status_;
  }
  int calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  std::thread::id thread() {
    absl::MutexLock lock(&mu_);
    return thread_;
  }

 private:
  absl::Mutex mu_;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<absl::Status> status_ ABSL_GUARDED_BY(mu_);
  std::thread::id thread_ ABSL_GUARDED_BY(mu_);
};

// Every DONE notice a receiver got.
class NoticeLog {
 public:
  std::function<void(uint64_t, uint32_t)> Callback() {
    return [this](uint64_t reservation_id, uint32_t generation) {
      absl::MutexLock lock(&mu_);
      notices_.emplace_back(reservation_id, generation);
    };
  }
  std::vector<std::pair<uint64_t, uint32_t>> notices() {
    absl::MutexLock lock(&mu_);
    return notices_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<uint64_t, uint32_t>> notices_ ABSL_GUARDED_BY(mu_);
};

// Transport `f32` started on cache `a` (f32) connecting to `bf16` started on `b` (bf16) of the
// same model is refused FailedPrecondition, naming both dtypes (the check every transport
// shares). The caches must outlive the transports.
inline void ExpectKvDtypeMismatchRefused(KvTransport& f32, kv::KvCache& a, KvTransport& bf16,
                                         kv::KvCache& b) {
  ASSERT_TRUE(f32.Start(&a, KvLayout::ForCache(a.shape(), "m"), nullptr).ok());
  ASSERT_TRUE(bf16.Start(&b, KvLayout::ForCache(b.shape(), "m"), nullptr).ok());
  absl::StatusOr<PeerId> id = f32.Connect(bf16.LocalAddress());
  ASSERT_EQ(id.status().code(), absl::StatusCode::kFailedPrecondition) << id.status();
  EXPECT_NE(id.status().message().find("stores KV as bf16, this worker as f32"),
            std::string::npos)
      << id.status();
}

}  // namespace preft::transport::testing
