#pragma once

// Runs a function every `period` on a thread of its own until destroyed: how services refresh
// gauges that mirror their state.

#include <functional>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace preft::metrics {

class Periodic {
 public:
  Periodic(absl::Duration period, std::function<void()> fn)
      : thread_([this, period, fn = std::move(fn)] {
          while (!stop_.WaitForNotificationWithTimeout(period)) fn();
        }) {}
  // Stops and joins (a call under way finishes first).
  ~Periodic() {
    stop_.Notify();
    thread_.join();
  }

 private:
  absl::Notification stop_;  // declared before thread_: the thread reads it
  std::thread thread_;
};

}  // namespace preft::metrics
