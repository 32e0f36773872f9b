#pragma once

// A fixed number of threads running posted work in order of posting: for CPU work that must
// not run on an event loop's or gRPC's callback threads (tokenising a prompt, say).

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace preft::base {

class ThreadPool {
 public:
  // `nice` > 0 runs the threads below the process's other threads (Linux's per-thread nice):
  // bulk work that must not delay latency-critical work on a busy host (the router's relays).
  explicit ThreadPool(int threads, int nice = 0);
  // Runs what was posted, then joins.
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Post(std::function<void()> work);
  int size() const { return static_cast<int>(threads_.size()); }

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace preft::base
