#pragma once

// The engine thread of a worker: runs closures posted from other threads (gRPC handlers,
// transport callbacks) in order, between forward steps, and steps the engine while it has work.
// The Engine itself stays single-threaded; everything else talks to it through Post/Call.

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>

#include "common/engine/engine.h"

namespace preft::engine {

class EngineLoop {
 public:
  explicit EngineLoop(std::unique_ptr<Engine> engine);
  // Stop()s.
  ~EngineLoop();
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Runs `fn` on the engine thread before the next step. After Stop, `fn` is dropped unrun.
  void Post(std::function<void(Engine&)> fn);

  // Runs `fn` on the engine thread and returns its result. Never call it from the engine thread
  // (an engine callback): it would wait for itself. After Stop it throws std::future_error.
  template <typename F>
  auto Call(F fn) -> std::invoke_result_t<F, Engine&> {
    using R = std::invoke_result_t<F, Engine&>;
    auto task = std::make_shared<std::packaged_task<R(Engine&)>>(std::move(fn));
    std::future<R> result = task->get_future();
    Post([task](Engine& e) { (*task)(e); });
    return result.get();
  }

  // Fails every active request with Unavailable("worker is shutting down"), runs nothing more
  // and joins the thread. Idempotent.
  void Stop();

  bool on_engine_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  void Run();

  std::unique_ptr<Engine> engine_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void(Engine&)>> tasks_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace preft::engine
