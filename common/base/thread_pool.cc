#include "common/base/thread_pool.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>

namespace preft::base {

ThreadPool::ThreadPool(int threads, int nice) {
  for (int i = 0; i < std::max(1, threads); ++i) {
    threads_.emplace_back([this, nice] {
      // Relative to the creator's nice, which a new thread inherits. Best effort: lowering
      // one's own priority needs no privilege; if refused, run as is.
      if (nice > 0) {
        const id_t self = static_cast<id_t>(gettid());
        (void)setpriority(PRIO_PROCESS, self, std::min(19, getpriority(PRIO_PROCESS, self) + nice));
      }
      Loop();
    });
  }
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void ThreadPool::Post(std::function<void()> work) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(work));
}

void ThreadPool::Loop() {
  for (;;) {
    std::function<void()> work;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ThreadPool* p) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return p->stopping_ || !p->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping, and nothing left
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    work();
  }
}

}  // namespace preft::base
