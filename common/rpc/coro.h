#pragma once

// C++20 coroutines over gRPC's callback API, so that a call with retries, waits and streams
// reads as straight-line code while holding no thread: every `co_await` below starts an
// asynchronous operation and gives the thread back; the callback that reports its end resumes
// the coroutine (on a gRPC callback thread). What a blocked stack used to hold lives in the
// coroutine's frame.
//
//   Task<absl::Status> Step() {
//     grpc::Status s = co_await rpc::Unary([&](auto done) { stub->async()->M(&ctx, &req, &resp, done); });
//     co_await rpc::Sleep(absl::Milliseconds(20), &alarm);
//     co_return rpc::FromGrpcStatus(s);
//   }
//
// Every awaiter copes with a callback that runs before (or inside) the call that starts the
// operation: it then does not suspend at all, so nothing resumes twice or recurses.

#include <grpcpp/alarm.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <coroutine>
#include <cstdlib>
#include <exception>
#include <functional>
#include <optional>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/base/thread_pool.h"

namespace preft::rpc {

// A coroutine returning T, started when awaited (once) by its parent, which it resumes when it
// ends (symmetric transfer: no stack grows however long the chain).
template <typename T>
class [[nodiscard]] Task {
 public:
  struct promise_type {
    std::optional<T> value;
    std::coroutine_handle<> parent = std::noop_coroutine();

    Task get_return_object() {
      return Task(std::coroutine_handle<promise_type>::from_promise(*this));
    }
    std::suspend_always initial_suspend() noexcept { return {}; }
    struct FinalAwaiter {
      bool await_ready() noexcept { return false; }
      std::coroutine_handle<> await_suspend(std::coroutine_handle<promise_type> h) noexcept {
        return h.promise().parent;
      }
      void await_resume() noexcept {}
    };
    FinalAwaiter final_suspend() noexcept { return {}; }
    template <typename U>
    void return_value(U&& v) {
      value.emplace(std::forward<U>(v));
    }
    void unhandled_exception() { std::abort(); }  // the code base does not throw
  };

  Task(Task&& o) noexcept : h_(std::exchange(o.h_, {})) {}
  Task& operator=(Task&&) = delete;
  ~Task() {
    if (h_) h_.destroy();
  }

  bool await_ready() const noexcept { return false; }
  std::coroutine_handle<> await_suspend(std::coroutine_handle<> parent) noexcept {
    h_.promise().parent = parent;
    return h_;
  }
  T await_resume() { return std::move(*h_.promise().value); }

 private:
  explicit Task(std::coroutine_handle<promise_type> h) : h_(h) {}
  std::coroutine_handle<promise_type> h_;
};

// A coroutine nobody awaits: it runs at once and frees itself at its end.
struct Detached {
  struct promise_type {
    Detached get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() { std::abort(); }
  };
};

// The suspend/complete handshake of an operation that reports once, from any thread, maybe
// before the awaiting coroutine has suspended.
class Rendezvous {
 public:
  // In await_suspend, after starting the operation: false when it already completed (do not
  // suspend, go on).
  bool Suspend(std::coroutine_handle<> h) {
    handle_ = h;
    return state_.exchange(kSuspended) != kCompleted;
  }
  // From the completion callback: resumes the coroutine if it suspended.
  void Complete() {
    if (state_.exchange(kCompleted) == kSuspended) handle_.resume();
  }
  // Ready for the next operation (an awaiter reused, as a stream's reads are).
  void Reset() { state_.store(kIdle); }

 private:
  enum : int { kIdle, kSuspended, kCompleted };
  std::atomic<int> state_{kIdle};
  std::coroutine_handle<> handle_;
};

// Awaits an operation that reports its result through a callback: `start(done)` starts it,
// `done(result)` reports it (once, from any thread, possibly inline).
template <typename Result, typename Start>
class CallbackAwaiter {
 public:
  explicit CallbackAwaiter(Start start) : start_(std::move(start)) {}
  bool await_ready() const noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> h) {
    start_([this](Result r) {
      result_.emplace(std::move(r));
      rendezvous_.Complete();
    });
    return rendezvous_.Suspend(h);
  }
  Result await_resume() { return std::move(*result_); }

 private:
  Start start_;
  std::optional<Result> result_;
  Rendezvous rendezvous_;
};

// A unary callback call: `start(done)` calls stub->async()->Method(ctx, req, resp, done).
// Returns its status.
template <typename Start>
auto Unary(Start start) {
  return CallbackAwaiter<grpc::Status, Start>(std::move(start));
}

// Waits `d` on `alarm` (cancel it to end the wait early); true if the time passed.
inline auto Sleep(absl::Duration d, grpc::Alarm* alarm) {
  auto start = [d, alarm](std::function<void(bool)> done) {
    alarm->Set(absl::ToChronoTime(absl::Now() + d), std::move(done));
  };
  return CallbackAwaiter<bool, decltype(start)>(std::move(start));
}

// Continues the coroutine on one of `pool`'s threads (CPU work off the callback threads).
inline auto ResumeOn(base::ThreadPool* pool) {
  struct Awaiter {
    base::ThreadPool* pool;
    bool await_ready() const noexcept { return false; }
    void await_suspend(std::coroutine_handle<> h) { pool->Post([h] { h.resume(); }); }
    void await_resume() const noexcept {}
  };
  return Awaiter{pool};
}

}  // namespace preft::rpc
