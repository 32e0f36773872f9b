#include "common/engine/engine_loop.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/log/log.h"

namespace preft::engine {

EngineLoop::EngineLoop(std::unique_ptr<Engine> engine)
    : engine_(std::move(engine)), thread_([this] { Run(); }) {}

EngineLoop::~EngineLoop() { Stop(); }

void EngineLoop::Post(std::function<void(Engine&)> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;  // dropped: a packaged_task's future then reports broken_promise
    tasks_.push_back(std::move(fn));
  }
  cv_.notify_one();
}

void EngineLoop::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable() && !on_engine_thread()) thread_.join();
}

void EngineLoop::Run() {
  for (;;) {
    std::deque<std::function<void(Engine&)>> tasks;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !tasks_.empty() || engine_->HasWork(); });
      if (stopping_) {
        tasks_.clear();
        break;
      }
      tasks.swap(tasks_);
    }
    for (auto& fn : tasks) fn(*engine_);
    if (engine_->HasWork()) {
      const absl::Status s = engine_->Step();
      if (!s.ok()) {
        log::Error("engine step failed: {}", s);
        engine_->FailAll(absl::InternalError(absl::StrCat("engine step failed: ", s.message())));
      }
    }
  }
  engine_->FailAll(absl::UnavailableError("worker is shutting down"));
}

}  // namespace preft::engine
