#pragma once

// Parties that must act together meet once per round: each posts its own status and gets the
// round's, the first error in party order, prefixed with "<label> <party>: ". Tensor-parallel
// ranks meet so once per step before their first collective, so that one rank's failure
// fails the step on every rank instead of leaving the others waiting in an all-reduce.
// Each party posts exactly once per round (a round ends when the last one posts).

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace preft::base {

class StatusRendezvous {
 public:
  StatusRendezvous(int parties, std::string label)
      : posted_(parties), label_(std::move(label)) {}

  // Blocks until every party has posted this round.
  absl::Status Post(int party, const absl::Status& mine) {
    std::unique_lock<std::mutex> lock(mu_);
    posted_[party] = mine;
    const uint64_t round = round_;
    if (++arrived_ == static_cast<int>(posted_.size())) {
      result_ = absl::OkStatus();
      for (size_t p = 0; p < posted_.size() && result_.ok(); ++p) {
        if (!posted_[p].ok()) {
          result_ = absl::Status(posted_[p].code(),
                                 absl::StrCat(label_, " ", p, ": ", posted_[p].message()));
        }
      }
      arrived_ = 0;
      ++round_;
      cv_.notify_all();
      return result_;
    }
    // The next round's result cannot be decided before this party posts again.
    cv_.wait(lock, [&] { return round_ != round; });
    return result_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<absl::Status> posted_;
  const std::string label_;
  int arrived_ = 0;
  uint64_t round_ = 0;
  absl::Status result_;
};

}  // namespace preft::base
